"""Subset sums as bitsets: bit ``s`` of a big integer is set when some subset of the items sums
to ``s``. Adding an item of size ``n`` is one shift and one or; a prefix list (the reach of the
first ``i`` items, for each ``i``) finds a subset for any reachable sum by walking back. Pure
Python, used by :class:`~energon_pack.OnlineBinPacker`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple

from energon_pack.packing.packer_state import Candidate


def prefixes(sizes: Sequence[int], start: int, mask: int) -> list[int]:
    """Subset-sum bitsets of ``sizes[:i]`` for each ``i``, from ``start`` (the empty set's)."""
    out = [start]
    for size in sizes:
        reach = out[-1]
        out.append((reach | (reach << size)) & mask)
    return out


WALKED_ITEMS = 48
"""Up to this many items :func:`subset_with_sum` tests each one, newest first; over it, it
searches (most of the few items a sum needs are then far apart)."""


def subset_with_sum(prefix: Sequence[int], sizes: Sequence[int], target: int) -> list[int]:
    """Positions in ``sizes`` of a subset summing to ``target`` (a bit of ``prefix[-1]``),
    preferring older (earlier) ones: newest first, each the newest item the rest of the sum
    cannot be reached without.

    The first ``i`` items reach a sum for every ``i`` from the least that reaches it on (each
    prefix holds the one before), so over :data:`WALKED_ITEMS` items that item is found by a
    search from the last one taken: steps of 1, 2, 4, ... down, then bisection (a few big-int
    tests per item taken, where a walk over every item tests each)."""
    chosen: list[int] = []
    high = len(sizes)
    if not (prefix[high] >> target) & 1:
        raise ValueError(f"the {high} items do not reach the sum {target}")
    if high <= WALKED_ITEMS:  # testing every item costs less than searching among few
        for index in range(high - 1, -1, -1):
            if not target:
                break
            if not (prefix[index] >> target) & 1:
                chosen.append(index)
                target -= sizes[index]
        return chosen
    while target:  # prefix[high] reaches target: each step keeps that
        step, low = 1, high - 1
        while low > 0 and (prefix[low] >> target) & 1:
            high, step = low, step * 2
            low = max(high - step, 0)
        while high - low > 1:  # prefix[0] reaches only 0
            middle = (low + high) // 2
            if (prefix[middle] >> target) & 1:
                high = middle
            else:
                low = middle
        chosen.append(low)  # the first `high` items reach target; the first `low` do not
        target -= sizes[low]
        high = low
    return chosen


def nearest_sum(reach: int, target: int, low: int, high: int) -> int | None:
    """The sum in the bitset ``reach`` nearest to ``target`` within ``[low, high]`` (the lower
    one on a tie), or None."""
    if high < low:
        return None
    below = (reach & ((1 << (min(target, high) + 1)) - 1)).bit_length() - 1
    above_bits = reach >> target if target <= high else 0
    above = target + (above_bits & -above_bits).bit_length() - 1 if above_bits else -1
    found = [s for s in (below, above) if low <= s <= high]
    return min(found, key=lambda s: (abs(s - target), s)) if found else None


class SubsetSums:
    """Held candidates of one kind, in stream order, with the subset sums of one of their
    sizes (the text-only ones by units, the media-carrying ones by vision tokens)."""

    def __init__(self, size: Literal["units", "vision"], mask: int) -> None:
        self.size = size
        self.mask = mask
        self.items: list[Candidate] = []
        self.units: list[int] = []
        self.vision: list[int] = []
        self.media: list[int] = []
        """The items' units, vision tokens and media, in their order (read by the walks)."""
        self.sizes = self.units if size == "units" else self.vision
        """The size the sums count: ``units`` or ``vision``, the same list."""
        self.prefix = [1]

    def reset(self, items: list[Candidate]) -> None:
        self.items = items
        self.units = [c.units for c in items]
        self.vision = [c.vision for c in items]
        self.media = [c.media for c in items]
        self.sizes = self.units if self.size == "units" else self.vision
        self.prefix = prefixes(self.sizes, 1, self.mask)

    def without(self, leaving: set[int]) -> SubsetSums:
        """These sums without the candidates whose ``id`` is in ``leaving`` (self where none
        is held; else a copy whose sums are rebuilt from the first one left out)."""
        first = next((i for i, c in enumerate(self.items) if id(c) in leaving), None)
        if first is None:
            return self
        rest = SubsetSums(self.size, self.mask)
        rest.items = self.items[:first] + [c for c in self.items[first:] if id(c) not in leaving]
        rest.units = [c.units for c in rest.items]
        rest.vision = [c.vision for c in rest.items]
        rest.media = [c.media for c in rest.items]
        rest.sizes = rest.units if self.size == "units" else rest.vision
        rest.prefix = self.prefix[:first] + prefixes(
            rest.sizes[first:], self.prefix[first], self.mask
        )
        return rest

    def append(self, cand: Candidate) -> None:
        self.items.append(cand)
        self.units.append(cand.units)
        self.vision.append(cand.vision)
        self.media.append(cand.media)
        size = cand.units if self.size == "units" else cand.vision
        reach = self.prefix[-1]
        self.prefix.append((reach | (reach << size)) & self.mask)

    def remove(self, leaving: set[int]) -> None:
        """Drop the candidates whose ``id`` is in ``leaving``; rebuild the sums after them."""
        first = next((i for i, c in enumerate(self.items) if id(c) in leaving), None)
        if first is None:
            return
        gone = [i for i in range(first, len(self.items)) if id(self.items[i]) in leaving]
        for column in (self.items, self.units, self.vision, self.media):  # sizes is one of them
            for index in reversed(gone):
                del column[index]
        rebuilt = prefixes(self.sizes[first:], self.prefix[first], self.mask)
        self.prefix[first + 1 :] = rebuilt[1:]

    def subset(self, target: int) -> list[Candidate]:
        """Candidates whose sizes sum to ``target``, older ones preferred."""
        return [self.items[p] for p in subset_with_sum(self.prefix, self.sizes, target)]


class Limits(NamedTuple):
    """What a steered walk may add (None: no cap) and the vision tokens it steers toward."""

    vision: int | None
    media: int | None
    goal: float | None
    """Vision tokens the walk's subset should carry (None: no steering, older ones preferred)."""


class Walked(NamedTuple):
    """A subset found by :func:`steered_subset`: positions (newest first) and what they carry."""

    chosen: list[int]
    vision: int
    media: int


def steered_subset(
    prefix: Sequence[int],
    units: Sequence[int],
    vision: Sequence[int],
    media: Sequence[int],
    target: int,
    limits: Limits,
) -> Walked | None:
    """A subset of the items summing to ``target`` units (a bit of ``prefix[-1]``) whose vision
    tokens and media stay within ``limits``, or None where this walk meets the caps first.

    One walk back from the newest item, as :func:`subset_with_sum`: an item is taken when the
    sum cannot be reached without it; where it can be reached both ways, the item is left out
    (older items preferred) unless ``limits.goal`` is set: then the choice whose projection is
    nearer the goal and within the media cap wins (what is taken so far, plus the rest of the
    sum at the vision tokens and media per unit of the older items). The plain walk is
    :func:`subset_with_sum`'s; a steered one is linear in the items."""
    goal = limits.goal
    if goal is None:  # the plain walk takes what subset_with_sum takes, within the caps or not
        plain = subset_with_sum(prefix, units, target)
        got_vision = sum(vision[i] for i in plain)
        got_media = sum(media[i] for i in plain)
        if (limits.vision is not None and got_vision > limits.vision) or (
            limits.media is not None and got_media > limits.media
        ):
            return None
        return Walked(plain, got_vision, got_media)
    count = len(units)
    scale = 1 / max(goal, 1.0)
    # what the items older than the one walked carry, for the projections
    older_units, older_vision, older_media = sum(units), sum(vision), sum(media)
    chosen: list[int] = []
    got_vision = got_media = 0
    rest = target
    most_media = limits.media
    most_vision = math.inf if limits.vision is None else limits.vision
    media_cap = math.inf if most_media is None else most_media
    media_scale = max(most_media or 0, 1)
    half = prefix[-1].bit_length() >> 1  # a bit below it is read by a mask, above by a shift
    for index in range(count - 1, -1, -1):  # prefix[index + 1] reaches rest: each step keeps that
        if rest == 0:
            break
        reach = prefix[index]
        size = units[index]
        older_units -= size
        older_vision -= vision[index]
        older_media -= media[index]
        if not (reach & (1 << rest) if rest < half else (reach >> rest) & 1):
            # the rest needs this item: rest - size is in reach
            if got_vision + vision[index] > most_vision or got_media + media[index] > media_cap:
                return None
            take = True
        elif (
            size > rest
            or not (
                reach & (1 << (rest - size)) if rest - size < half else (reach >> (rest - size)) & 1
            )
            or got_vision + vision[index] > most_vision
            or got_media + media[index] > media_cap
        ):
            continue  # it can only be left out
        else:
            rate_vision = older_vision / older_units if older_units else 0.0
            rate_media = older_media / older_units if older_units else 0.0
            # projections: what is taken so far, plus the rest at the older items' rates
            taken = abs(got_vision + vision[index] + (rest - size) * rate_vision - goal) * scale
            left = abs(got_vision + rest * rate_vision - goal) * scale
            if most_media is not None:  # what the media would pass their cap by
                over = got_media + media[index] + (rest - size) * rate_media - most_media
                taken += over / media_scale if over > 0.0 else 0.0
                over = got_media + rest * rate_media - most_media
                left += over / media_scale if over > 0.0 else 0.0
            take = taken < left
        if take:
            chosen.append(index)
            rest -= size
            got_vision += vision[index]
            got_media += media[index]
    return Walked(chosen, got_vision, got_media) if rest == 0 else None
