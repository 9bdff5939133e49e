"""Conversation encoding: ChatML (Qwen) token ids, loss mask and lazily decoded media.

:class:`ConversationEncoder` turns a conversation and its media members into an
:class:`EncodedSample`: token ids with every ``<image>``/``<video>`` placeholder expanded to
``<|vision_start|>`` + N pad tokens + ``<|vision_end|>``, N taken from the media *probe* (header
only). The media stay compressed bytes until :meth:`EncodedSample.materialize` decodes and
patchifies them, which the packers call only for samples they selected.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, Protocol

import torch

from energon_pack.media import (
    MediaConfig,
    MediaError,
    check_media_count,
    probe_image,
    probe_video,
    process_image,
    process_video,
    tensor_nbytes,
)
from energon_pack.sample import RawSample, parse_sample

logger = logging.getLogger("energon_pack.encode")

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


def _split_placeholders(content: str) -> list[str | None]:
    """Text pieces of ``content`` with None where an ``<image>``/``<video>`` placeholder stands."""
    pieces = _PLACEHOLDER.split(content)  # text, kind, text, kind, ..., text
    return [piece if index % 2 == 0 else None for index, piece in enumerate(pieces)]


class Tokenizer(Protocol):
    """What the encoder needs of a tokenizer (an HF tokenizer has both)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def convert_tokens_to_ids(self, token: str) -> int: ...


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


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a sample: compressed bytes plus what the header probe told."""

    member: str
    kind: Literal["image", "video"]
    data: bytes
    grid_thw: tuple[int, int, int]
    tokens: int
    second_per_grid_t: float | None = None
    """Seconds covered by one temporal patch (videos only)."""


@dataclass(frozen=True)
class VisionInputs:
    """Decoded, patchified media of one sample (or one packed row), in placeholder order."""

    pixel_values: torch.Tensor | None = None
    """``[sum of image grid products, 3*t*p*p]`` float32, or None without images."""
    image_grid_thw: torch.Tensor | None = None
    """``[images, 3]`` long."""
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    """``[videos]`` float32: seconds covered by one temporal patch of each video."""

    @classmethod
    def concat(cls, parts: Sequence[VisionInputs]) -> VisionInputs:
        """The media of ``parts`` one after the other (images and videos each in order)."""

        def cat(name: str) -> torch.Tensor | None:
            tensors = [getattr(part, name) for part in parts if getattr(part, name) is not None]
            return torch.cat(tensors) if tensors else None

        return cls(**{f.name: cat(f.name) for f in fields(cls)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(*self.tensors().values())


@dataclass(frozen=True)
class EncodedSample:
    """A tokenised sample ready to pack.

    ``loss_mask`` is aligned with ``input_ids``: 1 where that token is a training target. Media
    are kept as compressed bytes with probed grids until :meth:`materialize`.
    """

    key: str
    input_ids: torch.Tensor
    """``[L]`` long."""
    loss_mask: torch.Tensor
    """``[L]`` long, 1 on target tokens."""
    media: tuple[MediaItem, ...] = ()
    vision: VisionInputs | None = None
    """Set by :meth:`materialize`."""

    @property
    def length(self) -> int:
        """Token count (vision tokens included)."""
        return int(self.input_ids.numel())

    @property
    def is_materialized(self) -> bool:
        return self.vision is not None or not self.media

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: tokens, compressed media, and decoded media once materialised."""
        held = tensor_nbytes(self.input_ids, self.loss_mask) + sum(len(m.data) for m in self.media)
        return held + (self.vision.nbytes if self.vision is not None else 0)

    def materialize(self, config: MediaConfig | None = None) -> EncodedSample:
        """A copy with the media decoded and patchified into :attr:`vision`.

        Raises :class:`~energon_pack.media.MediaError` if a member cannot be decoded or decodes
        to another grid than its probe said (the token layout would no longer match).
        """
        if self.is_materialized:
            return self
        return replace(self, vision=decode_vision([self], config))


def decode_vision(
    samples: Sequence[EncodedSample], config: MediaConfig | None = None, *, shared: bool = False
) -> VisionInputs:
    """The media of ``samples``, in order, decoded straight into one tensor per field.

    Each image and video is patchified into its slice of ``pixel_values`` /
    ``pixel_values_videos``, sized from the probed grids, so a packed row's pixels exist once.
    Already materialised samples are copied in. ``shared=True`` allocates the pixels in shared
    memory (where a DataLoader worker would copy the batch anyway).
    Raises :class:`~energon_pack.media.MediaError` naming the sample and member on bad media.
    """
    cfg = config or MediaConfig()
    items = [item for s in samples for item in s.media]
    pixels = {
        kind: _alloc([i for i in items if i.kind == kind], cfg, shared)
        for kind in ("image", "video")
    }
    offsets = {"image": 0, "video": 0}
    for sample in samples:
        vision = sample.vision
        if vision is not None:  # materialised already: copy its blocks in
            for kind, block in (
                ("image", vision.pixel_values),
                ("video", vision.pixel_values_videos),
            ):
                if block is not None:
                    start = offsets[kind]
                    _slot(pixels[kind], start, block.shape[0]).copy_(block)
                    offsets[kind] += block.shape[0]
            continue
        for item in sample.media:
            rows = math.prod(item.grid_thw)
            slot = _slot(pixels[item.kind], offsets[item.kind], rows)
            offsets[item.kind] += rows
            decode = process_image if item.kind == "image" else process_video
            decode(item.data, cfg, key=sample.key, member=item.member, out=slot)
    grids = media_grids(samples)
    return replace(grids, pixel_values=pixels["image"], pixel_values_videos=pixels["video"])


