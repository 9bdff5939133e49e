"""The buffer that fills rows by default: it grows past ``packing_buffer_size`` while its samples
hold less than ``min_rows`` rows' worth of tokens, and warns once when packs keep leaving a full
buffer under-filled."""

from __future__ import annotations

import logging
import random
import re
import warnings

import pytest

from energon_pack import BufferConfig, OnlineBinPacker, PackingWarning, VisionBudget
from energon_pack.packing.bins import Bin

SEQ = 8192


def short_turns(count: int, seed: int = 0) -> list[int]:
    """Lengths of short chat turns: 100-600 tokens, as in a conversation dataset."""
    rng = random.Random(seed)
    return [rng.randint(100, 600) for _ in range(count)]


def push_images(packer: OnlineBinPacker, count: int, length: int) -> None:
    """``count`` samples of ``length`` tokens, each with one image of 100 vision tokens."""
    for key in range(count):
        packer.push(key, length, vision_tokens=100, media=1)


def run(packer: OnlineBinPacker, lengths: list[int]) -> list[Bin]:
    bins: list[Bin] = []
    for key, length in enumerate(lengths):
        bins += packer.push(key, length)
    return bins + packer.flush()


def test_short_samples_fill_rows_at_the_quick_start_buffer() -> None:
    lengths = short_turns(3000)
    grown = OnlineBinPacker(SEQ, 16, align=8)
    fixed = OnlineBinPacker(SEQ, 16, align=8, buffer=BufferConfig(min_rows=None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        run(fixed, lengths)
    run(grown, lengths)
    assert fixed.stats.bin_fill < 0.75  # 16 samples of ~350 tokens cannot fill 8192
    assert grown.stats.bin_fill > 0.99
    assert grown.stats.items == fixed.stats.items == len(lengths)


def test_long_samples_leave_exactly_as_with_a_count_bound() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(2000, 6000) for _ in range(600)]  # 16 of them hold ~8 rows
    grown = run(OnlineBinPacker(SEQ, 16, align=8), lengths)
    fixed = run(OnlineBinPacker(SEQ, 16, align=8, buffer=BufferConfig(min_rows=None)), lengths)
    assert grown == fixed


def test_growth_stops_at_max_size_and_max_bytes() -> None:
    lengths = short_turns(400)
    packer = OnlineBinPacker(SEQ, 4, buffer=BufferConfig(max_size=10, max_wait=None))
    most = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        for key, length in enumerate(lengths):
            packer.push(key, length)
            most = max(most, packer.held)
    assert most == 9  # the tenth sample makes it full
    by_bytes = OnlineBinPacker(SEQ, 4, buffer=BufferConfig(max_bytes=5000, max_wait=None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        for key, length in enumerate(lengths):
            by_bytes.push(key, length, nbytes=1000)
            assert by_bytes.held_bytes <= 5000


@pytest.mark.parametrize(
    ("budget", "rows"),
    [
        (VisionBudget(), 2),
        (VisionBudget(max_vision_tokens=4000), 4),
        (VisionBudget(balance=True), 8),
        (VisionBudget(max_vision_tokens=4000, balance=True), 8),
    ],
    ids=["tokens", "caps", "balance", "caps+balance"],
)
def test_a_vision_budget_grows_the_buffer_to_more_rows(budget: VisionBudget, rows: int) -> None:
    """Samples of 100 tokens never fill a row of 1024 early (their sums are multiples of 100),
    so the first row leaves when the full buffer holds its rows' worth: 2 by default, 4 under
    caps, 8 with balance."""
    packer = OnlineBinPacker(1024, 4, buffer=BufferConfig(max_wait=None), vision=budget)
    pushed = 0
    while not packer.push(pushed, 100, vision_tokens=10, media=1):
        pushed += 1
    assert pushed == rows * 1024 // 100  # the push that reached the rows' worth
    assert packer.stats.bins == 1
    assert packer.stats.items + packer.held == pushed + 1  # none lost


def test_a_buffer_of_one_never_grows() -> None:
    packer = OnlineBinPacker(SEQ, 1)
    bins = run(packer, short_turns(50))
    assert all(len(b.keys) == 1 for b in bins)
    assert "min_rows" not in packer.settings()


@pytest.mark.parametrize("budget", [VisionBudget(), VisionBudget(max_media=4)], ids=["", "caps"])
def test_an_underfilled_full_buffer_warns_once_naming_the_fix(budget: VisionBudget) -> None:
    """Text alone: caps or none, the buffer holds the fill down."""
    count_bound = BufferConfig(min_rows=None)
    packer = OnlineBinPacker(SEQ, 16, align=8, buffer=count_bound, vision=budget)
    with pytest.warns(PackingWarning) as caught:
        run(packer, short_turns(2000))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "left because the candidate buffer was full (buffer_size), at bin fill 0.7" in message
    assert "a row of seq_length=8192 needs about 22" in message  # 8192 / ~370 aligned tokens
    assert "raise packing_buffer_size to about 44" in message
    assert "BufferConfig(min_rows=2)" in message


def test_a_buffer_held_at_max_size_names_max_size() -> None:
    packer = OnlineBinPacker(SEQ, 8, buffer=BufferConfig(max_size=12))
    with pytest.warns(PackingWarning, match=r"\(max_size\).*raise BufferConfig\(max_size=12\)"):
        run(packer, short_turns(2000))


@pytest.mark.parametrize(
    ("budget", "rows"),
    [(VisionBudget(), 2), (VisionBudget(balance=True), 8)],
    ids=["tokens", "balance"],
)
def test_the_max_size_advice_counts_the_rows_a_budget_raises(
    budget: VisionBudget, rows: int
) -> None:
    """The buffer must hold the rows' worth it grows to, 8 with balance, not the setting's 2."""
    packer = OnlineBinPacker(SEQ, 8, buffer=BufferConfig(max_size=12), vision=budget)
    with pytest.warns(PackingWarning) as caught:
        run(packer, short_turns(2000))
    message = str(caught[0].message)
    per_row = int(re.search(r"needs about (\d+)", message)[1])  # type: ignore[index]
    wanted = int(re.search(r"max_size=12\) to about (\d+)", message)[1])  # type: ignore[index]
    assert abs(wanted - rows * per_row) <= rows  # per_row is rounded in the message


def test_caps_that_hold_the_fill_down_are_named_instead_of_the_buffer() -> None:
    """Every sample carries an image and a row takes at most 4: rows stay a quarter full however
    large the buffer, and the warning names the cap, not a buffer setting."""
    packer = OnlineBinPacker(SEQ, 16, vision=VisionBudget(max_media=4))
    with pytest.warns(PackingWarning) as caught:
        push_images(packer, 2000, 500)
    (warning,) = caught
    message = str(warning.message)
    assert "at bin fill 0.24: in 8 of them the vision budget's caps (max_media=4) kept out" in (
        message
    )
    assert "BufferConfig" not in message
    assert "packing_buffer_size" not in message


def test_caps_are_not_named_where_no_held_sample_fits_by_tokens() -> None:
    """Samples of 5000 tokens never pair in a row of 8192: the cap of one image per row would
    keep the others out too, but it is not what holds the fill down."""
    packer = OnlineBinPacker(
        SEQ, 4, buffer=BufferConfig(min_rows=None), vision=VisionBudget(max_media=1)
    )
    with pytest.warns(PackingWarning) as caught:
        push_images(packer, 100, 5000)
    (warning,) = caught
    assert "kept out" not in str(warning.message)
    assert "raise packing_buffer_size" in str(warning.message)


def test_a_filling_buffer_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackingWarning)
        run(OnlineBinPacker(SEQ, 16, align=8), short_turns(2000))


def test_bad_growth_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="min_rows"):
        BufferConfig(min_rows=0)
    with pytest.raises(ValueError, match="max_size"):
        BufferConfig(max_size=0)


def test_a_count_bounded_state_restores_as_it_was_saved(caplog: pytest.LogCaptureFixture) -> None:
    lengths = short_turns(600)
    half = len(lengths) // 2
    saved_by = OnlineBinPacker(SEQ, 16, align=8, buffer=BufferConfig(min_rows=None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        for key, length in enumerate(lengths[:half]):
            saved_by.push(key, length)
        state = saved_by.state_dict()
        assert "min_rows" not in state["settings"]
        original = [b for k, n in enumerate(lengths[half:], half) for b in saved_by.push(k, n)]
        original += saved_by.flush()
        restored = OnlineBinPacker(SEQ, 16, align=8)  # the growing default
        with caplog.at_level(logging.WARNING, logger="energon_pack.packing"):
            restored.load_state_dict(state)
        after = [b for k, n in enumerate(lengths[half:], half) for b in restored.push(k, n)]
        after += restored.flush()
    assert after == original
    assert restored.min_rows is None
    assert "keeps packing_buffer_size=16 as its bound" in caplog.text


def test_a_count_bounded_state_restored_under_balance_names_the_rows_it_grows_to(
    caplog: pytest.LogCaptureFixture,
) -> None:
    balance = VisionBudget(balance=True)
    count_bound = BufferConfig(min_rows=None)
    saved_by = OnlineBinPacker(SEQ, 16, align=8, buffer=count_bound, vision=balance)
    for key, length in enumerate(short_turns(40)):
        saved_by.push(key, length)
    restored = OnlineBinPacker(SEQ, 16, align=8, vision=balance)
    with caplog.at_level(logging.WARNING, logger="energon_pack.packing"):
        restored.load_state_dict(saved_by.state_dict())
    assert "grows the buffer to 8.0 rows' worth (min_rows=2.0, raised under the vision" in (
        caplog.text
    )


def test_a_growing_state_is_refused_by_a_count_bounded_packer() -> None:
    packer = OnlineBinPacker(SEQ, 16, align=8)
    for key, length in enumerate(short_turns(40)):
        packer.push(key, length)
    state = packer.state_dict()
    with pytest.raises(ValueError, match=r"min_rows.*max_size"):
        OnlineBinPacker(SEQ, 16, align=8, buffer=BufferConfig(min_rows=None)).load_state_dict(state)
