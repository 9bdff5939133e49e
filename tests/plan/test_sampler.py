"""``PlanSampler``: Megatron's sampler contract over a plan's packs. At the plan's sizes each
rank trains the packs the plan gave it; resumed from ``consumed_samples`` at another number of
ranks every pack is still trained exactly once per epoch, the packs after the cut are those of
an uninterrupted run at the new size, and the steps stay balanced for the vision encoder."""

from __future__ import annotations

import dataclasses
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import RowLayout, VisionBudget
from energon_pack.plan import PlanOrder, PlanSampler, PlanSpec
from energon_pack.plan.pack import lay_out_steps, straggler_floor, straggler_ratio


def plan_order(
    packs: int, ranks: int, per_step: int, seed: int = 0, balance: bool = True
) -> PlanOrder:
    """The order of ``packs`` packs of a VLM mix's vision loads as a plan lays them out
    (:func:`lay_out_steps`: steps of ``per_step`` over ``ranks``), by step, micro-batch, rank."""
    random = np.random.default_rng(seed)
    vision = (random.lognormal(7.0, 0.6, packs) * (random.random(packs) < 0.8)).astype(np.int64)
    spec = PlanSpec(
        RowLayout(8192),
        VisionBudget(balance=balance),
        data_parallel_size=ranks,
        global_batch_size=per_step,
        seed=seed,
    )
    steps = lay_out_steps(vision.tolist(), vision.tolist(), spec)
    order = np.lexsort((steps.rank, steps.micro, steps.step))
    return PlanOrder(
        step=steps.step[order],
        rank=steps.rank[order],
        vision=vision[order],
        data_parallel_size=ranks,
        global_batch_size=per_step,
        balance=balance,
        seed=seed,
    )


def run(
    order: PlanOrder, ranks: int, consumed: int, steps: int | None = None, **kw: int
) -> list[list[int]]:
    """Each rank's packs from ``consumed`` on, for ``steps`` steps (default: to the epoch's
    end)."""
    out = []
    for rank in range(ranks):
        sampler = PlanSampler(order, rank, ranks, consumed_samples=consumed, **kw)
        per_step = sampler.global_batch_size // (ranks * sampler.micro_batch_size)
        batches = list(sampler)
        if steps is not None:
            batches = batches[: steps * per_step]
        out.append([index for batch in batches for index in batch])
    return out


def test_at_the_plans_size_each_rank_trains_its_planned_packs() -> None:
    order = plan_order(37, ranks=4, per_step=8)
    packs = run(order, 4, 0)
    for rank, mine in enumerate(packs):
        assert mine == [i for i in range(37) if order.rank[i] == rank]
    assert sorted(i for mine in packs for i in mine) == list(range(37))


