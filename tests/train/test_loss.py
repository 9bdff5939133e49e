"""Loss reductions from one packed forward equal the same reductions computed sample by sample.

On tiny Qwen2 and Qwen2.5-VL models (float64, CPU, random weights), for every reduction: the
packed loss and every parameter gradient equal those of each sample run alone, its mean token
loss combined across samples by the reduction. Property tests check the arithmetic itself and
the accumulation rule (summed normalisers) on random rows without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import batches, image_bytes, read_samples, train_dataset, video_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hf import (
    ENCODER,
    RELATIVE,
    Grads,
    collator,
    conversation,
    mrope,
    text_items,
    tiny_model,
)
from transformers import PreTrainedModel
from unpacked import token_losses

from energon_pack import PackedLoss, VLMPackingCollator, loss_normaliser, packed_loss
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row import IGNORE_INDEX
from energon_pack.train.hf import HFTarget
from energon_pack.train.loss import LOSS_SEGMENTS, Reduction

Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
COMBINE: dict[str, Combine] = {
    "token": lambda means, counts: (means * counts).sum() / counts.sum(),
    "sample": lambda means, counts: means.mean(),
    "sqrt": lambda means, counts: (means * counts.sqrt()).sum() / counts.sqrt().sum(),
}
REDUCTIONS = list(COMBINE)


def vlm_samples() -> list[EncodedSample]:
    items = [
        ("image", conversation("look <image> here", "a cat", **{"0.png": image_bytes(64, 48)})),
        ("text", conversation("just text, please", "fine, here it is, at some length")),
        (
            "video",
            conversation("<video> what happens?", "it brightens", **{"0.mp4": video_bytes()}),
        ),
        ("short", conversation("and one more question", "ok")),
    ]
    return [ENCODER.encode_sample(key, raw) for key, raw in items]


def grads_of(model: PreTrainedModel, loss: torch.Tensor) -> Grads:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def alone(model: PreTrainedModel, samples: Sequence[EncodedSample], reduction: str) -> Any:
    """The reduction of the samples' mean token losses, each sample run by itself."""
    losses = [token_losses(model, sample) for sample in samples]
    means = torch.stack([each.mean() for each in losses])
    counts = torch.tensor([float(each.numel()) for each in losses], dtype=torch.float64)
    loss = COMBINE[reduction](means, counts)
    return float(loss.detach()), grads_of(model, loss)


def assert_close(packed: tuple[float, Grads], single: tuple[float, Grads]) -> None:
    assert packed[0] == pytest.approx(single[0], rel=RELATIVE)
    assert packed[1].keys() == single[1].keys()
    for name, grad in single[1].items():
        scale = float(grad.abs().max())
        assert float((packed[1][name] - grad).abs().max()) <= RELATIVE * scale + 1e-12, name


CASES = [
    (family, form) for family in ("qwen2", "qwen2_5_vl") for form in ("batch", "hf", "flattened hf")
]


@pytest.mark.parametrize(("family", "form"), CASES)
def test_each_reduction_of_one_packed_forward_equals_sample_by_sample(
    family: str, form: str
) -> None:
    samples = text_items() if family == "qwen2" else vlm_samples()
    model = tiny_model(family)
    batch = collator(family, "rows").collate(samples)
    assert batch.num_rows == 2
    assert all(len(keys) >= 2 for keys in batch.keys)
    by_key = {s.key: int(s.loss_mask[1:].sum()) for s in samples}
    assert batch.target_counts.tolist() == [by_key[key] for row in batch.keys for key in row]
    target = HFTarget(family, "flash_attention_2") if form == "flattened hf" else model
    inputs = collator(family, "rows", output="hf", hf_model=target, loss_segments=True)(samples)
    assert isinstance(inputs, dict)
    segments = inputs.pop(LOSS_SEGMENTS)
    assert segments.shape == inputs["labels"].shape
    assert torch.equal(segments >= 0, inputs["labels"] != IGNORE_INDEX)
    for reduction in REDUCTIONS:
        single = alone(model, samples, reduction)
        if form == "batch":
            logits = model(**batch.hf_model_inputs(model)).logits
            loss = packed_loss(logits, batch, reduction)  # type: ignore[arg-type]
        else:
            model_inputs = {k: v for k, v in inputs.items() if k != "labels"}
            logits = model(**model_inputs).logits
            hf_batch = {"labels": inputs["labels"], LOSS_SEGMENTS: segments}
            loss = packed_loss(logits, hf_batch, reduction)  # type: ignore[arg-type]
        assert_close((float(loss.detach()), grads_of(model, loss)), single)


