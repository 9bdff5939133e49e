"""How :class:`~energon_pack.OnlineBinPacker` chooses the candidates of the next pack: one chooser
per rule behind one small interface (:class:`Chooser`). Pure Python, no I/O, no torch.

* :class:`TokenChooser` (no vision budget): the fullest subset of held candidates by tokens,
  older ones preferred, read from the packer's subset-sum bitset.
* :class:`CappedChooser` (caps on vision tokens or media per pack): the media-carrying
  candidates searched within the caps (:func:`~energon_pack.packing.vision_budget.best_choice`),
  the rest of the row filled with the fullest text-only subset.
* :class:`BalancedChooser` (``VisionBudget(balance=True)``): the media-carrying subset whose
  vision tokens are nearest the stream's running target, topped up with text; the search of
  :class:`CappedChooser` decides where that breaks the row or ``max_media``.

The packer keeps the buffer, deadlines, byte bound, counters and state; a chooser keeps only the
index it searches (none for tokens alone), told of every candidate that enters or leaves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

from energon_pack.packing.packer_state import Candidate, DeadlineBin
from energon_pack.packing.subset_sums import SubsetSums, nearest_sum, prefixes, subset_with_sum
from energon_pack.packing.vision_budget import (
    BALANCE_SLACK,
    BALANCE_TOLERANCE,
    Choice,
    Room,
    VisionBudget,
    base_choice,
    best_choice,
)

__all__ = ["BalancedChooser", "CappedChooser", "Chooser", "Pool", "TokenChooser", "chooser_for"]


class Pool(Protocol):
    """What a chooser reads of the packer: the held candidates in stream order, their aligned
    units, the subset sums of their units (``prefix[i]``: sums reachable by the first ``i``),
    the row's size in units, the units a pack needs to leave early, and the vision target."""

    @property
    def candidates(self) -> Sequence[Candidate]: ...
    @property
    def units(self) -> Sequence[int]: ...
    @property
    def prefix(self) -> Sequence[int]: ...
    @property
    def cap_units(self) -> int: ...
    @property
    def fill_units(self) -> int: ...
    def vision_target(self) -> float: ...


class Chooser(Protocol):
    """One rule for the next pack."""

    def choose(self, pool: Pool, forced: list[int], *, early: bool) -> list[int] | None:
        """Indices (into ``pool.candidates``) of the next pack, holding the ``forced`` ones.
        ``early`` (a pack leaving by the fill rule; then ``forced`` is empty): only a pack good
        enough to leave now, else None. Not ``early``: never None."""
        ...

    def deadline_bin(
        self, pool: Pool, bins: Mapping[int, DeadlineBin], cand: Candidate, max_wait: int
    ) -> int | None:
        """The deadline bin a new candidate joins (the fullest it fits; ties to the earlier),
        or None for a new one."""
        ...

    def added(self, cand: Candidate) -> None:
        """``cand`` entered the buffer (after the candidates it holds)."""
        ...

    def removed(self, leaving: Sequence[Candidate]) -> None:
        """The candidates ``leaving`` left in a pack."""
        ...

    def reset(self, held: Sequence[Candidate]) -> None:
        """The buffer now holds ``held`` (a restored state)."""
        ...


def units_of(pool: Pool, chosen: Sequence[int]) -> int:
    """Aligned units of the candidates at ``chosen``."""
    units = pool.units
    return sum(units[i] for i in chosen)


def _fullest(fitting: list[tuple[int, int]]) -> int | None:
    """The bin id with the least free room among ``(free, bin_id)``; ties to the earlier."""
    return min(fitting, key=lambda f: f[0])[1] if fitting else None


