"""The vision budget of the collator: rows within the caps, the fewest rows, balance, refusals."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import SMALL_MEDIA, read_samples
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import VLMPackingCollator
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.packing.micro_batch import Weight, row_groups
from energon_pack.packing.vision_budget import VisionBudget


def _weights(draw: st.DrawFn, capacity: int, vision_cap: int, media_cap: int) -> list[Weight]:
    count = draw(st.integers(1, 7))
    out = []
    for index in range(count):
        units = draw(st.integers(1, capacity))
        media = draw(st.integers(0, media_cap))
        vision = draw(st.integers(0, min(units, vision_cap))) if media else 0
        out.append(Weight(f"s{index}", units, units, vision, media))
    return out


def _fewest(weights: list[Weight], capacity: int, vision_cap: int, media_cap: int) -> int:
    """Fewest rows within every budget, by brute force over assignments."""
    for rows in range(1, len(weights) + 1):
        for assignment in itertools.product(range(rows), repeat=len(weights)):
            loads = [[0, 0, 0] for _ in range(rows)]
            for w, row in zip(weights, assignment, strict=True):
                loads[row][0] += w.units
                loads[row][1] += w.vision_tokens
                loads[row][2] += w.media
            if all(a <= capacity and v <= vision_cap and m <= media_cap for a, v, m in loads):
                return rows
    raise AssertionError("every sample fits a row alone")


@settings(max_examples=150, deadline=None)
@given(data=st.data(), balance=st.booleans())
def test_rows_hold_every_budget_and_are_the_fewest(data: st.DataObject, balance: bool) -> None:
    capacity = data.draw(st.integers(10, 30))
    vision_cap, media_cap = data.draw(st.integers(1, 30)), data.draw(st.integers(1, 4))
    weights = _weights(data.draw, capacity, vision_cap, media_cap)
    budget = VisionBudget(vision_cap, media_cap, balance)
    groups = row_groups(weights, capacity, budget, max_items=None)
    assert sorted(i for g in groups for i in g) == list(range(len(weights)))
    for group in groups:
        assert sum(weights[i].units for i in group) <= capacity
        assert sum(weights[i].vision_tokens for i in group) <= vision_cap
        assert sum(weights[i].media for i in group) <= media_cap
    assert len(groups) == _fewest(weights, capacity, vision_cap, media_cap)


def test_balance_spreads_vision_tokens_over_the_same_rows() -> None:
    weights = [
        Weight(f"s{i}", n, n, v, 1)
        for i, (n, v) in enumerate([(40, 30), (40, 30), (10, 5), (10, 5), (50, 0), (50, 0)])
    ]
    plain = row_groups(weights, 100, VisionBudget(), max_items=None)
    even = row_groups(weights, 100, VisionBudget(balance=True), max_items=None)

    def most(groups: list[list[int]]) -> int:
        return max(sum(weights[i].vision_tokens for i in g) for g in groups)

    assert len(plain) == len(even) == 2
    assert most(plain) == 70  # both heavy samples in one row
    assert most(even) == 35


@pytest.fixture(scope="module")
def encoded(vlm_demo_path: Path) -> list[Any]:
    encoder = ConversationEncoder(media=SMALL_MEDIA)
    samples = read_samples(vlm_demo_path)
    return [encoder.encode_sample(k, raw) for k, raw in samples.items()]


def _collator(**kwargs: Any) -> VLMPackingCollator:
    return VLMPackingCollator(encoder=ConversationEncoder(media=SMALL_MEDIA), **kwargs)


def test_a_micro_batch_is_split_into_rows_within_the_caps(encoded: list[Any]) -> None:
    batch = [s for s in encoded if s.media and s.length < 2000 and s.vision_tokens < 200][:12]
    collator = _collator(
        seq_length=4096, pad_to_max_length=True, max_vision_tokens=200, max_media=3
    )
    out = collator(batch)
    pads = {
        collator.encoder.tokenizer.convert_tokens_to_ids(t)
        for t in ("<|image_pad|>", "<|video_pad|>")
    }
    assert out.num_rows > 1
    for row in out.input_ids:
        assert sum(int((row == pad).sum()) for pad in pads) <= 200
    assert sorted(k for row in out.keys for k in row) == sorted(s.key for s in batch)
    assert out.skipped_keys == ()


def test_a_variable_width_micro_batch_over_a_cap_is_split_into_rows(encoded: list[Any]) -> None:
    batch = [s for s in encoded if s.media][:8]
    for caps in ({"max_vision_tokens": max(s.vision_tokens for s in batch)}, {"max_media": 2}):
        collator = _collator(seq_length=8192, **caps)
        out = collator(batch)
        assert out.num_rows > 1, caps
        assert sorted(k for row in out.keys for k in row) == sorted(s.key for s in batch)
        media = {s.key: len(s.media) for s in batch}
        vision = {s.key: s.vision_tokens for s in batch}
        for keys in out.keys:
            if "max_media" in caps:
                assert sum(media[k] for k in keys) <= 2
            else:
                assert sum(vision[k] for k in keys) <= caps["max_vision_tokens"]
        widths = [int(cu[-1]) for cu in out.cu_seqlens_padded]
        assert max(widths) == out.input_ids.shape[1] < 8192  # as wide as the widest row


def test_a_sample_alone_over_a_cap_is_skipped_or_refused(encoded: list[Any]) -> None:
    big = max(encoded, key=lambda s: s.vision_tokens)
    small = [s for s in encoded if 0 < s.vision_tokens < 50][:3]
    cap = big.vision_tokens - 1
    out = _collator(seq_length=8192, max_vision_tokens=cap)([big, *small])  # skip: the default
    assert out.skipped_keys == (big.key,)
    assert big.key not in out.keys
    with pytest.raises(
        ValueError,
        match=rf"sample {big.key!r} has {big.vision_tokens} vision tokens, above max_vision_t",
    ):
        _collator(seq_length=8192, max_vision_tokens=cap, overlong="error")([big, *small])


def test_over_cap_decides_apart_from_overlong(encoded: list[Any]) -> None:
    big = max(encoded, key=lambda s: s.vision_tokens)
    small = [s for s in encoded if 0 < s.vision_tokens < 50][:3]
    skip = VisionBudget(max_vision_tokens=big.vision_tokens - 1, over_cap="skip")
    out = _collator(seq_length=8192, vision=skip)([big, *small])  # overlong stays "error"
    assert out.skipped_keys == (big.key,)
    strict = replace(skip, over_cap="error")
    with pytest.raises(ValueError, match=rf"sample {big.key!r} has {big.vision_tokens} vision"):
        _collator(seq_length=8192, vision=strict, overlong="truncate")([big, *small])


def test_bad_caps_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="max_media must be None"):
        _collator(seq_length=8192, max_media=-1)