@settings(max_examples=60, deadline=None)
@given(
    change=st.sampled_from([(4, 2, 8), (2, 3, 6), (1, 4, 8), (4, 3, 12), (3, 3, 6)]),
    packs=st.integers(1, 90),
    cut=st.integers(0, 20),
    seed=st.integers(0, 5),
    micro=st.sampled_from([1, 2]),
)
def test_every_pack_once_across_a_change_of_ranks(
    change: tuple[int, int, int], packs: int, cut: int, seed: int, micro: int
) -> None:
    before, after, per_step = change
    if per_step % (micro * before) or per_step % (micro * after):
        micro = 1
    order = plan_order(packs, before, per_step, seed)
    steps = min(cut, -(-packs // per_step))
    first = run(order, before, 0, steps, micro_batch_size=micro)
    consumed = min(steps * per_step, packs)
    # at the epoch's end the sampler goes on with the next epoch: nothing is left of this one
    rest = run(order, after, consumed, micro_batch_size=micro) if consumed < packs else []
    trained = [i for mine in first + rest for i in mine]
    assert sorted(trained) == list(range(packs))  # exactly once in the epoch
    uninterrupted = run(order, after, 0, micro_batch_size=micro)
    for rank in range(len(rest)):  # after the cut, as if the run had always had `after` ranks
        assert rest[rank] == uninterrupted[rank][len(uninterrupted[rank]) - len(rest[rank]) :]


def test_a_cut_after_every_step_resumes_exactly() -> None:
    order = plan_order(50, ranks=4, per_step=8, seed=1)
    for step in range(8):
        for ranks in (2, 4, 8):
            first = run(order, 4, 0, step)
            rest = run(order, ranks, step * 8) if step * 8 < 50 else []
            assert sorted(i for mine in first + rest for i in mine) == list(range(50))


def test_regrouped_steps_stay_balanced_for_the_vision_encoder() -> None:
    for before, after, per_step in ((4, 2, 8), (2, 3, 6), (1, 4, 8), (8, 4, 16), (2, 8, 16)):
        order = plan_order(600, before, per_step, seed=before * 10 + after)
        sampler = PlanSampler(order, 0, after)
        windows = [order.steps()[k] for k in range(len(order.steps()))]
        loads, largest = [], []
        for window in windows:
            if len(window) < per_step:
                continue
            dealt = sampler.step_packs(window)
            assert sorted(len(p) for p in dealt) == [per_step // after] * after
            loads.append([float(sum(order.vision[i] for i in p)) for p in dealt])
            largest.append([float(max((order.vision[i] for i in p), default=0)) for p in dealt])
        ratio, floor = straggler_ratio(loads), straggler_floor(largest, loads)
        assert ratio <= floor + 0.05, (before, after, ratio, floor)


def test_epochs_reshuffle_the_steps_and_count_consumed_samples() -> None:
    order = plan_order(45, ranks=2, per_step=4, seed=2)
    samplers = [PlanSampler(order, rank, 2) for rank in range(2)]
    epochs = []
    for _ in range(3):
        lengths = [len(s) for s in samplers]
        batches = [list(s) for s in samplers]
        assert [len(b) for b in batches] == lengths
        epochs.append(sorted(i for b in batches for batch in b for i in batch))
    assert all(epoch == list(range(45)) for epoch in epochs)
    assert [s.consumed_samples for s in samplers] == [135, 135]
    zero, one = samplers[0].epoch_order(0), samplers[0].epoch_order(1)
    assert zero != one
    steps = {tuple(step) for step in order.steps()}
    assert {tuple(one[k : k + 4]) for k in range(0, 44, 4)} == steps - {(44,)}
    assert one[-1] == 44  # the short last step stays last
    assert PlanSampler(order, 0, 2).epoch_order(1) == one  # from the plan's seed


def test_bad_sizes_are_refused_by_name() -> None:
    order = plan_order(10, ranks=2, per_step=4)
    with pytest.raises(ValueError, match="data_parallel_rank=2 is not below data_parallel_size=2"):
        PlanSampler(order, 2, 2)
    with pytest.raises(ValueError, match="global_batch_size=4 is not a multiple"):
        PlanSampler(order, 0, 3)
    with pytest.raises(ValueError, match="micro_batch_size"):
        PlanSampler(order, 0, 1, micro_batch_size=0)


def test_balance_off_deals_in_turn() -> None:
    order = plan_order(16, ranks=4, per_step=8, balance=False)
    packs = run(order, 2, 0)
    assert packs[0][:4] == [0, 2, 4, 6]
    assert statistics.mean(len(p) for p in packs) == 8


def test_a_regrouped_step_deals_the_heaviest_packs_to_the_least_loaded_ranks() -> None:
    order = PlanOrder(
        step=np.zeros(4, dtype=np.int64),
        rank=np.arange(4) % 4,
        vision=np.asarray([100, 90, 10, 0]),
        data_parallel_size=4,
        global_batch_size=4,
        balance=True,
        seed=0,
    )
    dealt = PlanSampler(order, 0, 2).step_packs([0, 1, 2, 3])
    assert dealt == [[0, 3], [1, 2]]  # 100 + 0 and 90 + 10, where in turn gives 110 and 90
    unbalanced = dataclasses.replace(order, balance=False)
    assert PlanSampler(unbalanced, 0, 2).step_packs([0, 1, 2, 3]) == [[0, 2], [1, 3]]
