"""A plan read by Megatron-Bridge 0.6.2's own ``MegatronPretrainingSampler``: at the plan's
data-parallel size (micro-batch 1) it gives every rank the packs ``PlanSampler`` gives it, the
packs the plan assigned to the rank, in the same order. Runs in the Bridge test environment
(``bash scripts/test_bridge.sh``); skipped elsewhere."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bridge.shims import require_bridge

require_bridge()

from megatron.bridge.data.samplers import MegatronPretrainingSampler  # noqa: E402

from energon_pack import RowLayout, VisionBudget  # noqa: E402
from energon_pack.plan import PlanOrder, PlanSampler, PlanSpec  # noqa: E402
from energon_pack.plan.pack import lay_out_steps  # noqa: E402


@pytest.mark.parametrize(("ranks", "per_step", "packs"), [(2, 4, 40), (4, 8, 64), (3, 6, 36)])
def test_megatrons_sampler_trains_each_rank_its_planned_packs(
    ranks: int, per_step: int, packs: int
) -> None:
    random = np.random.default_rng(ranks)
    vision = random.integers(0, 4000, packs).tolist()
    spec = PlanSpec(
        RowLayout(8192),
        VisionBudget(balance=True),
        data_parallel_size=ranks,
        global_batch_size=per_step,
    )
    steps = lay_out_steps(vision, vision, spec)
    order = np.lexsort((steps.rank, steps.micro, steps.step))  # PlannedDataset's order
    plan = PlanOrder(
        steps.step[order],
        steps.rank[order],
        np.asarray(vision)[order],
        ranks,
        per_step,
        balance=True,
        seed=0,
    )
    for rank in range(ranks):
        theirs = list(MegatronPretrainingSampler(packs, 0, 1, rank, ranks))
        ours = list(PlanSampler(plan, rank, ranks))
        assert theirs == ours
        assert [int(plan.rank[i]) for batch in theirs for i in batch] == [rank] * len(theirs)
