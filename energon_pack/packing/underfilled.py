"""The once-only warning of :class:`~energon_pack.OnlineBinPacker` when most packs leave a full
buffer under-filled: the buffer holds too few samples to fill a row at this stream's lengths, or
the vision caps keep out samples that would fill it. The warning names the fill, and the samples
a row needs and the setting to raise, or the caps. Pure Python.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from energon_pack.packing.bins import Bin
from energon_pack.packing.buffer import DEFAULT_MIN_ROWS
from energon_pack.packing.packer_state import Candidate, PackerCounters
from energon_pack.packing.row_layout import PackingWarning
from energon_pack.packing.vision_budget import VisionBudget

__all__ = [
    "CAPPED_SHARE",
    "UNDERFILLED_FILL",
    "UNDERFILLED_PACKS",
    "UnderfilledWatch",
    "caps_kept_out",
]

UNDERFILLED_PACKS = 8
"""Packs that must have left a full buffer before :data:`UNDERFILLED_FILL` is judged."""
UNDERFILLED_FILL = 0.9
"""Below this fill, packs leaving a full buffer draw the once-only :class:`PackingWarning`."""
CAPPED_SHARE = 0.5
"""Of the packs that left a full buffer under-filled, the share whose caps kept out a held sample
that fit by tokens for the warning (and ``energon-pack tune``) to name the caps, not the buffer."""


class UnderfilledWatch:
    """Counts the packs that left a full buffer and the units they filled; warns once where
    most packs left so, under-filled. ``min_rows`` (the rows' worth it grows to, raised under a
    vision budget) and ``max_size`` are the growing buffer's (None: ``buffer_size`` alone bounds
    it); ``max_bytes`` the byte bound."""

    def __init__(
        self,
        capacity: int,
        align: int,
        buffer_size: int,
        min_rows: float | None,
        max_size: int,
        max_bytes: int | None,
    ) -> None:
        self.capacity = capacity
        self.align = align
        self.buffer_size = buffer_size
        self.min_rows = min_rows
        self.max_size = max_size
        self.max_bytes = max_bytes
        self.packs = 0
        self.units = 0
        self.capped = 0
        """Packs the vision caps kept held samples out of (samples that fit by tokens)."""
        self.caps = ""
        self.warned = False

    def note(
        self, units: int, bound: str, held: int, stats: PackerCounters, *, capped: str = ""
    ) -> None:
        """A pack of ``units`` left a buffer full by ``bound`` holding ``held`` candidates;
        ``stats`` are the packer's counters after it left; ``capped``: the vision caps that
        kept held samples out of it, as ``name=value`` settings ("" for none)."""
        self.packs += 1
        self.units += units
        if capped:
            self.capped += 1
            self.caps = capped
        fill = self.units / (self.packs * (self.capacity // self.align))
        if (
            self.warned
            or self.buffer_size == 1  # one sample per row, as asked
            or self.packs < UNDERFILLED_PACKS
            or 2 * self.packs < stats.bins
            or fill >= UNDERFILLED_FILL
        ):
            return
        self.warned = True
        warnings.warn(self._message(fill, bound, held, stats), PackingWarning, stacklevel=4)

    def _message(self, fill: float, bound: str, held: int, stats: PackerCounters) -> str:
        left = (
            f"{self.packs} of {stats.bins} packs left because the candidate buffer was full "
            f"({bound}), at bin fill {fill:.2f}"
        )
        if self.capped >= CAPPED_SHARE * self.packs:
            return (
                f"{left}: in {self.capped} of them the vision budget's caps ({self.caps}) kept "
                "out held samples that fit by tokens, so the caps, not the buffer, hold the fill "
                "at this mix; raise the caps where the model's memory allows, or keep them and "
                "this fill (a larger buffer helps only where it brings samples with fewer media)"
            )
        mean = stats.aligned_tokens / stats.items
        per_row = self.capacity / mean
        rows = self.min_rows or DEFAULT_MIN_ROWS
        wanted = math.ceil(rows * per_row)
        fixes = {
            "max_bytes": f"raise BufferConfig(max_bytes={self.max_bytes}), the byte bound it hit",
            "buffer_size": f"raise packing_buffer_size to about {wanted}, or pass "
            f"BufferConfig(min_rows={rows:g}) to let the buffer grow to {rows:g} rows' worth",
            "max_size": f"raise BufferConfig(max_size={self.max_size}) to about {wanted}",
            "min_rows": f"raise BufferConfig(min_rows=...) above {rows:g}",
        }
        return (
            f"{left}: it held {held} samples, but at this stream's "
            f"mean of {mean:.0f} tokens a row of seq_length={self.capacity} needs about "
            f"{per_row:.0f}, and the buffer about {wanted} to choose among; {fixes[bound]}"
        )


def caps_kept_out(budget: VisionBudget, left: Bin, held: Sequence[Candidate], room: int) -> str:
    """The vision caps, as ``name=value`` settings, where ``left`` (a pack that left a full
    buffer, under :data:`UNDERFILLED_FILL` of the row) could have taken one of the ``held``
    candidates by tokens (``room`` units left) but not within the caps; "" otherwise."""
    if (
        budget.max_vision_tokens is None and budget.max_media is None
    ) or left.used >= UNDERFILLED_FILL * left.capacity:
        return ""
    for cand in held:
        if cand.units <= room and not budget.fits(
            left.vision_tokens + cand.vision, left.media + cand.media
        ):
            caps = (
                ("max_vision_tokens", budget.max_vision_tokens),
                ("max_media", budget.max_media),
            )
            return ", ".join(f"{name}={cap}" for name, cap in caps if cap is not None)
    return ""
