"""Conversation encoding: token ids, loss mask and lazily decoded media.

:class:`SampleEncoder` is what every encoder shares (settings, media probing, the vision-token
check); :class:`ConversationEncoder` is the hand-written ChatML (Qwen) encoder, and
:class:`~energon_pack.TemplateEncoder` the one driven by a tokenizer's chat
template. Each turns a conversation and its media members into an :class:`EncodedSample`: token
ids with every medium expanded by one hook, :func:`~energon_pack.media.vision_tokens` by default
(``<|vision_start|>`` + N pad tokens + ``<|vision_end|>``; a timestamped video: one such block per
temporal patch, its first timestamp tokenised with the text before it as the processor does), N
taken from the media *probe* (header only). The media stay compressed bytes until
:meth:`EncodedSample.materialize` decodes and patchifies them, which the packers call only for
samples they selected.
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any, Literal, Protocol, TypedDict

import torch
from typing_extensions import Unpack

from energon_pack.checks import check_config, check_type
from energon_pack.encoding.bounded import BoundedTemplate, RenderLimitError
from energon_pack.formats import parse_any
from energon_pack.formats.conversation import (
    check_media_order,
    conversation_messages,
    message_media_kinds,
)
from energon_pack.formats.raw import RawSample
from energon_pack.media import (
    Frames,
    MediaConfig,
    MediaError,
    MediaItem,
    VisionIds,
    check_media_count,
    probe_frames,
    probe_image,
    probe_video,
    vision_tokens,
)
from energon_pack.media.audio_decode import Waveform
from energon_pack.media.config import MediaKind
from energon_pack.media.tokens import SpecialTokens, special_token_id, vision_parts
from energon_pack.packing.packed import EncodedSample

logger = logging.getLogger("energon_pack.encoding")

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""The Qwen2-VL special tokens the encoder uses."""

_PLACEHOLDER = re.compile(r"<(image|video)>")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}

LossOn = Literal["assistant", "all"]


def _texts(content: str | list[dict[str, Any]]) -> list[str]:
    """Text pieces of a message's content, a medium between each two: split at ``<image>`` /
    ``<video>`` in a string, at media parts in typed content (whose text stays text)."""
    if isinstance(content, str):
        return _PLACEHOLDER.split(content)[::2]  # text, kind, text, kind, ..., text
    texts = [""]
    for part in content:
        if part["type"] != "text":
            texts.append("")
        else:
            texts[-1] = f"{texts[-1]}{part['text']}"
    return texts


def _shared(head: list[int], tokens: list[int]) -> int:
    """How many tokens ``tokens`` and ``head`` begin with in common."""
    shared = 0
    while shared < min(len(head), len(tokens)) and head[shared] == tokens[shared]:
        shared += 1
    return shared


