"""A packed VLM sample: one THD row plus the media of its segments, in segment order.

Both packing paths (the Energon task encoder and the collate-time packer) build their output
with :func:`pack_samples`, so the row layout and the media order are defined once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from energon_pack.encode import EncodedSample, VisionInputs
from energon_pack.layout import PackedRow, build_packed_row
from energon_pack.media import MediaConfig


@dataclass(frozen=True)
class PackedSample:
    """One packed row of several samples, their media concatenated in segment order."""

    keys: tuple[str, ...]
    """Source sample keys in segment order."""
    row: PackedRow
    vision: VisionInputs

    def to_dict(self) -> dict[str, Any]:
        """Flat mapping: the row's fields, the media tensors that are set, and ``keys``."""
        row = {f.name: getattr(self.row, f.name) for f in fields(self.row)}
        return {**row, **self.vision.tensors(), "keys": list(self.keys)}


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
) -> PackedSample:
    """Materialise ``samples`` (decode their media) and pack them, in order, into one row.

    The row options are those of :func:`~energon_pack.layout.build_packed_row`; ``media`` is
    the preprocessing used to decode. Raises ValueError (naming the keys) if they do not fit.
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
    vision = VisionInputs.concat([s.vision for s in ready if s.vision is not None])
    return PackedSample(keys=tuple(s.key for s in ready), row=row, vision=vision)
