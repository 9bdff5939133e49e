"""The plan's pack step and step layout: every row in exactly one pack, every pack within the
row and the caps, first fit decreasing's packs where no cap binds, evening out that keeps the
fill, and steps of ``global_batch_size`` packs dealt evenly over the ranks."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import RowLayout, VisionBudget
from energon_pack.packing.bins import first_fit_decreasing, groups_fill
from energon_pack.packing.synthetic import vision_mix
from energon_pack.plan.pack import even_out_vision, lay_out_steps, pack_rows
from energon_pack.plan.spec import PlanSpec

rows = st.lists(
    st.tuples(st.integers(1, 300), st.integers(0, 120), st.integers(0, 3)), min_size=1, max_size=80
)


def _columns(drawn: list[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
    return [r[0] for r in drawn], [r[1] for r in drawn], [r[2] for r in drawn]


@settings(max_examples=200, deadline=None)
@given(
    drawn=rows,
    align=st.sampled_from([1, 8]),
    cap=st.one_of(st.none(), st.integers(120, 400)),
    most=st.one_of(st.none(), st.integers(3, 6)),
    balance=st.booleans(),
)
def test_every_row_once_and_every_pack_within_the_budgets(
    drawn: list[tuple[int, int, int]],
    align: int,
    cap: int | None,
    most: int | None,
    balance: bool,
) -> None:
    lengths, vision, media = _columns(drawn)
    spec = PlanSpec(RowLayout(304, align), VisionBudget(cap, most, balance))
    groups = pack_rows(lengths, vision, media, spec)
    assert sorted(i for group in groups for i in group) == list(range(len(drawn)))
    for group in groups:
        assert group == sorted(group)
        assert sum(spec.layout.aligned(lengths[i]) for i in group) <= spec.layout.capacity
        assert cap is None or sum(vision[i] for i in group) <= cap
        assert most is None or sum(media[i] for i in group) <= most


@settings(max_examples=100, deadline=None)
@given(drawn=rows, align=st.sampled_from([1, 8]))
def test_caps_that_never_bind_give_first_fit_decreasings_packs(
    drawn: list[tuple[int, int, int]], align: int
) -> None:
    lengths, vision, media = _columns(drawn)
    loose = PlanSpec(RowLayout(304, align), VisionBudget(max_vision_tokens=10**6, max_media=10**6))
    ffd = first_fit_decreasing(lengths, 304, align=align)
    assert len(pack_rows(lengths, vision, media, loose)) == len(ffd)
    plain = pack_rows(lengths, vision, media, PlanSpec(RowLayout(304, align)))
    assert plain == [sorted(group) for group in ffd]


def test_evening_out_narrows_the_vision_spread_and_keeps_every_pack() -> None:
    samples = vision_mix(3000, seed=3, cap=16384, text_median=150)
    lengths = [s.length for s in samples]
    vision = [s.vision_tokens for s in samples]
    media = [s.media for s in samples]
    caps = (16384, 1 << 40, 1 << 40)
    before = [sorted(g) for g in first_fit_decreasing(lengths, 16384)]
    after = even_out_vision(before, (lengths, vision, media), caps)
    assert len(after) == len(before)
    assert sorted(i for g in after for i in g) == list(range(len(samples)))
    assert all(sum(lengths[i] for i in g) <= 16384 for g in after)
    assert groups_fill(after, lengths, 16384) == groups_fill(before, lengths, 16384)

    def spread(groups: list[list[int]]) -> int:
        loads = sorted(sum(vision[i] for i in g) for g in groups)
        return loads[-1 - len(loads) // 20] - loads[len(loads) // 20]  # 5th to 95th percentile

    assert spread(after) < spread(before) / 3


@settings(max_examples=100, deadline=None)
@given(
    loads=st.lists(st.integers(0, 5000), min_size=1, max_size=60),
    ranks=st.sampled_from([1, 2, 4]),
    per_rank=st.integers(1, 3),
    balance=st.booleans(),
    seed=st.integers(0, 3),
)
def test_steps_hold_global_batch_size_packs_dealt_evenly_over_the_ranks(
    loads: list[int], ranks: int, per_rank: int, balance: bool, seed: int
) -> None:
    spec = PlanSpec(
        RowLayout(64),
        VisionBudget(balance=balance),
        data_parallel_size=ranks,
        global_batch_size=ranks * per_rank,
        seed=seed,
    )
    layout = lay_out_steps(loads, loads, spec)
    steps = Counter(layout.step.tolist())
    full, last = divmod(len(loads), spec.steps_of)
    assert sorted(steps) == list(range(math.ceil(len(loads) / spec.steps_of)))
    assert [steps[s] for s in range(full)] == [spec.steps_of] * full
    if last:
        assert steps[full] == last
    places = Counter(
        zip(layout.step.tolist(), layout.rank.tolist(), layout.micro.tolist(), strict=True)
    )
    assert max(places.values()) == 1  # no two packs at one place
    for step in range(full):
        ranks_of = Counter(r for s, r in zip(layout.step, layout.rank, strict=True) if s == step)
        assert ranks_of == dict.fromkeys(range(ranks), per_rank)
    again = lay_out_steps(loads, loads, spec)
    assert again.step.tolist() == layout.step.tolist()
    assert again.rank.tolist() == layout.rank.tolist()


def test_balanced_steps_reach_the_floor_where_the_unbalanced_do_not() -> None:
    samples = vision_mix(6000, seed=1, cap=16384, text_median=150)
    lengths = [s.length for s in samples]
    vision = [s.vision_tokens for s in samples]
    media = [s.media for s in samples]
    results = {}
    for balance in (False, True):
        spec = PlanSpec(RowLayout(16384), VisionBudget(balance=balance), data_parallel_size=8)
        groups = pack_rows(lengths, vision, media, spec)
        pack_vision = [sum(vision[i] for i in g) for g in groups]
        largest = [max(vision[i] for i in g) for g in groups]
        results[balance] = lay_out_steps(pack_vision, largest, spec)
    assert results[True].straggler <= results[True].floor + 0.02
    assert results[False].straggler > results[False].floor + 0.2


def test_spec_errors_name_the_setting_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"layout must be a RowLayout.*PlanSpec\(RowLayout"):
        PlanSpec(8192)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"global_batch_size=6 is not a multiple of"):
        PlanSpec(RowLayout(64), data_parallel_size=4, global_batch_size=6)
    with pytest.raises(ValueError, match=r"overlong must be 'error' or 'skip'"):
        PlanSpec(RowLayout(64), overlong="truncate")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"data_parallel_size"):
        PlanSpec(RowLayout(64), data_parallel_size=0)
    assert PlanSpec(RowLayout(64), data_parallel_size=4).steps_of == 4