def _why_unencodable(text: str, error: Exception) -> str:
    """Why a tokenizer failed on ``text``: its lone surrogate if it has one, else the error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as bad:
        return (
            f"it has a lone surrogate {text[bad.start]!r} (half of an emoji, e.g. cut in "
            "escaped JSON), which is not valid Unicode"
        )
    return f"{type(error).__name__}: {error}"


class Tokenizer(SpecialTokens, Protocol):
    """What the encoder needs of a tokenizer (an HF tokenizer has both): ``encode`` and the
    ids of special tokens."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class ByteTokenizer:
    """Dependency-free tokenizer: UTF-8 bytes are ids 0-255, :data:`SPECIAL_TOKENS` follow."""

    def __init__(self) -> None:
        self._special = {token: 256 + index for index, token in enumerate(SPECIAL_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self._special)

    @property
    def pad_token_id(self) -> int:
        return self._special["<|endoftext|>"]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` (special-token strings in it are plain text)."""
        return list(text.encode("utf-8"))

    def convert_tokens_to_ids(self, token: str) -> int:
        try:
            return self._special[token]
        except KeyError:
            raise ValueError(
                f"ByteTokenizer has no special token {token!r}; it knows {SPECIAL_TOKENS}"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are written out by name."""
        names = {v: k for k, v in self._special.items()}
        out, run = [], bytearray()
        for token in ids:
            if token < 256:
                run.append(token)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(names[token])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def check_special_tokens(tokenizer: object, name: str | None = None) -> None:
    """Raise ValueError naming the :data:`SPECIAL_TOKENS` that ``tokenizer`` lacks (no id, or
    its unknown token's id) and the fix; the ChatML and template encoders need them all.
    ``name`` is how the message calls the tokenizer (default: its name or path and class)."""
    if isinstance(tokenizer, ByteTokenizer):
        return
    unknown = {None, getattr(tokenizer, "unk_token_id", None)}
    missing = [t for t in SPECIAL_TOKENS if _token_id(tokenizer, t) in unknown]
    if not missing:
        return
    if name is None:
        path = getattr(tokenizer, "name_or_path", None)
        name = (
            f"tokenizer {path!r} ({type(tokenizer).__name__})" if path else type(tokenizer).__name__
        )
    raise ValueError(
        f"{name} has no special tokens {missing}, which the ChatML / Qwen2-VL template uses; "
        "pass a Qwen2-VL tokenizer, or add them with tokenizer.add_special_tokens("
        f"{{'additional_special_tokens': {missing}}}) and save it"
    )


def _token_id(tokenizer: object, token: str) -> int | None:
    """The id ``tokenizer`` gives ``token``, or None (no such token, no int id)."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    try:
        found = convert(token) if callable(convert) else None
    except (KeyError, ValueError, TypeError):  # tokenizers refuse unknown tokens differently
        return None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def template_system_prompt(tokenizer: object) -> str | None:
    """The system prompt a tokenizer's ChatML chat template inserts when a conversation has
    none (e.g. ``"You are a helpful assistant."`` for Qwen2-VL), or None.

    Found by rendering a one-turn conversation as ``apply_chat_template`` does, within the
    render bounds of :class:`~energon_pack.encoding.bounded.BoundedTemplate` (a template over
    them is a ValueError); tokenizers without a chat template (or with one that adds no ChatML
    system turn) give None.
    """
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, Mapping):  # named templates: the default one renders
        template = template.get("default")
    if not isinstance(template, str):
        return None
    special = getattr(tokenizer, "special_tokens_map", None)
    variables = dict(special) if isinstance(special, Mapping) else {}
    return default_system_prompt(template, variables, type(tokenizer).__name__)


def default_system_prompt(
    template: str, variables: Mapping[str, Any], owner: str = "the tokenizer"
) -> str | None:
    """The system prompt the ChatML chat ``template`` inserts when a conversation has none, or
    None (see :func:`template_system_prompt`; ``owner`` names the template in errors)."""
    try:
        text, _ = BoundedTemplate(template).render(
            [{"role": "user", "content": "?"}], tools=None, variables=variables
        )
    except RenderLimitError as error:
        raise ValueError(
            f"the chat template of {owner} went over a render bound while "
            f"finding its default system prompt: {error}"
        ) from None
    except Exception as exc:  # a template may reject string content; then it has no default
        logger.debug("chat template did not render a plain user turn: %s", exc)
        return None
    head = "<|im_start|>system\n"
    if not isinstance(text, str) or not text.startswith(head) or "<|im_end|>" not in text:
        return None
    return text[len(head) : text.index("<|im_end|>")]


MediaBlock = Callable[[MediaItem], list[int]]
"""The hook that expands one medium into its ids (the ``<|vision_start|><|X_pad|><|vision_end|>``
block a template renders is replaced by them). A hook's ids are placed as they are, the text
before them tokenised on its own; only the default expansion (``media_block=None``) tokenises a
timestamped video's first timestamp together with the text before it, as the processor does
(:func:`~energon_pack.media.tokens.vision_parts`), so its ids can differ from
``encoder.media_block(item)``'s at that one place."""


class TurnOptions(TypedDict, total=False):
    """The settings every encoder takes besides its tokenizer (see :class:`SampleEncoder`)."""

    media: MediaConfig | None
    system_prompt: str | None
    loss_on: LossOn


class EncoderOptions(TurnOptions, total=False):
    """:class:`TurnOptions` and the media expansion hook of the Qwen encoders."""

    media_block: MediaBlock | None


class SampleEncoder(ABC):
    """What every encoder has: a tokenizer, media settings, the loss rule, media probing, and
    :meth:`encode_sample` for any input layout. Subclasses implement :meth:`encode`.

    Args:
        tokenizer: an HF-style tokenizer, or None for :class:`ByteTokenizer`.
        media: preprocessing settings and limits for images and videos.
        system_prompt: used when a sample has no system prompt (or first system turn) of its own;
            plain text (placeholders in it are not media).
        loss_on: ``"assistant"`` or ``"all"``.
        media_block: the hook that expands one medium into its ids (default
            :func:`~energon_pack.media.vision_tokens`, its first timestamp joined to the text
            before: see :data:`MediaBlock`); picklable when the encoder goes to loader workers.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        media: MediaConfig | None = None,
        system_prompt: str | None = None,
        loss_on: LossOn = "assistant",
        media_block: MediaBlock | None = None,
    ) -> None:
        if loss_on not in ("assistant", "all"):
            raise ValueError(f"loss_on must be 'assistant' or 'all', got {loss_on!r}")
        check_config("media", media, MediaConfig)
        check_type("system_prompt", system_prompt, str, "a str", fix="pass the prompt's text")
        if media_block is not None and not callable(media_block):
            raise ValueError(
                f"media_block must be a function of a MediaItem giving its ids, got "
                f"{type(media_block).__name__}; pass None for the processor's own expansion "
                "(vision_tokens)"
            )
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.media = media or MediaConfig()
        self.system_prompt = system_prompt
        self.loss_on: LossOn = loss_on
        self.media_block: MediaBlock = (
            media_block if media_block is not None else self._vision_tokens
        )
        self._own_block = media_block is None

    @cached_property
    def vision_ids(self) -> VisionIds:
        """The tokenizer's Qwen-VL vision token ids (read when first used: a processor
        family's tokenizer may have none)."""
        return VisionIds.of(self.tokenizer)

    def encode_sample(self, key: str, sample: Mapping[str, Any]) -> EncodedSample:
        """Encode a raw sample of any layout :func:`~energon_pack.formats.parse_any` reads
        (native, Megatron-Bridge Qwen-VL, chat rows); see the README."""
        return self.encode(parse_any(key, sample, self.media))

    @abstractmethod
    def encode(self, raw: RawSample) -> EncodedSample:
        """Encode a parsed sample, probing (not decoding) its media."""

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """The encoder's settings for a settings fingerprint (JSON-able values)."""

    def _probed_media(self, raw: RawSample) -> tuple[MediaItem, ...]:
        """The sample's media, probed (not decoded)."""
        return tuple(self._probe(raw.key, member, kind, data) for member, kind, data in raw.media)

    def _finished(
        self,
        key: str,
        ids: list[int],
        mask: list[int],
        media: tuple[MediaItem, ...],
        blocks: list[int],
    ) -> EncodedSample:
        """The encoded sample, once its vision tokens are checked against its media."""
        input_ids = torch.tensor(ids, dtype=torch.long)
        self._check_vision_tokens(key, input_ids, media, blocks)
        return EncodedSample(
            key=key,
            input_ids=input_ids,
            loss_mask=torch.tensor(mask, dtype=torch.long),
            media=media,
        )

    def _check_vision_tokens(
        self, key: str, input_ids: torch.Tensor, media: Sequence[MediaItem], blocks: list[int]
    ) -> None:
        """The finished sample's vision tokens are its media's: ``t*h*w / merge_size**2`` pads
        per medium's grid, and as many ``<|vision_start|>`` / ``<|vision_end|>`` as the
        media's ``blocks`` (the ids :attr:`media_block` gave them: one each by default); else
        a ``placeholder_mismatch`` (e.g. special-token text that the tokenizer made a token)."""
        merge = self.media.merge_size**2
        vision = self.vision_ids
        in_blocks = Counter(blocks)
        expected = [
            ("<|vision_start|>", vision.start, in_blocks[vision.start]),
            ("<|vision_end|>", vision.end, in_blocks[vision.end]),
        ]
        for kind, pad in (("image", vision.image_pad), ("video", vision.video_pad)):
            grids = [m.grid_thw for m in media if m.kind == kind]
            expected.append((f"<|{kind}_pad|>", pad, sum(t * h * w // merge for t, h, w in grids)))
        for token, token_id, count in expected:
            found = int((input_ids == token_id).sum())
            if found != count:
                raise MediaError(
                    key,
                    "json",
                    "placeholder_mismatch",
                    f"the sample has {found} {token} tokens but its {len(media)} media give "
                    f"{count} (pads: t*h*w / {merge} per grid; one vision start and end per "
                    f"block); this tokenizer reads special-token text such as {token!r} as "
                    "the token itself: remove it from the text",
                )

    def _text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _vision_tokens(self, item: MediaItem) -> list[int]:
        """The default :attr:`media_block`: :func:`~energon_pack.media.vision_tokens`."""
        return vision_tokens(item, self.vision_ids, self._text, self.media)

    def _media_parts(self, item: MediaItem) -> tuple[str, list[int]]:
        """``item``'s lead text (tokenised with the text before the medium) and the ids after
        it: :func:`~energon_pack.media.tokens.vision_parts` by default; with a hook, ``""`` and
        the hook's ids."""
        if self._own_block:
            return vision_parts(item, self.vision_ids, self._text, self.media)
        return "", self.media_block(item)

    def _messages(self, raw: RawSample) -> list[dict[str, Any]]:
        """The sample's chat messages (derived from its turns when it was built from turns
        only), after checking its media count and that their media parts take its media one
        to one."""
        check_media_count(raw.key, len(raw.media), self.media)
        if raw.messages:
            messages = list(raw.messages)
        else:
            turns = [{"role": role, "content": content} for role, content in raw.turns]
            messages = conversation_messages(raw.key, turns)
        check_media_order(raw.key, message_media_kinds(messages), raw.media)
        return messages

    def _probe(
        self, key: str, member: str, kind: MediaKind, data: bytes | Frames | Waveform
    ) -> MediaItem:
        if kind == "audio" or isinstance(data, Waveform):
            raise MediaError(
                key,
                member,
                "unsupported",
                "the Qwen-VL encoders take images and videos, not audio; encode audio samples "
                "with an audio model's processor family (make_encoder(family=processor))",
            )
        if isinstance(data, Frames):
            plan = probe_frames(data, kind, self.media, key=key, member=member)
            return MediaItem(
                member,
                kind,
                data,
                plan.grid_thw,
                plan.tokens,
                plan.second_per_grid_t,
                plan.timestamps,
            )
        if kind == "image":
            probe = probe_image(data, self.media, key=key, member=member)
            return MediaItem(member, kind, data, probe.grid_thw, probe.tokens)
        video = probe_video(data, self.media, key=key, member=member)
        return MediaItem(
            member,
            kind,
            data,
            video.grid_thw,
            video.tokens,
            video.second_per_grid_t,
            video.timestamps,
        )


class ConversationEncoder(SampleEncoder):
    """Encodes conversations with the ChatML template used by Qwen2-VL.

    Each turn becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; an optional system prompt
    comes first. The loss covers the content and ``<|im_end|>`` of assistant turns
    (``loss_on="assistant"``, the default) or every token (``loss_on="all"``).

    Text rules: ``<image>``/``<video>`` in a string turn (a system turn included) and the media
    parts of typed content take the sample's media in order (text parts stay text, a literal
    ``<image>`` included), but in a system prompt given outside the turns (the sample's ``system``
    field, ``system_prompt``, the template's default) they are plain text: such a prompt carries
    no media. Special-token text (``<|im_end|>``) becomes the token as in ``apply_chat_template``
    with an HF tokenizer (:class:`ByteTokenizer` keeps it as text); a sample whose vision tokens
    do not match its media (e.g. ``<|image_pad|>`` in its text) is a ``placeholder_mismatch``
    :class:`~energon_pack.media.MediaError`, and text the tokenizer cannot encode (a lone
    surrogate) a ``bad_sample``.

    Args:
        tokenizer: an HF-style tokenizer (``encode(text, add_special_tokens=False)`` and
            ``convert_tokens_to_ids``) or None for the built-in :class:`ByteTokenizer`. Text
            between special tokens is encoded as one string, as ``apply_chat_template`` does.
        media, system_prompt, loss_on, media_block: see :class:`SampleEncoder`.
        template_system: without a system prompt of the sample's or ``system_prompt``, use the
            one that the tokenizer's chat template adds by default (Qwen's ``"You are a helpful
            assistant."``), as ``apply_chat_template`` does; see :func:`template_system_prompt`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        template_system: bool = True,
        **options: Unpack[EncoderOptions],
    ) -> None:
        if tokenizer is not None:
            check_special_tokens(tokenizer)
        super().__init__(tokenizer, **options)
        if not isinstance(template_system, bool):
            raise ValueError(
                f"template_system must be True or False, got {template_system!r}; False uses no "
                "system prompt where the sample and system_prompt give none"
            )
        self.default_system_prompt = (
            template_system_prompt(self.tokenizer) if template_system else None
        )
        self._im_start = special_token_id(self.tokenizer, "<|im_start|>")
        self._im_end = special_token_id(self.tokenizer, "<|im_end|>")
        self._newline = self._text("\n")
        self._headers = {role: self._text(f"{role}\n") for role in set(_ROLES.values())}
        if self.system_prompt is not None:
            try:
                self._text(self.system_prompt)
            except Exception as error:  # any tokenizer's failure, as for a sample's text
                raise ValueError(
                    f"system_prompt={self.system_prompt!r} cannot be tokenised: "
                    f"{_why_unencodable(self.system_prompt, error)}; fix the setting"
                ) from error

    def settings(self) -> dict[str, Any]:
        """The system prompts and the loss rule (the ChatML path adds no other setting)."""
        return {
            "system_prompt": self.system_prompt,
            "default_system_prompt": self.default_system_prompt,
            "loss_on": self.loss_on,
        }

    def encode(self, raw: RawSample) -> EncodedSample:
        """Encode a parsed sample, probing (not decoding) its media.

        Text between special tokens is tokenised as one string, as ``apply_chat_template``
        does, so a token may span a turn's header (``"assistant\\n"``) and its content; such a
        token is a target when it holds content (transformers' assistant-mask rule). See the
        class docstring for the text rules and the checks of the finished sample.
        """
        messages = self._messages(raw)
        roles = [self._role(raw.key, message["role"]) for message in messages]
        media = self._probed_media(raw)
        ids: list[int] = []
        mask: list[int] = []

        def add(tokens: list[int], target: bool | list[int]) -> None:
            ids.extend(tokens)
            flags = target if isinstance(target, list) else [int(target)] * len(tokens)
            mask.extend(flag | int(self.loss_on == "all") for flag in flags)

        turns = [(r, _texts(m["content"])) for r, m in zip(roles, messages, strict=True)]
        system = self._system(raw.system, roles)
        if system is not None:  # plain text: a system prompt carries no media
            turns.insert(0, ("system", [system]))
        pending = iter(media)  # as many as the placeholders (checked above)
        blocks: list[int] = []
        for role, texts in turns:
            target = role == "assistant"
            add([self._im_start], False)
            for index, text in enumerate(texts):  # a medium after each but the last
                last = index == len(texts) - 1
                lead, block = ("", []) if last else self._media_parts(next(pending))
                head = f"{role}\n" if index == 0 else ""
                if head or text or lead:
                    add(*self._text_run(raw.key, role, head, text, lead, target))
                blocks.extend(block)
                add(block, False)
            add([self._im_end], target)
            add(self._newline, False)
        return self._finished(raw.key, ids, mask, media, blocks)

    def _system(self, own: str | None, roles: list[str]) -> str | None:
        """The system prompt to put first: the sample's, else (without a system turn of the
        sample's) ``system_prompt``, else the chat template's default."""
        if own is not None:
            return own
        if roles and roles[0] == "system":
            return None
        return self.system_prompt if self.system_prompt is not None else self.default_system_prompt

    def _text_run(
        self, key: str, role: str, head: str, text: str, lead: str, target: bool
    ) -> tuple[list[int], list[int]]:
        """Tokens of ``head`` (the turn header or ``""``) + ``text`` + ``lead`` (a medium's
        lead text or ``""``), tokenised together, and their target flags: the tokens holding
        ``text`` chars, i.e. all but the header's and the lead's own tokens at the ends."""
        tokens = self._content(key, role, f"{head}{text}{lead}")
        if not target or not text:
            return tokens, [0] * len(tokens)
        before = _shared(self._headers[role], tokens) if head else 0
        after = _shared(self._text(lead)[::-1], tokens[::-1]) if lead else 0
        return tokens, [0] * before + [1] * (len(tokens) - before - after) + [0] * after

    def _content(self, key: str, role: str, text: str) -> list[int]:
        """Tokens of a sample's text; text the tokenizer cannot encode is a ``bad_sample``."""
        try:
            return self._text(text)
        except MemoryError:
            raise
        except Exception as error:  # tokenizers differ: UnicodeEncodeError, TypeError, ...
            raise MediaError(
                key,
                "json",
                "bad_sample",
                f"the {role} text cannot be tokenised: {_why_unencodable(text, error)}; fix or "
                "drop the sample",
            ) from error

    def _role(self, key: str, role: str) -> str:
        try:
            return _ROLES[role]
        except KeyError:
            raise MediaError(
                key,
                "json",
                "bad_sample",
                f"unknown conversation role {role!r}; use one of {sorted(_ROLES)}",
            ) from None
