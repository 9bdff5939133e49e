"""Packing a whole dataset's measured rows, and laying the packs out as training steps.

:func:`pack_rows` is first fit decreasing over the padded lengths. Under vision caps each row
goes to the first pack that has room for its tokens, vision tokens and media alike (a segment
tree keeps each budget's most free room per range of packs, so a search skips every range
where one budget is short), in two orders of the rows, keeping the fewer packs. With balance,
:func:`even_out_vision` then trades rows between heavy and light packs.

:func:`lay_out_steps` gives each pack its step and rank: ``global_batch_size`` packs per step,
``global_batch_size / data_parallel_size`` per rank. With balance on, the packs of a step are
those nearest in vision tokens (packs sorted by them, then cut into steps) and are dealt to the
ranks heaviest first, each to the least loaded rank with room; the order of the steps is then
shuffled with the seed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from energon_pack.packing.bins import MaxTree, first_fit_decreasing
from energon_pack.packing.subset_sums import nearest_sum, prefixes, subset_with_sum
from energon_pack.packing.vision_budget import straggler_floor, straggler_ratio
from energon_pack.plan.spec import PlanSpec

_NO_CAP = 1 << 62


class _FreeTree:
    """Per budget (tokens, vision tokens, media), a segment tree of the most free room in
    each range of pack slots."""

    def __init__(self, size: int) -> None:
        self._trees = [MaxTree(size, -1) for _ in range(3)]

    def set(self, slot: int, free: Sequence[int]) -> None:
        for tree, value in zip(self._trees, free, strict=True):
            tree.set(slot, value)

    def first_fitting(self, tokens: int, vision: int, media: int) -> int:
        """The leftmost slot with at least this much free in every budget, or -1."""
        free_tokens, free_vision, free_media = (tree.nodes for tree in self._trees)
        leaves = self._trees[0].leaves
        stack = [1]
        while stack:
            node = stack.pop()
            if free_tokens[node] < tokens or free_vision[node] < vision or free_media[node] < media:
                continue
            if node >= leaves:
                return node - leaves
            stack.append(2 * node + 1)
            stack.append(2 * node)
        return -1


def pack_rows(
    lengths: Sequence[int], vision: Sequence[int], media: Sequence[int], spec: PlanSpec
) -> list[list[int]]:
    """Groups of indices into the rows (each group in row order), by first fit decreasing on
    the padded lengths, every group within ``spec.layout``'s capacity and ``spec.vision``'s
    caps, with vision tokens evened out between packs under ``spec.vision.balance``
    (:func:`even_out_vision`). Every row must fit a pack alone (the measure step left out
    those that do not)."""
    layout, budget = spec.layout, spec.vision
    caps = (
        layout.capacity,
        budget.max_vision_tokens if budget.max_vision_tokens is not None else _NO_CAP,
        budget.max_media if budget.max_media is not None else _NO_CAP,
    )
    padded = [layout.aligned(length) for length in lengths]
    if budget.max_vision_tokens is None and budget.max_media is None:
        groups = first_fit_decreasing(lengths, layout.capacity, align=layout.pad_to_multiple_of)
    else:
        groups = _first_fit_within_caps(padded, vision, media, caps)
    if budget.balance:
        groups = even_out_vision(groups, (padded, vision, media), caps)
    return [sorted(group) for group in groups]


def _first_fit_within_caps(
    padded: Sequence[int], vision: Sequence[int], media: Sequence[int], caps: Sequence[int]
) -> list[list[int]]:
    """First fit decreasing on vectors, each row into the first pack with room in every budget,
    in two orders: the rows by padded length, and by the sum of their shares of the three
    budgets (largest first both); the one that needs fewer packs (the first on a tie)."""
    by_length = [float(n) for n in padded]
    by_share = [
        padded[i] / caps[0] + vision[i] / caps[1] + media[i] / caps[2] for i in range(len(padded))
    ]
    tries = [_first_fit(size, padded, vision, media, caps) for size in (by_length, by_share)]
    return min(tries, key=len)


def _first_fit(
    size: Sequence[float],
    padded: Sequence[int],
    vision: Sequence[int],
    media: Sequence[int],
    caps: Sequence[int],
) -> list[list[int]]:
    """The rows by ``size``, largest first, each into the first pack with room for it."""
    order = sorted(range(len(padded)), key=lambda i: (-size[i], i))
    tree = _FreeTree(len(padded))
    groups: list[list[int]] = []
    free: list[list[int]] = []
    for index in order:
        need = (padded[index], vision[index], media[index])
        slot = tree.first_fitting(*need)
        if slot < 0:
            slot = len(groups)
            groups.append([])
            free.append(list(caps))
        groups[slot].append(index)
        room = free[slot]
        for budget_index, value in enumerate(need):
            room[budget_index] -= value
        tree.set(slot, room)
    return groups


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
    mean = sum(load[1] for load in loads) / max(len(loads), 1)
    for _ in range(EVEN_PASSES):
        order = sorted(range(len(groups)), key=lambda p: (-loads[p][1], p))
        heavy_side = order[: len(order) // 2]
        moved = False
        for light in reversed(order[len(order) // 2 :]):
            partners = failed = 0
            for heavy in heavy_side[:_SCANNED]:
                if loads[light][1] >= mean or partners == _PARTNERS or failed == _FAILURES:
                    break
                if loads[heavy][1] <= mean:
                    continue
                traded = False
                while loads[light][1] < mean and _trade(groups, loads, heavy, light, sizes, caps):
                    traded = True
                partners += traded
                failed += not traded
                moved |= traded
            # heavy packs brought down to the mean leave the front of the list
            front = [p for p in heavy_side[:_SCANNED] if loads[p][1] > mean]
            heavy_side[:_SCANNED] = front
        if not moved:
            break
    return groups


def _trade(
    groups: list[list[int]],
    loads: list[list[int]],
    heavy: int,
    light: int,
    sizes: Sequence[Sequence[int]],
    caps: Sequence[int],
) -> bool:
    """Move one row with vision tokens from ``heavy`` to ``light`` and text-only rows of
    ``light`` back, if that narrows their vision gap within the caps; whether it did."""
    padded, vision, media = sizes
    gap = loads[heavy][1] - loads[light][1]
    candidates = sorted(
        (i for i in groups[heavy] if vision[i] > 0 and abs(gap - 2 * vision[i]) < gap),
        key=lambda i: (abs(gap - 2 * vision[i]), i),
    )[:_TRIED]
    text = [i for i in groups[light] if vision[i] == 0 and media[i] == 0]
    text_sizes = [padded[i] for i in text]
    for row in candidates:
        if loads[light][1] + vision[row] > caps[1] or loads[light][2] + media[row] > caps[2]:
            continue
        low = padded[row] - (caps[0] - loads[light][0])  # what must leave light
        high = padded[row] + (caps[0] - loads[heavy][0])  # what heavy can take back
        prefix = prefixes(text_sizes, 1, (1 << (high + 1)) - 1)
        back = nearest_sum(prefix[-1], padded[row], max(low, 0), high)
        if back is None:
            continue
        returned = [text[k] for k in subset_with_sum(prefix, text_sizes, back)]
        groups[heavy].remove(row)
        groups[light].append(row)
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
        dealt = _deal(members, pack_vision, ranks, balance=spec.vision.balance)
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


def _deal(
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