class TokenChooser:
    """Packs by tokens alone: the fullest subset, older candidates preferred."""

    def choose(self, pool: Pool, forced: list[int], *, early: bool) -> list[int] | None:
        if forced:
            return self._topped_up(pool, forced)
        prefix = pool.prefix
        chosen = subset_with_sum(prefix, pool.units, prefix[-1].bit_length() - 1)
        if early and units_of(pool, chosen) < pool.fill_units:
            return None
        return chosen

    def _topped_up(self, pool: Pool, forced: list[int]) -> list[int]:
        """``forced`` plus the fullest subset of the other candidates that fits beside them."""
        kept = set(forced)
        others = [i for i in range(len(pool.candidates)) if i not in kept]
        units = [pool.units[i] for i in others]
        room = pool.cap_units - units_of(pool, forced)
        prefix = prefixes(units, 1, (1 << (room + 1)) - 1)
        picked = subset_with_sum(prefix, units, prefix[-1].bit_length() - 1)
        return forced + [others[p] for p in picked]

    def deadline_bin(
        self, pool: Pool, bins: Mapping[int, DeadlineBin], cand: Candidate, max_wait: int
    ) -> int | None:
        best, best_free, cap_units = None, pool.cap_units + 1, pool.cap_units
        for bin_id, deadline_bin in bins.items():
            free = cap_units - deadline_bin.units
            if cand.units <= free < best_free:  # the fullest it fits; ties to the earlier
                best, best_free = bin_id, free
        return best

    def added(self, cand: Candidate) -> None:
        return None

    def removed(self, leaving: Sequence[Candidate]) -> None:
        return None

    def reset(self, held: Sequence[Candidate]) -> None:
        return None


class CappedChooser:
    """Packs within caps on vision tokens and media: the media-carrying candidates searched
    depth-first within the caps, the rest of the row filled with the fullest text-only subset.
    Keeps the text-only candidates' unit sums and the media-carrying ones' vision sums."""

    def __init__(self, budget: VisionBudget, cap_units: int, capacity: int) -> None:
        self.budget = budget
        self._capacity = capacity
        self._text = SubsetSums("units", (1 << (cap_units + 1)) - 1)
        self._visual = SubsetSums("vision", (1 << (capacity + 1)) - 1)

    def choose(self, pool: Pool, forced: list[int], *, early: bool) -> list[int] | None:
        best, ready = self._searched(pool, forced)
        return ready if early else best

    def _searched(self, pool: Pool, forced: list[int]) -> tuple[list[int], list[int] | None]:
        """The best pack holding ``forced`` and the best one ready to leave early, if any
        (found by :func:`~energon_pack.packing.vision_budget.best_choice`)."""
        members = [pool.candidates[i] for i in forced]
        text, visual_sums = self._without(members)
        visual = visual_sums.items
        budget = self.budget
        base = base_choice(members)
        room = Room(
            pool.cap_units - base.units,
            None if budget.max_vision_tokens is None else budget.max_vision_tokens - base.vision,
            None if budget.max_media is None else budget.max_media - base.media,
        )
        best, ready = best_choice(
            visual,
            text.prefix[-1],
            room,
            base=base,
            target=pool.vision_target() if budget.balance else None,
            capacity_units=pool.cap_units,
            fill_units=pool.fill_units,
        )

        def indices(choice: Choice) -> list[int]:
            picked = [visual[p] for p in choice.visual] + text.subset(choice.text_units)
            return forced + _positions(pool, picked)

        return indices(best), None if ready is None else indices(ready)

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

    def deadline_bin(
        self, pool: Pool, bins: Mapping[int, DeadlineBin], cand: Candidate, max_wait: int
    ) -> int | None:
        return _fullest(self._fitting(pool, bins, cand))

    def _fitting(
        self, pool: Pool, bins: Mapping[int, DeadlineBin], cand: Candidate
    ) -> list[tuple[int, int]]:
        """``(free units, bin id)`` of the deadline bins ``cand`` fits within the caps."""
        budget = self.budget
        return [
            (pool.cap_units - b.units, bin_id)
            for bin_id, b in bins.items()
            if cand.units <= pool.cap_units - b.units
            and budget.fits(b.vision + cand.vision, b.media + cand.media)
        ]

    def added(self, cand: Candidate) -> None:
        (self._visual if cand.visual else self._text).append(cand)

    def removed(self, leaving: Sequence[Candidate]) -> None:
        ids = {id(c) for c in leaving}
        self._text.remove(ids)
        self._visual.remove(ids)

    def reset(self, held: Sequence[Candidate]) -> None:
        self._text.reset([c for c in held if not c.visual])
        self._visual.reset([c for c in held if c.visual])


