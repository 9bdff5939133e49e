"""The rows of one micro-batch (the collator's packing): which samples share a row, within the
row's tokens, its segment slots and the vision budget. Pure Python, no torch.

One row where every sample fits it together; otherwise the fewest rows
(:func:`~energon_pack.packing.bins.fewest_bins`), and with ``balance`` the same number of rows
with their vision tokens spread evenly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from energon_pack.packing.bins import Limit, fewest_bins
from energon_pack.packing.vision_budget import VisionBudget

BALANCE_STEP = 1.05
"""With ``balance``: each try loosens the even share of vision tokens per row by this factor."""


@dataclass(frozen=True)
class Weight:
    """What one sample of the micro-batch weighs."""

    key: str
    length: int
    """Real tokens."""
    units: int
    """Tokens after alignment, in units of ``pad_to_multiple_of``."""
    vision_tokens: int
    media: int


def row_groups(
    weights: Sequence[Weight],
    capacity: int,
    budget: VisionBudget,
    *,
    max_items: int | None,
) -> list[list[int]]:
    """Indices of the samples of each row (``capacity`` in units): rows by first sample,
    samples in micro-batch order."""
    named = _limits(weights, budget)
    limits = [limit for limit, _ in named]
    units = [w.units for w in weights]
    groups = fewest_bins(units, capacity, max_items=max_items, limits=limits)
    if budget.balance and len(groups) > 1:
        media = [limit for limit, name in named if name == "max_media"]
        groups = _balanced(weights, capacity, media, groups, max_items)
    return sorted(sorted(group) for group in groups)


def _limits(weights: Sequence[Weight], budget: VisionBudget) -> list[tuple[Limit, str]]:
    """The caps of ``budget`` as :func:`fewest_bins` limits, with their setting names."""
    out: list[tuple[Limit, str]] = []
    if budget.max_vision_tokens is not None:
        out.append(
            (([w.vision_tokens for w in weights], budget.max_vision_tokens), "max_vision_tokens")
        )
    if budget.max_media is not None:
        out.append((([w.media for w in weights], budget.max_media), "max_media"))
    return out


def _balanced(
    weights: Sequence[Weight],
    capacity: int,
    media: list[Limit],
    groups: list[list[int]],
    max_items: int | None,
) -> list[list[int]]:
    """As many rows as ``groups``, with the most vision tokens in one row as low as a few
    tighter vision caps find (from the even share up, by :data:`BALANCE_STEP`), within the
    ``media`` limit."""
    vision = [w.vision_tokens for w in weights]
    units = [w.units for w in weights]
    most = max(sum(vision[i] for i in group) for group in groups)
    tight = max(math.ceil(sum(vision) / len(groups)), max(vision))
    while tight < most:
        found = fewest_bins(units, capacity, max_items=max_items, limits=[(vision, tight), *media])
        if len(found) == len(groups):
            return found
        tight = math.ceil(tight * BALANCE_STEP)
    return groups
