"""The walks the choosers of :class:`~energon_pack.OnlineBinPacker` make over its held candidates
under a vision budget: what a chooser reads of the packer (:class:`Pool`), one way to make the
next pack (:class:`Attempt`), the walk over the subset sums of all held candidates within its
limits (:func:`walked`), the first-fit fallback, and when an early pack is tried (:func:`due`).
Pure Python, no I/O, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from energon_pack.packing.packer_state import Candidate
from energon_pack.packing.subset_sums import Limits, prefixes, steered_subset
from energon_pack.packing.vision_budget import VisionBudget

__all__ = [
    "FORCED_FILLS",
    "WALK_SUMS",
    "Attempt",
    "Beside",
    "Pool",
    "beside",
    "due",
    "first_fit",
    "room_left",
    "units_of",
    "walk_sums",
    "walked",
]

FORCED_FILLS = (0.995, 0.99)
"""Shares of the row a pack forced to leave also walks to (the fullest reachable sum at each),
where none of the fullest sums keeps its limits: a few tokens less beats a pack over the
target."""
WALK_SUMS = 4
"""Reachable sums, from the fullest down, one attempt walks."""


class Attempt(NamedTuple):
    """One way to make the next pack: the candidates it must hold (indices into the pool), its
    caps on vision tokens and media (None: none), the vision tokens the walks over all
    candidates steer to, in turn (None: not steered; empty: no such walk), the least vision
    tokens it may leave with, how full it must be when forced to leave, and the balanced
    chooser's picks it tries first, aimed at ``goal`` vision tokens."""

    forced: list[int]
    vision: int | None
    media: int | None
    walks: tuple[float | None, ...]
    least: int = 0
    goal: float = 0.0
    forced_fill: float = 0.0
    """Forced to leave: the least share of the row its walks fill (0: any)."""
    left_out: frozenset[int] = frozenset()
    """Candidates its walks leave out."""
    light_first: bool = False
    """The forced candidates topped up with light ones alone."""
    paired: bool = False
    """Media-carrying candidates picked by their vision tokens, topped up with light ones."""


class Pool(Protocol):
    """What a chooser reads of the packer: the held candidates in stream order, their aligned
    units, vision tokens and media, the subset sums of their units (``prefix[i]``: sums reachable
    by the first ``i``), the row's size in units, the units a pack needs to leave early, the
    packs emitted so far, the candidates pushed since the last one, ``max_wait``, the held
    candidates' vision tokens together, the tokens of the samples taken so far (emitted and
    held) and the vision target."""

    @property
    def candidates(self) -> Sequence[Candidate]: ...
    @property
    def units(self) -> Sequence[int]: ...
    @property
    def vision(self) -> Sequence[int]: ...
    @property
    def media(self) -> Sequence[int]: ...
    @property
    def prefix(self) -> Sequence[int]: ...
    @property
    def cap_units(self) -> int: ...
    @property
    def fill_units(self) -> int: ...
    @property
    def emitted(self) -> int: ...
    @property
    def fresh(self) -> int: ...
    @property
    def max_wait(self) -> int | None: ...
    @property
    def held_vision(self) -> int: ...
    @property
    def seen_tokens(self) -> int: ...
    def vision_target(self) -> float: ...


def units_of(pool: Pool, chosen: Sequence[int]) -> int:
    """Aligned units of the candidates at ``chosen``."""
    units = pool.units
    return sum(units[i] for i in chosen)


def room_left(cap: int | None, used: int) -> int | None:
    return None if cap is None else cap - used


class Beside(NamedTuple):
    """What an attempt's forced candidates leave of a row: units, vision tokens and media
    (None: no cap), and the vision tokens they carry."""

    units: int
    vision: int | None
    media: int | None
    carried: int

    def lowest(self, pool: Pool, share: float, *, early: bool) -> int:
        """Units the rest must fill: to leave early, or ``share`` of the row when forced."""
        full = pool.fill_units if early else math.ceil(share * pool.cap_units)
        return max(full - (pool.cap_units - self.units), 0)


