"""Online bin packing: :class:`OnlineBinPacker` packs a stream of lengths into fixed-capacity
rows with a bounded candidate buffer. Pure Python, no I/O, no torch. Its rule:

* Every pushed candidate is held until it leaves in a bin; at most ``buffer_size`` candidates are
  held at once, whether or not they are already part of a planned bin.
* The packer keeps the subset sums reachable by the held candidates as a bitset (one big
  integer, ``capacity // align + 1`` bits), updated in O(1) big-int operations per push. A bin
  leaves as soon as some subset of held candidates fills at least ``min_fill`` of the capacity;
  the subset chosen is the fullest one, preferring older candidates.
* Otherwise nothing leaves: under-filled bins are carried over to later rounds. When the buffer
  is full, the fullest subset leaves. With ``min_rows`` (:class:`~energon_pack.BufferConfig`),
  ``buffer_size`` candidates make the buffer full only once they hold ``min_rows`` rows' worth
  of tokens; below that it grows, up to ``max_size`` candidates (and ``max_bytes``). When packs
  keep leaving a full buffer under-filled, one :class:`~energon_pack.PackingWarning` names the
  fill, the samples a row needs and the setting to raise
  (:mod:`~energon_pack.packing.underfilled`).
* ``max_wait``: no candidate waits for more than ``max_wait`` emitted bins. The held candidates
  are kept in best-fit "deadline bins" (a witness that every candidate can still leave in time);
  a bin is only chosen if the remaining deadline bins can still be emitted in deadline order,
  otherwise the most urgent deadline bin leads it (a bin leaving early so is as good as any).

* A vision budget (:class:`~energon_pack.VisionBudget`: ``max_vision_tokens``, ``max_media``,
  ``balance``; see :mod:`~energon_pack.packing.vision_budget`) bounds and balances what bins
  hold besides tokens. Which subset leaves is a chooser's decision
  (:mod:`~energon_pack.packing.choosers`: tokens alone, capped or balanced, picked by the
  budget); the packer keeps the buffer, deadlines, byte bound, counters and state.

Emitted bins list their keys in stream order. Same pushes and settings give the same bins;
``state_dict()`` is plain JSON-able data and restoring it reproduces the remaining bins exactly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from energon_pack._moved import renamed
from energon_pack.moved_keywords import Moved, regroup
from energon_pack.packing.bins import (
    OVERLONG_FIX,
    Bin,
    Key,
    Overlong,
    aligned_length,
    check_capacity_and_align,
    check_length,
    overlong_refusal,
)
from energon_pack.packing.buffer import BufferConfig
from energon_pack.packing.choosers import chooser_for
from energon_pack.packing.packer_state import (
    GROWTH_SETTINGS,
    STATE_VERSION,
    Candidate,
    DeadlineBin,
    HeldSize,
    PackerCounters,
    Refusal,
    StateReader,
)
from energon_pack.packing.subset_sums import prefixes
from energon_pack.packing.underfilled import UnderfilledWatch, caps_kept_out
from energon_pack.packing.vision_budget import VISION_FIX, VisionBudget, check_vision, vision_target

__all__ = ["HeldSize", "OnlineBinPacker", "PackerCounters", "Refusal"]

logger = logging.getLogger("energon_pack.packing")

BUDGET_MIN_ROWS = 4.0
"""Under a vision budget, a growing buffer (``min_rows``) holds at least this many rows' worth
of tokens before a full buffer forces a pack out: rows within caps and near the balance target
need more candidates to choose among than rows by tokens alone."""
BALANCE_MIN_ROWS = 8.0
"""With balance (``VisionBudget(balance=True)``), the same at least this many: rows near the
target choose among still more candidates (at 4 rows' worth the most loaded of 8 ranks stayed up
to 0.08 further above its floor with small images)."""

MOVED = {
    "max_wait": Moved("buffer", "BufferConfig", "max_wait"),
    "min_fill": Moved("buffer", "BufferConfig", "min_fill"),
    "max_bytes": Moved("buffer", "BufferConfig", "max_bytes"),
    "max_vision_tokens": Moved("vision", "VisionBudget", "max_vision_tokens"),
    "max_media": Moved("vision", "VisionBudget", "max_media"),
    "vision_balance": Moved("vision", "VisionBudget", "balance"),
}
"""The packer's keywords from before :class:`BufferConfig` and :class:`VisionBudget`."""


