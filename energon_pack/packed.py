"""A packed VLM sample: one THD row plus the media of its segments, in segment order.

Both packing paths (the Energon task encoder and the collate-time packer) build their output
with :func:`pack_samples`, so the row layout and the media order are defined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from energon_pack.encode import EncodedSample, VisionInputs
from energon_pack.layout import PackedRow, build_packed_row
from energon_pack.media import MediaConfig
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
    """Materialise ``samples`` (decode their media) and pack them, in order, into one row.

    The row options are those of :func:`~energon_pack.layout.build_packed_row`; ``media`` is
    the preprocessing used to decode; with ``mrope`` the 3-D position ids of every segment are
    computed too. With ``with_pixels=False`` the result's media carry only the grids (for a
    caller that concatenates the pixels of several rows itself, in one copy). Raises ValueError
    (naming the keys) if the samples do not fit.
    """
    ready = [sample.materialize(media) for sample in samples]
    row = build_packed_row(
        [{"key": s.key, "input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in ready],
        seq_length=seq_length,
        pad_to_multiple_of=pad_to_multiple_of,
        pad_to_max_length=pad_to_max_length,
        pad_cu_seqlens=pad_cu_seqlens,
        max_segments=max_segments,
        pad_token_id=pad_token_id,
    )
    parts = [s.vision for s in ready if s.vision is not None]
    vision = VisionInputs.concat(parts if with_pixels else [v.without_pixels() for v in parts])
    keys = tuple(s.key for s in ready)
    if mrope is None:
        return PackedSample(keys=keys, row=row, vision=vision)
    positions, deltas = packed_mrope_position_ids(
        row.input_ids,
        row.cu_seqlens_padded,
        row.cu_seqlens,
        vision.image_grid_thw,
        vision.video_grid_thw,
        vision.second_per_grid_ts,
        mrope,
    )
    return PackedSample(keys, row, vision, mrope_position_ids=positions, rope_deltas=deltas)