def beside(pool: Pool, attempt: Attempt) -> Beside:
    """What ``attempt``'s forced candidates leave of the row within its caps."""
    members = [pool.candidates[i] for i in attempt.forced]
    carried = sum(c.vision for c in members)
    return Beside(
        pool.cap_units - sum(c.units for c in members),
        room_left(attempt.vision, carried),
        room_left(attempt.media, sum(c.media for c in members)),
        carried,
    )


def walked(pool: Pool, attempt: Attempt, *, early: bool) -> list[int] | None:
    """The pack of the first walk of ``attempt`` over all held candidates (those that fit its
    limits beside the forced ones) that keeps its limits and carries its ``least`` vision
    tokens: at each of :func:`walk_sums`, each of its walks in turn; else None."""
    if not attempt.walks:
        return None
    forced = attempt.forced
    left = beside(pool, attempt)
    room, vision_room, media_room, base_vision = left.units, left.vision, left.media, left.carried
    kept = set(forced) | attempt.left_out
    units: Sequence[int] = pool.units
    prefix: Sequence[int] = pool.prefix
    vision: Sequence[int] = pool.vision
    media: Sequence[int] = pool.media
    others: Sequence[int] = range(len(units))
    if (
        kept
        or (vision_room is not None and max(vision, default=0) > vision_room)
        or (media_room is not None and max(media, default=0) > media_room)
    ):  # the subset sums of the candidates that fit beside the forced ones
        others = [
            i
            for i in others
            if i not in kept
            and (vision_room is None or vision[i] <= vision_room)
            and (media_room is None or media[i] <= media_room)
        ]
        units = [units[i] for i in others]
        first = next((n for n, i in enumerate(others) if n != i), len(others))  # 1st left out
        rebuilt = prefixes(units[first:], prefix[first], (1 << (room + 1)) - 1)
        prefix = [*prefix[:first], *rebuilt]  # bits above room differ, and are never read
        vision = [vision[i] for i in others]
        media = [media[i] for i in others]
    limits = [
        Limits(vision_room, media_room, None if goal is None else goal - base_vision)
        for goal in attempt.walks
    ]
    least = attempt.least - base_vision
    lowest = left.lowest(pool, attempt.forced_fill, early=early)
    reach = prefix[-1] & ((1 << (room + 1)) - 1)
    for total in walk_sums(reach, room, lowest, early=early):
        for limit in limits:
            found = steered_subset(prefix, units, vision, media, total, limit)
            if found is not None and found.vision >= least:
                return forced + [others[p] for p in found.chosen]
    return None


def first_fit(pool: Pool, forced: list[int], budget: VisionBudget) -> list[int]:
    """``forced`` plus each other candidate, oldest first, that still fits the row and the
    caps: a pack within the caps whatever the walks found."""
    chosen = list(forced)
    units = sum(pool.units[i] for i in forced)
    vision = sum(pool.candidates[i].vision for i in forced)
    media = sum(pool.candidates[i].media for i in forced)
    kept = set(forced)
    for index, cand in enumerate(pool.candidates):
        if index in kept or units + cand.units > pool.cap_units:
            continue
        if budget.fits(vision + cand.vision, media + cand.media):
            chosen.append(index)
            units += cand.units
            vision += cand.vision
            media += cand.media
    return chosen


def due(pool: Pool) -> bool:
    """Whether an early pack is tried at this push: right after a pack left, and then after
    1, 2, 4, 8, ... more pushes (``pool.fresh``; a restored packer counts them from its held
    candidates, so it tries where the original did)."""
    fresh = pool.fresh
    return fresh & (fresh - 1) == 0


def walk_sums(reach: int, room: int, lowest: int, *, early: bool) -> list[int]:
    """The unit sums a walk tries, fullest first: the :data:`WALK_SUMS` fullest reachable
    ones, and for a pack forced to leave, the fullest at each of :data:`FORCED_FILLS`."""
    sums: list[int] = []
    total = reach.bit_length() - 1
    while total >= lowest and len(sums) < WALK_SUMS:
        sums.append(total)
        total = (reach & ((1 << total) - 1)).bit_length() - 1
    if not early:
        for share in FORCED_FILLS:
            total = (reach & ((1 << (math.floor(share * room) + 1)) - 1)).bit_length() - 1
            if total not in sums and total >= lowest:
                sums.append(total)
    return sums