class OnlineBinPacker:
    """Online packer with a bounded, carry-over candidate buffer (see the module docstring).

    Args:
        capacity: tokens per bin (the packed sequence length, ``seq_length``).
        buffer_size: most candidates held at once (>= 1; Energon's ``packing_buffer_size``).
        align: every length is rounded up to a multiple of this before packing
            (``pad_to_multiple_of``).
        overlong: what to do with a candidate whose aligned length exceeds the capacity:
            ``"error"`` raises ValueError, ``"skip"`` counts it in ``stats.rejected`` and logs
            its key. One alone over a vision cap follows ``vision.over_cap`` (by default this).
        buffer: when bins leave early (``min_fill``), how long a candidate may wait
            (``max_wait``) and the bound on the bytes held (``max_bytes``); see
            :class:`~energon_pack.BufferConfig`.
        vision: caps on the vision tokens (``vision_tokens`` given to :meth:`push`) and media
            per bin, and the balance mode (:class:`~energon_pack.VisionBudget`; default: none).

    The keywords ``max_wait``, ``min_fill``, ``max_bytes``, ``max_vision_tokens``,
    ``max_media`` and ``vision_balance`` of earlier releases still work, with a
    ``DeprecationWarning`` naming the new spelling.
    """

    def __init__(
        self,
        capacity: int,
        buffer_size: int,
        *,
        align: int = 1,
        overlong: Overlong = "error",
        buffer: BufferConfig | None = None,
        vision: VisionBudget | None = None,
        **moved: Any,
    ) -> None:
        old = regroup("OnlineBinPacker", moved, MOVED, {"buffer": buffer, "vision": vision})
        buffer = replace(buffer or BufferConfig(), **old.get("buffer", {}))
        vision = replace(vision or VisionBudget(), **old.get("vision", {}))
        check_capacity_and_align(capacity, align)
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(
                f"buffer_size (packing_buffer_size) must be an int >= 1, got {buffer_size!r}"
            )
        if overlong not in ("error", "skip"):
            raise ValueError(f"overlong must be 'error' or 'skip', got {overlong!r}")
        if not isinstance(buffer, BufferConfig):
            raise ValueError(f"buffer must be a BufferConfig, got {type(buffer).__name__}")
        if not isinstance(vision, VisionBudget):
            raise ValueError(f"vision must be a VisionBudget, got {type(vision).__name__}")
        self.buffer = buffer
        """The buffer settings (the packer reads ``max_wait``, ``min_fill``, ``max_bytes``)."""
        self.budget = vision
        """The per-bin vision caps and balance mode."""
        self._budgeted = vision.active
        self.capacity = capacity
        self.buffer_size = buffer_size
        self.align = align
        self.max_wait = buffer.max_wait
        self.overlong: Overlong = overlong
        self.min_fill = buffer.min_fill
        self.max_bytes = buffer.max_bytes
        self._cap_units = capacity // align
        self._grow(buffer.min_rows, buffer.max_size)
        self._mask = (1 << (self._cap_units + 1)) - 1
        # Units a bin needs to leave early; the epsilon keeps min_fill=1.0 exact under rounding.
        self._fill_units = min(self._cap_units, math.ceil(self.min_fill * capacity / align - 1e-9))
        self._reset()

    def _reset(self) -> None:
        self.stats = PackerCounters(capacity=self.capacity)
        self._held: list[Candidate] = []
        self._units: list[int] = []  # the held candidates' units, in the same order
        self._vision: list[int] = []  # and their vision tokens and media
        self._media: list[int] = []
        self._held_bytes = 0
        self._prefix: list[int] = [1]  # _prefix[i]: subset sums reachable by _held[:i]
        self._chooser = chooser_for(self.budget, self._cap_units, self.capacity)
        self._held_vision = 0
        self._held_tokens = 0
        self._held_units = 0
        self._underfilled = UnderfilledWatch(
            self.capacity,
            self.align,
            self.buffer_size,
            self.grown_rows,
            self.max_size,
            self.max_bytes,
        )
        self._emitted = 0
        self._fresh = 0  # candidates pushed since the last bin left
        self._deadline_bins: dict[int, DeadlineBin] = {}  # only used with max_wait
        self._late: bool | None = None  # whether they are late unless some leave (None: unknown)
        self._urgent_bin: tuple[int, list[int]] | None = None  # its id and members' indices
        self._next_deadline_bin = 0

    def _grow(self, min_rows: float | None, max_size: int) -> None:
        """Set the growing buffer's bounds (``min_rows=None``: ``buffer_size`` alone; under a
        vision budget at least :data:`BUDGET_MIN_ROWS`, with balance :data:`BALANCE_MIN_ROWS`).
        A buffer of one never grows: it is how a row holds one sample (nothing packed)."""
        min_rows = None if self.buffer_size == 1 else min_rows
        self.min_rows = min_rows
        self.max_size = max_size
        if min_rows is not None and self.budget.active:
            least = BALANCE_MIN_ROWS if self.budget.balance else BUDGET_MIN_ROWS
            min_rows = max(min_rows, least)
        self.grown_rows = min_rows
        """The rows' worth a growing buffer holds before it is full: ``min_rows``, raised under a
        vision budget (None: bounded by ``buffer_size`` alone)."""
        self._grow_units = 0 if min_rows is None else math.ceil(min_rows * self._cap_units)
        grows = min_rows is not None
        self.max_held = max(self.buffer_size, max_size) if grows else self.buffer_size
        """The most candidates held at once: ``buffer_size``, or ``max_size`` when it grows."""

    @property
    def held(self) -> int:
        """Number of candidates currently held."""
        return len(self._held)

    @property
    def capped_underfilled(self) -> int:
        """Packs that left a full buffer under 0.9 of the row (``UNDERFILLED_FILL``) while the
        vision caps kept out a held sample that fit by tokens: the caps, not the buffer, held
        their fill down (counted since this packer started or was restored; not saved)."""
        return self._underfilled.capped

    @property
    def held_bytes(self) -> int:
        """Sum of the held candidates' ``nbytes``."""
        return self._held_bytes

    @property
    def held_keys(self) -> list[Key]:
        """Keys of the held candidates, in stream order."""
        return [c.key for c in self._held]

    def held_sizes(self) -> list[HeldSize]:
        """What each held candidate weighs, in stream order, as recorded at its push."""
        return [HeldSize(c.key, c.length, c.vision, c.media) for c in self._held]

    # --- what a chooser reads (:class:`~energon_pack.packing.choosers.Pool`) ------------------
    @property
    def candidates(self) -> list[Candidate]:
        """The held candidates, in stream order."""
        return self._held

    @property
    def units(self) -> list[int]:
        """The held candidates' aligned units, in stream order."""
        return self._units

    @property
    def vision(self) -> list[int]:
        """The held candidates' vision tokens, in stream order."""
        return self._vision

    @property
    def media(self) -> list[int]:
        """The held candidates' media, in stream order."""
        return self._media

    @property
    def prefix(self) -> list[int]:
        """Subset sums of the held units: ``prefix[i]`` for the first ``i`` candidates."""
        return self._prefix

    @property
    def cap_units(self) -> int:
        """A bin's size in units of ``align``."""
        return self._cap_units

    @property
    def fill_units(self) -> int:
        """Units a bin needs to leave early (``min_fill``)."""
        return self._fill_units

    @property
    def emitted(self) -> int:
        """Bins emitted so far."""
        return self._emitted

    @property
    def fresh(self) -> int:
        """Held candidates pushed since the last bin left."""
        return self._fresh

    @property
    def held_vision(self) -> int:
        """Vision tokens of the held candidates together."""
        return self._held_vision

    @property
    def seen_tokens(self) -> int:
        """Tokens of the samples taken so far (emitted and held)."""
        return self.stats.real_tokens + self._held_tokens

    def vision_target(self) -> float:
        """The stream's vision tokens per token so far (emitted and held; starting from the
        budget's ``vision_share`` where known) times the capacity."""
        vision = self.stats.vision_tokens + self._held_vision
        return vision_target(vision, self.seen_tokens, self.capacity, self.budget.vision_share)

    # ----------------------------------------------------------------------------- public API
    def refusal(
        self, key: Key, length: int, vision_tokens: int = 0, media: int = 0
    ) -> Refusal | None:
        """Why a sample cannot be in any bin (its aligned length is above the capacity, or it
        alone is over a vision cap), or None when it can."""
        if message := overlong_refusal(key, length, self.align, self.capacity):
            return Refusal("overlong", message, OVERLONG_FIX)
        if excess := self.budget.excess(key, vision_tokens, media):
            return Refusal(f"over_max_{excess[0]}", excess[1], VISION_FIX)
        return None

    def fits(self, lengths: list[int]) -> bool:
        """Whether samples of these lengths fit one bin together (after alignment)."""
        return sum(aligned_length(n, self.align) for n in lengths) <= self.capacity

    def push(
        self, key: Key, length: int, *, nbytes: int = 0, vision_tokens: int = 0, media: int = 0
    ) -> list[Bin]:
        """Add one candidate; return the bins that are ready to leave (possibly none).

        ``nbytes`` is the memory the candidate holds, bounded by ``max_bytes``;
        ``vision_tokens`` (among its ``length``) and ``media`` count against the vision budget.
        """
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise ValueError(f"key must be a str or int (JSON-able), got {key!r}")
        length = check_length(key, length)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"sample {key!r}: nbytes must be an int >= 0, got {nbytes!r}")
        vision = vision_tokens
        if type(vision) is not int or type(media) is not int or vision < 0 or media < 0:
            vision, media = check_vision(key, vision, media)  # raises naming the sample
        if vision > length:
            raise ValueError(
                f"sample {key!r}: vision_tokens={vision} is more than its length={length} "
                "(vision tokens are among the sample's tokens)"
            )
        units = aligned_length(length, self.align) // self.align
        refusal = None
        if units > self._cap_units or (self._budgeted and self.budget.excess(key, vision, media)):
            refusal = self.refusal(key, length, vision, media)
        if refusal is not None:
            if refusal.policy(self.overlong, self.budget) == "error":
                raise ValueError(f"{refusal.message}; {refusal.fix}")
            self.stats.rejected += 1
            logger.warning("skipping %s", refusal.message)
            return []
        out: list[Bin] = []
        cand = Candidate(key, length, units, self._emitted, -1, nbytes, vision, media)
        if self.max_wait is not None:
            cand.deadline_bin = self._deadline_bin_for(cand)
        self._held.append(cand)
        self._units.append(units)
        self._vision.append(vision)
        self._media.append(media)
        self._fresh += 1
        self._held_bytes += nbytes
        self._held_vision += vision
        self._held_tokens += length
        self._held_units += units
        last = self._prefix[-1]
        self._prefix.append((last | (last << units)) & self._mask)
        self._chooser.added(cand)
        if self.max_wait is not None:
            if (deadline_bin := self._deadline_bins.get(cand.deadline_bin)) is None:
                deadline_bin = self._deadline_bins[cand.deadline_bin] = DeadlineBin()
            deadline_bin.add(cand)
            if self._urgent_bin is not None and self._urgent_bin[0] == cand.deadline_bin:
                self._urgent_bin[1].append(len(self._held) - 1)
            while len(self._deadline_bins) > self.max_wait:
                out.append(self._emit(self._most_urgent_subset(), "deadline"))
        while self._prefix[-1] >> self._fill_units:
            chosen = self._next_subset(early=True)
            if chosen is None:
                break
            out.append(self._emit(chosen, "fill"))
        while bound := self._full():
            held = len(self._held)
            out.append(self._emit(self._leaving(), "buffer"))
            units = out[-1].used // self.align
            capped = caps_kept_out(self.budget, out[-1], self._held, self._cap_units - units)
            self._underfilled.note(units, bound, held, self.stats, capped=capped)
        return out

    def _full(self) -> str:
        """What makes a bin leave now ("" for nothing): ``max_bytes`` held, or ``buffer_size``
        candidates holding ``min_rows`` rows' worth of units, or ``max_held`` candidates."""
        held = len(self._held)
        if self.max_bytes is not None and held and self._held_bytes > self.max_bytes:
            return "max_bytes"
        if held < self.buffer_size:
            return ""
        if held >= self.max_held:
            return "buffer_size" if self.min_rows is None else "max_size"
        return "min_rows" if self._held_units >= self._grow_units else ""

    def flush(self) -> list[Bin]:
        """Emit every held candidate (end of stream)."""
        out: list[Bin] = []
        while self._held:
            out.append(self._emit(self._leaving(), "flush"))
        return out

    def settings(self) -> dict[str, Any]:
        """The settings a saved state must have been saved with (the vision budget's only
        where it is on)."""
        grows = self.min_rows is not None
        growth = dict(zip(GROWTH_SETTINGS, (self.min_rows, self.max_size), strict=True))
        return {
            "capacity": self.capacity,
            "buffer_size": self.buffer_size,
            "align": self.align,
            "max_wait": self.max_wait,
            "min_fill": self.min_fill,
            "max_bytes": self.max_bytes,
            **(growth if grows else {}),
            **self.budget.settings(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: settings, held candidates, the deadline bins in their order
        (ties in best fit go to the earlier one), counters."""
        return {
            "version": STATE_VERSION,
            "settings": self.settings(),
            "emitted": self._emitted,
            "next_deadline_bin": self._next_deadline_bin,
            "held": [c.saved() for c in self._held],
            "deadline_bins": list(self._deadline_bins),
            "stats": asdict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the packer then emits exactly what the original would.

        The whole state is checked first (structure, types, ranges, consistency); a bad state
        raises ValueError naming the field and leaves the packer unchanged."""
        checked = StateReader(self).read(state)
        if checked.count_bounded and self.min_rows is not None:
            logger.warning(
                "restoring a packer state saved by a buffer bounded by its count alone: this run "
                "keeps packing_buffer_size=%d as its bound, as it was saved (BufferConfig("
                "min_rows=None)); a fresh run grows the buffer to %s rows' worth (min_rows=%s%s)",
                self.buffer_size,
                self.grown_rows,
                self.min_rows,
                ", raised under the vision budget" if self.grown_rows != self.min_rows else "",
            )
            self._grow(None, self.max_size)
        self._reset()
        self.stats = checked.stats
        self._emitted = checked.emitted
        self._next_deadline_bin = checked.next_deadline_bin
        self._held = checked.held
        fresh = (n for n, c in enumerate(reversed(self._held)) if c.pushed_at != self._emitted)
        self._fresh = next(fresh, len(self._held))
        self._units = [c.units for c in checked.held]
        self._vision = [c.vision for c in checked.held]
        self._media = [c.media for c in checked.held]
        self._held_bytes = sum(c.nbytes for c in checked.held)
        self._held_vision = sum(c.vision for c in checked.held)
        self._held_tokens = sum(c.length for c in checked.held)
        self._held_units = sum(self._units)
        if self.max_wait is not None:
            # Best fit breaks ties by the deadline bins' order: rebuild them in the saved order.
            self._deadline_bins = {bin_id: DeadlineBin() for bin_id in checked.deadline_bins}
            for cand in checked.held:
                self._deadline_bins[cand.deadline_bin].add(cand)
        self._prefix = prefixes(self._units, 1, self._mask)
        self._chooser.reset(self._held)

    # ------------------------------------------------------------------------------ internals
    def _next_subset(self, *, early: bool) -> list[int] | None:
        """The bin to leave next. ``early`` (a bin leaving by the fill rule): only a bin good
        enough to leave now (full enough; balanced, with ``vision_balance``), else None."""
        if early and self.max_wait is not None and self._late_unless_some_leave():
            return self._chooser.choose(self, self._urgent(), early=True)
        chosen = self._chooser.choose(self, [], early=early)
        if chosen is None or self.max_wait is None or self._schedulable(chosen):
            return chosen
        return self._chooser.choose(self, self._urgent(), early=early)

    def _leaving(self) -> list[int]:
        """The bin that leaves when one must (full buffer, end of stream): never empty (the
        oldest candidate alone where the choice holds nothing, e.g. only media without vision
        tokens are held while the target is above 0)."""
        return self._next_subset(early=False) or [0]

    # --- max_wait: deadline bins -------------------------------------------------------------
    # Every held candidate sits in a deadline bin whose items fit the capacity (and the vision
    # caps) together. A bin's deadline is the emission index by which all its items must have
    # left: the oldest member's pushed_at + max_wait. Emitting the bins in deadline order is
    # always possible while the j-th earliest deadline (0-based) is >= emitted + j. Every step
    # keeps that true, and keeps at most max_wait deadline bins after each push, so a new
    # candidate can always open a bin with the latest deadline without anything leaving before
    # it entered the buffer.

    def _deadline(self, members: list[Candidate]) -> int:
        """The deadline of a deadline bin's ``members`` (held in stream order: the first is
        the oldest)."""
        assert self.max_wait is not None
        return members[0].pushed_at + self.max_wait

    def _late_unless_some_leave(self) -> bool:
        """Whether the deadline bins are late unless the next bin takes some of their members (the
        earliest deadline's); kept until a bin leaves, since a push never makes them late."""
        if self._late is None:
            self._late = not self._schedulable([])
        return self._late

    def _schedulable(self, chosen: list[int]) -> bool:
        """Whether the deadline bins left after emitting ``chosen`` can still all be on time."""
        assert self.max_wait is not None
        if self._held[0].pushed_at + self.max_wait >= self._emitted + len(self._deadline_bins):
            return True  # each deadline left is at least the oldest's, and no more bins are left
        leaving = {id(self._held[i]) for i in chosen}
        deadlines = []
        for deadline_bin in self._deadline_bins.values():
            for cand in deadline_bin.members:  # the oldest one staying sets the deadline
                if id(cand) not in leaving:
                    deadlines.append(cand.pushed_at + self.max_wait)
                    break
        deadlines.sort()
        after = self._emitted + 1
        return all(deadline >= after + j for j, deadline in enumerate(deadlines))

    def _urgent(self) -> list[int]:
        """Indices of the held candidates in the earliest-deadline bin; kept until a bin leaves
        (a push adds to a bin without changing its oldest member, or opens the latest one)."""
        if self._urgent_bin is None:
            bins = self._deadline_bins
            urgent_id = min(bins, key=lambda b: (self._deadline(bins[b].members), b))
            members = [i for i, c in enumerate(self._held) if c.deadline_bin == urgent_id]
            self._urgent_bin = (urgent_id, members)
        return list(self._urgent_bin[1])

    def _most_urgent_subset(self) -> list[int]:
        """The earliest-deadline bin, topped up by the chooser with the best of the others."""
        chosen = self._chooser.choose(self, self._urgent(), early=False)
        assert chosen is not None
        return chosen

    def _deadline_bin_for(self, cand: Candidate) -> int:
        """Id of the deadline bin a new candidate joins (the chooser's pick, else a new one)."""
        assert self.max_wait is not None
        found = self._chooser.deadline_bin(self, self._deadline_bins, cand, self.max_wait)
        if found is not None:
            return found
        self._next_deadline_bin += 1
        return self._next_deadline_bin - 1

    def _emit(self, chosen: list[int], reason: str) -> Bin:
        order = sorted(chosen)
        cands = [self._held[i] for i in order]
        stats = self.stats
        for cand in cands:
            wait = self._emitted - cand.pushed_at
            stats.total_wait += wait
            stats.max_wait = max(stats.max_wait, wait)
        used = sum(c.units for c in cands) * self.align
        vision = sum(c.vision for c in cands)
        media = sum(c.media for c in cands)
        stats.bins += 1
        stats.items += len(cands)
        stats.aligned_tokens += used
        stats.real_tokens += sum(c.length for c in cands)
        stats.vision_tokens += vision
        stats.vision_tokens_max = max(stats.vision_tokens_max, vision)
        stats.media += media
        stats.media_max = max(stats.media_max, media)
        stats.emitted_by[reason] += 1
        self._emitted += 1
        self._fresh = 0
        self._late = self._urgent_bin = None
        for column in (self._held, self._units, self._vision, self._media):
            for index in reversed(order):
                del column[index]
        self._held_bytes -= sum(c.nbytes for c in cands)
        self._held_vision -= vision
        self._held_tokens -= sum(c.length for c in cands)
        self._held_units -= used // self.align
        for cand in cands:
            if cand.deadline_bin in self._deadline_bins:
                deadline_bin = self._deadline_bins[cand.deadline_bin]
                deadline_bin.remove(cand)
                if not deadline_bin.members:
                    del self._deadline_bins[cand.deadline_bin]
        start = order[0]
        prefix = self._prefix
        prefix[start + 1 :] = prefixes(self._units[start:], prefix[start], self._mask)[1:]
        self._chooser.removed(cands)
        return Bin(
            keys=tuple(c.key for c in cands),
            lengths=tuple(c.length for c in cands),
            used=used,
            capacity=self.capacity,
            vision_tokens=vision,
            media=media,
        )


if TYPE_CHECKING:  # the old name, for type checkers
    PackerStats = PackerCounters
else:  # the old name, with a DeprecationWarning
    __getattr__ = renamed(__name__, "PackerStats")
