"""The plan's pack step and step layout: every row in exactly one pack, every pack within the
row and the caps, first fit decreasing's packs where no cap binds, evening out that keeps the
fill, and steps of ``global_batch_size`` packs dealt evenly over the ranks."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import RowLayout, VisionBudget
from energon_pack.packing.bins import first_fit_decreasing, groups_fill
from energon_pack.packing.subset_sums import nearest_sum, prefixes, subset_with_sum
from energon_pack.packing.synthetic import vision_mix
from energon_pack.plan import pack as plan_pack
from energon_pack.plan.first_fit import first_fit_runs
from energon_pack.plan.pack import even_out_vision, lay_out_steps, pack_rows, refill_tail
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
    fewest = -(-sum(RowLayout(304, align).aligned(n) for n in lengths) // 304)
    assert fewest <= len(plain) <= len(ffd)  # without caps the tail may be refilled
    if len(ffd) == fewest:
        assert plain == [sorted(group) for group in ffd]


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=80),
    capacity=st.sampled_from([300, 304, 512]),
)
def test_refilling_the_tail_keeps_every_row_and_never_adds_a_pack(
    lengths: list[int], capacity: int
) -> None:
    ffd = first_fit_decreasing(lengths, capacity)
    refilled = refill_tail([list(group) for group in ffd], lengths, capacity)
    assert sorted(i for group in refilled for i in group) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in group) <= capacity for group in refilled)
    assert -(-sum(lengths) // capacity) <= len(refilled) <= len(ffd)


def test_short_turns_fill_the_fewest_packs_their_tokens_allow() -> None:
    """First fit decreasing leaves the smallest rows in a last pack that no single pack has
    room for; two packs pooled make the room (2,000 rows of 90-590 tokens at seq 8192)."""
    rng = random.Random(1)  # a draw where first fit decreasing needs one pack more
    lengths = [rng.randint(90, 590) for _ in range(2000)]
    layout = RowLayout(8192, 8)
    fewest = -(-sum(layout.aligned(n) for n in lengths) // 8192)
    ffd = first_fit_decreasing(lengths, 8192, align=8)
    none = [0] * len(lengths)
    planned = pack_rows(lengths, none, none, PlanSpec(layout))
    assert len(ffd) == fewest + 1
    assert len(planned) == fewest


@settings(max_examples=300, deadline=None)
@given(
    drawn=rows,
    align=st.sampled_from([1, 8]),
    cap=st.integers(1, 400),
    most=st.integers(3, 6),
    by_share=st.booleans(),
)
def test_first_fit_by_runs_places_every_row_as_first_fit_does_row_by_row(
    drawn: list[tuple[int, int, int]], align: int, cap: int, most: int, by_share: bool
) -> None:
    lengths, vision, media = _columns(drawn)
    padded = [-(-n // align) * align for n in lengths]
    capacity = max(max(padded), 304)
    caps = (capacity, max(cap, max(vision)), max(most, max(media)))
    key = [
        p / caps[0] + v / caps[1] + m / caps[2]
        for p, v, m in zip(padded, vision, media, strict=True)
    ]
    key = key if by_share else lengths
    # the reference: one row at a time, into the first pack with room in every budget
    order = sorted(range(len(drawn)), key=lambda i: (-key[i], vision[i] == media[i] == 0, i))
    expected: list[list[int]] = []
    free: list[list[int]] = []
    for i in order:
        need = (padded[i], vision[i], media[i])
        slot = next(
            (
                s
                for s, room in enumerate(free)
                if all(r >= n for r, n in zip(room, need, strict=True))
            ),
            None,
        )
        if slot is None:
            slot = len(expected)
            expected.append([])
            free.append(list(caps))
        expected[slot].append(i)
        free[slot] = [r - n for r, n in zip(free[slot], need, strict=True)]
    assert first_fit_runs(key, padded, vision, media, caps) == expected


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 500), min_size=1, max_size=300), align=st.sampled_from([1, 8])
)
def test_first_fit_by_runs_is_first_fit_decreasing_on_lengths_alone(
    lengths: list[int], align: int
) -> None:
    padded = [-(-n // align) * align for n in lengths]
    none = [0] * len(lengths)
    grouped = first_fit_runs(lengths, padded, none, none, (512, 1 << 62, 1 << 62))
    assert grouped == first_fit_decreasing(lengths, 512, align=align)


def _even_out_reference(
    groups: list[list[int]], sizes: tuple[list[int], list[int], list[int]], caps: tuple
) -> list[list[int]]:
    """``even_out_vision`` as its docstring states it, every trade tried afresh."""
    padded, vision, media = sizes
    groups = [list(g) for g in groups]
    loads = [[sum(size[i] for i in g) for size in sizes] for g in groups]
    mean = sum(load[1] for load in loads) / len(loads)

    def trade(heavy: int, light: int) -> bool:
        gap = loads[heavy][1] - loads[light][1]
        rows = [i for i in groups[heavy] if vision[i] > 0 and abs(gap - 2 * vision[i]) < gap]
        rows = sorted(rows, key=lambda i: (abs(gap - 2 * vision[i]), i))[: plan_pack._TRIED]
        text = [i for i in groups[light] if vision[i] == 0 and media[i] == 0]
        text_sizes = [padded[i] for i in text]
        for row in rows:
            if loads[light][1] + vision[row] > caps[1] or loads[light][2] + media[row] > caps[2]:
                continue
            low = padded[row] - (caps[0] - loads[light][0])
            high = padded[row] + (caps[0] - loads[heavy][0])
            prefix = prefixes(text_sizes, 1, (1 << (high + 1)) - 1)
            back = nearest_sum(prefix[-1], padded[row], max(low, 0), high)
            if back is None:
                continue
            returned = [text[k] for k in subset_with_sum(prefix, text_sizes, back)]
            groups[heavy].remove(row)
            groups[light].append(row)
            for other in returned:
                groups[light].remove(other)
                groups[heavy].append(other)
            for budget, value in enumerate((padded[row] - back, vision[row], media[row])):
                loads[heavy][budget] -= value
                loads[light][budget] += value
            return True
        return False

    for _ in range(plan_pack.EVEN_PASSES):
        order = sorted(range(len(groups)), key=lambda p: (-loads[p][1], p))
        heavy_side = order[: len(order) // 2]
        moved = False
        for light in reversed(order[len(order) // 2 :]):
            partners = failed = 0
            for heavy in heavy_side[: plan_pack._SCANNED]:
                if (
                    loads[light][1] >= mean
                    or partners == plan_pack._PARTNERS
                    or failed == plan_pack._FAILURES
                ):
                    break
                if loads[heavy][1] <= mean:
                    continue
                traded = False
                while loads[light][1] < mean and trade(heavy, light):
                    traded = True
                partners += traded
                failed += not traded
                moved |= traded
            front = [p for p in heavy_side[: plan_pack._SCANNED] if loads[p][1] > mean]
            heavy_side[: plan_pack._SCANNED] = front
        if not moved:
            break
    return groups


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), count=st.integers(50, 1500))
def test_evening_out_trades_as_its_rules_say(seed: int, count: int) -> None:
    samples = vision_mix(count, seed=seed, cap=4096, text_median=150)
    sizes = (
        [s.length for s in samples],
        [s.vision_tokens for s in samples],
        [s.media for s in samples],
    )
    caps = (4096, max(3000, max(sizes[1])), max(8, max(sizes[2])))
    groups = first_fit_runs(*[sizes[0], *sizes], caps)
    assert even_out_vision(groups, sizes, caps) == _even_out_reference(groups, sizes, caps)


def test_a_row_that_fits_no_pack_is_named_not_packed() -> None:
    with pytest.raises(ValueError, match=r"row 1 \(600 tokens, 0 vision tokens, 0 media\)"):
        first_fit_runs([10, 600], [10, 600], [0, 0], [0, 0], (512, 100, 4))
    with pytest.raises(ValueError, match=r"row 0 \(10 tokens, 101 vision tokens"):
        first_fit_runs([10], [10], [101], [1], (512, 100, 4))


def test_many_rows_are_packed_in_partitions_of_the_same_mix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    samples = vision_mix(5000, seed=5, cap=4096, text_median=150)
    lengths, vision, media = _columns([(s.length, s.vision_tokens, s.media) for s in samples])
    budget = VisionBudget(max_vision_tokens=3000, max_media=8, balance=True)
    kept = [i for i in range(len(lengths)) if budget.fits(vision[i], media[i])]
    columns = [[column[i] for i in kept] for column in (lengths, vision, media)]
    spec = PlanSpec(RowLayout(4096, 8), budget)
    monkeypatch.setattr(plan_pack, "PARTITION_ROWS", 1000)
    groups = pack_rows(*columns, spec)
    count = len(kept)
    assert sorted(i for group in groups for i in group) == list(range(count))
    # each partition (row i in partition i % 4) is packed as its rows alone would be
    monkeypatch.setattr(plan_pack, "PARTITION_ROWS", 10**9)
    expected = []
    for part in range(count // 1000):
        rows = list(range(part, count, count // 1000))
        alone = pack_rows(*[[column[i] for i in rows] for column in columns], spec)
        expected += [sorted(rows[j] for j in group) for group in alone]
    assert groups == expected
    for group in groups:
        assert sum(spec.layout.aligned(columns[0][i]) for i in group) <= 4096
        assert budget.fits(sum(columns[1][i] for i in group), sum(columns[2][i] for i in group))


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
    with pytest.raises(ValueError, match=r"vision_share=0.3: a plan balances .* drop vision_share"):
        PlanSpec(RowLayout(64), VisionBudget(balance=True, vision_share=0.3))
    assert PlanSpec(RowLayout(64), data_parallel_size=4).steps_of == 4
