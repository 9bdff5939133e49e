"""Offline bin packing of sequence lengths into fixed-capacity rows, and the rules every packer
shares (aligned lengths, the overlong message). Pure Python, no I/O, no torch.

:func:`first_fit_decreasing` and :func:`best_fit_decreasing` pack a whole list of lengths in
O(n log n) and return groups of indices; :func:`fewest_bins` finds the fewest rows for a small
input such as one micro-batch. The online packer is :class:`~energon_pack.OnlineBinPacker`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

Key: TypeAlias = str | int
Overlong = Literal["error", "skip"]
"""What a packer or a loader that cannot cut a sample does with one longer than a row (the
collator and the offline packer can also cut:
:data:`~energon_pack.packing.row_layout.OverlongPolicy`)."""


def aligned_length(length: int, align: int) -> int:
    """``length`` rounded up to a multiple of ``align``."""
    return -(-length // align) * align


def check_capacity_and_align(capacity: int, align: int) -> None:
    if not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    if not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be a positive int, got {align!r}")
    if align > capacity:
        raise ValueError(
            f"align={align} is larger than capacity={capacity}; no sequence would fit. "
            "Use an align (pad_to_multiple_of) that divides the capacity."
        )


def check_length(key: object, length: object) -> int:
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"sample {key!r}: length must be a positive int, got {length!r}")
    return length


OVERLONG_FIX = (
    "raise seq_length, shorten or filter such samples, or pass overlong='skip' to count and skip "
    "them"
)
"""The fix an overlong error names (after :func:`overlong_message`)."""


def overlong_message(key: object, length: int, align: int, capacity: int) -> str:
    """The one statement of a sample longer than a row, in every loader and packer."""
    return (
        f"sample {key!r} has {length} tokens ({aligned_length(length, align)} after padding to a "
        f"multiple of {align}), above seq_length={capacity}"
    )


def overlong_refusal(key: object, length: int, align: int, capacity: int) -> str | None:
    """Why a sample of ``length`` tokens cannot fit a row of ``capacity`` once padded to a
    multiple of ``align``, or None when it fits: the one answer every packer and loader uses."""
    if aligned_length(length, align) <= capacity:
        return None
    return overlong_message(key, length, align, capacity)


class MaxTree:
    """Segment tree over ``size`` slots holding ints; finds the leftmost slot >= a value.

    ``nodes[1]`` is the root and node ``n`` has children ``2n`` and ``2n + 1``; slot ``i`` is
    node ``leaves + i``; each inner node holds the larger of its children."""

    def __init__(self, size: int, initial: int) -> None:
        self.leaves = 1 << max(0, (size - 1).bit_length())
        self.nodes = [initial] * (2 * self.leaves)

    def set(self, index: int, value: int) -> None:
        node = index + self.leaves
        tree = self.nodes
        tree[node] = value
        node >>= 1
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            tree[node] = left if left >= right else right
            node >>= 1

    def leftmost_at_least(self, value: int) -> int:
        """Index of the leftmost slot holding ``>= value``, or -1 if there is none."""
        tree = self.nodes
        if tree[1] < value:
            return -1
        node = 1
        while node < self.leaves:
            node = 2 * node if tree[2 * node] >= value else 2 * node + 1
        return node - self.leaves


def _decreasing_order(lengths: Sequence[int], capacity: int, align: int) -> list[int]:
    check_capacity_and_align(capacity, align)
    for index, length in enumerate(lengths):
        check_length(index, length)
        if refusal := overlong_refusal(index, length, align, capacity):
            raise ValueError(f"{refusal}; {OVERLONG_FIX}")
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def first_fit_decreasing(
    lengths: Sequence[int], capacity: int, *, align: int = 1
) -> list[list[int]]:
    """Pack ``lengths`` (aligned up to ``align``) into bins of ``capacity`` by first fit
    decreasing. Returns groups of indices into ``lengths``. O(n log n)."""
    order = _decreasing_order(lengths, capacity, align)
    cap_units = capacity // align
    free = MaxTree(len(lengths), -1)  # slot = bin index, value = free units
    groups: list[list[int]] = []
    free_units: list[int] = []
    for index in order:
        units = aligned_length(lengths[index], align) // align
        slot = free.leftmost_at_least(units)
        if slot < 0:
            slot = len(groups)
            groups.append([])
            free_units.append(cap_units)
        groups[slot].append(index)
        free_units[slot] -= units
        free.set(slot, free_units[slot])
    return groups


def best_fit_decreasing(
    lengths: Sequence[int], capacity: int, *, align: int = 1
) -> list[list[int]]:
    """Pack ``lengths`` (aligned up to ``align``) into bins of ``capacity`` by best fit
    decreasing (each item goes to the fullest bin it fits). Returns groups of indices into
    ``lengths``. O(n log capacity)."""
    order = _decreasing_order(lengths, capacity, align)
    cap_units = capacity // align
    # Bins are bucketed by their free units; slot r holds r while some bin has r units free.
    nonempty = MaxTree(cap_units + 1, -1)
    buckets: list[list[int]] = [[] for _ in range(cap_units + 1)]
    groups: list[list[int]] = []
    for index in order:
        units = aligned_length(lengths[index], align) // align
        free = nonempty.leftmost_at_least(units)
        if free < 0:
            slot, free = len(groups), cap_units
            groups.append([])
        else:
            slot = buckets[free].pop()
            if not buckets[free]:
                nonempty.set(free, -1)
        groups[slot].append(index)
        left = free - units
        buckets[left].append(slot)
        nonempty.set(left, left)
    return groups


@dataclass(frozen=True)
class Bin:
    """One emitted bin: the keys of its items in stream order and their real lengths."""

    keys: tuple[Key, ...]
    lengths: tuple[int, ...]
    used: int
    """Sum of the aligned lengths."""
    capacity: int
    vision_tokens: int = 0
    """Vision tokens of its items (what :meth:`OnlineBinPacker.push` was told)."""
    media: int = 0
    """Images and videos of its items."""

    @property
    def fill(self) -> float:
        """Fraction of the capacity taken by the aligned lengths."""
        return self.used / self.capacity


def groups_fill(
    groups: Sequence[Sequence[int]], lengths: Sequence[int], capacity: int, *, align: int = 1
) -> float:
    """Bin fill of offline ``groups`` (indices into ``lengths``): aligned tokens over capacity."""
    if not groups:
        return 0.0
    used = sum(aligned_length(lengths[i], align) for group in groups for i in group)
    return used / (len(groups) * capacity)


_SEARCH_BUDGET = 10_000
"""Nodes the exact search of :func:`fewest_bins` may visit before falling back to BFD."""


Limit = tuple[Sequence[int], int]
"""Another budget of a row for :func:`fewest_bins`: each item's size in it, and the row's cap
(e.g. vision tokens and ``max_vision_tokens``)."""


def fewest_bins(
    sizes: Sequence[int],
    capacity: int,
    *,
    max_items: int | None = None,
    limits: Sequence[Limit] = (),
) -> list[list[int]]:
    """Groups of indices of ``sizes`` into the fewest bins of ``capacity`` (and at most
    ``max_items`` items and every one of ``limits`` each), for small inputs such as one
    micro-batch. Every item must fit a bin alone.

    Exact (depth-first search with symmetry pruning) while the search visits at most
    ``_SEARCH_BUDGET`` nodes; otherwise best-fit decreasing. Deterministic.
    """
    dims = [(list(sizes), capacity), *((list(s), cap) for s, cap in limits)]
    most = max_items or len(sizes)
    if limits:
        greedy = _best_fit_decreasing(dims, most)
    else:
        greedy = [
            group[start : start + most]
            for group in best_fit_decreasing(sizes, capacity)
            for start in range(0, len(group), most)
        ]
    lower = max([math.ceil(sum(s) / cap) for s, cap in dims] + [math.ceil(len(sizes) / most)])
    search = _BinSearch(dims, most)
    for bins in range(lower, len(greedy)):
        found = search.run(bins)
        if found is None:
            return greedy  # budget spent: keep the greedy answer
        if found:
            return [group for group in found if group]
    return greedy


def _best_fit_decreasing(dims: list[tuple[list[int], int]], max_items: int) -> list[list[int]]:
    """Best fit decreasing by the first budget, within every budget and ``max_items``."""
    sizes = dims[0][0]
    groups: list[list[int]] = []
    loads: list[list[int]] = []
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        fitting = [
            b
            for b, load in enumerate(loads)
            if len(groups[b]) < max_items
            and all(load[d] + s[item] <= cap for d, (s, cap) in enumerate(dims))
        ]
        if fitting:
            slot = max(fitting, key=lambda b: (loads[b][0], -b))
        else:
            slot = len(groups)
            groups.append([])
            loads.append([0] * len(dims))
        groups[slot].append(item)
        for d, (s, _) in enumerate(dims):
            loads[slot][d] += s[item]
    return groups


class _BinSearch:
    """Exact bin packing by depth-first search, items largest first, within a node budget."""

    def __init__(self, dims: list[tuple[list[int], int]], max_items: int) -> None:
        self.dims = dims
        sizes = dims[0][0]
        self.max_items = max_items
        self.order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        self.remaining = [
            [sum(s[i] for i in self.order[j:]) for s, _ in dims] for j in range(len(sizes))
        ]
        self.budget = _SEARCH_BUDGET
        self.groups: list[list[int]] = []
        self.loads: list[list[int]] = []

    def run(self, bins: int) -> list[list[int]] | None:
        """A packing into ``bins`` bins, ``[]`` if there is none, None if the budget ran out."""
        self.groups = [[] for _ in range(bins)]
        self.loads = [[0] * len(self.dims) for _ in range(bins)]
        try:
            return self.groups if self._place(0) else []
        except _BudgetSpent:
            return None

    def _place(self, j: int) -> bool:
        if j == len(self.order):
            return True
        self.budget -= 1
        if self.budget < 0:
            raise _BudgetSpent
        bins = len(self.loads)
        for d, (_, cap) in enumerate(self.dims):
            if self.remaining[j][d] > bins * cap - sum(load[d] for load in self.loads):
                return False
        item = self.order[j]
        tried: set[tuple[int, ...]] = set()
        for b, group in enumerate(self.groups):
            load = self.loads[b]
            if len(group) >= self.max_items or any(
                load[d] + s[item] > cap for d, (s, cap) in enumerate(self.dims)
            ):
                continue
            state = (*load, len(group))
            if state in tried:  # an identical bin was tried already
                continue
            tried.add(state)
            for d, (s, _) in enumerate(self.dims):
                load[d] += s[item]
            group.append(item)
            if self._place(j + 1):
                return True
            group.pop()
            for d, (s, _) in enumerate(self.dims):
                load[d] -= s[item]
        return False


class _BudgetSpent(Exception):
    pass
