"""The packing core: the sample it packs, the packed sample, and the one pack step.

Both loaders (the Energon task encoder and the collate-time packer) build their output with
:func:`pack_samples` and drop a sample whose media fail with :func:`pack_dropping_failures`,
so the row layout, the media order and the failure rule are defined once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, TypeVar

import torch
from torch.utils.data import get_worker_info

from energon_pack.media import (
    MediaConfig,
    MediaError,
    MediaItem,
    MediaTensors,
    decode_vision,
    media_grids,
    tensor_nbytes,
)
from energon_pack.packing.mrope import MRopeConfig, packed_mrope_position_ids
from energon_pack.packing.row import PackedRow, build_packed_row
from energon_pack.packing.row_layout import RowLayout

__all__ = [
    "Decode",
    "EncodedSample",
    "PackedSample",
    "SkippedSample",
    "mrope_for_packed",
    "pack_dropping_failures",
    "pack_samples",
    "padding_pack",
]

Decode = Literal["lazy", "eager"]
"""When a sample's media are decoded: ``"lazy"`` once its pack is chosen, ``"eager"`` before
it is buffered (Megatron-Bridge's order)."""

S = TypeVar("S")
P = TypeVar("P")


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
    vision: MediaTensors | None = None
    """Set by :meth:`materialize`."""

    @property
    def length(self) -> int:
        """Token count (vision tokens included)."""
        return int(self.input_ids.numel())

    @property
    def vision_tokens(self) -> int:
        """Encoder tokens among :attr:`length`: image, video and audio tokens (from the media
        probes)."""
        return sum(m.tokens for m in self.media)

    @property
    def audio_tokens(self) -> int:
        """The audio encoder's tokens among :attr:`vision_tokens` (a video's audio track's
        too)."""
        return sum(m.tokens if m.kind == "audio" else m.audio_tokens for m in self.media)

    @property
    def is_materialized(self) -> bool:
        return self.vision is not None or not self.media

    @property
    def nbytes(self) -> int:
        """Bytes held in memory: tokens, compressed media, and decoded media once materialised."""
        held = tensor_nbytes(self.input_ids, self.loss_mask) + sum(m.nbytes for m in self.media)
        return held + (self.vision.nbytes if self.vision is not None else 0)

    def materialize(self, config: MediaConfig | None = None) -> EncodedSample:
        """A copy with the media decoded and patchified into :attr:`vision`.

        Raises :class:`~energon_pack.media.MediaError` if a member cannot be decoded or decodes
        to another grid than its probe said (the token layout would no longer match).
        """
        if self.is_materialized:
            return self
        return replace(self, vision=decode_vision([self], config))


@dataclass(frozen=True)
class PackedSample:
    """One packed row of several samples, their media concatenated in segment order."""

    keys: tuple[str, ...]
    """Source sample keys in segment order."""
    row: PackedRow
    vision: MediaTensors
    mrope_position_ids: torch.Tensor | None = None
    """``[3, T]`` long mRoPE ids (temporal, height, width), when asked for."""
    rope_deltas: torch.Tensor | None = None
    """``[N]`` long per-segment rope deltas (max position + 1 - length), with mRoPE."""

    def to_dict(self) -> dict[str, Any]:
        """Flat mapping: the row's fields, the media and mRoPE tensors that are set, ``keys``."""
        row = {f.name: getattr(self.row, f.name) for f in fields(self.row)}
        rope = {"mrope_position_ids": self.mrope_position_ids, "rope_deltas": self.rope_deltas}
        rope = {name: value for name, value in rope.items() if value is not None}
        return {**row, **self.vision.tensors(), **rope, "keys": list(self.keys)}


def mrope_for_packed(
    packed: PackedSample, config: MRopeConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~energon_pack.packed_mrope_position_ids` of a :class:`PackedSample`."""
    row, vision = packed.row, packed.vision
    return packed_mrope_position_ids(
        row.input_ids,
        row.cu_seqlens_padded,
        row.cu_seqlens,
        vision.image_grid_thw,
        vision.video_grid_thw,
        vision.second_per_grid_ts,
        config,
    )


class SkippedSample(Exception):
    """The media of one sample of a pack failed: its ``position`` in the list being packed
    (keys may repeat, in a blend or a micro-batch) and the :class:`MediaError` naming it."""

    def __init__(self, position: int, error: MediaError) -> None:
        super().__init__(str(error))
        self.position = position
        self.error = error

    @property
    def key(self) -> str:
        return self.error.key

    @property
    def reason(self) -> str:
        """The failure kind, as counted in the stats."""
        return self.error.kind


def pack_dropping_failures(
    samples: Sequence[S],
    pack: Callable[[list[S]], P],
    dropped: Callable[[S, SkippedSample], None],
) -> tuple[P, list[S]] | None:
    """The one pack step: ``pack(samples)``; a sample it reports as :class:`SkippedSample` is
    dropped (``dropped`` is told, once) and the others are packed again. Returns the pack and
    the samples in it, or None when every sample was dropped."""
    remaining = list(samples)
    while remaining:
        try:
            return pack(remaining), remaining
        except SkippedSample as skipped:
            dropped(remaining[skipped.position], skipped)
            del remaining[skipped.position]
    return None


def pack_samples(
    samples: Sequence[EncodedSample],
    layout: RowLayout | None = None,
    /,
    *,
    media: MediaConfig | None = None,
    mrope: MRopeConfig | None = None,
    with_pixels: bool = True,
    **settings: Any,
) -> PackedSample:
    """Pack ``samples``, in order, into one row and decode their media into it.

    ``layout`` is the row's :class:`~energon_pack.RowLayout` (or its fields as
    keywords); ``media`` is the preprocessing used to decode (each image/video is patchified
    straight into its slice of the row's pixel tensors, see
    :func:`~energon_pack.media.decode_vision`); with ``mrope`` the 3-D position ids of every
    segment are computed too. With ``with_pixels=False`` nothing is decoded and the result's
    media carry only the grids, for a caller that decodes the pixels of several rows itself.
    Raises ValueError (naming the keys) if the samples do not fit, and
    :class:`SkippedSample` (its position and the :class:`~energon_pack.media.MediaError`) when
    a sample's media fail.
    """
    row = build_packed_row(
        [{"key": s.key, "input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples],
        RowLayout.of(layout, settings),
    )
    if with_pixels:
        # In a DataLoader worker the batch goes through shared memory: decode it there.
        vision = decode_pixels(samples, media, shared=get_worker_info() is not None)
    else:
        vision = media_grids(samples)
    packed = PackedSample(keys=tuple(s.key for s in samples), row=row, vision=vision)
    if mrope is None:
        return packed
    positions, deltas = mrope_for_packed(packed, mrope)
    return replace(packed, mrope_position_ids=positions, rope_deltas=deltas)


def decode_pixels(
    samples: Sequence[EncodedSample], media: MediaConfig | None, *, shared: bool = False
) -> MediaTensors:
    """:func:`~energon_pack.media.decode_vision` of ``samples``; a failing sample is raised as
    :class:`SkippedSample` at its position in ``samples``."""
    try:
        return decode_vision(samples, media, shared=shared)
    except MediaError as error:
        if error.position is None:
            raise
        raise SkippedSample(error.position, error) from error


def padding_pack(layout: RowLayout, mrope: MRopeConfig | None = None) -> PackedSample:
    """A row that contributes nothing to the loss: one segment of padding, no keys, no media.

    It stands in for a pack or micro-batch whose samples were all skipped: its loss mask is all
    zero and its labels all ``-100``; it is ``pad_to_multiple_of`` tokens wide (``seq_length``
    with ``pad_to_max_length``).
    """
    width = layout.pad_to_multiple_of
    filler = EncodedSample(
        "<padding>",
        torch.full((width,), layout.pad_token_id, dtype=torch.long),
        torch.zeros(width, dtype=torch.long),
    )
    return replace(pack_samples([filler], layout, mrope=mrope), keys=())
