from __future__ import annotations

import copy
import itertools
import logging
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import assert_restore_at_every_step_is_invisible, assert_resume_equivalent
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import (
    Bin,
    BufferConfig,
    OnlineBinPacker,
    best_fit_decreasing,
    first_fit_decreasing,
)
from energon_pack.packing.bins import aligned_length, fewest_bins, groups_fill


# ------------------------------------------------------------------------------------- offline
def _optimal_bins(lengths: list[int], capacity: int) -> int:
    """Fewest bins, by brute force over assignments (tiny inputs only)."""
    best = len(lengths)

    def place(index: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if index == len(lengths):
            best = len(loads)
            return
        for slot in range(len(loads)):
            if loads[slot] + lengths[index] <= capacity:
                loads[slot] += lengths[index]
                place(index + 1, loads)
                loads[slot] -= lengths[index]
        place(index + 1, [*loads, lengths[index]])

    place(0, [])
    return best


OFFLINE = [best_fit_decreasing, first_fit_decreasing]


@pytest.mark.parametrize("pack", OFFLINE)
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=9),
    capacity=st.integers(20, 30),
)
def test_offline_is_a_partition_within_the_ffd_bound(
    pack: Callable[..., list[list[int]]], lengths: list[int], capacity: int
) -> None:
    groups = pack(lengths, capacity)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= capacity for g in groups)
    assert len(groups) <= 11 / 9 * _optimal_bins(lengths, capacity) + 1


@pytest.mark.parametrize("pack", OFFLINE)
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 100), min_size=1, max_size=60),
    align=st.integers(1, 8),
)
def test_offline_respects_alignment(
    pack: Callable[..., list[list[int]]], lengths: list[int], align: int
) -> None:
    capacity = 128
    groups = pack(lengths, capacity, align=align)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(aligned_length(lengths[i], align) for i in g) <= capacity for g in groups)


def test_best_fit_puts_an_item_in_the_fullest_bin_it_fits() -> None:
    # Decreasing order: 6 (bin 0), 5 (bin 1), 4 -> bin 0 (free 4) not bin 1 (free 5).
    assert best_fit_decreasing([4, 6, 5], 10) == [[1, 0], [2]]
    # First fit puts 4 in the first bin that has room: bin 0 too; 1 then goes to bin 1.
    assert first_fit_decreasing([4, 6, 5, 1], 10) == [[1, 0], [2, 3]]
    assert best_fit_decreasing([4, 6, 5, 1], 10) == [[1, 0], [2, 3]]
    assert best_fit_decreasing([3, 7, 2], 9) == [[1, 2], [0]]
    assert first_fit_decreasing([3, 7, 2], 9) == [[1, 2], [0]]


def test_offline_scales_to_many_items() -> None:
    lengths = [(i * 7919) % 4000 + 1 for i in range(200_000)]
    groups = best_fit_decreasing(lengths, 8192)
    assert groups_fill(groups, lengths, 8192) > 0.99


@pytest.mark.parametrize("pack", OFFLINE)
def test_offline_rejects_overlong_and_bad_input(pack: Callable[..., list[list[int]]]) -> None:
    with pytest.raises(ValueError, match=r"sample 1 has 11 tokens .* above seq_length=10"):
        pack([3, 11], 10)
    with pytest.raises(ValueError, match=r"12 after padding to a multiple of 4"):
        pack([9], 10, align=4)
    with pytest.raises(ValueError, match="length must be a positive int"):
        pack([0], 10)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        pack([1], 0)


# -------------------------------------------------------------------------------------- online
class Run:
    """Pushes a stream through a packer and checks the invariants at every step."""

    def __init__(self, packer: OnlineBinPacker) -> None:
        self.packer = packer
        self.bins: list[Bin] = []
        self.emitted_before: dict[int, int] = {}
        self.lengths: dict[int, int] = {}

    def push(self, key: int, length: int, nbytes: int = 0) -> list[Bin]:
        self.emitted_before[key] = len(self.bins)
        self.lengths[key] = length
        out = self.packer.push(key, length, nbytes=nbytes)
        self.bins += out
        packer = self.packer
        assert packer.held < packer.max_held
        if packer.held >= packer.buffer_size:  # grown: it holds less than min_rows rows' worth
            assert packer.min_rows is not None
            assert sum(packer.units) < packer.min_rows * packer.cap_units
        if self.packer.max_bytes is not None:
            assert self.packer.held_bytes <= self.packer.max_bytes
        return out

    def flush(self) -> list[Bin]:
        out = self.packer.flush()
        self.bins += out
        assert self.packer.held == 0
        return out

    def waits(self) -> dict[int, int]:
        return {
            key: index - self.emitted_before[key]
            for index, b in enumerate(self.bins)
            for key in b.keys
        }


