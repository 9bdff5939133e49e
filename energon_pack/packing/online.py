"""Online bin packing: :class:`OnlineBinPacker` packs a stream of lengths into fixed-capacity
rows with a bounded candidate buffer. Pure Python, no I/O, no torch. Its rule:

* Every pushed candidate is held until it leaves in a bin; at most ``buffer_size`` candidates are
  held at once, whether or not they are already part of a planned bin.
* The packer keeps the subset sums reachable by the held candidates as a bitset (one big
  integer, ``capacity // align + 1`` bits), updated in O(1) big-int operations per push. A bin
  leaves as soon as some subset of held candidates fills at least ``min_fill`` of the capacity;
  the subset chosen is the fullest one, preferring older candidates.
* Otherwise nothing leaves: under-filled bins are carried over to later rounds. When the buffer
  is full, the fullest subset leaves.
* ``max_wait``: no candidate waits for more than ``max_wait`` emitted bins. The held candidates
  are kept in best-fit "deadline bins" (a witness that every candidate can still leave in time);
  a bin is only chosen if the remaining deadline bins can still be emitted in deadline order,
  otherwise the most urgent deadline bin leaves, topped up with the fullest subset of the rest.

* A vision budget (``max_vision_tokens``, ``max_media``, ``vision_balance``; see
  :mod:`~energon_pack.packing.vision_budget`) bounds and balances what bins hold besides
  tokens; without one, none of it runs.

Emitted bins list their keys in stream order. Same pushes and settings give the same bins;
``state_dict()`` is plain JSON-able data and restoring it reproduces the remaining bins exactly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict
from typing import Any

from energon_pack.packing.bins import (
    OVERLONG_FIX,
    Bin,
    Key,
    Overlong,
    aligned_length,
    check_capacity_and_align,
    check_length,
    overlong_message,
)
from energon_pack.packing.packer_state import (
    STATE_VERSION,
    Candidate,
    DeadlineBin,
    PackerStats,
    StateReader,
)
from energon_pack.packing.subset_sums import SubsetSums, nearest_sum, prefixes, subset_with_sum
from energon_pack.packing.vision_budget import (
    BALANCE_SLACK,
    BALANCE_TOLERANCE,
    VISION_FIX,
    Choice,
    Room,
    VisionBudget,
    base_choice,
    best_choice,
    check_vision,
    vision_target,
)

__all__ = ["OnlineBinPacker", "PackerStats"]

logger = logging.getLogger("energon_pack.packing")


class OnlineBinPacker:
    """Online packer with a bounded, carry-over candidate buffer (see the module docstring).

    Args:
        capacity: tokens per bin (the packed sequence length).
        buffer_size: most candidates held at once (>= 1).
        align: every length is rounded up to a multiple of this before packing.
        max_wait: most bins a candidate may wait for after its push, so that no sample
            starves and data order stays close to the stream's (None: unbounded).
        overlong: what to do with a candidate whose aligned length exceeds the capacity, or
            whose vision tokens or media alone exceed a cap: ``"error"`` raises ValueError,
            ``"skip"`` counts it in ``stats.rejected`` and logs its key.
        min_fill: a bin leaves as soon as it can be filled to at least this fraction.
        max_bytes: if set, the candidates' ``nbytes`` (given to :meth:`push`) held at once are
            also bounded: while they sum above it, the fullest subset leaves.
        max_vision_tokens: most vision tokens (``vision_tokens`` given to :meth:`push`) per bin
            (None: no cap).
        max_media: most media (``media`` given to :meth:`push`) per bin (None: no cap).
        vision_balance: keep each bin's vision tokens near the stream's running mean (see
            :mod:`~energon_pack.packing.vision_budget`).
    """

    def __init__(
        self,
        capacity: int,
        buffer_size: int,
        *,
        align: int = 1,
        max_wait: int | None = 64,
        overlong: Overlong = "error",
        min_fill: float = 0.999,
        max_bytes: int | None = None,
        max_vision_tokens: int | None = None,
        max_media: int | None = None,
        vision_balance: bool = False,
    ) -> None:
        check_capacity_and_align(capacity, align)
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(
                f"buffer_size (packing_buffer_size) must be an int >= 1, got {buffer_size!r}"
            )
        if max_wait is not None and (not isinstance(max_wait, int) or max_wait < 0):
            raise ValueError(f"max_wait must be None or an int >= 0, got {max_wait!r}")
        if overlong not in ("error", "skip"):
            raise ValueError(f"overlong must be 'error' or 'skip', got {overlong!r}")
        if not 0.0 < min_fill <= 1.0:
            raise ValueError(f"min_fill must be in (0, 1], got {min_fill!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(
                f"max_bytes (packing_buffer_bytes) must be None or an int >= 1, got {max_bytes!r}"
            )
        self.budget = VisionBudget(max_vision_tokens, max_media, vision_balance)
        """The per-bin vision caps and balance mode."""
        self._budgeted = self.budget.active
        self.capacity = capacity
        self.buffer_size = buffer_size
        self.align = align
        self.max_wait = max_wait
        self.overlong: Overlong = overlong
        self.min_fill = min_fill
        self.max_bytes = max_bytes
        self._cap_units = capacity // align
        self._mask = (1 << (self._cap_units + 1)) - 1
        # Units a bin needs to leave early; the epsilon keeps min_fill=1.0 exact under rounding.
        self._fill_units = min(self._cap_units, math.ceil(min_fill * capacity / align - 1e-9))
        self._reset()

    def _reset(self) -> None:
        self.stats = PackerStats(capacity=self.capacity)
        self._held: list[Candidate] = []
        self._units: list[int] = []  # the held candidates' units, in the same order
        self._held_bytes = 0
        self._prefix: list[int] = [1]  # _prefix[i]: subset sums reachable by _held[:i]
        # With a vision budget: the text-only candidates by units, the others by vision tokens.
        self._text = SubsetSums("units", self._mask)
        self._visual = SubsetSums("vision", (1 << (self.capacity + 1)) - 1)
        self._held_vision = 0
        self._held_tokens = 0
        self._emitted = 0
        self._deadline_bins: dict[int, DeadlineBin] = {}  # only used with max_wait
        self._next_deadline_bin = 0

    @property
    def held(self) -> int:
        """Number of candidates currently held."""
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        """Sum of the held candidates' ``nbytes``."""
        return self._held_bytes

    @property
    def held_keys(self) -> list[Key]:
        """Keys of the held candidates, in stream order."""
        return [c.key for c in self._held]

    # ----------------------------------------------------------------------------- public API
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
        if units > self._cap_units:
            refusal = overlong_message(key, length, self.align, self.capacity), OVERLONG_FIX
        elif self._budgeted and (excess := self.budget.excess(key, vision, media)):
            refusal = excess[1], VISION_FIX
        if refusal is not None:
            if self.overlong == "error":
                raise ValueError(f"{refusal[0]}; {refusal[1]}")
            self.stats.rejected += 1
            logger.warning("skipping %s", refusal[0])
            return []
        out: list[Bin] = []
        cand = Candidate(key, length, units, self._emitted, -1, nbytes, vision, media)
        if self.max_wait is not None:
            cand.deadline_bin = self._deadline_bin_for(cand)
        self._held.append(cand)
        self._units.append(units)
        self._held_bytes += nbytes
        self._held_vision += vision
        self._held_tokens += length
        last = self._prefix[-1]
        self._prefix.append((last | (last << units)) & self._mask)
        if self._budgeted:
            (self._visual if cand.visual else self._text).append(cand)
        if self.max_wait is not None:
            self._deadline_bins.setdefault(cand.deadline_bin, DeadlineBin()).add(cand)
            while len(self._deadline_bins) > self.max_wait:
                out.append(self._emit(self._most_urgent_subset(), "deadline"))
        while self._prefix[-1] >> self._fill_units:
            chosen = self._next_subset(early=True)
            if chosen is None:
                break
            out.append(self._emit(chosen, "fill"))
        while len(self._held) >= self.buffer_size or (
            self.max_bytes is not None and self._held and self._held_bytes > self.max_bytes
        ):
            out.append(self._emit(self._leaving(), "buffer"))
        return out

    def flush(self) -> list[Bin]:
        """Emit every held candidate (end of stream)."""
        out: list[Bin] = []
        while self._held:
            out.append(self._emit(self._leaving(), "flush"))
        return out

    def settings(self) -> dict[str, Any]:
        """The settings a saved state must have been saved with (the vision budget's only
        where it is on)."""
        return {
            "capacity": self.capacity,
            "buffer_size": self.buffer_size,
            "align": self.align,
            "max_wait": self.max_wait,
            "min_fill": self.min_fill,
            "max_bytes": self.max_bytes,
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
        self._reset()
        self.stats = checked.stats
        self._emitted = checked.emitted
        self._next_deadline_bin = checked.next_deadline_bin
        self._held = checked.held
        self._units = [c.units for c in checked.held]
        self._held_bytes = sum(c.nbytes for c in checked.held)
        self._held_vision = sum(c.vision for c in checked.held)
        self._held_tokens = sum(c.length for c in checked.held)
        if self.max_wait is not None:
            # Best fit breaks ties by the deadline bins' order: rebuild them in the saved order.
            self._deadline_bins = {bin_id: DeadlineBin() for bin_id in checked.deadline_bins}
            for cand in checked.held:
                self._deadline_bins[cand.deadline_bin].add(cand)
        self._prefix = prefixes(self._units, 1, self._mask)
        if self._budgeted:
            self._text.reset([c for c in self._held if not c.visual])
            self._visual.reset([c for c in self._held if c.visual])

    # ------------------------------------------------------------------------------ internals
    def _fullest_subset(self) -> list[int]:
        """Indices of the fullest subset of held candidates; older ones preferred."""
        prefix = self._prefix
        return subset_with_sum(prefix, self._units, prefix[-1].bit_length() - 1)

    def _next_subset(self, *, early: bool) -> list[int] | None:
        """The bin to leave next. ``early`` (a bin leaving by the fill rule): only a bin that is
        full enough (and balanced, with ``vision_balance``), else None."""
        if self.budget.balance:
            chosen = self._balanced_subset([], early=early)
        elif self._budgeted:
            best, ready = self._budget_subsets([])
            chosen = ready if early else best
        else:
            chosen = self._fullest_subset()
            if early and self._units_of(chosen) < self._fill_units:
                chosen = None
        if chosen is None or self.max_wait is None or self._schedulable(chosen):
            return chosen
        urgent = self._most_urgent_subset()
        return None if early and self._units_of(urgent) < self._fill_units else urgent

    def _leaving(self) -> list[int]:
        """The bin that leaves when one must (full buffer, end of stream): never empty (the
        oldest candidate alone where the choice holds nothing, e.g. only media without vision
        tokens are held while the target is above 0)."""
        return self._next_subset(early=False) or [0]

    def _units_of(self, chosen: list[int]) -> int:
        units = self._units
        return sum(units[i] for i in chosen)

    def _budget_subsets(self, forced: list[int]) -> tuple[list[int], list[int] | None]:
        """With a vision budget: the best bin holding ``forced`` (indices of held candidates)
        and the best one ready to leave early, if any (found by
        :func:`~energon_pack.packing.vision_budget.best_choice`)."""
        held = self._held
        members = [held[i] for i in forced]
        text, visual_sums = self._without(members)
        visual = visual_sums.items
        budget = self.budget
        base = base_choice(members)
        room = Room(
            self._cap_units - base.units,
            None if budget.max_vision_tokens is None else budget.max_vision_tokens - base.vision,
            None if budget.max_media is None else budget.max_media - base.media,
        )
        best, ready = best_choice(
            visual,
            text.prefix[-1],
            room,
            base=base,
            target=self._vision_target() if budget.balance else None,
            capacity_units=self._cap_units,
            fill_units=self._fill_units,
        )

        def indices(choice: Choice) -> list[int]:
            picked = [visual[p] for p in choice.visual] + text.subset(choice.text_units)
            return forced + self._positions(picked)

        return indices(best), None if ready is None else indices(ready)

    def _balanced_subset(self, forced: list[int], *, early: bool) -> list[int] | None:
        """With ``vision_balance``: ``forced`` (indices of held candidates) plus the
        media-carrying candidates whose vision tokens bring the bin nearest to the target,
        without passing it by more than :data:`BALANCE_TOLERANCE` (the oldest one goes alone
        if it alone is above that), topped up with the fullest text-only subset. ``early``:
        only a bin at least :data:`BALANCE_SLACK` near the target and full enough, else None.
        Where those media break the row or ``max_media``, the search of
        :meth:`_budget_subsets` decides."""
        held, budget = self._held, self.budget
        members = [held[i] for i in forced]
        text, visual = self._without(members)
        target = self._vision_target() - sum(c.vision for c in members)
        over = math.floor(target * (1 + BALANCE_TOLERANCE))
        high = self.capacity if budget.max_vision_tokens is None else budget.max_vision_tokens
        high -= sum(c.vision for c in members)
        if not members and visual.items and visual.items[0].vision > over:
            picked = visual.items[:1]
        else:
            low = math.ceil(target * (1 - BALANCE_SLACK)) if early else 0
            high = max(min(high, over), 0)  # forced members may pass the target already
            nearest = nearest_sum(visual.prefix[-1], max(round(target), 0), low, high)
            if nearest is None:
                return None if early else self._budget_subsets(forced)[0]
            picked = visual.subset(nearest)
        units = sum(c.units for c in members + picked)
        media = sum(c.media for c in members + picked)
        if units > self._cap_units or (budget.max_media is not None and media > budget.max_media):
            return None if early else self._budget_subsets(forced)[0]
        reach = text.prefix[-1] & ((1 << (self._cap_units - units + 1)) - 1)
        text_units = reach.bit_length() - 1
        if early and units + text_units < self._fill_units:
            return None
        return forced + self._positions(picked + text.subset(text_units))

    def _positions(self, cands: list[Candidate]) -> list[int]:
        """Indices of ``cands`` among the held candidates."""
        index = {id(c): i for i, c in enumerate(self._held)}
        return [index[id(c)] for c in cands]

    def _without(self, members: list[Candidate]) -> tuple[SubsetSums, SubsetSums]:
        """The text-only and media-carrying sums without ``members`` (the kept ones where
        nothing is removed)."""
        if not members:
            return self._text, self._visual
        leaving = {id(c) for c in members}
        sums = []
        for kept in (self._text, self._visual):
            if any(id(c) in leaving for c in kept.items):
                rebuilt = SubsetSums(kept.size, kept.mask)
                rebuilt.reset([c for c in kept.items if id(c) not in leaving])
                kept = rebuilt
            sums.append(kept)
        return sums[0], sums[1]

    def _vision_target(self) -> float:
        """The stream's vision tokens per token so far (emitted and held) times the capacity."""
        stats = self.stats
        vision = stats.vision_tokens + self._held_vision
        tokens = stats.real_tokens + self._held_tokens
        return vision_target(vision, tokens, self.capacity)

    # --- max_wait: deadline bins -------------------------------------------------------------
    # Every held candidate sits in a deadline bin whose items fit the capacity (and the vision
    # caps) together. A bin's deadline is the emission index by which all its items must have
    # left: the oldest member's pushed_at + max_wait. Emitting the bins in deadline order is
    # always possible while the j-th earliest deadline (0-based) is >= emitted + j. Every step
    # keeps that true, and keeps at most max_wait deadline bins after each push, so a new
    # candidate can always open a bin with the latest deadline without anything leaving before
    # it entered the buffer.

    def _deadline(self, members: list[Candidate]) -> int:
        assert self.max_wait is not None
        return min(c.pushed_at for c in members) + self.max_wait

    def _schedulable(self, chosen: list[int]) -> bool:
        """Whether the deadline bins left after emitting ``chosen`` can still all be on time."""
        leaving = {id(self._held[i]) for i in chosen}
        deadlines = []
        for deadline_bin in self._deadline_bins.values():
            staying = [c for c in deadline_bin.members if id(c) not in leaving]
            if staying:
                deadlines.append(self._deadline(staying))
        deadlines.sort()
        after = self._emitted + 1
        return all(deadline >= after + j for j, deadline in enumerate(deadlines))

    def _most_urgent_subset(self) -> list[int]:
        """The earliest-deadline bin, topped up with the best subset of the others."""
        urgent_id = min(
            self._deadline_bins, key=lambda b: (self._deadline(self._deadline_bins[b].members), b)
        )
        urgent = [i for i, c in enumerate(self._held) if c.deadline_bin == urgent_id]
        if self.budget.balance:
            chosen = self._balanced_subset(urgent, early=False)
            assert chosen is not None
            return chosen
        if self._budgeted:
            return self._budget_subsets(urgent)[0]
        others = [i for i, c in enumerate(self._held) if c.deadline_bin != urgent_id]
        units = [self._units[i] for i in others]
        room = self._cap_units - self._units_of(urgent)
        prefix = prefixes(units, 1, (1 << (room + 1)) - 1)
        picked = subset_with_sum(prefix, units, prefix[-1].bit_length() - 1)
        return urgent + [others[p] for p in picked]

    def _deadline_bin_for(self, cand: Candidate) -> int:
        """Id of the best-fit deadline bin for a new candidate (maybe a new one). With
        ``vision_balance`` a bin whose vision tokens stay within the target is preferred, since
        a deadline bin may have to leave as it is."""
        if self._budgeted:
            return self._budgeted_deadline_bin_for(cand)
        best, best_free = -1, self._cap_units + 1
        for bin_id, deadline_bin in self._deadline_bins.items():
            free = self._cap_units - deadline_bin.units
            if cand.units <= free < best_free:
                best, best_free = bin_id, free
        if best < 0:
            best = self._next_deadline_bin
            self._next_deadline_bin += 1
        return best

    def _budgeted_deadline_bin_for(self, cand: Candidate) -> int:
        budget, bins = self.budget, self._deadline_bins
        fitting = [
            (self._cap_units - deadline_bin.units, bin_id)
            for bin_id, deadline_bin in bins.items()
            if cand.units <= self._cap_units - deadline_bin.units
            and budget.fits(deadline_bin.vision + cand.vision, deadline_bin.media + cand.media)
        ]
        if budget.balance and cand.visual and fitting:
            over = self._vision_target() * (1 + BALANCE_TOLERANCE)
            balanced = [f for f in fitting if bins[f[1]].vision + cand.vision <= over]
            room_for_a_bin = self.max_wait is not None and len(bins) < self.max_wait
            fitting = balanced or ([] if room_for_a_bin else fitting)
        if fitting:
            return min(fitting, key=lambda f: f[0])[1]  # the fullest; ties to the earlier bin
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
        chosen_set = set(chosen)
        self._held = [c for i, c in enumerate(self._held) if i not in chosen_set]
        self._units = [u for i, u in enumerate(self._units) if i not in chosen_set]
        self._held_bytes -= sum(c.nbytes for c in cands)
        self._held_vision -= vision
        self._held_tokens -= sum(c.length for c in cands)
        for cand in cands:
            if cand.deadline_bin in self._deadline_bins:
                deadline_bin = self._deadline_bins[cand.deadline_bin]
                deadline_bin.remove(cand)
                if not deadline_bin.members:
                    del self._deadline_bins[cand.deadline_bin]
        start = order[0]
        prefix = self._prefix
        prefix[start + 1 :] = prefixes(self._units[start:], prefix[start], self._mask)[1:]
        if self._budgeted:
            leaving = {id(c) for c in cands}
            self._text.remove(leaving)
            self._visual.remove(leaving)
        return Bin(
            keys=tuple(c.key for c in cands),
            lengths=tuple(c.length for c in cands),
            used=used,
            capacity=self.capacity,
            vision_tokens=vision,
            media=media,
        )