class BalancedChooser(CappedChooser):
    """Packs whose vision tokens stay near the stream's running target (see
    :mod:`~energon_pack.packing.vision_budget`), within any caps."""

    def choose(self, pool: Pool, forced: list[int], *, early: bool) -> list[int] | None:
        """``forced`` plus the media-carrying candidates whose vision tokens bring the pack
        nearest to the target, without passing it by more than :data:`BALANCE_TOLERANCE` (the
        oldest one goes alone if it alone is above that), topped up with the fullest text-only
        subset. ``early``: only a pack at least :data:`BALANCE_SLACK` near the target and full
        enough, else None. Where those media break the row or ``max_media``, the search of
        :class:`CappedChooser` decides."""
        budget = self.budget
        members = [pool.candidates[i] for i in forced]
        text, visual = self._without(members)
        target = pool.vision_target() - sum(c.vision for c in members)
        over = math.floor(target * (1 + BALANCE_TOLERANCE))
        high = self._capacity if budget.max_vision_tokens is None else budget.max_vision_tokens
        high -= sum(c.vision for c in members)
        if not members and visual.items and visual.items[0].vision > over:
            picked = visual.items[:1]
        else:
            low = math.ceil(target * (1 - BALANCE_SLACK)) if early else 0
            high = max(min(high, over), 0)  # forced members may pass the target already
            nearest = nearest_sum(visual.prefix[-1], max(round(target), 0), low, high)
            if nearest is None:
                return None if early else self._searched(pool, forced)[0]
            picked = visual.subset(nearest)
        units = sum(c.units for c in members + picked)
        media = sum(c.media for c in members + picked)
        if units > pool.cap_units or (budget.max_media is not None and media > budget.max_media):
            return None if early else self._searched(pool, forced)[0]
        reach = text.prefix[-1] & ((1 << (pool.cap_units - units + 1)) - 1)
        text_units = reach.bit_length() - 1
        if early and units + text_units < pool.fill_units:
            return None
        return forced + _positions(pool, picked + text.subset(text_units))

    def deadline_bin(
        self, pool: Pool, bins: Mapping[int, DeadlineBin], cand: Candidate, max_wait: int
    ) -> int | None:
        """A media-carrying candidate joins a deadline bin whose vision tokens stay within the
        target, since a deadline bin may have to leave as it is; failing that a new bin while
        ``max_wait`` leaves room for one."""
        fitting = self._fitting(pool, bins, cand)
        if cand.visual and fitting:
            over = pool.vision_target() * (1 + BALANCE_TOLERANCE)
            balanced = [f for f in fitting if bins[f[1]].vision + cand.vision <= over]
            fitting = balanced or ([] if len(bins) < max_wait else fitting)
        return _fullest(fitting)


def _positions(pool: Pool, cands: Sequence[Candidate]) -> list[int]:
    """Indices of ``cands`` among the held candidates."""
    index = {id(c): i for i, c in enumerate(pool.candidates)}
    return [index[id(c)] for c in cands]


def chooser_for(budget: VisionBudget, cap_units: int, capacity: int) -> Chooser:
    """The chooser a vision budget asks for (tokens alone without one)."""
    if budget.balance:
        return BalancedChooser(budget, cap_units, capacity)
    if budget.active:
        return CappedChooser(budget, cap_units, capacity)
    return TokenChooser()