packer_settings = st.fixed_dictionaries(
    {
        "capacity": st.integers(8, 120),
        "buffer_size": st.integers(1, 24),
        "align": st.integers(1, 8),
        "max_wait": st.one_of(st.none(), st.integers(0, 6)),
        "min_fill": st.sampled_from([0.5, 0.9, 0.99, 1.0]),
        "max_bytes": st.one_of(st.none(), st.integers(1, 400)),
        "min_rows": st.one_of(st.none(), st.sampled_from([0.5, 1.0, 2.0])),
        "max_size": st.integers(1, 40),
    }
)


Scenario = tuple[dict[str, Any], list[tuple[int, int]]]


def packer_of(config: dict[str, Any], **options: Any) -> OnlineBinPacker:
    """The packer of a drawn flat config (its buffer settings as one BufferConfig)."""
    buffer = BufferConfig(
        config["max_wait"],
        config["min_fill"],
        config["max_bytes"],
        min_rows=config["min_rows"],
        max_size=config["max_size"],
    )
    size, align = config["buffer_size"], config["align"]
    return OnlineBinPacker(config["capacity"], size, align=align, buffer=buffer, **options)


RESUME_EXAMPLES = int(os.environ.get("RESUME_EXAMPLES", "1000"))
"""Examples of the restore-at-every-push property (raise it for a longer fuzz run)."""


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Packer settings and a stream of (length, nbytes); some lengths are overlong."""
    config = draw(packer_settings)
    capacity = config["capacity"]
    item = st.tuples(st.integers(1, capacity + capacity // 4), st.integers(0, 100))
    size = draw(st.integers(0, 120), label="stream length")  # long streams as often as short
    return config, draw(st.lists(item, min_size=size, max_size=size))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_online_invariants(scenario: Scenario) -> None:
    config, stream = scenario
    run = Run(packer_of(config, overlong="skip"))
    for key, (length, nbytes) in enumerate(stream):
        run.push(key, length, nbytes)
    run.flush()
    lengths = [length for length, _ in stream]

    capacity, align = config["capacity"], config["align"]
    accepted = [k for k, n in enumerate(lengths) if aligned_length(n, align) <= capacity]
    emitted = Counter(key for b in run.bins for key in b.keys)
    assert emitted == Counter(accepted), "every accepted key leaves exactly once"
    assert run.packer.stats.rejected == len(lengths) - len(accepted)
    for b in run.bins:
        assert b.keys, "no empty bins"
        assert list(b.keys) == sorted(b.keys), "keys in stream order"
        assert b.lengths == tuple(run.lengths[k] for k in b.keys)
        assert b.used == sum(aligned_length(n, align) for n in b.lengths) <= capacity
    if config["max_wait"] is not None:
        assert max(run.waits().values(), default=0) <= config["max_wait"]
    stats = run.packer.stats
    assert stats.bins == len(run.bins)
    assert stats.items == len(accepted)
    assert stats.max_wait == max(run.waits().values(), default=0)
    assert sum(stats.emitted_by.values()) == stats.bins


def _holding_after_each_push(scenario: Scenario) -> Iterator[OnlineBinPacker]:
    """The packer of ``scenario`` (with ``max_wait``, 2 where it has none) after each push that
    leaves it holding candidates."""
    config, stream = scenario
    if config["max_wait"] is None:
        config = {**config, "max_wait": 2}
    packer = packer_of(config, overlong="skip")
    for key, (length, nbytes) in enumerate(stream):
        packer.push(key, length, nbytes=nbytes)
        if packer.held:
            yield packer


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_whether_the_deadlines_are_late_unless_some_leave_is_known_after_every_push(
    scenario: Scenario,
) -> None:
    """The packer keeps that answer until a bin leaves (a push never makes the deadline bins
    late); it must equal the schedule checked afresh, whatever the pushes since."""
    for packer in _holding_after_each_push(scenario):
        assert packer._late_unless_some_leave() is (not packer._schedulable([]))


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_the_earliest_deadline_bin_is_known_after_every_push(scenario: Scenario) -> None:
    """The packer keeps the earliest-deadline bin's members until a bin leaves (a push adds to
    a bin without changing its oldest member, or opens the latest); they must equal the bin
    found afresh, whatever the pushes since."""
    for packer in _holding_after_each_push(scenario):
        bins = packer._deadline_bins
        urgent = min(bins, key=lambda b: (bins[b].members[0].pushed_at, b))
        want = [i for i, c in enumerate(packer.candidates) if c.deadline_bin == urgent]
        assert packer._urgent() == want


def _push_steps(stream: list[tuple[int, int]]) -> list[Callable[[OnlineBinPacker], Any]]:
    """Push every (length, nbytes) of ``stream`` under its index, flush, read the stats."""
    steps: list[Callable[[OnlineBinPacker], Any]] = [
        (lambda p, k=k, n=n, b=b: p.push(k, n, nbytes=b)) for k, (n, b) in enumerate(stream)
    ]
    steps.append(lambda p: p.flush())
    steps.append(lambda p: p.stats)
    return steps


@settings(max_examples=RESUME_EXAMPLES, deadline=None)
@given(scenarios())
def test_online_restore_at_every_push_index(scenario: Scenario) -> None:
    config, stream = scenario
    assert_restore_at_every_step_is_invisible(
        lambda: packer_of(config, overlong="skip"),
        _push_steps(stream),
        save=OnlineBinPacker.state_dict,
        load=OnlineBinPacker.load_state_dict,
    )


@settings(max_examples=150, deadline=None)
@given(scenario=scenarios(), data=st.data())
def test_online_resume_gives_the_same_remaining_bins(
    scenario: Scenario, data: st.DataObject
) -> None:
    config, stream = scenario
    steps = _push_steps(stream)
    at = data.draw(st.integers(0, len(steps) - 1), label="resume at")
    assert_resume_equivalent(
        lambda: packer_of(config, overlong="skip"),
        steps,
        at,
        save=OnlineBinPacker.state_dict,
        load=OnlineBinPacker.load_state_dict,
    )


def test_resume_where_best_fit_ties_between_deadline_bins() -> None:
    """A stream where restoring the deadline bins in held order changed later bins."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 1000) for _ in range(1000)]
    steps = _push_steps([(length, 0) for length in lengths])
    assert_resume_equivalent(
        lambda: OnlineBinPacker(1024, 64, align=8),
        steps,
        150,
        save=OnlineBinPacker.state_dict,
        load=OnlineBinPacker.load_state_dict,
    )


