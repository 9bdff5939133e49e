"""A packed VLM sample: one THD row plus the media of its segments, in segment order.

Both packing paths (the Energon task encoder and the collate-time packer) build their output
with :func:`pack_samples`, so the row layout and the media order are defined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch.utils.data import get_worker_info

from energon_pack.encode import EncodedSample
from energon_pack.layout import PackedRow, build_packed_row
from energon_pack.media import MediaConfig, MediaError, VisionInputs, decode_vision, media_grids
from energon_pack.rope import MRopeConfig, packed_mrope_position_ids


@dataclass(frozen=True)
class PackedSample:
    """One packed row of several samples, their media concatenated in segment order."""

    keys: tuple[str, ...]
    """Source sample keys in segment order."""
    row: PackedRow
    vision: VisionInputs
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
    """:func:`~energon_pack.rope.packed_mrope_position_ids` of a :class:`PackedSample`."""
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


def by_position(samples: Sequence[EncodedSample]) -> list[EncodedSample]:
    """``samples`` renamed ``key#position``: keys may repeat (across shards, in a micro-batch),
    and a media error must name one sample. :func:`real_keys` and :func:`real_error` map the
    names back."""
    return [replace(sample, key=f"{sample.key}#{i}") for i, sample in enumerate(samples)]


def real_keys(samples: Sequence[EncodedSample], names: Sequence[str]) -> tuple[str, ...]:
    """The keys of ``samples`` that :func:`by_position` ``names`` stand for."""
    return tuple(samples[_position(name)].key for name in names)


def real_error(samples: Sequence[EncodedSample], error: MediaError) -> tuple[int, MediaError]:
    """The position of the sample a :func:`by_position` ``error`` names, and the error under
    its real key."""
    position = _position(error.key)
    return position, MediaError(samples[position].key, error.member, error.kind, error.cause)


def _position(name: str) -> int:
    return int(name.rsplit("#", 1)[1])


def pack_samples(
    samples: Sequence[EncodedSample],
    *,
    seq_length: int,
    pad_to_multiple_of: int = 1,
    pad_to_max_length: bool = False,
    pad_cu_seqlens: bool = False,
    max_segments: int | None = None,
    pad_token_id: int = 0,
    media: MediaConfig | None = None,
    mrope: MRopeConfig | None = None,
    with_pixels: bool = True,
) -> PackedSample:
    """Pack ``samples``, in order, into one row and decode their media into it.

    The row options are those of :func:`~energon_pack.layout.build_packed_row`; ``media`` is
    the preprocessing used to decode (each image/video is patchified straight into its slice of
    the row's pixel tensors, see :func:`~energon_pack.media.decode_vision`); with ``mrope`` the
    3-D position ids of every segment are computed too. With ``with_pixels=False`` nothing is
    decoded and the result's media carry only the grids, for a caller that decodes the pixels
    of several rows itself. Raises ValueError (naming the keys) if the samples do not
    fit, and :class:`~energon_pack.media.MediaError` on bad media.
    """
    row = build_packed_row(
        [{"key": s.key, "input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples],
        seq_length=seq_length,
        pad_to_multiple_of=pad_to_multiple_of,
        pad_to_max_length=pad_to_max_length,
        pad_cu_seqlens=pad_cu_seqlens,
        max_segments=max_segments,
        pad_token_id=pad_token_id,
    )
    if with_pixels:
        # In a DataLoader worker the batch goes through shared memory: decode it there.
        vision = decode_vision(samples, media, shared=get_worker_info() is not None)
    else:
        vision = media_grids(samples)
    packed = PackedSample(keys=tuple(s.key for s in samples), row=row, vision=vision)
    if mrope is None:
        return packed
    positions, deltas = mrope_for_packed(packed, mrope)
    return replace(packed, mrope_position_ids=positions, rope_deltas=deltas)


def padding_pack(
    *, pad_token_id: int = 0, pad_to_multiple_of: int = 1, **options: Any
) -> PackedSample:
    """A row that contributes nothing to the loss: one segment of padding, no keys, no media.

    It stands in for a pack or micro-batch whose samples were all skipped: its loss mask is all
    zero and its labels all ``-100``; it is ``pad_to_multiple_of`` tokens wide (``seq_length``
    with ``pad_to_max_length``). ``options`` are the other row options of :func:`pack_samples`.
    """
    filler = EncodedSample(
        "<padding>",
        torch.full((pad_to_multiple_of,), pad_token_id, dtype=torch.long),
        torch.zeros(pad_to_multiple_of, dtype=torch.long),
    )
    packed = pack_samples(
        [filler], pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of, **options
    )
    return replace(packed, keys=())
