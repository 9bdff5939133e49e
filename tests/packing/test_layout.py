"""Tests of THD row assembly (energon_pack.packing.row)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack.packing.row import IGNORE_INDEX, PackedRow, build_packed_row, unpack


def seq(ids: list[int], mask: list[float] | None = None, **extra: Any) -> dict[str, Any]:
    """A sequence whose loss mask defaults to all targets except the first token."""
    if mask is None:
        mask = [0.0] + [1.0] * (len(ids) - 1)
    return {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask), **extra}


def as_list(tensor: torch.Tensor) -> list[Any]:
    values: list[Any] = tensor.tolist()
    return values


# --- boundaries, shifting, masking -------------------------------------------------------------


def test_design_example_boundaries() -> None:
    row = build_packed_row(
        [seq([1, 2, 3, 4, 5]), seq([6, 7, 8, 9])], seq_length=16, pad_to_multiple_of=4
    )
    assert as_list(row.cu_seqlens) == [0, 5, 9]
    assert as_list(row.cu_seqlens_padded) == [0, 8, 12]
    assert row.max_seqlen == 8
    assert as_list(row.input_ids) == [1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 9]
    assert as_list(row.seq_idx) == [0] * 8 + [1] * 4
    assert as_list(row.position_ids) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert row.num_segments == 2


def test_shift_and_mask_inside_segments() -> None:
    row = build_packed_row(
        [seq([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]), seq([6, 7, 8], [0, 1, 0])],
        seq_length=8,
    )
    assert as_list(row.labels) == [-100, 3, 4, 5, -100, 7, -100, -100]
    assert as_list(row.loss_mask) == [0, 1, 1, 1, 0, 1, 0, 0]


def test_first_token_mask_is_ignored() -> None:
    """Nothing in the segment predicts its first token, so mask[0] has no effect."""
    a = build_packed_row([seq([1, 2, 3], [1, 1, 1]), seq([4, 5], [1, 1])], seq_length=5)
    b = build_packed_row([seq([1, 2, 3], [0, 1, 1]), seq([4, 5], [0, 1])], seq_length=5)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.loss_mask, b.loss_mask)
    # the last token of segment 0 does not predict the first token of segment 1
    assert int(a.labels[2]) == IGNORE_INDEX


def test_pad_token_id_fills_gaps() -> None:
    row = build_packed_row([seq([5, 6, 7])], seq_length=8, pad_to_multiple_of=4, pad_token_id=99)
    assert as_list(row.input_ids) == [5, 6, 7, 99]
    assert as_list(row.labels) == [6, 7, -100, -100]


def test_dtypes_and_shapes() -> None:
    row = build_packed_row(
        [seq([1, 2, 3]), seq([4, 5])], seq_length=12, pad_to_multiple_of=4, pad_to_max_length=True
    )
    assert row.input_ids.dtype == torch.long
    assert row.labels.dtype == torch.long
    assert row.loss_mask.dtype == torch.float32
    assert row.position_ids.dtype == torch.long
    assert row.cu_seqlens.dtype == torch.int32
    assert row.cu_seqlens_padded.dtype == torch.int32
    assert row.seq_idx.dtype == torch.int32
    assert isinstance(row.max_seqlen, int)
    for tensor in (row.input_ids, row.labels, row.loss_mask, row.position_ids, row.seq_idx):
        assert tensor.shape == (12,)


def test_weighted_loss_mask_is_carried() -> None:
    row = build_packed_row([seq([1, 2, 3], [0.0, 0.5, 1.0])], seq_length=3)
    assert as_list(row.loss_mask) == [0.5, 1.0, 0.0]


# --- input forms -------------------------------------------------------------------------------


@dataclass
class Encoded:
    input_ids: Any
    loss_mask: Any
    key: str = "obj"


def test_lists_numpy_tensors_and_objects_agree() -> None:
    ids, mask = [1, 2, 3, 4], [0, 1, 1, 0]
    rows = [
        build_packed_row([{"input_ids": ids, "loss_mask": mask}], seq_length=4),
        build_packed_row(
            [{"input_ids": np.array(ids, dtype=np.int32), "loss_mask": np.array(mask, bool)}],
            seq_length=4,
        ),
        build_packed_row([Encoded(torch.tensor(ids), torch.tensor(mask))], seq_length=4),
    ]
    for row in rows[1:]:
        assert torch.equal(row.input_ids, rows[0].input_ids)
        assert torch.equal(row.labels, rows[0].labels)
        assert torch.equal(row.loss_mask, rows[0].loss_mask)


def test_hf_labels_equal_loss_mask_form() -> None:
    ids = [10, 11, 12, 13, 14]
    hf = {"input_ids": ids, "labels": [-100, -100, 12, 13, 14]}
    masked = {"input_ids": ids, "loss_mask": [0, 0, 1, 1, 1]}
    a = build_packed_row([hf, masked], seq_length=10)
    b = build_packed_row([masked, masked], seq_length=10)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.loss_mask, b.loss_mask)
    assert as_list(a.labels[:5]) == [-100, 12, 13, 14, -100]


def test_loss_mask_wins_over_labels() -> None:
    both = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 0], "labels": [-100, 2, 3]}
    row = build_packed_row([both], seq_length=3)
    assert as_list(row.labels) == [2, -100, -100]


def test_pre_shifted_hf_labels_are_rejected() -> None:
    shifted = {"key": "s1", "input_ids": [1, 2, 3], "labels": [2, 3, -100]}
    with pytest.raises(ValueError, match=r"sample 's1': labels\[0\]=2 differs from input_ids"):
        build_packed_row([shifted], seq_length=3)


def test_custom_position_ids_and_gap_continuation() -> None:
    row = build_packed_row(
        [seq([1, 2, 3], position_ids=[7, 8, 9]), seq([4, 5])],
        seq_length=8,
        pad_to_multiple_of=4,
    )
    assert as_list(row.position_ids) == [7, 8, 9, 10, 0, 1, 2, 3]


def test_input_is_not_mutated() -> None:
    ids = torch.tensor([1, 2, 3])
    mask = torch.tensor([1.0, 1.0, 1.0])
    build_packed_row([{"input_ids": ids, "loss_mask": mask}], seq_length=3)
    assert as_list(mask) == [1.0, 1.0, 1.0]


# --- fixed width and static metadata -----------------------------------------------------------


def test_pad_to_max_length_absorbs_trailing_pad_in_last_segment() -> None:
    row = build_packed_row(
        [seq([1, 2, 3, 4, 5]), seq([6, 7, 8, 9])],
        seq_length=32,
        pad_to_multiple_of=4,
        pad_to_max_length=True,
    )
    assert row.input_ids.shape == (32,)
    assert as_list(row.cu_seqlens) == [0, 5, 9]
    assert as_list(row.cu_seqlens_padded) == [0, 8, 32]
    assert row.max_seqlen == 24
    assert as_list(row.seq_idx[8:]) == [1] * 24
    assert as_list(row.position_ids[8:]) == list(range(24))
    assert float(row.loss_mask[11:].sum()) == 0.0


def test_pad_cu_seqlens_static_metadata() -> None:
    row = build_packed_row(
        [seq([1, 2, 3, 4, 5]), seq([6, 7, 8, 9])],
        seq_length=16,
        pad_to_multiple_of=4,
        pad_to_max_length=True,
        pad_cu_seqlens=True,
        max_segments=5,
    )
    assert as_list(row.cu_seqlens) == [0, 5, 9, 9, 9, 9]
    assert as_list(row.cu_seqlens_padded) == [0, 8, 16, 16, 16, 16]
    assert row.max_seqlen == 16
    assert row.num_segments == 2


# --- adapters ----------------------------------------------------------------------------------


def test_packed_seq_params_kwargs() -> None:
    row = build_packed_row(
        [seq([1, 2, 3, 4, 5]), seq([6, 7, 8, 9])], seq_length=12, pad_to_multiple_of=4
    )
    kwargs = row.to_packed_seq_params_kwargs()
    assert kwargs["qkv_format"] == "thd"
    assert as_list(kwargs["cu_seqlens_q"]) == as_list(kwargs["cu_seqlens_kv"]) == [0, 5, 9]
    assert as_list(kwargs["cu_seqlens_q_padded"]) == [0, 8, 12]
    assert as_list(kwargs["cu_seqlens_kv_padded"]) == [0, 8, 12]
    assert kwargs["max_seqlen_q"] == kwargs["max_seqlen_kv"] == 8
    assert set(kwargs) == {
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded",
        "max_seqlen_q",
        "max_seqlen_kv",
        "qkv_format",
    }


def test_hf_varlen_kwargs_use_physical_boundaries() -> None:
    row = build_packed_row(
        [seq([1, 2, 3, 4, 5]), seq([6, 7, 8, 9])], seq_length=12, pad_to_multiple_of=4
    )
    kwargs = row.to_hf_varlen_kwargs()
    assert kwargs["position_ids"].shape == (1, 12)
    assert as_list(kwargs["cu_seq_lens_q"]) == as_list(kwargs["cu_seq_lens_k"]) == [0, 8, 12]
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 8


# --- properties --------------------------------------------------------------------------------


@st.composite
def groups(draw: st.DrawFn) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    n = draw(st.integers(1, 6))
    with_positions = draw(st.booleans())
    sequences = []
    for _ in range(n):
        length = draw(st.integers(1, 12))
        ids = draw(st.lists(st.integers(0, 50), min_size=length, max_size=length))
        tail = draw(st.lists(st.sampled_from([0, 1]), min_size=length - 1, max_size=length - 1))
        mask = [0, *tail]
        item: dict[str, Any] = {
            "input_ids": torch.tensor(ids),
            "loss_mask": torch.tensor(mask, dtype=torch.float32),
        }
        if with_positions:
            start = draw(st.integers(0, 100))
            item["position_ids"] = torch.arange(start, start + length)
        sequences.append(item)
    multiple = draw(st.sampled_from([1, 2, 4, 8]))
    used = sum(-(-len(s["input_ids"]) // multiple) * multiple for s in sequences)
    fixed = draw(st.booleans())
    seq_length = -(-(used + draw(st.integers(0, 16))) // multiple) * multiple
    options: dict[str, Any] = {
        "seq_length": seq_length,
        "pad_to_multiple_of": multiple,
        "pad_to_max_length": fixed,
    }
    if fixed and draw(st.booleans()):
        options.update(pad_cu_seqlens=True, max_segments=n + draw(st.integers(0, 3)))
    return sequences, options


@settings(max_examples=60, deadline=None)
@given(groups())
def test_unpack_inverts_build(case: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    sequences, options = case
    row = build_packed_row(sequences, **options)
    with_positions = "position_ids" in sequences[0]
    restored = unpack(row, position_ids=with_positions)
    assert len(restored) == len(sequences)
    for got, want in zip(restored, sequences, strict=True):
        assert set(got) == set(want)
        for name, value in want.items():
            assert torch.equal(got[name], value.to(got[name].dtype)), name


@settings(max_examples=60, deadline=None)
@given(groups())
def test_labels_never_cross_a_boundary(case: tuple[list[dict[str, Any]], dict[str, Any]]) -> None:
    sequences, options = case
    row = build_packed_row(sequences, **options)
    check_row_invariants(row, options["seq_length"], options.get("pad_to_max_length", False))
    cu = as_list(row.cu_seqlens)
    cu_pad = as_list(row.cu_seqlens_padded)
    real = torch.zeros(row.input_ids.shape[0], dtype=torch.bool)
    for i in range(len(cu) - 1):
        real[cu_pad[i] : cu_pad[i] + cu[i + 1] - cu[i]] = True
    for t in torch.nonzero(row.loss_mask).flatten().tolist():
        assert t + 1 < row.input_ids.shape[0]
        assert bool(real[t])
        assert bool(real[t + 1])
        assert int(row.seq_idx[t]) == int(row.seq_idx[t + 1])
        assert int(row.labels[t]) == int(row.input_ids[t + 1])
    assert bool((row.labels[row.loss_mask == 0] == IGNORE_INDEX).all())


def check_row_invariants(row: PackedRow, seq_length: int, fixed: bool) -> None:
    total = row.input_ids.shape[0]
    assert int(row.cu_seqlens_padded[-1]) == total
    assert total == seq_length if fixed else total <= seq_length
    spans = row.cu_seqlens_padded[1:] - row.cu_seqlens_padded[:-1]
    assert torch.equal(
        row.seq_idx.long(), torch.repeat_interleave(torch.arange(spans.shape[0]), spans.long())
    )


# --- rejections --------------------------------------------------------------------------------


def test_reject_empty_group() -> None:
    with pytest.raises(ValueError, match="empty group"):
        build_packed_row([], seq_length=8)


def test_reject_empty_sequence() -> None:
    with pytest.raises(ValueError, match=r"sample 'e': input_ids is empty \(length 0\)"):
        build_packed_row([{"key": "e", "input_ids": [], "loss_mask": []}], seq_length=8)


def test_reject_mismatched_loss_mask_length() -> None:
    bad = {"__key__": "k7", "input_ids": [1, 2, 3], "loss_mask": [0, 1]}
    with pytest.raises(
        ValueError, match="sample 'k7': loss_mask has length 2 but input_ids has length 3"
    ):
        build_packed_row([bad], seq_length=8)


def test_reject_mismatched_labels_and_position_lengths() -> None:
    with pytest.raises(ValueError, match="#1: labels has length 1 but input_ids has length 2"):
        build_packed_row([seq([1]), {"input_ids": [1, 2], "labels": [1]}], seq_length=8)
    with pytest.raises(
        ValueError, match="#0: position_ids has length 3 but input_ids has length 2"
    ):
        build_packed_row([seq([1, 2], position_ids=[0, 1, 2])], seq_length=8)


def test_reject_overlong_group_without_fixed_width() -> None:
    group = [seq([1] * 5, key="a"), seq([2] * 4, key="b")]
    with pytest.raises(
        ValueError,
        match=r"group needs 12 tokens .* multiple of 4 \(lengths: 'a'=5, 'b'=4\) "
        r"but seq_length=10",
    ):
        build_packed_row(group, seq_length=10, pad_to_multiple_of=4)


def test_reject_pad_cu_seqlens_without_fixed_width() -> None:
    with pytest.raises(
        ValueError, match=r"pad_cu_seqlens=True .* requires fixed-width rows; set pad_to_max_length"
    ):
        build_packed_row([seq([1, 2])], seq_length=8, pad_cu_seqlens=True, max_segments=2)


def test_reject_pad_cu_seqlens_without_max_segments() -> None:
    with pytest.raises(ValueError, match="pad_cu_seqlens=True requires max_segments"):
        build_packed_row([seq([1, 2])], seq_length=8, pad_to_max_length=True, pad_cu_seqlens=True)


def test_reject_more_segments_than_max_segments() -> None:
    with pytest.raises(ValueError, match=r"group has 3 segments .* but max_segments=2"):
        build_packed_row(
            [seq([1]), seq([2]), seq([3])],
            seq_length=8,
            pad_to_max_length=True,
            pad_cu_seqlens=True,
            max_segments=2,
        )


def test_reject_fixed_width_seq_length_not_aligned() -> None:
    with pytest.raises(
        ValueError, match=r"seq_length=10 is not a multiple of pad_to_multiple_of=4 \(pad_to_max"
    ):
        build_packed_row([seq([1])], seq_length=10, pad_to_multiple_of=4, pad_to_max_length=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seq_length": 0}, "seq_length must be a positive int, got 0"),
        ({"seq_length": 8, "pad_to_multiple_of": 0}, "pad_to_multiple_of must be a positive int"),
        ({"seq_length": 8, "max_segments": 0}, "max_segments must be a positive int or None"),
        ({"seq_length": 8, "pad_token_id": 1.5}, "pad_token_id must be an int token id"),
    ],
)
def test_reject_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_packed_row([seq([1, 2])], **kwargs)


def test_reject_missing_fields() -> None:
    with pytest.raises(ValueError, match="sample 'x': no input_ids"):
        build_packed_row([{"key": "x", "loss_mask": [1]}], seq_length=8)
    with pytest.raises(ValueError, match="sample 'x': neither loss_mask nor labels given"):
        build_packed_row([{"key": "x", "input_ids": [1]}], seq_length=8)


def test_reject_bad_values() -> None:
    with pytest.raises(ValueError, match=r"sample #0: input_ids must hold integers, got dtype"):
        build_packed_row([{"input_ids": [1.0, 2.0], "loss_mask": [0, 1]}], seq_length=8)
    with pytest.raises(ValueError, match=r"sample #0: input_ids must be 1-D \[L\], got shape"):
        build_packed_row([{"input_ids": [[1, 2]], "loss_mask": [[0, 1]]}], seq_length=8)
    with pytest.raises(ValueError, match=r"sample 'n': loss_mask\[1\]=-1.0; .* finite and >= 0"):
        build_packed_row([seq([1]), seq([1, 2], [0, -1], key="n")], seq_length=8)
    with pytest.raises(ValueError, match="sample #0: input_ids must be a 1-D numeric"):
        build_packed_row([{"input_ids": ["a", "b"], "loss_mask": [0, 1]}], seq_length=8)