def test_resume_while_bins_are_carried_over() -> None:
    """A resume point where the buffer holds under-filled candidates that leave later."""
    lengths = [700, 600, 500, 250, 200, 150, 990, 10, 400, 600]
    packer = OnlineBinPacker(1000, 8, buffer=BufferConfig(max_wait=None))
    for key, length in enumerate(lengths[:4]):
        assert packer.push(key, length) == []
    assert packer.held == 4
    steps = [(lambda p, k=k, n=n: p.push(k, n)) for k, n in enumerate(lengths)]
    steps.append(lambda p: p.flush())
    assert_resume_equivalent(
        lambda: OnlineBinPacker(1000, 8, buffer=BufferConfig(max_wait=None)),
        steps,
        4,
        save=OnlineBinPacker.state_dict,
        load=OnlineBinPacker.load_state_dict,
    )


def test_deterministic_across_instances() -> None:
    lengths = [(i * 2654435761) % 3000 + 1 for i in range(3000)]

    def bins() -> list[Bin]:
        packer = OnlineBinPacker(8192, 16, align=8)
        out = [b for k, n in enumerate(lengths) for b in packer.push(k, n)]
        return out + packer.flush()

    assert bins() == bins()


def test_full_bins_leave_early_and_under_filled_ones_are_carried() -> None:
    packer = OnlineBinPacker(100, 10, buffer=BufferConfig(max_wait=None, min_fill=1.0))
    assert packer.push("a", 60) == []
    assert packer.push("b", 30) == []  # 90 of 100: carried over
    out = packer.push("c", 40)  # a+c = 100: leaves at once, b stays
    assert [b.keys for b in out] == [("a", "c")]
    assert out[0].fill == 1.0
    assert packer.held_keys == ["b"]
    assert packer.stats.emitted_by["fill"] == 1


