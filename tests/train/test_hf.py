"""``hf_model_inputs()`` on real transformers model code: packed training equals one by one.

Tiny Qwen2, Qwen2-VL and Qwen2.5-VL models are built from config (random weights, float64, CPU).
For each batch, ``model(**batch.hf_model_inputs(model)).loss * targets`` and every parameter
gradient must equal the sums over the batch's samples run alone (each with its own labels, its
positions computed by the model). transformers computes the loss in float32, hence the 1e-6.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SMALL_MEDIA, batches, image_bytes, read_samples, train_dataset, video_bytes
from transformers import (
    PreTrainedModel,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Trainer,
    TrainingArguments,
)
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from energon_pack.collate import CollatedBatch, VLMPackingCollator
from energon_pack.encoding.chatml import ByteTokenizer, ConversationEncoder
from energon_pack.packing.mrope import MRopeConfig
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row import IGNORE_INDEX
from energon_pack.train import hf
from energon_pack.train.hf import HFTarget

TOKENIZER = ByteTokenizer()
ENCODER = ConversationEncoder(TOKENIZER, media=SMALL_MEDIA)
IMAGE_PAD = TOKENIZER.convert_tokens_to_ids("<|image_pad|>")
VIDEO_PAD = TOKENIZER.convert_tokens_to_ids("<|video_pad|>")
TOKENS_PER_SECOND = {"qwen2_vl": None, "qwen2_5_vl": 2}
RELATIVE = 1e-6

Grads = dict[str, torch.Tensor]


def tiny_model(family: str, attn: str = "sdpa") -> PreTrainedModel:
    """A two-layer model of ``family`` with random float64 weights, in training mode."""
    torch.manual_seed(0)
    text: dict[str, Any] = {
        "vocab_size": TOKENIZER.vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": TOKENIZER.pad_token_id,
    }
    model: PreTrainedModel
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**text))
    else:
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
        }
        vision: dict[str, Any] = {
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": 32,
            "out_hidden_size": 32,
            "intermediate_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "spatial_merge_size": 2,
        }
        special = {
            "vision_start_token_id": TOKENIZER.convert_tokens_to_ids("<|vision_start|>"),
            "image_token_id": IMAGE_PAD,
            "video_token_id": VIDEO_PAD,
        }
        if family == "qwen2_vl":
            model = Qwen2VLForConditionalGeneration(
                Qwen2VLConfig(text_config=text, vision_config=vision, **special)
            )
        else:
            vision.update(tokens_per_second=2, window_size=56, fullatt_block_indexes=[0])
            model = Qwen2_5_VLForConditionalGeneration(
                Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
            )
    model.config._attn_implementation = attn
    return model.double().train()


def mrope(family: str) -> MRopeConfig:
    # The installed transformers (>= 5.3) resumes text after a video at start + max(h, w) / 2.
    return MRopeConfig.from_tokenizer(
        TOKENIZER, tokens_per_second=TOKENS_PER_SECOND[family], text_after_vision="spatial"
    )


def conversation(question: str, answer: str, **media: bytes) -> dict[str, Any]:
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return {"json": {"conversations": turns}, **media}


@pytest.fixture(scope="module")
def vlm_items() -> list[tuple[str, dict[str, Any]]]:
    """Images, a video and text in one micro-batch (``(key, raw sample)`` items)."""
    return [
        ("image", conversation("look <image> here", "a cat", **{"0.png": image_bytes(64, 48)})),
        ("text", conversation("just text, please", "fine, here it is")),
        (
            "video",
            conversation("<video> what happens?", "it brightens", **{"0.mp4": video_bytes()}),
        ),
        (
            "two images",
            conversation(
                "<image> and <image>",
                "two of them",
                **{"0.png": image_bytes(40, 90, seed=1), "1.jpg": image_bytes(70, 30, "JPEG")},
            ),
        ),
        ("more text", conversation("and one more question", "and one more answer")),
    ]


def text_items(count: int = 6) -> list[EncodedSample]:
    generator = torch.Generator().manual_seed(1)
    items = []
    for index in range(count):
        length = int(torch.randint(5, 40, (1,), generator=generator))
        ids = torch.randint(0, 256, (length,), generator=generator)
        mask = torch.randint(0, 2, (length,), generator=generator)
        items.append(EncodedSample(f"t{index}", ids, mask))
    return items


LAYOUTS: dict[str, dict[str, Any]] = {
    "dynamic": {"seq_length": 2048, "pad_to_multiple_of": 8},
    "fixed": {"seq_length": 1024, "pad_to_multiple_of": 8, "pad_to_max_length": True},
    "rows": {
        "seq_length": 160,
        "pad_to_multiple_of": 4,
        "pad_to_max_length": True,
        "pad_cu_seqlens": True,
        "max_segments": 3,
    },
}


def collator(family: str, layout: str, **options: Any) -> VLMPackingCollator:
    if family != "qwen2":
        options.update(position_ids="mrope", mrope=mrope(family))
    return VLMPackingCollator(**LAYOUTS[layout], encoder=ENCODER, **options)


def forward_backward(model: PreTrainedModel, inputs: Mapping[str, Any]) -> tuple[float, Grads]:
    """``loss * targets`` of one forward (the model's own mean loss) and the gradients."""
    model.zero_grad()
    out = model(**inputs)
    targets = int((inputs["labels"][..., 1:] != IGNORE_INDEX).sum())
    (out.loss * targets).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(out.loss.detach()) * targets, grads


def one_by_one(model: PreTrainedModel, samples: Sequence[EncodedSample]) -> tuple[float, Grads]:
    """Summed ``loss * targets`` and gradients of the samples run alone, as a user would."""
    model.zero_grad()
    total = 0.0
    for sample in samples:
        ids = sample.input_ids
        labels = torch.where(sample.loss_mask != 0, ids, IGNORE_INDEX)
        labels[0] = IGNORE_INDEX
        inputs: dict[str, Any] = {"input_ids": ids[None], "labels": labels[None]}
        vision = sample.materialize(SMALL_MEDIA).vision
        if model.config.model_type != "qwen2":
            token_types = (ids == IMAGE_PAD).long() + 2 * (ids == VIDEO_PAD).long()
            inputs["mm_token_type_ids"] = token_types[None]
            inputs.update(vision.tensors() if vision is not None else {})
            if model.config.model_type == "qwen2_vl":
                inputs.pop("second_per_grid_ts", None)
        targets = int((labels != IGNORE_INDEX).sum())
        out = model(**inputs, use_cache=False)
        (out.loss * targets).backward()
        total += float(out.loss.detach()) * targets
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, grads


def assert_same_training_signal(packed: tuple[float, Grads], single: tuple[float, Grads]) -> None:
    (packed_loss, packed_grads), (single_loss, single_grads) = packed, single
    assert packed_loss == pytest.approx(single_loss, rel=RELATIVE)
    assert packed_grads.keys() == single_grads.keys()
    for name, grad in single_grads.items():
        scale = float(grad.abs().max())
        assert float((packed_grads[name] - grad).abs().max()) <= RELATIVE * scale + 1e-12, name


def encoded(items: Sequence[tuple[str, dict[str, Any]]]) -> list[EncodedSample]:
    return [ENCODER.encode_sample(key, raw) for key, raw in items]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_qwen2_packed_equals_one_by_one(attn: str, layout: str) -> None:
    samples = text_items()
    batch = collator("qwen2", layout).collate(samples)
    assert batch.num_rows == (2 if layout == "rows" else 1)
    assert all(len(keys) >= 2 for keys in batch.keys)
    model = tiny_model("qwen2", attn)
    inputs = batch.hf_model_inputs(model)
    assert inputs["position_ids"].shape == batch.input_ids.shape
    assert_same_training_signal(forward_backward(model, inputs), one_by_one(model, samples))


VL_CASES = [
    (family, attn, layout)
    for family in ("qwen2_vl", "qwen2_5_vl")
    for attn, layout in (
        ("sdpa", "dynamic"),
        ("sdpa", "fixed"),
        ("sdpa", "rows"),
        ("eager", "rows"),
    )
]


@pytest.mark.parametrize(("family", "attn", "layout"), VL_CASES)
def test_qwen_vl_packed_equals_one_by_one(
    vlm_items: list[tuple[str, dict[str, Any]]], family: str, attn: str, layout: str
) -> None:
    batch = collator(family, layout).collate(vlm_items)
    assert batch.num_rows == (2 if layout == "rows" else 1)
    assert all(len(keys) >= 2 for keys in batch.keys)
    model = tiny_model(family, attn)
    inputs = batch.hf_model_inputs(model)
    assert inputs["position_ids"].shape == (4, *batch.input_ids.shape)
    assert inputs["use_cache"] is False
    assert ("second_per_grid_ts" in inputs) == (family == "qwen2_5_vl")
    packed = forward_backward(model, inputs)
    assert_same_training_signal(packed, one_by_one(model, encoded(vlm_items)))


def test_energon_packed_batch_equals_one_by_one(vlm_demo_path: Path) -> None:
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
    model = tiny_model("qwen2_5_vl")
    inputs = batch.hf_model_inputs(model)
    assert inputs["position_ids"].shape == (4, 1, 2048)
    raw = read_samples(vlm_demo_path)
    samples = [ENCODER.encode_sample(key, raw[key]) for key in batch.__keys__]
    assert_same_training_signal(forward_backward(model, inputs), one_by_one(model, samples))


# The three traps: each silently trains on wrong data, and the equality above catches each.


@pytest.fixture(scope="module")
def vl_rows(vlm_items: list[tuple[str, dict[str, Any]]]) -> CollatedBatch:
    batch = collator("qwen2_vl", "rows").collate(vlm_items)
    assert batch.num_rows == 2
    assert all(len(keys) >= 2 for keys in batch.keys)  # packed rows, not one sample each
    return batch


def _trap(vl_rows: CollatedBatch, vlm_items: list[tuple[str, Any]], change: str) -> None:
    """The training signal with ``change`` made to the inputs is far from the one-by-one one."""
    model = tiny_model("qwen2_vl")
    inputs = vl_rows.hf_model_inputs(model)
    single_loss, single_grads = one_by_one(model, encoded(vlm_items))
    if change == "use_cache":
        del inputs["use_cache"]  # the config's default, True
    elif change == "mrope_only":
        inputs["position_ids"] = vl_rows.mrope_position_ids
    else:
        inputs["labels"] = vl_rows.labels
    loss, grads = forward_backward(model, inputs)
    assert abs(loss - single_loss) > 1e-5 * single_loss  # float32 rounding is ~1e-8 here
    worst = max(
        float((grads[name] - grad).abs().max() / grad.abs().max())
        for name, grad in single_grads.items()
    )
    assert worst > 1e-2


def test_trap_a_cache_lets_attention_cross_segments(
    vl_rows: CollatedBatch, vlm_items: list[tuple[str, Any]]
) -> None:
    assert tiny_model("qwen2_vl").config.get_text_config().use_cache is True
    _trap(vl_rows, vlm_items, "use_cache")


def test_trap_b_three_mrope_rows_lose_the_segment_mask(
    vl_rows: CollatedBatch, vlm_items: list[tuple[str, Any]]
) -> None:
    _trap(vl_rows, vlm_items, "mrope_only")


def test_trap_c_shifted_labels_are_shifted_twice(
    vl_rows: CollatedBatch, vlm_items: list[tuple[str, Any]]
) -> None:
    _trap(vl_rows, vlm_items, "labels")


def test_labels_are_unshifted_with_segment_starts_ignored(vl_rows: CollatedBatch) -> None:
    labels = vl_rows.hf_model_inputs()["labels"]
    assert torch.equal(labels[:, 1:], vl_rows.labels[:, :-1])
    for row, (cu, keys) in enumerate(zip(vl_rows.cu_seqlens_padded, vl_rows.keys, strict=True)):
        assert (labels[row, cu[: len(keys)].long()] == IGNORE_INDEX).all()
    targets = labels != IGNORE_INDEX
    assert torch.equal(labels[targets], vl_rows.input_ids[targets])


# Flash attention cannot run on CPU: its inputs are checked against transformers' own reading of
# them, and run through sdpa, which reads the same flattened row the same way.


def test_flash_attention_text_inputs() -> None:
    samples = text_items(5)
    batch = collator("qwen2", "rows").collate(samples)
    rows, width = batch.input_ids.shape
    inputs = batch.hf_model_inputs(HFTarget("qwen2", "flash_attention_2"))
    for name in ("input_ids", "labels", "position_ids"):
        assert inputs[name].shape == (1, rows * width), name
    assert inputs["cu_seq_lens_q"] is inputs["cu_seq_lens_k"]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32
    real = sum(len(keys) for keys in batch.keys)
    assert batch.cu_seqlens_padded_flat.numel() > real + 1  # static slots, left out here
    assert torch.equal(inputs["cu_seq_lens_q"], batch.cu_seqlens_padded_flat[: real + 1])
    assert inputs["max_length_q"] == inputs["max_length_k"] == batch.max_seqlen
    # transformers finds the same segments in the flattened position ids.
    (derived, _), _ = prepare_fa_kwargs_from_position_ids(inputs["position_ids"])
    assert torch.equal(derived, inputs["cu_seq_lens_q"])
    model = tiny_model("qwen2")
    assert_same_training_signal(forward_backward(model, inputs), one_by_one(model, samples))


def test_flash_attention_vl_inputs_leave_boundaries_to_the_text_positions(
    vl_rows: CollatedBatch, vlm_items: list[tuple[str, Any]]
) -> None:
    rows, width = vl_rows.input_ids.shape
    inputs = vl_rows.hf_model_inputs(HFTarget("qwen2_vl", "flash_attention_2"))
    assert inputs["position_ids"].shape == (4, 1, rows * width)
    # The vision encoder's flash attention sets cu_seq_lens itself: none are passed down.
    assert not {"cu_seq_lens_q", "cu_seq_lens_k"} & inputs.keys()
    (derived, _), (longest, _) = prepare_fa_kwargs_from_position_ids(inputs["position_ids"][0])
    assert torch.equal(derived, torch.unique_consecutive(vl_rows.cu_seqlens_padded_flat))
    assert int(longest) <= vl_rows.max_seqlen
    model = tiny_model("qwen2_vl")
    assert_same_training_signal(
        forward_backward(model, inputs), one_by_one(model, encoded(vlm_items))
    )


def test_target_of_model_config_and_errors() -> None:
    model = tiny_model("qwen2_5_vl", "eager")
    assert HFTarget.of(model) == HFTarget("qwen2_5_vl", "eager")
    assert HFTarget.of(model.config) == HFTarget("qwen2_5_vl", "eager")
    assert HFTarget.of(None) == HFTarget()
    assert HFTarget("qwen2", "flash_attention_3").flash
    with pytest.raises(ValueError, match=r"without config\.model_type"):
        HFTarget.of(object())


@pytest.mark.parametrize(
    ("installed", "match"),
    [("4.57.1", r"needs transformers >= 5\.0, found 4\.57\.1"), (None, "which is not installed")],
)
def test_unsupported_transformers_is_refused(
    monkeypatch: pytest.MonkeyPatch, vl_rows: CollatedBatch, installed: str | None, match: str
) -> None:
    monkeypatch.setattr(hf, "_installed_transformers", lambda: installed)
    with pytest.raises(RuntimeError, match=match):
        vl_rows.hf_model_inputs()


def test_version_parsing() -> None:
    assert hf._release("5.0.0rc1") == (5, 0)
    assert hf._release("4.57.1") == (4, 57)
    assert hf._release("5.24.0.dev0") == (5, 24)
    assert hf._release("main") == (0, 0)


def test_collator_output_hf(vlm_items: list[tuple[str, Any]]) -> None:
    model = tiny_model("qwen2_5_vl")
    collate = collator("qwen2_5_vl", "fixed", output="hf", hf_model=model)
    restored = pickle.loads(pickle.dumps(collate))
    got = restored(vlm_items)
    assert isinstance(got, dict)
    expected = collate.collate(vlm_items).hf_model_inputs(model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value) if torch.is_tensor(value) else got[name] == value
    with pytest.raises(ValueError, match="output must be 'batch' or 'hf'"):
        collator("qwen2_5_vl", "fixed", output="megatron")


class _Recording:
    """A data collator that remembers the sample keys of every micro-batch it packed."""

    def __init__(self, collate: VLMPackingCollator) -> None:
        self.collate = collate
        self.keys: list[list[str]] = []

    def __call__(self, items: list[dict[str, Any]]) -> Any:
        self.keys.append([item["__key__"] for item in items])
        return self.collate(items)


def test_trainer_runs_with_the_collator(vlm_demo_path: Path, tmp_path: Path) -> None:
    raw = read_samples(vlm_demo_path)
    keys = sorted(raw)[:8]
    dataset = [{"__key__": key, **raw[key]} for key in keys]
    model = tiny_model("qwen2_vl")
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    collate = _Recording(collator("qwen2_vl", "fixed", output="hf", hf_model=model))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=3,
        logging_steps=1,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2
    assert all(torch.isfinite(torch.tensor(losses)))
    fresh = tiny_model("qwen2_vl")
    fresh.load_state_dict(initial)
    first = [ENCODER.encode_sample(key, raw[key]) for key in collate.keys[0]]
    total, _ = one_by_one(fresh, first)
    targets = sum(int(s.loss_mask[1:].sum()) for s in first)
    assert losses[0] == pytest.approx(total / targets, rel=RELATIVE)