def test_energon_packed_batch_reductions_equal_sample_by_sample(vlm_demo_path: Path) -> None:
    dataset = train_dataset(
        vlm_demo_path,
        4,
        seq_length=2048,
        position_ids="mrope",
        mrope=mrope("qwen2_5_vl"),
        pad_to_max_length=True,
        overlong="skip",
    )
    batch = next(batches(dataset))
    assert len(batch.__keys__) >= 2
    raw = read_samples(vlm_demo_path)
    samples = [ENCODER.encode_sample(key, raw[key]) for key in batch.__keys__]
    model = tiny_model("qwen2_5_vl")
    for reduction in ("sample", "sqrt"):
        logits = model(**batch.hf_model_inputs(model)).logits
        loss = packed_loss(logits, batch, reduction)  # type: ignore[arg-type]
        packed = (float(loss.detach()), grads_of(model, loss))
        assert_close(packed, alone(model, samples, reduction))


@torch.no_grad()
def test_packed_loss_as_compute_loss_func_token_equals_the_models_loss() -> None:
    samples = text_items()
    model = tiny_model("qwen2")
    inputs = collator("qwen2", "fixed", output="hf", hf_model=model)(samples)
    assert isinstance(inputs, dict)
    own = model(**inputs).loss
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    targets = int((labels[..., 1:] != IGNORE_INDEX).sum())
    assert float(PackedLoss()(outputs, labels)) == pytest.approx(float(own), rel=RELATIVE)
    halved = PackedLoss("token")(outputs, labels, num_items_in_batch=torch.tensor(2 * targets))
    assert float(halved) == pytest.approx(float(own) / 2, rel=RELATIVE)


# Arithmetic on random rows (no model): the reductions by their definition, the normaliser, and
# the accumulation rule: micro-batches' losses over the summed normaliser add up to the whole.

VOCAB = 11


@st.composite
def micro_batches(draw: st.DrawFn) -> list[EncodedSample]:
    count = draw(st.integers(2, 6))
    samples = []
    for index in range(count):
        length = draw(st.integers(2, 12))
        ids = torch.tensor(
            draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
        )
        mask = torch.tensor(draw(st.lists(st.integers(0, 1), min_size=length, max_size=length)))
        samples.append(EncodedSample(f"s{index}", ids, mask))
    return samples


def _collate(samples: Sequence[EncodedSample], **options: Any) -> Any:
    return VLMPackingCollator(
        32,
        pad_to_multiple_of=4,
        pad_to_max_length=True,
        max_segments=3,
        pad_cu_seqlens=True,
        **options,
    )(list(samples))


def _by_definition(
    logits: torch.Tensor, samples: Sequence[EncodedSample], batch: Any, reduction: str
) -> torch.Tensor:
    """Each segment's targets read off its own span of the rows, then the definition."""
    means, counts = [], []
    for row, keys in enumerate(batch.keys):
        bounds = batch.cu_seqlens_padded[row].tolist()
        for index in range(len(keys)):
            span = slice(bounds[index], bounds[index + 1])
            labels = batch.labels[row, span]
            keep = labels != IGNORE_INDEX
            if keep.any():
                nll = F.cross_entropy(logits[row, span][keep], labels[keep], reduction="none")
                means.append(nll.mean())
                counts.append(float(keep.sum()))
    return COMBINE[reduction](torch.stack(means), torch.tensor(counts, dtype=torch.float64))