def test_full_buffer_emits_the_fullest_subset() -> None:
    packer = OnlineBinPacker(
        100, 3, buffer=BufferConfig(max_wait=None, min_fill=1.0, min_rows=None)
    )
    packer.push("a", 50)
    packer.push("b", 45)
    out = packer.push("c", 30)
    assert [b.keys for b in out] == [("a", "b")]  # 95 beats 80 and 75
    assert packer.stats.emitted_by["buffer"] == 1


def test_byte_bound_emits_before_the_count_bound() -> None:
    packer = OnlineBinPacker(
        100, 10, buffer=BufferConfig(max_wait=None, min_fill=1.0, max_bytes=1000)
    )
    assert packer.push("a", 10, nbytes=600) == []
    out = packer.push("b", 10, nbytes=600)
    assert [b.keys for b in out] == [("a", "b")]
    assert packer.held_bytes == 0
    with pytest.raises(ValueError, match="nbytes must be an int >= 0"):
        packer.push("c", 10, nbytes=-1)


def test_buffer_size_one_emits_every_sample_alone() -> None:
    packer = OnlineBinPacker(100, 1)
    assert [b.keys for b in packer.push("a", 10)] == [("a",)]
    assert [b.keys for b in packer.push("b", 10)] == [("b",)]


def test_max_wait_bounds_starvation() -> None:
    # A 9-token item never fits well with 5s; unbounded it would wait until flush.
    lengths = [9] + [5] * 200
    starving = OnlineBinPacker(10, 8, buffer=BufferConfig(max_wait=None, min_fill=1.0))
    bounded = Run(OnlineBinPacker(10, 8, buffer=BufferConfig(max_wait=3, min_fill=1.0)))
    for key, length in enumerate(lengths):
        starving.push(key, length)
        bounded.push(key, length)
    assert 0 in starving.held_keys
    bounded.flush()
    assert bounded.waits()[0] <= 3
    assert bounded.packer.stats.emitted_by["deadline"] >= 1


def test_stats_figures() -> None:
    packer = OnlineBinPacker(16, 4, align=4, buffer=BufferConfig(max_wait=None, min_fill=1.0))
    packer.push("a", 5)  # aligned 8
    packer.push("b", 7)  # aligned 8 -> a+b = 16 leaves
    packer.push("c", 3)  # aligned 4
    packer.flush()
    stats = packer.stats
    assert (stats.bins, stats.items, stats.rejected) == (2, 3, 0)
    assert stats.bin_fill == pytest.approx((16 + 4) / 32)
    assert stats.token_efficiency == pytest.approx(15 / 20)
    assert stats.items_per_bin == 1.5
    assert stats.mean_wait == 0.0


def test_overlong_error_names_key_length_and_capacity() -> None:
    packer = OnlineBinPacker(100, 4)
    with pytest.raises(ValueError, match=r"sample 'big' has 101 tokens .* seq_length=100"):
        packer.push("big", 101)
    assert packer.held == 0


def test_overlong_skip_counts_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    packer = OnlineBinPacker(100, 4, overlong="skip")
    with caplog.at_level(logging.WARNING, logger="energon_pack.packing"):
        assert packer.push("big", 200) == []
        packer.push("ok", 50)
    assert packer.stats.rejected == 1
    assert [r.getMessage().count("'big'") for r in caplog.records] == [1]
    assert [b.keys for b in packer.flush()] == [("ok",)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": 0, "buffer_size": 4}, "capacity must be a positive int"),
        ({"capacity": 10, "buffer_size": 0}, r"buffer_size \(packing_buffer_size\)"),
        ({"capacity": 10, "buffer_size": 4, "align": 16}, "align=16 is larger than capacity"),
        ({"capacity": 10, "buffer_size": 4, "max_wait": -1}, "max_wait must be None or"),
        ({"capacity": 10, "buffer_size": 4, "overlong": "drop"}, "overlong must be"),
        ({"capacity": 10, "buffer_size": 4, "min_fill": 0}, "min_fill must be in"),
        ({"capacity": 10, "buffer_size": 4, "max_bytes": 0}, r"max_bytes \(packing_buffer_bytes\)"),
    ],
)
def test_bad_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OnlineBinPacker(**kwargs)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "7"])
def test_bad_length(bad: Any) -> None:
    with pytest.raises(ValueError, match="sample 'k': length must be a positive int"):
        OnlineBinPacker(10, 4).push("k", bad)


