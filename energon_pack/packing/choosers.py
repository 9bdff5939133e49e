"""How :class:`~energon_pack.OnlineBinPacker` chooses the candidates of the next pack: one chooser
per rule behind one small interface (:class:`Chooser`). Pure Python, no I/O, no torch.

* :class:`TokenChooser` (no vision budget): the fullest subset of held candidates by tokens,
  older ones preferred, read from the packer's subset-sum bitset.
* :class:`CappedChooser` (caps on vision tokens or media per pack): the same fullest subset,
  walked back never past a cap (steered toward the stream's vision target where the plain walk
  meets one; :func:`~energon_pack.packing.subset_sums.steered_subset`).
* :class:`BalancedChooser` (``VisionBudget(balance=True)``): packs whose vision tokens stay near
  the stream's running target: media-carrying candidates picked by their vision tokens, the rest
  of the row filled with the fullest subset of the light candidates (text-only, or little vision
  per token), walked toward the target.

Each choice under a budget is a short list of
:class:`~energon_pack.packing.walks.Attempt` s tried in turn, each a few linear walks
(:mod:`~energon_pack.packing.walks`); a pack that must leave and that no attempt finds takes
the fullest of first fit and walks without the candidates with the most vision tokens. An early
pack (one leaving by the fill rule) is tried only right after a pack left and then after 1, 2,
4, ... more pushes (:func:`~energon_pack.packing.walks.due`), so a stream whose packs cannot yet
leave early costs a few walks per pack, not per sample.

The packer keeps the buffer, deadlines, byte bound, counters and state; a chooser keeps only the
index it searches (none for tokens or caps alone), told of every candidate that enters or leaves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from energon_pack.packing.packer_state import Candidate, DeadlineBin
from energon_pack.packing.subset_sums import (
    Limits,
    SubsetSums,
    nearest_sum,
    prefixes,
    steered_subset,
    subset_with_sum,
)
from energon_pack.packing.vision_budget import BALANCE_SLACK, BALANCE_TOLERANCE, VisionBudget
from energon_pack.packing.walks import (
    FORCED_FILLS,
    Attempt,
    Beside,
    Pool,
    beside,
    due,
    first_fit,
    room_left,
    units_of,
    walked,
)

__all__ = ["BalancedChooser", "CappedChooser", "Chooser", "TokenChooser", "chooser_for"]

AIMS = (1.0, 0.8, 0.6)
"""Where the walks of a balanced pack forced to leave steer, as shares of its goal, in turn (a
walk steered at the goal can pass it where the rest of the row must carry media)."""
AGED = 0.5
"""With balance: the share of ``max_wait`` packs after which the oldest candidate leads the
next pack (a candidate the target passes over would otherwise leave only when its deadline
forces a pack, as it comes)."""
AGED_WITHOUT_WAIT = 64
"""The horizon in packs :data:`AGED` applies to where ``max_wait`` is None."""
BALANCED_FILL = 0.99
"""With balance: the least share of the row a pack forced to leave fills while it keeps to the
target; only the last attempts, within the caps alone, go below."""
LIGHT_STEPS = 32
"""With balance: a candidate is *light* (fills rows beside the media-carrying ones) when its
vision tokens per token are at most the target's (its vision tokens over the row capacity),
counted in steps of 1/LIGHT_STEPS: the split changes only when the target crosses a step."""
PAIRED_SUMS = 3
"""With balance: vision sums of the media-carrying candidates, nearest the aim first, a paired
choice for a pack forced to leave tries (an early one tries the nearest; it tries again after
more pushes, :func:`due`)."""
LIGHT_SUMS = 2
"""With balance: unit sums of the light candidates, fullest first, a pack forced to leave tries
(an early one tries the fullest)."""
THINNED = 4
"""How many of the candidates with the most vision tokens a pack forced to leave, that no
attempt found, walks without (one more at a time), against first fit."""


class Chooser(Protocol):
    """One rule for the next pack."""

    def choose(self, pool: Pool, forced: list[int], *, early: bool) -> list[int] | None:
        """Indices (into ``pool.candidates``) of the next pack, holding the ``forced`` ones.
        ``early`` (a pack leaving by the fill rule): only a pack good enough to leave now (full
        enough; within the budget's rules for an early pack), else None. Not ``early``: never
        None."""
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


class TokenChooser:
    """Packs by tokens alone: the fullest subset, older candidates preferred."""

    def choose(self, pool: Pool, forced: list[int], *, early: bool) -> list[int] | None:
        if forced:
            chosen = self._topped_up(pool, forced)
        else:
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
    """Packs within caps on vision tokens and media: the fullest subset by tokens, walked back
    as :class:`TokenChooser` walks it but never past a cap; where that walk meets a cap, one
    steered toward the stream's vision target; from the :data:`WALK_SUMS` fullest reachable
    sums down. A pack that must leave and that no walk finds is the fullest of first fit (the
    oldest candidates that fit, always within the caps) and walks without the candidates with
    the most vision tokens (:meth:`_thinned`)."""

    def __init__(self, budget: VisionBudget) -> None:
        self.budget = budget

    def choose(self, pool: Pool, forced: list[int], *, early: bool) -> list[int] | None:
        if early and not due(pool):
            return None
        for attempt in self._attempts(pool, forced, early=early):
            chosen = self._tried(pool, attempt, early=early)
            if chosen is not None:
                return chosen
        return None if early else self._thinned(pool, forced)

    def _thinned(self, pool: Pool, forced: list[int]) -> list[int]:
        """A pack forced to leave that no attempt found: the fullest of first fit and the walks
        that leave out the candidates with the most vision tokens, one more at a time (up to
        :data:`THINNED`; the sums of the rest keep the caps more often)."""
        budget = self.budget
        kept = set(forced)
        heaviest = sorted(
            (i for i in range(len(pool.candidates)) if i not in kept),
            key=lambda i: (-pool.candidates[i].vision, i),
        )
        best = first_fit(pool, forced, budget)
        cap, most = budget.max_vision_tokens, budget.max_media
        for count in range(1, min(THINNED, len(heaviest)) + 1):
            left_out = frozenset(heaviest[:count])
            chosen = walked(
                pool, Attempt(forced, cap, most, (None,), left_out=left_out), early=False
            )
            if chosen is not None and units_of(pool, chosen) > units_of(pool, best):
                best = chosen
        return best

    def _attempts(self, pool: Pool, forced: list[int], *, early: bool) -> list[Attempt]:
        """At each sum the plain walk, then one steered to the target."""
        budget = self.budget
        cap, most = budget.max_vision_tokens, budget.max_media
        return [Attempt(forced, cap, most, (None, pool.vision_target()))]

    def _tried(self, pool: Pool, attempt: Attempt, *, early: bool) -> list[int] | None:
        return walked(pool, attempt, early=early)

    def deadline_bin(
        self, pool: Pool, bins: Mapping[int, DeadlineBin], cand: Candidate, max_wait: int
    ) -> int | None:
        return self._fullest_fitting(pool, bins, cand, None)[0]

    def _fullest_fitting(
        self, pool: Pool, bins: Mapping[int, DeadlineBin], cand: Candidate, over: float | None
    ) -> tuple[int | None, int | None]:
        """The fullest deadline bin ``cand`` fits within the caps, and the fullest of those
        whose vision tokens with it stay within ``over`` (None: not asked); ties to the
        earlier, None where there is none."""
        budget = self.budget
        room = pool.cap_units - cand.units
        vision_room = room_left(budget.max_vision_tokens, cand.vision)
        media_room = room_left(budget.max_media, cand.media)
        best = best_within = None
        best_units = best_within_units = -1
        for bin_id, b in bins.items():
            units = b.units
            if (
                units > room
                or units <= best_within_units
                or (vision_room is not None and b.vision > vision_room)
                or (media_room is not None and b.media > media_room)
            ):
                continue
            if units > best_units:
                best, best_units = bin_id, units
            if over is not None and b.vision + cand.vision <= over:
                best_within, best_within_units = bin_id, units
        return best, best_within

    def added(self, cand: Candidate) -> None:
        return None

    def removed(self, leaving: Sequence[Candidate]) -> None:
        return None

    def reset(self, held: Sequence[Candidate]) -> None:
        return None


class BalancedChooser(CappedChooser):
    """Packs whose vision tokens stay near the stream's running target (see
    :mod:`~energon_pack.packing.vision_budget`), within any caps. It holds the light candidates
    (:data:`LIGHT_STEPS`) as a subset-sum bitset of their units and the others as one of their
    vision tokens. A pack is, in turn:

    * led by the candidate that should go next (:meth:`_lead`), topped up with light ones
      (with no vision tokens where the lead alone passes the target); early, a lead that
      carries vision tokens leaves only within :data:`BALANCE_SLACK` below its goal (a
      text-only one may leave lighter);
    * media-carrying candidates whose vision tokens sum near the aim, topped up with light ones
      walked toward the target (:meth:`_paired`): early, only within :data:`BALANCE_SLACK`
      below and :data:`BALANCE_TOLERANCE` above the target; right after a pack left, where
      that pick finds none, a walk over all candidates steered to the target within the same
      bounds (:func:`_steered_early`);
    * forced to leave: walks over all candidates steered to the target (:data:`AIMS`), then any
      walk within the caps, then the fallback of :class:`CappedChooser`.

    Without a ``vision_share``, no pack leaves early before the packer has read
    :data:`~energon_pack.packing.vision_budget.WARMUP_ROWS` rows' worth of tokens
    (:meth:`~energon_pack.VisionBudget.warmed_up`): until then the target is a few samples' share.
    """

    def __init__(self, budget: VisionBudget, cap_units: int, capacity: int) -> None:
        super().__init__(budget)
        self._light = SubsetSums("units", (1 << (cap_units + 1)) - 1)
        most = capacity if budget.max_vision_tokens is None else budget.max_vision_tokens
        self._dense = SubsetSums("vision", (1 << (min(most, capacity) + 1)) - 1)  # no pick passes
        self._rebuilt: dict[str, tuple[frozenset[int], SubsetSums]] = {}  # by kind
        self._capacity = capacity
        self._light_steps = 0  # vision tokens per token of a light candidate, in LIGHT_STEPS

    def choose(self, pool: Pool, forced: list[int], *, early: bool) -> list[int] | None:
        if early and not (due(pool) and self.budget.warmed_up(pool.seen_tokens, self._capacity)):
            return None
        steps = max(math.floor(pool.vision_target() / self._capacity * LIGHT_STEPS), 1)
        if steps != self._light_steps:  # a function of the target alone: restores the same
            self._light_steps = steps
            self.reset(pool.candidates)
        return super().choose(pool, forced, early=early)

    def _attempts(self, pool: Pool, forced: list[int], *, early: bool) -> list[Attempt]:
        budget = self.budget
        cap, most = budget.max_vision_tokens, budget.max_media
        target = pool.vision_target()
        attempts = []
        lead = None if forced else self._lead(pool, target)
        if lead is not None:
            led = pool.candidates[lead].vision
            goal = max(target, led)
            attempts.append(
                Attempt(
                    [lead],
                    led if led > target else _tolerated(cap, goal),
                    most,
                    () if early else (goal,),
                    _slackened(goal) if early and led else 0,
                    goal=goal,
                    forced_fill=BALANCED_FILL,
                    light_first=True,
                    paired=True,
                )
            )
        goal = max([target, *(pool.candidates[i].vision for i in forced)])
        within, least = _tolerated(cap, goal), _slackened(goal)
        steered = (goal,) if early and _steered_early(pool, least) else ()
        attempts.append(Attempt(forced, within, most, steered, least, goal=goal, paired=True))
        if not early:
            aims = tuple(goal * aim for aim in AIMS)
            attempts.append(
                Attempt(
                    forced, within, most, aims, goal=goal, forced_fill=BALANCED_FILL, paired=True
                )
            )
            attempts.append(Attempt(forced if lead is None else [lead], cap, most, (goal,)))
        return attempts

    def _lead(self, pool: Pool, target: float) -> int | None:
        """The candidate the next pack should hold: the oldest one where it has waited
        :data:`AGED` of ``max_wait`` packs, else the oldest media-carrying one that is not light
        where it alone passes the target by more than :data:`BALANCE_TOLERANCE`."""
        cands = pool.candidates
        horizon = AGED_WITHOUT_WAIT if pool.max_wait is None else pool.max_wait
        if cands and pool.emitted - cands[0].pushed_at >= AGED * horizon:
            return 0
        dense = self._dense.items
        if not dense or dense[0].vision <= target * (1 + BALANCE_TOLERANCE):
            return None
        return next(i for i, c in enumerate(cands) if c is dense[0])

    def _tried(self, pool: Pool, attempt: Attempt, *, early: bool) -> list[int] | None:
        if not (attempt.light_first or attempt.paired):
            return walked(pool, attempt, early=early)
        left = beside(pool, attempt)
        # forced to leave: nearly as full as the walks' fullest
        lowest = left.lowest(pool, FORCED_FILLS[0], early=early)
        leaving = {id(pool.candidates[i]) for i in attempt.forced}
        light = self._without(self._light, leaving)
        limits = Limits(left.vision, left.media, attempt.goal - left.carried)
        least = attempt.least - left.carried
        room = left.units
        picked: list[Candidate] | None = None
        tries = 1 if early else 0  # 0: as many as a forced pack tries
        if attempt.light_first:
            picked = _filled(light, [], _Need(room, lowest, least, limits, tries or LIGHT_SUMS))
        if picked is None and attempt.paired and not _paired_as_filled(attempt, left):
            dense = self._without(self._dense, leaving)
            picked = _paired(light, dense, _Need(room, lowest, least, limits, tries))
        if picked is not None:
            return attempt.forced + _positions(pool, picked)
        return walked(pool, attempt, early=early)

    def _without(self, kept: SubsetSums, leaving: set[int]) -> SubsetSums:
        """``kept`` (the light or the other candidates' sums) without the candidates whose
        ``id`` is in ``leaving``; the last ones built of each kind are kept, and grow with
        the candidates that enter, until a pack leaves."""
        if not leaving:
            return kept
        left_out = frozenset(leaving)
        last = self._rebuilt.get(kept.size)
        if last is None or last[0] != left_out:
            last = (left_out, kept.without(leaving))
            self._rebuilt[kept.size] = last
        return last[1]

    def deadline_bin(
        self, pool: Pool, bins: Mapping[int, DeadlineBin], cand: Candidate, max_wait: int
    ) -> int | None:
        """A media-carrying candidate joins a deadline bin whose vision tokens stay within the
        target, since a deadline bin may have to leave as it is; failing that a new bin while
        ``max_wait`` leaves room for one."""
        if not cand.visual:
            return self._fullest_fitting(pool, bins, cand, None)[0]
        over = pool.vision_target() * (1 + BALANCE_TOLERANCE)
        fullest, balanced = self._fullest_fitting(pool, bins, cand, over)
        if balanced is not None or len(bins) < max_wait:
            return balanced
        return fullest

    def added(self, cand: Candidate) -> None:
        kept = self._light if self._is_light(cand) else self._dense
        kept.append(cand)
        last = self._rebuilt.get(kept.size)
        if last is not None and last[1] is not kept:  # the new one is never left out
            last[1].append(cand)

    def removed(self, leaving: Sequence[Candidate]) -> None:
        ids = {id(c) for c in leaving}
        self._light.remove(ids)
        self._dense.remove(ids)
        self._rebuilt = {}

    def reset(self, held: Sequence[Candidate]) -> None:
        self._rebuilt = {}
        self._light.reset([c for c in held if self._is_light(c)])
        self._dense.reset([c for c in held if not self._is_light(c)])

    def _is_light(self, cand: Candidate) -> bool:
        return cand.vision * LIGHT_STEPS <= self._light_steps * cand.length


class _Need(NamedTuple):
    """What the rest of a row needs: at most ``room`` units and at least ``lowest``, at least
    ``least`` vision tokens, within ``limits``; ``tries`` sums (or picks) to try."""

    room: int
    lowest: int
    least: int
    limits: Limits
    tries: int


def _filled(light: SubsetSums, taken: list[Candidate], need: _Need) -> list[Candidate] | None:
    """The fullest subset of the light candidates within the room (at least ``lowest``) whose
    vision tokens and media stay within the limits and carry ``least`` with ``taken``: the
    plain walk (older ones preferred), else one toward the limits' goal; from the fullest
    reachable sum down ``tries`` sums, else None."""
    room, lowest, least, limits = need.room, need.lowest, need.least, need.limits
    vision, media = light.vision, light.media
    have = sum(c.vision for c in taken)
    carried = sum(vision)
    if have + carried < least:  # the light ones together cannot carry what is missing
        return None
    reach = light.prefix[-1] & ((1 << (room + 1)) - 1)
    total = reach.bit_length() - 1
    plain = Limits(limits.vision, limits.media, None)
    walks = (plain, limits) if carried else (plain,)  # steering needs vision to steer
    for _ in range(need.tries):
        if total < max(lowest, 0):
            return None
        for walk in walks:  # the plain walk is the cheaper one
            found = steered_subset(light.prefix, light.sizes, vision, media, total, walk)
            if found is not None and found.vision + have >= least:
                return taken + [light.items[p] for p in found.chosen]
        total = (reach & ((1 << total) - 1)).bit_length() - 1
    return None


def _paired(light: SubsetSums, dense: SubsetSums, need: _Need) -> list[Candidate] | None:
    """Media-carrying candidates whose vision tokens sum nearest the aim (read from their vision
    subset sums), topped up with light ones (:func:`_filled`): the aim leaves the light ones the
    vision tokens they carry per unit over the rest of the row. The first of the ``tries``
    nearest sums that works (0: :data:`PAIRED_SUMS`, each topped up as a forced pack is), else
    None."""
    room, limits = need.room, need.limits
    goal = max(limits.goal or 0.0, 0.0)
    high = limits.vision if limits.vision is not None else dense.mask.bit_length() - 1
    if high < 0:
        return None
    light_units = sum(light.units)
    light_rate = sum(light.vision) / light_units if light_units else 0.0
    dense_units = sum(dense.units)
    dense_rate = sum(dense.vision) / dense_units if dense_units else 1.0
    share = 1 - light_rate / dense_rate if dense_rate > light_rate else 1.0
    aim = round(min(max((goal - room * light_rate) / share, 0.0), goal))
    reach = dense.prefix[-1]
    for _ in range(need.tries or PAIRED_SUMS):
        nearest = nearest_sum(reach, aim, 0, high)
        if nearest is None:
            return None
        reach &= ~(1 << nearest)
        picked = dense.subset(nearest)
        units = sum(c.units for c in picked)
        media = sum(c.media for c in picked)
        if units > room or (limits.media is not None and media > limits.media):
            continue
        rest = _Need(
            room - units,
            need.lowest - units,
            need.least,
            Limits(
                room_left(limits.vision, nearest), room_left(limits.media, media), goal - nearest
            ),
            need.tries or LIGHT_SUMS,
        )
        filled = _filled(light, picked, rest)
        if filled is not None:
            return filled
    return None


def _paired_as_filled(attempt: Attempt, left: Beside) -> bool:
    """Whether the paired pick of ``attempt`` would only repeat its light-first one: the forced
    candidates leave no vision tokens (the one pick is then of no media-carrying candidate, the
    rest filled with light ones as the light-first one fills it, toward the same goal)."""
    return attempt.light_first and left.vision == 0 and attempt.goal >= left.carried


def _steered_early(pool: Pool, least: int) -> bool:
    """Whether an early paired pick that finds nothing also walks over all held candidates
    steered to its goal: only right after a pack left (once per pack: such a walk costs more than
    the pick), and only where the held candidates together carry the ``least`` vision tokens the
    pack must leave with (else no walk finds one)."""
    return pool.fresh == 0 and pool.held_vision >= least


def _slackened(goal: float) -> int:
    """The fewest vision tokens a pack kept near ``goal`` leaves with: :data:`BALANCE_SLACK`
    below it."""
    return math.ceil(goal * (1 - BALANCE_SLACK))


def _tolerated(cap: int | None, goal: float) -> int:
    """The vision cap of a pack aimed at ``goal``: its tolerance above it, within ``cap``."""
    tolerated = math.floor(goal * (1 + BALANCE_TOLERANCE))
    return tolerated if cap is None else min(cap, tolerated)


def _positions(pool: Pool, cands: Sequence[Candidate]) -> list[int]:
    """Indices of ``cands`` among the held candidates (in the pool's order)."""
    wanted = {id(c) for c in cands}
    return [i for i, c in enumerate(pool.candidates) if id(c) in wanted]


def chooser_for(budget: VisionBudget, cap_units: int, capacity: int) -> Chooser:
    """The chooser a vision budget asks for (tokens alone without one)."""
    if budget.balance:
        return BalancedChooser(budget, cap_units, capacity)
    if budget.active:
        return CappedChooser(budget)
    return TokenChooser()