@settings(max_examples=40, deadline=None)
@given(micro_batches(), st.sampled_from(REDUCTIONS), st.integers(0, 2**31 - 1))
def test_reductions_and_their_normaliser_follow_the_definition(
    samples: list[EncodedSample], reduction: Reduction, seed: int
) -> None:
    batch = _collate(samples)
    if not bool((batch.labels != IGNORE_INDEX).any()):
        assert float(packed_loss(torch.zeros(*batch.labels.shape, VOCAB), batch, reduction)) == 0
        return
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(*batch.labels.shape, VOCAB, dtype=torch.float64, generator=generator)
    want = _by_definition(logits, samples, batch, reduction)
    assert float(packed_loss(logits, batch, reduction)) == pytest.approx(float(want), rel=1e-12)
    counts = batch.target_counts[batch.target_counts > 0].double()
    expected_norm = {"token": counts.sum(), "sample": counts.numel(), "sqrt": counts.sqrt().sum()}
    assert float(loss_normaliser(batch, reduction)) == pytest.approx(
        float(expected_norm[reduction]), rel=1e-12
    )
    hf = _collate(samples, output="hf", loss_segments=True)
    assert float(packed_loss(logits, hf, reduction)) == pytest.approx(float(want), rel=1e-12)
    assert float(loss_normaliser(hf, reduction)) == pytest.approx(float(expected_norm[reduction]))


@settings(max_examples=30, deadline=None)
@given(micro_batches(), micro_batches(), st.sampled_from(REDUCTIONS))
def test_micro_batches_over_the_summed_normaliser_add_up_to_the_whole_step(
    first: list[EncodedSample], second: list[EncodedSample], reduction: Reduction
) -> None:
    whole = [
        *first,
        *[EncodedSample(f"b{i}", s.input_ids, s.loss_mask) for i, s in enumerate(second)],
    ]
    parts = [_collate(first), _collate(second)]
    step = _collate(whole)
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, VOCAB, dtype=torch.float64, generator=generator)
    total = sum(loss_normaliser(part, reduction) for part in parts)
    summed = sum(float(packed_loss(table[p.input_ids % VOCAB], p, reduction, total)) for p in parts)
    alone = float(packed_loss(table[step.input_ids % VOCAB], step, reduction))
    assert summed == pytest.approx(alone, rel=1e-10, abs=1e-12)


def test_bad_settings_and_batches_are_named() -> None:
    samples = [EncodedSample(k, torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1])) for k in "ab"]
    with pytest.raises(ValueError, match="reduction must be"):
        packed_loss(torch.zeros(1, 2, 3), _collate(samples), "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction must be"):
        PackedLoss("median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"loss_segments=True needs output='hf'"):
        VLMPackingCollator(64, loss_segments=True)
    with pytest.raises(ValueError, match="loss_segments must be True or False, got 1"):
        VLMPackingCollator(64, output="hf", loss_segments=1)  # type: ignore[arg-type]
    hf = _collate(samples, output="hf")
    with pytest.raises(ValueError, match=r"has no 'loss_segments'.*loss_segments=True"):
        packed_loss(torch.zeros(*hf["labels"].shape, 256), hf, "sample")
    rows = _collate(samples * 3)
    assert rows.num_rows == 2
    with pytest.raises(ValueError, match="2 rows without row_offsets"):
        loss_normaliser(SimpleNamespace(labels=rows.labels, seq_idx=rows.seq_idx), "sample")
    with pytest.raises(ValueError, match="needs the batch's 'labels'"):
        loss_normaliser({}, "token")
    with pytest.raises(ValueError, match=r"call loss\.attach"):
        PackedLoss("sqrt")({"logits": torch.zeros(1, 2, 3)}, torch.zeros(1, 2, dtype=torch.long))