def test_bad_key() -> None:
    with pytest.raises(ValueError, match="key must be a str or int"):
        OnlineBinPacker(10, 4).push(("a", 1), 3)  # type: ignore[arg-type]


def test_restore_refuses_other_settings() -> None:
    state = OnlineBinPacker(100, 4).state_dict()
    with pytest.raises(ValueError, match=r"saved with capacity=100 .* capacity=200"):
        OnlineBinPacker(200, 4).load_state_dict(state)
    with pytest.raises(ValueError, match="state version"):
        OnlineBinPacker(100, 4).load_state_dict({**state, "version": 99})


def test_targets_on_the_vlm_mix() -> None:
    """The fill the README promises, on a seeded VLM-like stream (the benchmark has timings)."""
    from energon_pack.packing.synthetic import vlm_lengths

    lengths = vlm_lengths(3000, seed=3)
    for buffer_size, target in [(16, 0.99), (64, 0.995)]:
        packer = OnlineBinPacker(8192, buffer_size)
        for key, length in zip(itertools.count(), lengths):
            packer.push(key, length)
        packer.flush()
        assert packer.stats.bin_fill >= target


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=8),
    capacity=st.integers(20, 30),
)
def test_fewest_bins_is_optimal_on_small_inputs(lengths: list[int], capacity: int) -> None:
    groups = fewest_bins(lengths, capacity)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= capacity for g in groups)
    assert len(groups) == _optimal_bins(lengths, capacity)


def _held_state() -> dict[str, Any]:
    """A state with three held candidates (max_wait 4, capacity 100, align 4)."""
    packer = OnlineBinPacker(100, 8, align=4, buffer=BufferConfig(max_wait=4, min_fill=1.0))
    for key, length in enumerate([50, 30, 7]):
        packer.push(key, length, nbytes=10)
    assert packer.held == 3
    return packer.state_dict()


