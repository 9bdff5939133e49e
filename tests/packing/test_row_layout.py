"""Tests of the row layout object, its shared rules and the one pack step."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import (
    ByteTokenizer,
    ConversationEncoder,
    MediaError,
    PackingSpec,
    PackingTaskEncoder,
    RowLayout,
    TrainingSetup,
    VLMPackingCollator,
    build_packed_row,
)
from energon_pack.packing.bins import aligned_length
from energon_pack.packing.packed import SkippedSample, pack_dropping_failures

layouts = st.builds(
    dict,
    seq_length=st.integers(1, 64),
    pad_to_multiple_of=st.integers(1, 16),
    pad_to_max_length=st.booleans(),
    pad_cu_seqlens=st.booleans(),
    max_segments=st.none() | st.integers(1, 8),
)


def broken_rules(values: dict[str, Any]) -> list[str]:
    """The rules ``values`` break, written from the README's contract (not from the code)."""
    size, mult = values["seq_length"], values["pad_to_multiple_of"]
    broken = []
    if mult > size:
        broken.append("is larger than seq_length")
    elif values["pad_to_max_length"] and size % mult:
        broken.append("is not a multiple of pad_to_multiple_of")
    if values["pad_cu_seqlens"] and not values["pad_to_max_length"]:
        broken.append("requires fixed-width rows")
    if values["pad_cu_seqlens"] and values["max_segments"] is None:
        broken.append("requires max_segments")
    return broken


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_a_layout_is_made_exactly_when_no_rule_is_broken(values: dict[str, Any]) -> None:
    broken = broken_rules(values)
    if not broken:
        layout = RowLayout(**values)
        assert layout.capacity <= layout.seq_length
        assert layout.capacity % layout.pad_to_multiple_of == 0
        return
    with pytest.raises(ValueError, match=broken[0]) as info:
        RowLayout(**values)
    for rule in broken:  # every broken rule is named in the one error
        assert rule in str(info.value)


@settings(max_examples=200, deadline=None)
@given(layouts.filter(lambda v: not broken_rules(v)), st.integers(1, 80))
def test_overlong_says_exactly_what_the_row_builder_refuses(
    values: dict[str, Any], length: int
) -> None:
    layout = RowLayout(**values)
    sequence = {"key": "s", "input_ids": torch.ones(length, dtype=torch.long)}
    sequence["loss_mask"] = torch.ones(length)
    reason = layout.overlong("s", length)
    if reason is None:
        row = build_packed_row([sequence], layout)
        assert int(row.cu_seqlens[1]) == length
    else:
        assert f"has {length} tokens" in reason
        assert f"above seq_length={layout.seq_length}" in reason
        with pytest.raises(ValueError, match="seq_length"):
            build_packed_row([sequence], layout)


def test_layout_or_keywords_not_both() -> None:
    layout = RowLayout(16, 4)
    assert RowLayout.of(None, {"seq_length": 16, "pad_to_multiple_of": 4}) == layout
    assert RowLayout.of(layout, {}) is layout
    with pytest.raises(ValueError, match="pass one of them"):
        RowLayout.of(layout, {"seq_length": 16})
    with pytest.raises(ValueError, match=r"unknown row setting\(s\) \['seq_len'\]"):
        RowLayout.of(None, {"seq_len": 16})
    with pytest.raises(ValueError, match="at least seq_length"):
        RowLayout.of(None, {})
    with pytest.raises(ValueError, match="not both"):
        VLMPackingCollator(16, layout=layout)


def test_the_fixed_width_rule_reads_the_same_everywhere() -> None:
    with pytest.raises(ValueError, match="fixed-width") as from_layout:
        RowLayout(64, pad_cu_seqlens=True, max_segments=4)
    with pytest.raises(ValueError, match="fixed-width") as from_spec:
        PackingSpec(64, pad_cu_seqlens=True)
    (from_config,) = TrainingSetup(seq_length=64, pad_cu_seqlens=True).validate()
    rule = str(from_layout.value)
    assert rule in str(from_spec.value)
    assert rule == from_config


