"""Encoding through a tokenizer's own chat template: ids equal ``apply_chat_template``'s.

:class:`TemplateEncoder` renders each conversation as ``tokenizer.apply_chat_template`` does
(``tools=`` from the sample, tool and ``tool_calls`` messages and ``reasoning_content`` passed
through), tokenises the text once, and takes the loss mask from the assistant spans:

* a template with ``{% generation %}`` markers: transformers' own assistant mask
  (``return_assistant_tokens_mask``);
* a template without markers (the released Qwen templates): the ChatML rule. Each assistant
  message is rendered as ``<|im_start|>assistant\\n`` + what the assistant writes +
  ``<|im_end|>``; the span is everything after that header through ``<|im_end|>``, i.e. what the
  model produces after the generation prompt (``<|im_start|>assistant\\n``), think block and
  tool calls included. Tokens overlapping a span are targets (transformers' rule for generation
  spans). The rule is checked on a probe conversation when the encoder is made, so a template it
  does not fit is refused by name, not masked wrongly.

Media are expanded after rendering, as the model's processor expands them: each
``<|vision_start|><|image_pad|><|vision_end|>`` (or ``<|video_pad|>``) block the template
renders is replaced by the ids of the encoder's media-block hook
(:func:`~energon_pack.vision_tokens` by default). The processor tokenises the expanded text
whole, so the default expansion's lead text (a timestamped video's first timestamp in the 4.57
form, :func:`~energon_pack.media.tokens.vision_parts`) goes into the rendered text before its
block and is tokenised with the text before it. Media tokens are never targets (a token holding
text and a timestamp is a target where its text is).

:func:`make_encoder` chooses the encoder explicitly: the template encoder for an HF tokenizer
with a chat template, the hand-written ChatML :class:`~energon_pack.ConversationEncoder`
for the built-in byte tokenizer, a tokenizer without a template (with a
:class:`~energon_pack.PackingWarning`, once per tokenizer), or ``encoding="chatml"``.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any, Literal

import numpy as np
from typing_extensions import Unpack

from energon_pack.checks import check_choice
from energon_pack.encoding.bounded import (
    RENDER_CHARS,
    RENDER_SECONDS,
    BoundedTemplate,
    has_generation_markers,
    template_sha256,
)
from energon_pack.encoding.chatml import (
    ByteTokenizer,
    ConversationEncoder,
    EncoderOptions,
    LossOn,
    MediaBlock,
    SampleEncoder,
    Tokenizer,
    check_special_tokens,
    default_system_prompt,
)
from energon_pack.encoding.families import ProcessorFamily, delimited_spans
from energon_pack.encoding.family import Family, family_media, model_family
from energon_pack.encoding.family_encoder import FamilyEncoder
from energon_pack.encoding.processor_encoder import ProcessorEncoder, processor_chat_template
from energon_pack.encoding.rendering import render_sample, tokenise_text, with_system
from energon_pack.encoding.request_encoder import RequestEncoder
from energon_pack.formats.raw import RawSample
from energon_pack.media import MediaConfig, MediaError, MediaItem
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row_layout import PackingWarning

__all__ = ["Encoding", "TemplateEncoder", "chat_template_of", "make_encoder", "template_sha256"]

logger = logging.getLogger("energon_pack.encoding")

Encoding = Literal["auto", "template", "chatml"]
"""Which encoder :func:`make_encoder` builds: ``"template"`` (:class:`TemplateEncoder`),
``"chatml"`` (:class:`~energon_pack.ConversationEncoder`) or ``"auto"`` (the template
encoder when the tokenizer has a chat template, else ChatML)."""

_PAD = re.compile(r"<\|(?:image|video)_pad\|>")
_VISION_START = "<|vision_start|>"
_HEADER = "<|im_start|>assistant\n"
_END = "<|im_end|>"
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]


def chat_template_of(tokenizer: object) -> str | None:
    """The chat template of an HF tokenizer (a string), or None when it has none."""
    if not callable(getattr(tokenizer, "apply_chat_template", None)):
        return None
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) and template else None


class TemplateEncoder(SampleEncoder):
    """Encodes conversations through the tokenizer's chat template (see the module docstring).

    Takes every input form :class:`~energon_pack.ConversationEncoder` takes, with the
    same ``encode_sample(key, sample)``: ShareGPT strings keep their ``<image>`` / ``<video>``
    placeholders, typed content only its ``{"type": "image" | "video"}`` parts (a literal
    ``<image>`` in a text part is text); a row's ``tools`` are the template's ``tools=``. The
    sample's ``system`` field, else ``system_prompt`` (when the conversation has no system turn
    first), becomes a first system message; without either the template decides (Qwen's
    templates add their default prompt).

    Args:
        tokenizer: a fast HF tokenizer with a chat template (``tokenizer.chat_template``).
        media, system_prompt, loss_on, media_block: see :class:`~energon_pack.SampleEncoder`.
        chat_template: render with this template instead of the tokenizer's.
        template_kwargs: extra template variables, JSON-able (e.g. ``{"enable_thinking":
            False}``); they are in the settings fingerprint.

    Raises:
        ValueError: the tokenizer has no chat template or no fast backend, or the template has
            no generation markers and does not fit the ChatML rule (the message names the
            template and the fix).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        **options: Unpack[EncoderOptions],
    ) -> None:
        named = getattr(tokenizer, "chat_template", None)
        if chat_template is None and isinstance(named, Mapping):
            raise ValueError(
                f"{type(tokenizer).__name__} has several named chat templates {sorted(named)}; "
                "pass the one to train with as chat_template= (e.g. "
                "tokenizer.chat_template['default'])"
            )
        check_special_tokens(tokenizer)
        template = chat_template if chat_template is not None else chat_template_of(tokenizer)
        if not isinstance(template, str) or not template:
            raise ValueError(
                f"TemplateEncoder needs a tokenizer with a chat template; "
                f"{type(tokenizer).__name__} has none (chat_template={template!r:.80}); set "
                "tokenizer.chat_template, pass chat_template=, or use the ChatML encoder "
                "(encoding='chatml')"
            )
        if template_kwargs is not None and not isinstance(template_kwargs, Mapping):
            raise ValueError(
                f"template_kwargs must be a mapping of template variables, got "
                f"{type(template_kwargs).__name__}; pass e.g. {{'enable_thinking': False}}"
            )
        super().__init__(tokenizer, **options)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"TemplateEncoder needs a fast tokenizer (token offsets); "
                f"{type(tokenizer).__name__} has no backend_tokenizer: load it with "
                "AutoTokenizer.from_pretrained(..., use_fast=True)"
            )
        self._backend = backend
        self.chat_template = template
        self.template_sha256 = template_sha256(template)
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.masking: Literal["markers", "chatml"] = (
            "markers" if has_generation_markers(template) else "chatml"
        )
        try:
            self._bounded = BoundedTemplate(template)
        except Exception as error:  # a syntax error, ...
            raise ValueError(
                f"the chat template (sha256 {self.template_sha256[:12]}) does not compile: "
                f"{type(error).__name__}: {error}; fix tokenizer.chat_template or pass "
                "chat_template="
            ) from None
        special = getattr(tokenizer, "special_tokens_map", None)
        self._special_tokens: dict[str, Any] = dict(special) if isinstance(special, Mapping) else {}
        self._check_masking()
        self.default_system_prompt = default_system_prompt(
            template, self._special_tokens, self.template_name
        )
        """The system prompt the template inserts in a conversation without one (Qwen2-VL's
        ``"You are a helpful assistant."``), or None."""

    @property
    def template_name(self) -> str:
        """The template as errors name it: the tokenizer's name and the template's digest."""
        name = getattr(self.tokenizer, "name_or_path", None) or type(self.tokenizer).__name__
        return f"the chat template of {name!r} (sha256 {self.template_sha256[:12]})"

    def settings(self) -> dict[str, Any]:
        """The system prompt, loss rule, encoding, template digest and template variables."""
        return {
            "system_prompt": self.system_prompt,
            "loss_on": self.loss_on,
            "encoding": "template",
            "chat_template_sha256": self.template_sha256,
            "template_kwargs": self.template_kwargs,
        }

    def encode(self, raw: RawSample) -> EncodedSample:
        """Encode a parsed sample, probing (not decoding) its media; see the class docstring.

        Raises :class:`~energon_pack.media.MediaError`: ``placeholder_mismatch`` when the
        rendered media blocks are not the sample's media (a text-only template drops them,
        or vision-token text is in the conversation), ``bad_sample`` when the template cannot
        render the conversation, its text cannot be tokenised, or its assistant turns are not
        found.
        """
        messages = self._messages(raw)
        media = self._probed_media(raw)
        parts = [self._media_parts(item) for item in media]
        ids, mask = self._render(raw.key, messages, raw.tools, [lead for lead, _ in parts])
        if self.loss_on == "all":
            mask = [1] * len(ids)
        ids, mask, blocks = self._expand(raw.key, ids, mask, media, [b for _, b in parts])
        return self._finished(raw.key, ids, mask, media, blocks)

    def _messages(self, raw: RawSample) -> list[dict[str, Any]]:
        """The sample's chat messages, its system prompt (or ``system_prompt``) first."""
        return with_system(super()._messages(raw), raw.system, self.system_prompt)

    def _render(
        self,
        key: str,
        messages: list[dict[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        leads: Sequence[str] = (),
    ) -> tuple[list[int], list[int]]:
        """Ids and assistant mask of the rendered conversation (before media expansion), each
        medium's lead text (``leads``, in media order) put before its rendered block."""
        assistants = sum(message["role"] == "assistant" for message in messages)
        markers = self.masking == "markers"
        text, generation = render_sample(
            self._bounded,
            key,
            messages,
            tools,
            variables={**self._special_tokens, **self.template_kwargs},
            track_generation=markers,
            name=self.template_name,
        )
        spans = generation if markers else chatml_spans(text)
        if not markers and len(spans) != assistants:
            raise MediaError(
                key,
                "json",
                "bad_sample",
                f"{self.template_name} rendered {len(spans)} assistant turns "
                f"({_HEADER!r} ... {_END!r}) for {assistants} assistant messages, so the loss "
                "mask cannot be placed; remove ChatML control-token text (<|im_start|>, "
                "<|im_end|>) from the conversation",
            )
        if any(leads):
            text, spans = _with_leads(text, spans, leads)
        return self._tokenised(key, text, spans)

    def _tokenised(
        self, key: str, text: str, spans: Sequence[tuple[int, int]]
    ) -> tuple[list[int], list[int]]:
        """Ids of the rendered text and the mask of the tokens overlapping ``spans``."""
        ids, offsets = tokenise_text(self._backend, key, text, add_special_tokens=False)
        return ids, _span_mask(offsets, spans)

    def _expand(
        self,
        key: str,
        ids: list[int],
        mask: list[int],
        media: Sequence[MediaItem],
        ids_of: Sequence[list[int]],
    ) -> tuple[list[int], list[int], list[int]]:
        """Each rendered ``<|vision_start|><|X_pad|><|vision_end|>`` replaced by the ids of
        the next medium (placeholder order; ``ids_of``: each medium's ids after its lead
        text); also gives the blocks' ids."""
        vision = self.vision_ids
        pads = {vision.image_pad: "image", vision.video_pad: "video"}
        where = [i for i, token in enumerate(ids) if token in pads]
        rendered = [pads[ids[i]] for i in where]
        if rendered != [item.kind for item in media] or any(
            i == 0 or ids[i - 1] != vision.start or i + 1 == len(ids) or ids[i + 1] != vision.end
            for i in where
        ):
            raise MediaError(
                key,
                "json",
                "placeholder_mismatch",
                f"{self.template_name} rendered the media blocks {rendered} but the sample has "
                f"the media {[item.kind for item in media]}; a text-only template renders no "
                "media (use the model's VL template), and vision-token text such as "
                "<|image_pad|> in the conversation must be removed",
            )
        if not where:
            return ids, mask, []
        out_ids: list[int] = []
        out_mask: list[int] = []
        blocks: list[int] = []
        media_flag = int(self.loss_on == "all")
        last = 0
        for i, block in zip(where, ids_of, strict=True):
            out_ids += ids[last : i - 1]
            out_mask += mask[last : i - 1]
            out_ids += block
            out_mask += [media_flag] * len(block)
            blocks += block
            last = i + 2
        out_ids += ids[last:]
        out_mask += mask[last:]
        return out_ids, out_mask, blocks

    def _check_masking(self) -> None:
        """The masking rule finds the assistant's reply of a probe conversation."""
        fix = (
            "wrap what the assistant writes in {% generation %}...{% endgeneration %} "
            "(transformers' assistant-mask markers) in tokenizer.chat_template, or use the "
            "ChatML encoder (encoding='chatml')"
        )
        try:
            ids, mask = self._render("probe", [dict(m) for m in _PROBE], None)
        except MediaError as error:
            if "render bound" in error.cause:
                raise ValueError(
                    f"{self.template_name} goes over a render bound on a two-turn probe "
                    f"conversation: {error.cause.split('render bound: ', 1)[1]} (bounds: "
                    f"{RENDER_SECONDS:g} s, {RENDER_CHARS:,} characters per conversation)"
                ) from None
            raise ValueError(
                f"{self.template_name} has no generation markers and does not render "
                f"assistant turns as ChatML ({_HEADER!r} ... {_END!r}), so the loss mask "
                f"cannot be found ({error.cause}); {fix}"
            ) from None
        masked = [token for token, flag in zip(ids, mask, strict=True) if flag]
        if str(_PROBE[1]["content"]) not in self._backend.decode(masked):
            raise ValueError(
                f"{self.template_name}: its assistant mask ({self.masking}) does not cover the "
                f"assistant's reply {_PROBE[1]['content']!r} of a probe conversation; {fix}"
            )


def chatml_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the assistant turns of a rendered ChatML conversation: from after
    each ``<|im_start|>assistant\\n`` through its ``<|im_end|>``; a turn without an end
    counts as no span (so the count check refuses it)."""
    return delimited_spans(text, _HEADER, _END)


def _with_leads(
    text: str, spans: Sequence[tuple[int, int]], leads: Sequence[str]
) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with each medium's lead text put before the ``<|vision_start|>`` of its
    rendered block, and ``spans`` moved with the text, the leads no part of them. Blocks that
    do not line up with the media leave the text as it is (the expansion names the mismatch)."""
    pads = [found.start() - len(_VISION_START) for found in _PAD.finditer(text)]
    if len(pads) != len(leads) or any(
        lead and (at < 0 or not text.startswith(_VISION_START, at))
        for at, lead in zip(pads, leads, strict=True)
    ):
        return text, list(spans)
    points = [(at, lead) for at, lead in zip(pads, leads, strict=True) if lead]
    pieces, last = [], 0
    for at, lead in points:
        pieces += [text[last:at], lead]
        last = at
    pieces.append(text[last:])

    def moved(at: int, after_lead: bool) -> int:
        """Where ``text[at:]`` starts once the leads are in (after a lead put at ``at``)."""
        return at + sum(len(lead) for p, lead in points if p < at or (after_lead and p == at))

    moved_spans = []
    for begin, end in spans:
        edges = [begin, *(p for p, _ in points if begin < p < end), end]
        moved_spans += [
            (moved(a, after_lead=True), moved(b, after_lead=False)) for a, b in pairwise(edges)
        ]
    return "".join(pieces), moved_spans


def _span_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose character offsets overlap a span (transformers' rule)."""
    if not offsets:
        return []
    bounds = np.asarray(offsets, dtype=np.int64)
    mask = np.zeros(len(bounds), dtype=bool)
    for begin, end in spans:
        mask |= (bounds[:, 1] > begin) & (bounds[:, 0] < end)
    flags: list[int] = mask.astype(np.int64).tolist()
    return flags


def make_encoder(
    tokenizer: Tokenizer | None = None,
    *,
    encoding: Encoding = "auto",
    media: MediaConfig | None = None,
    system_prompt: str | None = None,
    loss_on: LossOn = "assistant",
    media_block: MediaBlock | None = None,
    family: Family | str | Any = None,
) -> SampleEncoder:
    """The encoder for ``tokenizer``: see :data:`Encoding`. ``"auto"`` takes the template
    encoder for an HF tokenizer with a chat template and the ChatML encoder otherwise (the byte
    tokenizer, a tokenizer without a template: each turn ``<|im_start|>{role}\\n{content}
    <|im_end|>\\n``, loss on the assistant content and its ``<|im_end|>``).
    That fallback for an HF tokenizer is never silent: a
    :class:`~energon_pack.PackingWarning` names it, once per tokenizer (``encoding="chatml"``
    chooses ChatML without one). The tokenizer must have the Qwen2-VL special tokens
    (:func:`~energon_pack.encoding.chatml.check_special_tokens`: a ValueError names the
    missing ones and the fix).

    ``family`` (anything :func:`~energon_pack.model_family` takes: a processor, its saved
    directory, a preset name, ...): a Qwen preset gives the encoder its media settings
    (``media`` must fit them); a processor-backed family gives its
    :class:`~energon_pack.ProcessorEncoder`, whose ids equal the family's processor
    (``tokenizer``: None, the processor's, or one equal to it such as the tokenizer loaded
    from the same directory); its :class:`~energon_pack.RequestEncoder` where the family's
    tokenizer encodes conversations itself (Voxtral's mistral-common).
    """
    check_choice("encoding", encoding, ("auto", "template", "chatml"))
    chosen = None if family is None else model_family(family)
    if isinstance(chosen, ProcessorFamily):
        _check_processor_options(chosen, tokenizer, encoding, media_block)
        made = RequestEncoder if chosen.tokenizes == "request" else ProcessorEncoder
        return made(chosen, media=media, system_prompt=system_prompt, loss_on=loss_on)
    options: dict[str, Any] = {
        "media": family_media(chosen, media),
        "system_prompt": system_prompt,
        "loss_on": loss_on,
        "media_block": media_block,
    }
    has_template = bool(getattr(tokenizer, "chat_template", None)) and callable(
        getattr(tokenizer, "apply_chat_template", None)
    )
    if encoding == "template" or (encoding == "auto" and has_template):
        if tokenizer is None:
            raise ValueError(
                "encoding='template' needs an HF tokenizer with a chat template; the built-in "
                "ByteTokenizer has none: pass tokenizer=, or encoding='chatml'"
            )
        return TemplateEncoder(tokenizer, **options)
    logger.debug("ChatML encoder: %s", "chosen" if encoding == "chatml" else "no chat template")
    encoder = ConversationEncoder(tokenizer, **options)
    if encoding == "auto" and not isinstance(encoder.tokenizer, ByteTokenizer):
        _warn_no_template(encoder)
    return encoder


_warned_no_template: set[str] = set()
"""The tokenizers (name or path) already warned about: :func:`make_encoder` warns once each."""


def _warn_no_template(encoder: ConversationEncoder) -> None:
    """A :class:`~energon_pack.PackingWarning`, once per tokenizer, that ``"auto"`` fell back
    to the ChatML encoder because the tokenizer has no chat template."""
    tokenizer = encoder.tokenizer
    name = getattr(tokenizer, "name_or_path", None) or type(tokenizer).__name__
    if name in _warned_no_template:
        return
    _warned_no_template.add(name)
    system = encoder.system_prompt
    warnings.warn(
        f"tokenizer {name!r} has no chat template, so conversations are encoded with the "
        "built-in ChatML rule ("
        + ("no system prompt" if system is None else f"system prompt {system!r:.60}")
        + "), not your model's template: token counts and packs differ where the template "
        "differs (Qwen2-VL's adds a default system prompt). Set tokenizer.chat_template (on the "
        "command line: --chat-template FILE), or pass encoding='chatml' to choose ChatML",
        PackingWarning,
        stacklevel=3,
    )


def check_encoder(encoder: SampleEncoder, family: Family | None) -> SampleEncoder:
    """``encoder`` if it serves ``family`` (a built family, or None): a processor family's own
    :class:`~energon_pack.ProcessorEncoder` (or :class:`~energon_pack.RequestEncoder`), or
    media settings that fit a Qwen preset
    (:func:`~energon_pack.encoding.family.family_media`); ValueError naming the fix otherwise."""
    if isinstance(family, ProcessorFamily):
        if not isinstance(encoder, FamilyEncoder) or encoder.family.name != family.name:
            raise ValueError(
                f"family={family.name!r} needs the family's encoder; pass "
                f"encoder=make_encoder(tokenizer, family=family), not "
                f"{type(encoder).__name__}"
            )
        return encoder
    family_media(family, encoder.media)  # the encoder's media must fit the family
    return encoder


def _same_tokenizer(tokenizer: Any, family: ProcessorFamily) -> bool:
    """Whether ``tokenizer`` encodes as the family's processor's tokenizer does: that object,
    or one with the same vocabulary and special tokens and no other chat template (the family
    renders its processor's)."""
    own: Any = family.tokenizer
    if tokenizer is own:
        return True
    template = getattr(tokenizer, "chat_template", None)
    try:
        return bool(
            tokenizer.get_vocab() == own.get_vocab()
            and tokenizer.all_special_tokens == own.all_special_tokens
            and (not template or template == processor_chat_template(family))
        )
    except AttributeError:  # not an HF tokenizer (e.g. the built-in ByteTokenizer)
        return False


def _check_processor_options(
    family: ProcessorFamily, tokenizer: object, encoding: str, media_block: object
) -> None:
    """What a processor-backed family's encoder takes: its processor's tokenizer (or None, or
    a tokenizer equal to it, e.g. loaded from the same directory), its processor's own
    expansion, its chat template."""
    if tokenizer is not None and not _same_tokenizer(tokenizer, family):
        raise ValueError(
            f"family={family.name!r} encodes with its processor's tokenizer, and this "
            "tokenizer differs from it (its vocabulary, special tokens or chat template); pass "
            "the tokenizer saved with the processor, processor.tokenizer, or None"
        )
    if media_block is not None:
        raise ValueError(
            f"family={family.name!r} expands media as its processor does; media_block= is "
            "for the Qwen encoders"
        )
    if encoding == "chatml":
        raise ValueError(
            f"family={family.name!r} renders its processor's chat template; "
            "encoding='chatml' is for the Qwen tokenizers"
        )
