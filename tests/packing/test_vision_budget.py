"""The vision budget of the online packer: caps on vision tokens and media per bin, the balance
mode, their state (exact resume, old states) and their refusals."""

from __future__ import annotations

import copy
import logging
import os
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from helpers import assert_restore_at_every_step_is_invisible, assert_resume_equivalent
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import BufferConfig, OnlineBinPacker, VisionBudget
from energon_pack.packing.bins import aligned_length
from energon_pack.packing.synthetic import vision_mix
from energon_pack.packing.vision_budget import (
    KNOWN_SHARE_ROWS,
    WARMUP_ROWS,
    even_share,
    straggler_floor,
    straggler_ratio,
    vision_target,
)

Item = tuple[int, int, int]
"""(length, vision tokens, media) of one pushed sample."""
Scenario = tuple[dict[str, Any], list[Item]]
RESUME_EXAMPLES = int(os.environ.get("RESUME_EXAMPLES", "300"))


def budget_of(settings: dict[str, Any]) -> VisionBudget:
    """The vision budget of flat settings (``vision_balance`` is its ``balance``)."""
    return VisionBudget(
        settings.get("max_vision_tokens"),
        settings.get("max_media"),
        settings.get("vision_balance", False),
        vision_share=settings.get("vision_share"),
    )


def packer_of(config: dict[str, Any], **options: Any) -> OnlineBinPacker:
    """The packer of a drawn flat config (its settings as a BufferConfig and a VisionBudget)."""
    buffer = BufferConfig(config["max_wait"], config["min_fill"])
    size, align = config["buffer_size"], config["align"]
    return OnlineBinPacker(
        config["capacity"], size, align=align, buffer=buffer, vision=budget_of(config), **options
    )