def test_the_offline_spec_maps_its_names_onto_the_layout() -> None:
    spec = PackingSpec(64, pad_seq_to_mult=8, pad_to_max_length=True, max_segments=5)
    assert spec.row_layout(pad_token_id=7) == RowLayout(64, 8, True, False, 5, 7)
    static = PackingSpec(64, pad_to_max_length=True, pad_cu_seqlens=True)
    assert static.row_layout(slots=3).static_segments == 3


class _NamedTokenizer(ByteTokenizer):
    @property
    def pad_token_id(self) -> int:
        return 3


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), _NamedTokenizer()])
def test_both_loaders_pad_with_the_same_id(tokenizer: ByteTokenizer) -> None:
    collator = VLMPackingCollator(64, encoder=ConversationEncoder(tokenizer))
    encoder = PackingTaskEncoder(tokenizer, seq_length=64)
    assert collator.layout.pad_token_id == encoder.layout.pad_token_id == tokenizer.pad_token_id


def test_the_encoder_fingerprint_keeps_its_row_keys() -> None:
    settings = PackingTaskEncoder(seq_length=64, pad_to_multiple_of=8).packing_settings(4)
    assert {k: settings[k] for k in RowLayout(64, 8).fingerprint()} == {
        "seq_length": 64,
        "pad_to_multiple_of": 8,
        "pad_to_max_length": False,
        "pad_token_id": ByteTokenizer().pad_token_id,
    }
    assert "pad_cu_seqlens" not in settings  # states saved before it existed still match


def _failure(position: int, key: str) -> SkippedSample:
    return SkippedSample(position, MediaError(key, "0.jpg", "corrupt", "broken"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=0, max_size=8))
def test_the_pack_step_drops_each_failing_sample_once(bad: list[bool]) -> None:
    # Samples are (index, is_bad); keys repeat on purpose: only the position tells them apart.
    samples = [(i, is_bad) for i, is_bad in enumerate(bad)]
    calls: list[list[int]] = []

    def pack(chosen: list[tuple[int, bool]]) -> list[int]:
        calls.append([i for i, _ in chosen])
        for position, (_, is_bad) in enumerate(chosen):
            if is_bad:
                raise _failure(position, "same-key")
        return [i for i, _ in chosen]

    dropped: list[int] = []
    result = pack_dropping_failures(samples, pack, lambda s, f: dropped.append(s[0]))
    assert dropped == [i for i, is_bad in samples if is_bad]
    good = [i for i, is_bad in samples if not is_bad]
    if good:
        assert result is not None
        packed, kept = result
        assert packed == good
        assert [i for i, _ in kept] == good
    else:
        assert result is None
    assert len(calls) == len(dropped) + (1 if good else 0)


# ------------------------------------------------- Megatron-Bridge's packed parquet rows
@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=2, max_size=40),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(60, 99),
)
def test_bridge_row_pads_spans_and_rolls_the_mask(
    sequences: list[list[tuple[int, bool]]], mult: int, pad_id: int
) -> None:
    layout = RowLayout(4096, mult)
    ids = [np.array([t for t, _ in seq]) for seq in sequences]
    masks = [np.array([int(m) for _, m in seq]) for seq in sequences]
    row_ids, row_mask, starts = layout.bridge_row(ids, masks, pad_id)
    assert row_ids.dtype == np.int64
    assert row_mask.dtype == np.int8
    assert len(row_ids) == len(row_mask)
    bounds = [*starts, len(row_ids)]
    assert starts[0] == 0
    assert len(starts) == len(sequences)
    for (a, b), seq_ids, seq_mask in zip(itertools.pairwise(bounds), ids, masks, strict=True):
        stored = row_ids[a:b]
        # Bridge feeds b - a - 1 tokens: that span meets the multiple, with the least padding
        assert (
            b - a - 1 == layout.bridge_span(len(seq_ids)) == aligned_length(len(seq_ids) - 1, mult)
        )
        assert stored[: len(seq_ids)].tolist() == seq_ids.tolist()
        assert (stored[len(seq_ids) :] == pad_id).all()
        # entry t weights the label t + 1 (Bridge's fill_packing_strategy roll); padding: 0
        rolled = row_mask[a:b].tolist()
        assert rolled[: len(seq_ids) - 1] == seq_mask[1:].tolist()
        assert rolled[len(seq_ids) - 1 :] == [0] * (b - a - len(seq_ids) + 1)
