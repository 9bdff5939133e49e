"""What a plan is asked for: :class:`PlanSpec` (the row, the vision budget, the step
structure, the seed, what an overlong sample gets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from energon_pack.checks import check_choice, check_config, check_int
from energon_pack.packing.row_layout import RowLayout
from energon_pack.packing.vision_budget import VisionBudget

PlanOverlong = Literal["error", "skip"]


@dataclass(frozen=True)
class PlanSpec:
    """The settings of a whole-dataset plan; :func:`~energon_pack.plan.plan_dataset` records
    them in ``plan.json`` and refuses a plan directory built with others.

    Args:
        layout: the packed row (:class:`~energon_pack.RowLayout`: ``seq_length``,
            ``pad_to_multiple_of``, ...); each member counts its padded length.
        vision: per-pack caps (``max_vision_tokens``, ``max_media``) and ``balance``: with
            balance on, each global step's packs are spread over the data-parallel ranks so
            that their vision tokens are as even as the packs allow.
        data_parallel_size: ranks that train one pack each per micro-step (micro-batch 1).
        global_batch_size: packs per optimizer step (a multiple of ``data_parallel_size``;
            default ``data_parallel_size``).
        seed: the order of the steps is shuffled with this seed (deterministic).
        overlong: a sample that fits no row, or alone over a vision cap: ``"skip"``
            (default) counts it and lists its key in ``plan.json``; ``"error"`` stops.
    """

    layout: RowLayout
    vision: VisionBudget = field(default_factory=VisionBudget)
    data_parallel_size: int = 1
    global_batch_size: int | None = None
    seed: int = 0
    overlong: PlanOverlong = "skip"

    def __post_init__(self) -> None:
        if not isinstance(self.layout, RowLayout):
            raise ValueError(
                f"layout must be a RowLayout, got {self.layout!r}; pass e.g. "
                "PlanSpec(RowLayout(8192, pad_to_multiple_of=8))"
            )
        check_config("vision", self.vision, VisionBudget)
        if self.vision.vision_share is not None:
            raise ValueError(
                f"vision_share={self.vision.vision_share}: a plan balances the packs of the "
                "whole dataset, whose vision share it measures; drop vision_share (it is for "
                "online packing, where each rank sees only its own samples)"
            )
        check_int("data_parallel_size", self.data_parallel_size)
        check_int("global_batch_size", self.global_batch_size, none_ok=True)
        check_int("seed", self.seed, minimum=0)
        check_choice("overlong", self.overlong, ("error", "skip"))
        if self.steps_of % self.data_parallel_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"data_parallel_size={self.data_parallel_size}; each rank trains the same "
                "number of packs per step: pass a multiple"
            )

    @property
    def steps_of(self) -> int:
        """Packs per optimizer step (``global_batch_size``, default ``data_parallel_size``)."""
        return self.global_batch_size or self.data_parallel_size

    def to_json(self) -> dict[str, Any]:
        """Every setting, JSON-able (what ``plan.json`` records and compares)."""
        return {
            "layout": self.layout.fingerprint(),
            "vision": self.vision.settings(),
            "data_parallel_size": self.data_parallel_size,
            "global_batch_size": self.steps_of,
            "seed": self.seed,
            "overlong": self.overlong,
        }
