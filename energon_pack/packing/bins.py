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


class _MaxTree:
    """Segment tree over ``size`` slots holding ints; finds the leftmost slot >= a value."""

    def __init__(self, size: int, initial: int) -> None:
        self._leaves = 1 << max(0, (size - 1).bit_length())
        self._tree = [initial] * (2 * self._leaves)

    def set(self, index: int, value: int) -> None:
        node = index + self._leaves
        tree = self._tree
        tree[node] = value
        node >>= 1
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            tree[node] = left if left >= right else right
            node >>= 1

    def leftmost_at_least(self, value: int) -> int:
        """Index of the leftmost slot holding ``>= value``, or -1 if there is none."""
        tree = self._tree
        if tree[1] < value:
            return -1
        node = 1
        while node < self._leaves:
            node = 2 * node if tree[2 * node] >= value else 2 * node + 1
        return node - self._leaves


def _decreasing_order(lengths: Sequence[int], capacity: int, align: int) -> list[int]:
    check_capacity_and_align(capacity, align)
    for index, length in enumerate(lengths):
        check_length(index, length)
        if aligned_length(length, align) > capacity:
            raise ValueError(f"{overlong_message(index, length, align, capacity)}; {OVERLONG_FIX}")
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def first_fit_decreasing(
    lengths: Sequence[int], capacity: int, *, align: int = 1
) -> list[list[int]]:
    """Pack ``lengths`` (aligned up to ``align``) into bins of ``capacity`` by first fit
    decreasing. Returns groups of indices into ``lengths``. O(n log n)."""
    order = _decreasing_order(lengths, capacity, align)
    cap_units = capacity // align
    free = _MaxTree(len(lengths), -1)  # slot = bin index, value = free units
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
    nonempty = _MaxTree(cap_units + 1, -1)
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


def fewest_bins(
    sizes: Sequence[int], capacity: int, *, max_items: int | None = None
) -> list[list[int]]:
    """Groups of indices of ``sizes`` into the fewest bins of ``capacity`` (and at most
    ``max_items`` items each), for small inputs such as one micro-batch.

    Exact (depth-first search with symmetry pruning) while the search visits at most
    ``_SEARCH_BUDGET`` nodes; otherwise best-fit decreasing. Deterministic.
    """
    greedy = [
        group[start : start + (max_items or len(group))]
        for group in best_fit_decreasing(sizes, capacity)
        for start in range(0, len(group), max_items or len(group))
    ]
    lower = math.ceil(sum(sizes) / capacity)
    if max_items is not None:
        lower = max(lower, math.ceil(len(sizes) / max_items))
    search = _BinSearch(sizes, capacity, max_items or len(sizes))
    for bins in range(lower, len(greedy)):
        found = search.run(bins)
        if found is None:
            return greedy  # budget spent: keep the greedy answer
        if found:
            return [group for group in found if group]
    return greedy


class _BinSearch:
    """Exact bin packing by depth-first search, items largest first, within a node budget."""

    def __init__(self, sizes: Sequence[int], capacity: int, max_items: int) -> None:
        self.sizes = list(sizes)
        self.capacity = capacity
        self.max_items = max_items
        self.order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
        self.remaining = [sum(self.sizes[i] for i in self.order[j:]) for j in range(len(sizes))]
        self.budget = _SEARCH_BUDGET
        self.groups: list[list[int]] = []
        self.loads: list[int] = []

    def run(self, bins: int) -> list[list[int]] | None:
        """A packing into ``bins`` bins, ``[]`` if there is none, None if the budget ran out."""
        self.groups = [[] for _ in range(bins)]
        self.loads = [0] * bins
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
        if self.remaining[j] > len(self.loads) * self.capacity - sum(self.loads):
            return False
        item = self.order[j]
        size = self.sizes[item]
        tried: set[tuple[int, int]] = set()
        for b, group in enumerate(self.groups):
            state = (self.loads[b], len(group))
            if self.loads[b] + size > self.capacity or len(group) >= self.max_items:
                continue
            if state in tried:  # an identical bin was tried already
                continue
            tried.add(state)
            self.loads[b] += size
            group.append(item)
            if self._place(j + 1):
                return True
            group.pop()
            self.loads[b] -= size
        return False


class _BudgetSpent(Exception):
    pass
