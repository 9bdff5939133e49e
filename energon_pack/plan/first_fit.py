"""First fit decreasing over a whole dataset, by runs of equal rows.

Rows go in decreasing order of a key, each into the first pack with room for its tokens, vision
tokens and media. Rows that need only tokens (no vision tokens, no media) and have the same
padded length come in runs; a run is placed as first fit would place its rows one by one, but
a pack takes as many of them as fit at once, and rows that no open pack can take open their
new packs together. Only packs are searched, not rows, so a dataset of short text rows costs
a few tree searches per pack. The result is the row-by-row first fit's, to the pack.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


class _Room:
    """Per budget (tokens, vision tokens, media), a segment tree of the most free room in each
    range of pack slots, and a fourth of each pack's joint room: the lesser of its free tokens
    and its free vision tokens in tokens' units (a range whose packs lack room in one budget or
    the other is skipped even when each budget alone has room in some pack). It doubles its
    slots as packs open."""

    def __init__(self, slots: int) -> None:
        self.leaves = 1 << max(0, (slots - 1).bit_length())
        self.trees = [[-1] * (2 * self.leaves) for _ in range(4)]

    def grow(self) -> None:
        """Twice the slots (the free room of every pack kept)."""
        old, self.leaves = self.leaves, 2 * self.leaves
        for budget, tree in enumerate(self.trees):
            new = [-1] * (2 * self.leaves)
            new[self.leaves : self.leaves + old] = tree[old : 2 * old]
            for node in range(self.leaves - 1, 0, -1):
                left, right = new[2 * node], new[2 * node + 1]
                new[node] = left if left >= right else right
            self.trees[budget] = new

    def set(self, slot: int, budget: int, value: int) -> None:
        """One budget's free room of a pack; its ancestors are updated while their most free
        room changes."""
        tree = self.trees[budget]
        node = slot + self.leaves
        tree[node] = value
        node >>= 1
        while node:
            left, right = tree[2 * node], tree[2 * node + 1]
            most = left if left >= right else right
            if tree[node] == most:
                return
            tree[node] = most
            node >>= 1

    def first_with_tokens(self, tokens: int) -> int:
        """The leftmost pack with at least ``tokens`` free, or -1."""
        tree = self.trees[0]
        if tree[1] < tokens:
            return -1
        node, leaves = 1, self.leaves
        while node < leaves:
            node = 2 * node if tree[2 * node] >= tokens else 2 * node + 1
        return node - leaves

    def first_with(self, tokens: int, vision: int, media: int, joint: int) -> int:
        """The leftmost pack with at least this much free in every budget (``joint``: the
        same joint room), or -1."""
        free_tokens, free_vision, free_media, free_joint = self.trees
        leaves = self.leaves
        stack = [1]
        while stack:
            node = stack.pop()
            if (
                free_joint[node] < joint
                or free_tokens[node] < tokens
                or free_vision[node] < vision
                or free_media[node] < media
            ):
                continue
            if node >= leaves:
                return node - leaves
            stack.append(2 * node + 1)
            stack.append(2 * node)
        return -1


def first_fit_runs(
    key: npt.ArrayLike,
    padded: npt.ArrayLike,
    vision: npt.ArrayLike,
    media: npt.ArrayLike,
    caps: Sequence[int],
) -> list[list[int]]:
    """Groups of row indices: the rows by ``key``, largest first (on a tie, rows with vision
    tokens or media first, then by index), each into the first pack with room for its
    ``padded`` tokens, ``vision`` tokens and ``media`` within ``caps`` (tokens, vision tokens,
    media per pack). A row that fits no pack alone is a ValueError naming it."""
    padded_rows = np.asarray(padded, dtype=np.int64)
    vision_rows = np.asarray(vision, dtype=np.int64)
    media_rows = np.asarray(media, dtype=np.int64)
    count = len(padded_rows)
    over = (padded_rows > caps[0]) | (vision_rows > caps[1]) | (media_rows > caps[2])
    if over.any():
        row = int(np.flatnonzero(over)[0])
        raise ValueError(
            f"row {row} ({padded_rows[row]} tokens, {vision_rows[row]} vision tokens, "
            f"{media_rows[row]} media) fits no pack of {tuple(caps)}; leave it out first"
        )
    plain = (vision_rows == 0) & (media_rows == 0)
    order = np.lexsort((np.arange(count), plain, -np.asarray(key)))
    sizes = padded_rows[order]
    plain_order = plain[order]
    # a run: one row with vision tokens or media, or plain rows of one padded length
    starts_mask = np.ones(count, dtype=bool)
    starts_mask[1:] = ~plain_order[1:] | ~plain_order[:-1] | (sizes[1:] != sizes[:-1])
    starts = [*np.flatnonzero(starts_mask).tolist(), count]
    rows = order.tolist()
    size_of, vision_of, media_of = (
        values[order].tolist() for values in (padded_rows, vision_rows, media_rows)
    )
    plain_of = plain_order.tolist()
    capacity, vision_cap, media_cap = caps
    room = _Room(max(1, int(padded_rows.sum()) // capacity + 1))

    def joint(tokens: int, vision: int) -> int:
        """Joint room: a pack with room for (tokens, vision) has at least this joint room."""
        return min(tokens, vision * capacity // vision_cap)

    groups: list[list[int]] = []
    free_tokens: list[int] = []
    free_vision: list[int] = []
    free_media: list[int] = []

    def open_pack() -> int:
        slot = len(groups)
        if slot == room.leaves:
            room.grow()
        groups.append([])
        free_tokens.append(capacity)
        free_vision.append(vision_cap)
        free_media.append(media_cap)
        room.set(slot, 1, vision_cap)
        room.set(slot, 2, media_cap)
        room.set(slot, 3, joint(capacity, vision_cap))
        return slot

    for start, stop in itertools.pairwise(starts):
        size = size_of[start]
        if not plain_of[start]:
            need = joint(size, vision_of[start])
            slot = room.first_with(size, vision_of[start], media_of[start], need)
            if slot < 0:
                slot = open_pack()
            groups[slot].append(rows[start])
            free_tokens[slot] -= size
            free_vision[slot] -= vision_of[start]
            free_media[slot] -= media_of[start]
            room.set(slot, 0, free_tokens[slot])
            room.set(slot, 1, free_vision[slot])
            room.set(slot, 2, free_media[slot])
            room.set(slot, 3, joint(free_tokens[slot], free_vision[slot]))
            continue
        while start < stop:
            slot = room.first_with_tokens(size)
            if slot < 0:
                slot = open_pack()
            take = stop - start if size == 0 else min(stop - start, free_tokens[slot] // size)
            groups[slot].extend(rows[start : start + take])
            free_tokens[slot] -= take * size
            room.set(slot, 0, free_tokens[slot])
            room.set(slot, 3, joint(free_tokens[slot], free_vision[slot]))
            start += take
    return groups
