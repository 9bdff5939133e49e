"""Packing a whole dataset's measured rows, and laying the packs out as training steps.

:func:`pack_rows` is first fit decreasing over the padded lengths; without caps
:func:`refill_tail` then empties the last, near-empty packs into the others by subset sums
where the rows fit fewer packs. Under vision caps each row
goes to the first pack that has room for its tokens, vision tokens and media alike, in two
orders of the rows, keeping the fewer packs (:func:`~energon_pack.plan.first_fit.first_fit_runs`
places runs of equal text-only rows at once). With balance, :func:`even_out_vision` then trades
rows between heavy and light packs.

:func:`lay_out_steps` gives each pack its step and rank: ``global_batch_size`` packs per step,
``global_batch_size / data_parallel_size`` per rank. With balance on, the packs of a step are
those nearest in vision tokens (packs sorted by them, then cut into steps) and are dealt to the
ranks heaviest first, each to the least loaded rank with room; the order of the steps is then
shuffled with the seed.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from energon_pack.packing.subset_sums import nearest_sum, prefixes, subset_with_sum
from energon_pack.packing.vision_budget import straggler_floor, straggler_ratio
from energon_pack.plan.first_fit import first_fit_runs
from energon_pack.plan.spec import PlanSpec

_NO_CAP = 1 << 62


def pack_rows(
    lengths: Sequence[int], vision: Sequence[int], media: Sequence[int], spec: PlanSpec
) -> list[list[int]]:
    """Groups of indices into the rows (each group in row order), by first fit decreasing on
    the padded lengths, every group within ``spec.layout``'s capacity and ``spec.vision``'s
    caps, with vision tokens evened out between packs under ``spec.vision.balance``
    (:func:`even_out_vision`). Every row must fit a pack alone (the measure step left out
    those that do not).

    Under caps, ``2 * PARTITION_ROWS`` rows or more are cut into partitions of at least
    ``PARTITION_ROWS`` (row ``i`` in partition ``i % partitions``, so each holds the
    same mix) packed one by one: the capped search's cost per row grows with the packs it
    searches, a partition's only loss is its last packs' room."""
    layout, budget = spec.layout, spec.vision
    caps = (
        layout.capacity,
        budget.max_vision_tokens if budget.max_vision_tokens is not None else _NO_CAP,
        budget.max_media if budget.max_media is not None else _NO_CAP,
    )
    padded = np.asarray([layout.aligned(length) for length in lengths], dtype=np.int64)
    if budget.max_vision_tokens is None and budget.max_media is None:
        none = np.zeros(len(padded), dtype=np.int64)
        first_fit = first_fit_runs(lengths, padded, none, none, caps)
        groups = refill_tail(first_fit, padded.tolist(), layout.capacity)
        if budget.balance:
            groups = even_out_vision(groups, (padded.tolist(), list(vision), list(media)), caps)
        return [sorted(group) for group in groups]
    columns = (padded, np.asarray(vision, dtype=np.int64), np.asarray(media, dtype=np.int64))
    partitions = max(1, len(padded) // PARTITION_ROWS)
    out: list[list[int]] = []
    for part in range(partitions):
        rows = np.arange(part, len(padded), partitions)
        sizes = [column[rows] for column in columns]
        groups = _first_fit_within_caps(sizes, caps)
        if budget.balance:
            groups = even_out_vision(groups, [size.tolist() for size in sizes], caps)
        out.extend(sorted(rows[group].tolist()) for group in groups)
    return out


PARTITION_ROWS = 100_000
"""Fewest rows :func:`pack_rows` packs together under caps (see there)."""
_REFILLED = 64
"""Packs with free room :func:`refill_tail` pairs up for one emptied pack (the roomiest)."""
_PASSES = 4
"""Most passes :func:`refill_tail` makes over those pairs while they still gain."""
_EMPTIED = 64
"""Most packs :func:`refill_tail` empties (each costs a pass over every pack's load)."""


def refill_tail(groups: list[list[int]], sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """``groups`` with their emptiest pack emptied into the others where the rows fit fewer
    packs. The emptiest pack's rows (``left``) are pooled with two other packs at a time, the
    pair with the most free room first: the first pack of the pair is refilled as full as the
    pool allows (the subset nearest the capacity, its own rows kept where it can), then the
    second from the rest, and what neither takes is left. A pair only ever gains tokens, and
    two packs together can take a row that neither's own free room could. It stops when
    nothing is left (one pack fewer; then the next emptiest is tried) or no pair gains; a pack
    that cannot be emptied stays as it was; at most :data:`_EMPTIED` packs are emptied.
    ``sizes`` are the rows' padded lengths, ``capacity`` a pack's."""
    if not groups:
        return groups
    fewest = -(-sum(sizes) // capacity)
    packs = dict(enumerate(list(group) for group in groups))
    flat = np.fromiter((i for group in groups for i in group), dtype=np.int64)
    starts = np.cumsum([0, *(len(group) for group in groups[:-1])], dtype=np.int64)
    summed = np.add.reduceat(np.asarray(sizes, dtype=np.int64)[flat], starts)
    loads = dict(enumerate(int(load) for load in summed))
    for _ in range(min(_EMPTIED, len(packs) - fewest)):
        emptiest = min(packs, key=lambda g: (loads[g], g))
        trial = {g: group for g, group in packs.items() if g != emptiest}
        trial_loads = {g: load for g, load in loads.items() if g != emptiest}
        left = _empty_into(packs[emptiest], trial, trial_loads, sizes, capacity)
        if left:
            break
        packs, loads = trial, trial_loads
    return [packs[g] for g in sorted(packs)]


def _empty_into(
    left: list[int],
    trial: dict[int, list[int]],
    loads: dict[int, int],
    sizes: Sequence[int],
    capacity: int,
) -> list[int]:
    """Move ``left``'s rows into the packs of ``trial`` (refilled in place with their
    ``loads``, pairs of the packs with the most free room first); the rows no pair could
    take."""
    roomy = heapq.nsmallest(
        _REFILLED, (g for g in trial if loads[g] < capacity), key=lambda g: (loads[g], g)
    )
    if sum(sizes[i] for i in left) > sum(capacity - loads[g] for g in roomy):
        return left  # more than all their free room: no refill can take it
    mask = (1 << (capacity + 1)) - 1
    for _ in range(_PASSES):
        gained = False
        for first, second in itertools.combinations(roomy, 2):
            if not left:
                return left
            pool = trial[first] + trial[second] + left
            before = loads[first] + loads[second]
            refilled = []
            for _pack in range(2):
                units = [sizes[i] for i in pool]
                reach = prefixes(units, 1, mask)
                best = nearest_sum(reach[-1], capacity, 0, capacity) or 0
                chosen = set(subset_with_sum(reach, units, best))
                refilled.append(([pool[k] for k in sorted(chosen)], best))
                pool = [pool[k] for k in range(len(pool)) if k not in chosen]
            if refilled[0][1] + refilled[1][1] <= before:
                continue
            (trial[first], loads[first]), (trial[second], loads[second]) = refilled
            left, gained = pool, True
        if not gained:
            break
    return left


def _first_fit_within_caps(
    sizes: Sequence[npt.NDArray[np.int64]], caps: Sequence[int]
) -> list[list[int]]:
    """First fit decreasing on vectors (``sizes``: padded lengths, vision tokens, media), each
    row into the first pack with room in every budget, in two orders: the rows by padded
    length, and by the sum of their shares of the three budgets (largest first both); the one
    that needs fewer packs (the first on a tie)."""
    padded, vision, media = sizes
    shares = padded / caps[0] + vision / caps[1] + media / caps[2]
    tries = [first_fit_runs(key, padded, vision, media, caps) for key in (padded, shares)]
    return min(tries, key=len)


EVEN_PASSES = 8
"""Most passes of :func:`even_out_vision` over the packs."""
_TRIED = 4
"""Rows of the heavier pack :func:`_trade` tries to move, best first."""
_PARTNERS = 8
"""Heavy packs a light pack trades with in one pass, heaviest first."""
_SCANNED = 64
"""Heavy packs a light pack looks at in one pass for a trade (heaviest first)."""
_FAILURES = 16
"""Heavy packs without a trade after which a light pack waits for the next pass."""


def even_out_vision(
    groups: list[list[int]], sizes: Sequence[Sequence[int]], caps: Sequence[int]
) -> list[list[int]]:
    """``groups`` with vision tokens moved from heavy packs to light ones. Each pass takes the
    packs below the mean vision tokens, lightest first; each trades with packs above the mean,
    heaviest first: a row that carries vision tokens goes from the heavy pack to the light one
    and text-only rows of the same total tokens (as near as the packs' free room allows) come
    back, while that brings the two closer and the light one is below the mean.
    ``sizes`` is ``(padded lengths, vision tokens, media)`` per row. Every pack stays within
    ``caps`` and the packs keep their count, so the fill is unchanged."""
    groups = [list(group) for group in groups]
    loads = [[sum(size[i] for i in group) for size in sizes] for group in groups]
    carriers = [[i for i in group if sizes[1][i] > 0] for group in groups]
    lightest = [min((sizes[1][i] for i in rows), default=_NO_CAP) for rows in carriers]
    mean = sum(load[1] for load in loads) / max(len(loads), 1)
    for _ in range(EVEN_PASSES):
        order = sorted(range(len(groups)), key=lambda p: (-loads[p][1], p))
        heavy_side = order[: len(order) // 2]
        moved = False
        for light in reversed(order[len(order) // 2 :]):
            partners = failed = 0
            text: _TextRows | None = None
            light_traded = False
            for heavy in heavy_side[:_SCANNED]:
                if loads[light][1] >= mean or partners == _PARTNERS or failed == _FAILURES:
                    break
                if loads[heavy][1] <= mean:
                    continue
                traded = False
                while loads[light][1] < mean:
                    if lightest[heavy] >= loads[heavy][1] - loads[light][1]:
                        break  # each of heavy's rows would overshoot: no trade narrows the gap
                    if text is None:
                        text = _TextRows(groups[light], sizes, caps[0])
                    if not _trade(groups, loads, carriers, (heavy, light), sizes, caps, text):
                        break
                    traded, text = True, None
                    for pack in (light, heavy):
                        lightest[pack] = min((sizes[1][i] for i in carriers[pack]), default=_NO_CAP)
                partners += traded
                failed += not traded
                light_traded |= traded
            if light_traded:  # heavy packs brought down to the mean leave the front
                front = [p for p in heavy_side[:_SCANNED] if loads[p][1] > mean]
                heavy_side[:_SCANNED] = front
                moved = True
        if not moved:
            break
    return groups


class _TextRows:
    """A light pack's text-only rows, their padded lengths and the subset sums of those (up to
    the capacity, taken when first asked for), kept while the pack does not change."""

    def __init__(self, group: Sequence[int], sizes: Sequence[Sequence[int]], capacity: int):
        padded, vision, media = sizes
        self.rows = [i for i in group if vision[i] == 0 and media[i] == 0]
        self.sizes = [padded[i] for i in self.rows]
        self._capacity = capacity
        self._prefix: list[int] | None = None

    @property
    def prefix(self) -> list[int]:
        if self._prefix is None:
            self._prefix = prefixes(self.sizes, 1, (1 << (self._capacity + 1)) - 1)
        return self._prefix


def _trade(
    groups: list[list[int]],
    loads: list[list[int]],
    carriers: list[list[int]],
    pair: tuple[int, int],
    sizes: Sequence[Sequence[int]],
    caps: Sequence[int],
    text: _TextRows,
) -> bool:
    """Move one row with vision tokens from the ``pair``'s heavy pack to its light one and
    ``text`` rows (light's) back, if that narrows their vision gap within the caps; whether it
    did. ``carriers`` holds each pack's rows with vision tokens."""
    heavy, light = pair
    padded, vision, media = sizes
    gap = loads[heavy][1] - loads[light][1]
    candidates = sorted(
        (i for i in carriers[heavy] if abs(gap - 2 * vision[i]) < gap),
        key=lambda i: (abs(gap - 2 * vision[i]), i),
    )[:_TRIED]
    for row in candidates:
        if loads[light][1] + vision[row] > caps[1] or loads[light][2] + media[row] > caps[2]:
            continue
        low = padded[row] - (caps[0] - loads[light][0])  # what must leave light
        high = padded[row] + (caps[0] - loads[heavy][0])  # what heavy can take back
        back = nearest_sum(text.prefix[-1], padded[row], max(low, 0), high)
        if back is None:
            continue
        returned = [text.rows[k] for k in subset_with_sum(text.prefix, text.sizes, back)]
        groups[heavy].remove(row)
        groups[light].append(row)
        carriers[heavy].remove(row)
        carriers[light].append(row)
        for other in returned:
            groups[light].remove(other)
            groups[heavy].append(other)
        change = (padded[row] - back, vision[row], media[row])
        for budget, value in enumerate(change):
            loads[heavy][budget] -= value
            loads[light][budget] += value
        return True
    return False


@dataclass(frozen=True)
class StepLayout:
    """Which step and rank trains each pack, and the balance of the full steps."""

    step: npt.NDArray[np.int64]
    """Per pack: its optimizer step (from 0)."""
    rank: npt.NDArray[np.int64]
    """Per pack: its data-parallel rank."""
    micro: npt.NDArray[np.int64]
    """Per pack: its place among its rank's packs of the step (the micro-batch)."""
    straggler: float
    """Mean over the full steps of the most loaded rank's vision tokens over the mean (1.0
    without vision tokens; NaN without a full step)."""
    floor: float
    """The straggler ratio the same steps would have with vision tokens spread as evenly as
    whole samples allow (:func:`~energon_pack.packing.vision_budget.straggler_floor`)."""


def lay_out_steps(
    pack_vision: Sequence[int], pack_largest: Sequence[int], spec: PlanSpec
) -> StepLayout:
    """Steps and ranks of packs with ``pack_vision`` vision tokens each (``pack_largest``: the
    most vision tokens of one of its samples), as the module docstring describes. The last
    step holds the packs left over (fewer than ``global_batch_size``), dealt in turn."""
    count, per_step, ranks = len(pack_vision), spec.steps_of, spec.data_parallel_size
    if spec.vision.balance:
        order = sorted(range(count), key=lambda p: (-pack_vision[p], p))
    else:
        order = list(range(count))
        random.Random(spec.seed).shuffle(order)
    steps = [order[start : start + per_step] for start in range(0, count, per_step)]
    full = [step for step in steps if len(step) == per_step]
    if spec.vision.balance:
        random.Random(spec.seed).shuffle(full)
    steps = full + [step for step in steps if len(step) < per_step]
    step_of, rank_of, micro_of = (np.zeros(count, dtype=np.int64) for _ in range(3))
    loads: list[list[float]] = []
    largest: list[list[float]] = []
    for number, members in enumerate(steps):
        dealt = deal_packs(members, pack_vision, ranks, balance=spec.vision.balance)
        load = [0.0] * ranks
        big = [0.0] * ranks
        for rank, packs in enumerate(dealt):
            for micro, pack in enumerate(packs):
                step_of[pack], rank_of[pack], micro_of[pack] = number, rank, micro
                load[rank] += pack_vision[pack]
                big[rank] = max(big[rank], pack_largest[pack])
        if len(members) == per_step:
            loads.append(load)
            largest.append(big)
    ratio = straggler_ratio(loads) if loads else float("nan")
    floor = straggler_floor(largest, loads) if loads else float("nan")
    return StepLayout(step_of, rank_of, micro_of, ratio, floor)


def deal_packs(
    members: Sequence[int], pack_vision: Sequence[int], ranks: int, *, balance: bool
) -> list[list[int]]:
    """The packs of one step per rank: in turn, or with ``balance`` heaviest first to the
    least loaded rank that still has room (each rank gets the same count, give or take one)."""
    if not balance:
        return [list(members[rank::ranks]) for rank in range(ranks)]
    room = [len(members) // ranks + (rank < len(members) % ranks) for rank in range(ranks)]
    dealt: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for pack in sorted(members, key=lambda p: (-pack_vision[p], p)):
        rank = min((r for r in range(ranks) if len(dealt[r]) < room[r]), key=lambda r: load[r])
        dealt[rank].append(pack)
        load[rank] += pack_vision[pack]
    return dealt