def media_grids(samples: Sequence[EncodedSample]) -> VisionInputs:
    """The grids and video timings of ``samples``' media, in order, from their probes only."""
    images = [item for s in samples for item in s.media if item.kind == "image"]
    videos = [item for s in samples for item in s.media if item.kind == "video"]
    seconds = [item.second_per_grid_t or 0.0 for item in videos]
    return VisionInputs(
        image_grid_thw=_grids(images),
        video_grid_thw=_grids(videos),
        second_per_grid_ts=torch.tensor(seconds, dtype=torch.float32) if videos else None,
    )


def _alloc(items: list[MediaItem], cfg: MediaConfig, shared: bool) -> torch.Tensor | None:
    if not items:
        return None
    out = torch.empty((sum(math.prod(i.grid_thw) for i in items), cfg.patch_dim))
    if shared:
        out.share_memory_()  # type: ignore[no-untyped-call]
    return out


def _slot(pixels: torch.Tensor | None, start: int, rows: int) -> torch.Tensor:
    assert pixels is not None  # allocated from the same items
    return pixels[start : start + rows]


def _grids(items: list[MediaItem]) -> torch.Tensor | None:
    return torch.tensor([list(i.grid_thw) for i in items], dtype=torch.long) if items else None


class ConversationEncoder:
    """Encodes conversations with the ChatML template used by Qwen2-VL.

    Each turn becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; an optional system prompt
    comes first. The loss covers the content and ``<|im_end|>`` of assistant turns
    (``loss_on="assistant"``, the default) or every token (``loss_on="all"``).

    Args:
        tokenizer: an HF-style tokenizer (``encode(text, add_special_tokens=False)`` and
            ``convert_tokens_to_ids``) or None for the built-in :class:`ByteTokenizer`. Text
            between special tokens is encoded piece by piece, as HF tokenizers split on them.
        media: preprocessing settings and limits for images and videos.
        system_prompt: used when a sample has no system prompt of its own.
        loss_on: ``"assistant"`` or ``"all"``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        media: MediaConfig | None = None,
        system_prompt: str | None = None,
        loss_on: LossOn = "assistant",
    ) -> None:
        if loss_on not in ("assistant", "all"):
            raise ValueError(f"loss_on must be 'assistant' or 'all', got {loss_on!r}")
        self.tokenizer: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.media = media or MediaConfig()
        self.system_prompt = system_prompt
        self.loss_on: LossOn = loss_on
        ids = {token: self.tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
        self._im_start = ids["<|im_start|>"]
        self._im_end = ids["<|im_end|>"]
        self._vision_start = ids["<|vision_start|>"]
        self._vision_end = ids["<|vision_end|>"]
        self._pad = {"image": ids["<|image_pad|>"], "video": ids["<|video_pad|>"]}
        self._newline = self._text("\n")

    def encode_sample(self, key: str, sample: Mapping[str, Any]) -> EncodedSample:
        """Encode a raw WebDataset sample (``json`` plus media members; see the README)."""
        return self.encode(parse_sample(key, sample, self.media))

    def encode(self, raw: RawSample) -> EncodedSample:
        """Encode a parsed sample, probing (not decoding) its media."""
        check_media_count(raw.key, len(raw.media), self.media)
        media = tuple(self._probe(raw.key, member, kind, data) for member, kind, data in raw.media)
        ids: list[int] = []
        mask: list[int] = []

        def add(tokens: list[int], target: bool) -> None:
            ids.extend(tokens)
            mask.extend([int(target or self.loss_on == "all")] * len(tokens))

        system = raw.system if raw.system is not None else self.system_prompt
        turns = [("system", system)] if system is not None else []
        turns += [(self._role(raw.key, role), content) for role, content in raw.turns]
        pending = iter(media)
        for role, content in turns:
            target = role == "assistant"
            add([self._im_start, *self._text(f"{role}\n")], False)
            for piece in _split_placeholders(content):
                if piece is None:
                    item = next(pending)
                    add([self._vision_start, *[self._pad[item.kind]] * item.tokens], False)
                    add([self._vision_end], False)
                elif piece:
                    add(self._text(piece), target)
            add([self._im_end], target)
            add(self._newline, False)
        return EncodedSample(
            key=raw.key,
            input_ids=torch.tensor(ids, dtype=torch.long),
            loss_mask=torch.tensor(mask, dtype=torch.long),
            media=media,
        )

    def _text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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

    def _probe(
        self, key: str, member: str, kind: Literal["image", "video"], data: bytes
    ) -> MediaItem:
        if kind == "image":
            probe = probe_image(data, self.media, key=key, member=member)
            return MediaItem(member, kind, data, probe.grid_thw, probe.tokens)
        video = probe_video(data, self.media, key=key, member=member)
        return MediaItem(member, kind, data, video.grid_thw, video.tokens, video.second_per_grid_t)
