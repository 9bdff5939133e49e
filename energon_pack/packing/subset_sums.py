"""Subset sums as bitsets: bit ``s`` of a big integer is set when some subset of the items sums
to ``s``. Adding an item of size ``n`` is one shift and one or; a prefix list (the reach of the
first ``i`` items, for each ``i``) finds a subset for any reachable sum by walking back. Pure
Python, used by :class:`~energon_pack.OnlineBinPacker`.
"""

from __future__ import annotations

from collections.abc import Sequence

from energon_pack.packing.packer_state import Candidate


def prefixes(sizes: Sequence[int], start: int, mask: int) -> list[int]:
    """Subset-sum bitsets of ``sizes[:i]`` for each ``i``, from ``start`` (the empty set's)."""
    out = [start]
    for size in sizes:
        reach = out[-1]
        out.append((reach | (reach << size)) & mask)
    return out


def subset_with_sum(prefix: Sequence[int], sizes: Sequence[int], target: int) -> list[int]:
    """Positions in ``sizes`` of a subset summing to ``target`` (a bit of ``prefix[-1]``),
    preferring older (earlier) ones."""
    chosen = []
    for index in range(len(sizes) - 1, -1, -1):
        if target == 0:
            break
        if not (prefix[index] >> target) & 1:
            chosen.append(index)
            target -= sizes[index]
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

    def __init__(self, size: str, mask: int) -> None:
        self.size = size
        self.mask = mask
        self.items: list[Candidate] = []
        self.sizes: list[int] = []
        self.prefix = [1]

    def reset(self, items: list[Candidate]) -> None:
        self.items = items
        self.sizes = [getattr(c, self.size) for c in items]
        self.prefix = prefixes(self.sizes, 1, self.mask)

    def append(self, cand: Candidate) -> None:
        size = getattr(cand, self.size)
        self.items.append(cand)
        self.sizes.append(size)
        reach = self.prefix[-1]
        self.prefix.append((reach | (reach << size)) & self.mask)

    def remove(self, leaving: set[int]) -> None:
        """Drop the candidates whose ``id`` is in ``leaving``; rebuild the sums after them."""
        first = next((i for i, c in enumerate(self.items) if id(c) in leaving), None)
        if first is None:
            return
        kept = [i for i, c in enumerate(self.items) if id(c) not in leaving]
        self.items = [self.items[i] for i in kept]
        self.sizes = [self.sizes[i] for i in kept]
        rebuilt = prefixes(self.sizes[first:], self.prefix[first], self.mask)
        self.prefix[first + 1 :] = rebuilt[1:]

    def subset(self, target: int) -> list[Candidate]:
        """Candidates whose sizes sum to ``target``, older ones preferred."""
        return [self.items[p] for p in subset_with_sum(self.prefix, self.sizes, target)]