@st.composite
def items(draw: st.DrawFn, capacity: int) -> Item:
    length = draw(st.integers(1, capacity + capacity // 4))
    media = draw(st.sampled_from([0, 0, 0, 1, 2, 5]))
    vision = draw(st.integers(0, length)) if media else 0
    return length, vision, media


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Packer settings with a vision budget, and a stream; some samples exceed a limit."""
    capacity = draw(st.integers(8, 120))
    config = {
        "capacity": capacity,
        "buffer_size": draw(st.integers(1, 24)),
        "align": draw(st.integers(1, 4)),
        "max_wait": draw(st.one_of(st.none(), st.integers(0, 6))),
        "min_fill": draw(st.sampled_from([0.5, 0.9, 1.0])),
        "max_vision_tokens": draw(st.one_of(st.none(), st.integers(1, capacity))),
        "max_media": draw(st.one_of(st.none(), st.integers(1, 6))),
        "vision_balance": draw(st.booleans()),
    }
    if config["vision_balance"]:
        config["vision_share"] = draw(st.one_of(st.none(), st.floats(0, 1)))
    size = draw(st.integers(0, 80), label="stream length")
    return config, draw(st.lists(items(capacity), min_size=size, max_size=size))


def _accepted(config: dict[str, Any], stream: list[Item]) -> list[int]:
    vision_cap, media_cap = config["max_vision_tokens"], config["max_media"]
    return [
        key
        for key, (length, vision, media) in enumerate(stream)
        if aligned_length(length, config["align"]) <= config["capacity"]
        and (vision_cap is None or vision <= vision_cap)
        and (media_cap is None or media <= media_cap)
    ]


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_every_bin_holds_the_caps_and_every_sample_leaves_once(scenario: Scenario) -> None:
    config, stream = scenario
    packer = packer_of(config, overlong="skip")
    bins = []
    pushed_at = {}
    for key, (length, vision, media) in enumerate(stream):
        pushed_at[key] = len(bins)
        bins += packer.push(key, length, vision_tokens=vision, media=media)
        assert packer.held < packer.max_held
    bins += packer.flush()
    accepted = _accepted(config, stream)
    assert Counter(k for b in bins for k in b.keys) == Counter(accepted)
    assert packer.stats.rejected == len(stream) - len(accepted)
    for index, b in enumerate(bins):
        assert list(b.keys) == sorted(b.keys)
        assert b.vision_tokens == sum(stream[int(k)][1] for k in b.keys)
        assert b.media == sum(stream[int(k)][2] for k in b.keys)
        assert b.used <= config["capacity"]
        if config["max_vision_tokens"] is not None:
            assert b.vision_tokens <= config["max_vision_tokens"]
        if config["max_media"] is not None:
            assert b.media <= config["max_media"]
        if config["max_wait"] is not None:
            assert all(index - pushed_at[int(k)] <= config["max_wait"] for k in b.keys)
    stats = packer.stats
    assert stats.vision_tokens == sum(b.vision_tokens for b in bins)
    assert stats.vision_tokens_max == max((b.vision_tokens for b in bins), default=0)
    assert stats.media == sum(b.media for b in bins)
    assert stats.media_max == max((b.media for b in bins), default=0)


def _steps(stream: list[Item]) -> list[Callable[[OnlineBinPacker], Any]]:
    steps: list[Callable[[OnlineBinPacker], Any]] = [
        (lambda p, k=k, n=n, v=v, m=m: p.push(k, n, vision_tokens=v, media=m))
        for k, (n, v, m) in enumerate(stream)
    ]
    steps.append(lambda p: p.flush())
    steps.append(lambda p: p.stats)
    return steps


@settings(max_examples=RESUME_EXAMPLES, deadline=None)
@given(scenarios())
def test_restore_at_every_push_with_a_vision_budget(scenario: Scenario) -> None:
    config, stream = scenario
    assert_restore_at_every_step_is_invisible(
        lambda: packer_of(config, overlong="skip"),
        _steps(stream),
        save=OnlineBinPacker.state_dict,
        load=OnlineBinPacker.load_state_dict,
    )


MIX = vision_mix(1500, seed=5, cap=8192, text_median=150)
MIX_ITEMS = [(s.length, s.vision_tokens, s.media) for s in MIX]


@pytest.mark.parametrize(
    "budget",
    [
        {"max_vision_tokens": 6000, "max_media": 8},
        {"max_vision_tokens": 6000, "max_media": 8, "vision_balance": True},
        {"vision_balance": True},
        {"vision_balance": True, "vision_share": 0.35},
    ],
)
def test_resume_at_eight_cut_points_on_a_vlm_mix(budget: dict[str, Any]) -> None:
    steps = _steps(MIX_ITEMS)
    for at in range(1, len(steps), len(steps) // 8):
        assert_resume_equivalent(
            lambda: OnlineBinPacker(8192, 32, overlong="skip", vision=budget_of(budget)),
            steps,
            at,
            save=OnlineBinPacker.state_dict,
            load=OnlineBinPacker.load_state_dict,
        )


def _packs(samples: list[tuple[int, int, int]], **budget: Any) -> list[int]:
    """Vision tokens of each bin (the end-of-stream flush left out)."""
    packer = OnlineBinPacker(16384, 64, overlong="skip", vision=budget_of(budget))
    out = []
    for key, (length, vision, media) in enumerate(samples):
        out += [
            b.vision_tokens for b in packer.push(key, length, vision_tokens=vision, media=media)
        ]
    return out


def test_balance_evens_out_vision_tokens_between_ranks() -> None:
    """Four ranks, each packing its own share: balance keeps the step's most loaded rank near
    the mean, where packing by tokens alone does not."""
    samples = [
        (s.length, s.vision_tokens, s.media)
        for s in vision_mix(16000, seed=2, cap=16384, text_median=150)
    ]
    ratios = {}
    for balance in (False, True):
        ranks = [_packs(samples[r::4], vision_balance=balance) for r in range(4)]
        steps = min(len(r) for r in ranks)
        ratios[balance] = straggler_ratio([[r[s] for r in ranks] for s in range(steps)])
    assert ratios[True] < 1.15 < 1.3 < ratios[False], ratios


def test_a_known_vision_share_evens_out_the_first_steps() -> None:
    """32 ranks of 400 samples each (10 steps): each rank's target from its own first samples
    differs from the others'; started from the share the first 1,000 samples give (what
    ``tune`` would report), every rank aims at the same level from its first pack."""
    mix = vision_mix(12800, seed=2, cap=16384, text_median=150)
    share = sum(s.vision_tokens for s in mix[:1000]) / sum(s.length for s in mix[:1000])
    samples = [(s.length, s.vision_tokens, s.media) for s in mix]
    ratios = {}
    for known in (None, share):
        ranks = [_packs(samples[r::32], vision_balance=True, vision_share=known) for r in range(32)]
        steps = min(len(r) for r in ranks)
        ratios[known] = straggler_ratio([[r[s] for r in ranks] for s in range(steps)])
    assert ratios[share] < 1.12 < 1.2 < ratios[None], ratios


@pytest.mark.parametrize(
    ("budget", "first_row_after"),
    [
        ({"vision_balance": True}, WARMUP_ROWS * 4),  # 4 samples a row
        ({"vision_balance": True, "vision_share": 0.2}, 4),
        ({"max_vision_tokens": 500}, 4),
        ({}, 4),
    ],
)
def test_balance_leaves_no_row_early_before_its_target_has_read_warmup_rows(
    budget: dict[str, Any], first_row_after: int
) -> None:
    """With balance and no known share, the target is the share the packer has seen: no row
    leaves by the fill rule before it has read WARMUP_ROWS rows' worth of tokens, and then rows
    leave as they fill. A known share, caps alone or no budget: the first full row leaves."""
    packer = OnlineBinPacker(
        1000, 1000, buffer=BufferConfig(min_rows=None), vision=budget_of(budget)
    )
    out = []
    for key in range(WARMUP_ROWS * 4 + 8):
        vision = 100 if key % 2 else 0
        bins = packer.push(key, 250, vision_tokens=vision, media=1 if vision else 0)
        out.append(len(bins))
    first = next(i for i, count in enumerate(out) if count)
    assert first + 1 == first_row_after, out
    assert sum(out) >= (len(out) - first_row_after) // 4  # then a row per 4 samples or more
    assert packer.stats.emitted_by["buffer"] == 0  # all left by the fill rule


def test_the_known_share_starts_the_target_and_the_seen_share_takes_over() -> None:
    assert vision_target(0, 0, 1000, 0.25) == 250.0
    assert vision_target(0, 0, 1000) == 0.0
    seen = KNOWN_SHARE_ROWS * 1000  # as many tokens as the known share counts for
    assert vision_target(seen // 2, seen, 1000, 0.25) == pytest.approx(375.0)
    assert vision_target(seen * 100, seen * 1000, 1000, 0.9) < 101.0
    packer = OnlineBinPacker(1000, 8, vision=VisionBudget(balance=True, vision_share=0.25))
    assert packer.vision_target() == 250.0
    packer.push("a", 100, vision_tokens=100, media=1)
    assert packer.vision_target() == pytest.approx((100 + 0.25 * seen) / (100 + seen) * 1000)


packs_of_samples = st.lists(
    st.lists(st.integers(0, 5000), min_size=1, max_size=6), min_size=1, max_size=40
)


@given(packs_of_samples)
def test_even_share_spreads_the_packs_own_total(packs: list[list[int]]) -> None:
    """Every pack at the level or at its largest sample: together they carry the packs' total,
    and the level never passes the mean (packs above it leave the others less)."""
    largest = [max(p) for p in packs]
    total = sum(map(sum, packs))
    level = even_share(largest, total)
    assert sum(max(level, v) for v in largest) == pytest.approx(total, rel=1e-9, abs=1e-6)
    assert 0 <= level <= total / len(packs) + 1e-9
    if total > sum(largest):  # room left over: some pack sits at the level itself
        assert any(v <= level for v in largest)


@given(st.lists(st.lists(st.integers(1, 5000), min_size=3, max_size=3), min_size=1, max_size=20))
def test_the_floor_of_single_sample_packs_is_their_ratio(steps: list[list[int]]) -> None:
    """A pack of one sample cannot be evened out: the floor is the ratio itself."""
    assert straggler_floor(steps, steps) == pytest.approx(straggler_ratio(steps))


def test_the_floor_is_one_without_large_samples_and_counts_the_large_ones() -> None:
    loads = [[900, 1100, 1000, 1000], [1000, 1000, 800, 1200]]
    largest = [[300, 400, 250, 500], [450, 300, 200, 600]]
    assert straggler_floor(largest, loads) == 1.0
    # One pack holds a 5000-token sample of a 12000 total: the other seven share 7000 (1000
    # each), so that step's floor is 5000 over a mean of (5000 + 3 * 1000) / 4.
    loads = [[5000, 1500, 500, 1000], [1000, 1000, 1000, 1000]]
    largest = [[5000, 700, 500, 400], [600, 500, 400, 300]]
    assert straggler_floor(largest, loads) == pytest.approx((5000 / 2000 + 1.0) / 2)
    with pytest.raises(ValueError, match="same steps and ranks"):
        straggler_floor(largest, loads[:1])
    with pytest.raises(ValueError, match=">= 0"):
        even_share([-1], 10)


def test_balance_ends_near_the_floor_where_large_samples_are_common() -> None:
    """Eight ranks of short turns at seq 8192, where a third of the packs hold one sample above
    the mean: balance ends within 0.05 of the floor of its packs, packing by tokens alone 0.1
    or more above it."""
    stream = vision_mix(16000, seed=5, cap=8192, text_median=150)

    def packs(samples: list[Any], **budget: Any) -> list[tuple[int, int]]:
        packer = OnlineBinPacker(8192, 64, overlong="skip", vision=budget_of(budget))
        out = []
        for key, s in enumerate(samples):
            for b in packer.push(key, s.length, vision_tokens=s.vision_tokens, media=s.media):
                out.append((b.vision_tokens, max(samples[k].vision_tokens for k in b.keys)))
        return out

    gaps = {}
    for balance in (False, True):
        ranks = [packs(stream[r::8], vision_balance=balance) for r in range(8)]
        steps = min(map(len, ranks))
        loads = [[rank[s][0] for rank in ranks] for s in range(steps)]
        largest = [[rank[s][1] for rank in ranks] for s in range(steps)]
        floor = straggler_floor(largest, loads)
        assert floor > 1.3  # large single samples are common here
        gaps[balance] = straggler_ratio(loads) - floor
    assert gaps[True] < 0.05, gaps
    assert gaps[False] > 0.10, gaps


def test_balance_keeps_the_fill() -> None:
    fills = {}
    for balance in (False, True):
        packer = OnlineBinPacker(8192, 64, overlong="skip", vision=VisionBudget(balance=balance))
        for key, (length, vision, media) in enumerate(MIX_ITEMS):
            packer.push(key, length, vision_tokens=vision, media=media)
        fills[balance] = packer.stats.bin_fill
    assert fills[True] >= 0.99 * fills[False], fills


def test_caps_bound_every_row_on_a_vlm_mix() -> None:
    uncapped = _packs(MIX_ITEMS)
    cap = int(1.5 * statistics.fmean(uncapped))
    assert max(uncapped) > cap  # the cap binds
    assert max(_packs(MIX_ITEMS, max_vision_tokens=cap)) <= cap


def test_a_sample_over_a_cap_is_refused_by_name() -> None:
    packer = OnlineBinPacker(1000, 8, vision=VisionBudget(max_vision_tokens=100, max_media=2))
    with pytest.raises(
        ValueError, match=r"sample 'a' has 120 vision tokens, above max_vision_tokens=100; raise"
    ):
        packer.push("a", 300, vision_tokens=120, media=1)
    with pytest.raises(
        ValueError, match=r"sample 'b' has 3 images and videos, above max_media=2.*overlong='skip'"
    ):
        packer.push("b", 300, vision_tokens=90, media=3)
    assert packer.held == 0


def test_a_sample_over_a_cap_is_counted_and_logged_with_skip(
    caplog: pytest.LogCaptureFixture,
) -> None:
    packer = OnlineBinPacker(1000, 8, overlong="skip", vision=VisionBudget(max_vision_tokens=100))
    with caplog.at_level(logging.WARNING, "energon_pack.packing"):
        assert packer.push("a", 300, vision_tokens=120, media=1) == []
    assert packer.stats.rejected == 1
    assert "sample 'a' has 120 vision tokens" in caplog.text
    assert packer.held == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_vision_tokens": 0}, "max_vision_tokens must be None"),
        ({"max_vision_tokens": True}, "max_vision_tokens must be None"),
        ({"max_media": "4"}, "max_media must be None"),
        ({"vision_balance": "yes"}, "vision_balance must be True or False"),
    ],
)
def test_bad_budget_settings(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OnlineBinPacker(100, 4, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"balance": True, "vision_share": 1.5}, r"vision_share must be .* \[0, 1\].*got 1.5"),
        ({"balance": True, "vision_share": -0.1}, "vision_share must be None or a number"),
        ({"balance": True, "vision_share": "0.3"}, "vision_share must be None or a number"),
        ({"balance": True, "vision_share": True}, "vision_share must be None or a number"),
        ({"vision_share": 0.3}, "vision_share=0.3 is where balance starts its target"),
    ],
)
def test_bad_vision_share(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VisionBudget(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vision_tokens": -1}, "vision_tokens must be an int >= 0"),
        ({"vision_tokens": 1.5}, "vision_tokens must be an int >= 0"),
        ({"media": True}, "media must be an int >= 0"),
        ({"vision_tokens": 11}, "vision_tokens=11 is more than its length=10"),
    ],
)
def test_bad_vision_figures_name_the_sample(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"sample 'k': {message}|{message}"):
        OnlineBinPacker(100, 4).push("k", 10, **kwargs)


def _held_state(**budget: Any) -> dict[str, Any]:
    packer = OnlineBinPacker(
        100, 8, vision=budget_of(budget), buffer=BufferConfig(max_wait=4, min_fill=1.0)
    )
    for key, (length, vision, media) in enumerate([(30, 20, 1), (20, 0, 0), (25, 10, 2)]):
        packer.push(key, length, vision_tokens=vision, media=media)
    return packer.state_dict()


def test_a_state_saved_under_another_budget_is_refused_by_name() -> None:
    state = _held_state(max_vision_tokens=50)
    with pytest.raises(ValueError, match="unknown \\['max_vision_tokens'\\]"):
        OnlineBinPacker(100, 8, buffer=BufferConfig(max_wait=4, min_fill=1.0)).load_state_dict(
            state
        )
    with pytest.raises(
        ValueError, match="saved with max_vision_tokens=50 but this packer has max_vision_tokens=60"
    ):
        OnlineBinPacker(
            100,
            8,
            buffer=BufferConfig(max_wait=4, min_fill=1.0),
            vision=VisionBudget(max_vision_tokens=60),
        ).load_state_dict(state)
    balanced = _held_state(vision_balance=True)
    with pytest.raises(ValueError, match="missing \\['vision_balance'\\]"):
        OnlineBinPacker(
            100, 8, buffer=BufferConfig(max_wait=4, min_fill=1.0), vision=VisionBudget(balance=True)
        ).load_state_dict(_held_state())
    OnlineBinPacker(
        100, 8, buffer=BufferConfig(max_wait=4, min_fill=1.0), vision=VisionBudget(balance=True)
    ).load_state_dict(balanced)
    known = VisionBudget(balance=True, vision_share=0.4)
    with pytest.raises(ValueError, match=r"saved with vision_share=0\.3 but this packer has "):
        OnlineBinPacker(
            100, 8, buffer=BufferConfig(max_wait=4, min_fill=1.0), vision=known
        ).load_state_dict(_held_state(vision_balance=True, vision_share=0.3))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s["held"][0].__setitem__(5, 60),
            r"held\[0\].vision_tokens=60 must be an int in \[0, 30\]",
        ),
        (lambda s: s["held"][0].__setitem__(6, 3), r"held\[0\].media=3 must be an int in \[0, 2\]"),
        (lambda s: s["held"][0].__setitem__(5, -1), r"held\[0\].vision_tokens=-1"),
        (
            lambda s: s["held"][1].pop(),
            r"held\[1\]=.* must be \[key, length, pushed_at, deadline_bin, nbytes, vision_tokens,",
        ),
        (
            lambda s: s["stats"].__setitem__("vision_tokens_max", 5),
            r"stats.vision_tokens_max=5 must be at most",
        ),
    ],
)
def test_a_tampered_vision_field_is_refused(
    edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    state = _held_state(max_vision_tokens=30, max_media=2)
    state["stats"]["vision_tokens"] = 3  # as if one bin with 3 vision tokens had left
    state["stats"]["vision_tokens_max"] = 3
    state["stats"]["bins"] = state["emitted"] = 0
    edited = copy.deepcopy(state)
    edit(edited)
    packer = OnlineBinPacker(
        100,
        8,
        buffer=BufferConfig(max_wait=4, min_fill=1.0),
        vision=VisionBudget(max_vision_tokens=30, max_media=2),
    )
    with pytest.raises(ValueError, match=message):
        packer.load_state_dict(edited)


def test_a_state_saved_before_the_vision_budget_restores() -> None:
    """A version-2 state (five fields per held candidate, no vision figures) restores into a
    packer without a budget and packs on exactly as the packer that saved it would have."""
    stream = [(n, 0, 0) for n in (30, 50, 12, 70, 9, 41, 33, 18, 64, 27)]
    reference = OnlineBinPacker(100, 8, buffer=BufferConfig(max_wait=4))
    for key, (length, _, _) in enumerate(stream[:5]):
        reference.push(key, length)
    state = reference.state_dict()
    old = {**state, "version": 2, "held": [h[:5] for h in state["held"]]}
    old["stats"] = {
        k: v for k, v in state["stats"].items() if not k.startswith(("vision", "media"))
    }
    resumed = OnlineBinPacker(100, 8, buffer=BufferConfig(max_wait=4))
    resumed.load_state_dict(copy.deepcopy(old))
    rest = stream[5:]
    expected = [reference.push(5 + k, n) for k, (n, _, _) in enumerate(rest)] + [reference.flush()]
    got = [resumed.push(5 + k, n) for k, (n, _, _) in enumerate(rest)] + [resumed.flush()]
    assert got == expected
    with pytest.raises(ValueError, match="missing \\['max_vision_tokens'\\]"):
        OnlineBinPacker(
            100, 8, buffer=BufferConfig(max_wait=4), vision=VisionBudget(max_vision_tokens=10)
        ).load_state_dict(old)