def _with(state: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(state)
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is _DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


_DROP = object()

TAMPERED = [
    (("held", 1, 1), -1, r"held\[1\]\.length=-1 must be an int in \[1, 100\]"),
    (("held", 1, 1), 0, r"held\[1\]\.length=0 must be"),
    (("held", 1, 1), 101, r"held\[1\]\.length=101 must be an int in \[1, 100\]"),
    (("held", 1, 1), "30", r"held\[1\]\.length='30' must be an int"),
    (("held", 1, 1), 2**70, r"held\[1\]\.length=\d+ must be"),
    (("held", 1, 0), 0, r"held\[1\]\.key=0 must be unique"),
    (("held", 1, 0), None, r"held\[1\]\.key=None must be a str or int"),
    (("held", 1, 0), True, r"held\[1\]\.key=True must be a str or int"),
    (("held", 1, 2), -3, r"held\[1\]\.pushed_at=-3 must be"),
    (("held", 1, 3), 99, r"held\[1\]\.deadline_bin=99 must be"),
    (("held", 1, 4), -5, r"held\[1\]\.nbytes=-5 must be"),
    (("held", 1), [1, 30, 0], r"held\[1\]=\[1, 30, 0\] must be \[key, length"),
    (("held",), None, r"held=None must be a list"),
    (("held",), [[k, 1, 0, 0, 0] for k in range(1024)], r"len\(held\)=1024 must be below 1024"),
    (("emitted",), -1, r"emitted=-1 must be an int"),
    (("emitted",), 1.0, r"emitted=1.0 must be an int"),
    (("next_deadline_bin",), None, r"next_deadline_bin=None must be an int"),
    (("deadline_bins",), [0, 0], r"deadline_bins=\[0, 0\] must list each deadline bin"),
    (("deadline_bins",), "0", r"deadline_bins='0' must be a list of ints"),
    (("stats", "bins"), 5, r"stats\.bins=5 must equal emitted=0"),
    (("stats", "items"), "0", r"stats\.items='0' must be an int"),
    (("stats", "emitted_by", "fill"), -1, r"stats\.emitted_by\.fill=-1 must be"),
    (("stats", "emitted_by", "late"), 0, r"stats\.emitted_by must have the keys .*'late'"),
    (("stats", "capacity"), 50, r"stats\.capacity=50 must be capacity=100"),
    (("stats", "total_wait"), _DROP, r"stats must have the keys .*missing \['total_wait'\]"),
    (("stats",), [], r"stats must be a dict"),
    (("settings",), None, r"settings must be a dict"),
    (("settings", "align"), True, r"was saved with align=True but this packer has align=4"),
    (("held", 0, 0), "k", None),  # a str key is fine
]


@pytest.mark.parametrize(("path", "value", "message"), TAMPERED)
def test_a_tampered_packer_state_is_refused_by_field_and_changes_nothing(
    path: tuple[Any, ...], value: Any, message: str | None
) -> None:
    state = _with(_held_state(), path, value)
    packer = OnlineBinPacker(100, 8, align=4, buffer=BufferConfig(max_wait=4, min_fill=1.0))
    packer.push("x", 20)
    kept = packer.state_dict()
    if message is None:
        packer.load_state_dict(state)
        assert [b.keys for b in packer.flush()] == [("k", 1, 2)]
        return
    with pytest.raises(ValueError, match=rf"^packer state:? {message}.*start a fresh run"):
        packer.load_state_dict(state)
    assert packer.state_dict() == kept, "a refused state changed the packer"


@pytest.mark.parametrize("state", [None, [], "x", {"version": 2}])
def test_a_packer_state_of_the_wrong_shape_is_refused(state: Any) -> None:
    with pytest.raises(ValueError, match=r"^packer state must (be a dict|have the keys)"):
        OnlineBinPacker(100, 8).load_state_dict(state)


def test_held_candidates_out_of_push_order_are_refused() -> None:
    packer = OnlineBinPacker(100, 8, buffer=BufferConfig(max_wait=4, min_fill=1.0))
    for key, length in enumerate([60, 40, 50, 30]):  # 60 + 40 leave: 50 and 30 pushed after
        packer.push(key, length)
    state = packer.state_dict()
    assert [c[2] for c in state["held"]] == [1, 1]
    state["held"][0][2] = 2
    state["held"][1][2] = 1
    with pytest.raises(ValueError, match=r"held\[0\]\.pushed_at=2 must be an int in \[0, 1\]"):
        OnlineBinPacker(100, 8, buffer=BufferConfig(max_wait=4, min_fill=1.0)).load_state_dict(
            state
        )
    state["held"][0][2] = 1
    state["held"][1][2] = 0
    with pytest.raises(ValueError, match=r"held\[1\]\.pushed_at=0 must be an int in \[1, 1\]"):
        OnlineBinPacker(100, 8, buffer=BufferConfig(max_wait=4, min_fill=1.0)).load_state_dict(
            state
        )


def test_deadline_bins_that_cannot_all_leave_in_time_are_refused() -> None:
    packer = OnlineBinPacker(100, 8, buffer=BufferConfig(max_wait=2, min_fill=1.0))
    packer.push(0, 60)
    packer.push(1, 60)  # a second deadline bin, same deadline (2)
    state = packer.state_dict()
    state["emitted"] = 2  # both must now leave in the next bin: impossible
    state["stats"].update(bins=2, items=2, aligned_tokens=100, real_tokens=100)
    state["stats"]["emitted_by"]["fill"] = 2
    with pytest.raises(ValueError, match=r"deadline_bins=\[0, 1\] must be emittable in deadline"):
        OnlineBinPacker(100, 8, buffer=BufferConfig(max_wait=2, min_fill=1.0)).load_state_dict(
            state
        )


def test_held_bytes_above_max_bytes_and_bool_settings_are_refused() -> None:
    packer = OnlineBinPacker(
        100, 8, buffer=BufferConfig(max_wait=None, min_fill=1.0, max_bytes=100)
    )
    packer.push(0, 10, nbytes=60)
    state = packer.state_dict()
    state["held"][0][4] = 101
    with pytest.raises(ValueError, match=r"held nbytes=101 must sum to at most max_bytes=100"):
        OnlineBinPacker(
            100, 8, buffer=BufferConfig(max_wait=None, min_fill=1.0, max_bytes=100)
        ).load_state_dict(state)
    state = OnlineBinPacker(100, 8).state_dict()
    state["settings"]["align"] = True  # == 1, but not the saved setting
    with pytest.raises(ValueError, match=r"saved with align=True but this packer has align=1"):
        OnlineBinPacker(100, 8).load_state_dict(state)
