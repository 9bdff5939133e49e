"""Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 on real transformers model code (tiny models from
config: random weights, float64, CPU).

Qwen3-VL and Qwen3-VL-MoE: ``model(**batch.hf_model_inputs(model)).loss * targets`` and every
gradient of a packed batch of images, Qwen3-VL videos (one block per temporal patch behind its
timestamp text) and text equal the sums over its samples run alone, each with the positions
the model computes itself (``get_rope_index``). transformers computes the loss in float32,
hence the 1e-6.

Qwen3.5: its Gated DeltaNet layers run along the whole row on transformers' torch path, so a
packed segment sees its predecessors; packed rows are refused by name, and one sample per row
trains exactly like one sample at a time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import batches, fixture_maker, image_bytes, read_samples, train_dataset, video_bytes
from test_hf import Grads, assert_same_training_signal, forward_backward
from transformers import (
    PreTrainedModel,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

from energon_pack.collate import CollatedBatch, VLMPackingCollator
from energon_pack.encoding.chatml import ByteTokenizer, ConversationEncoder
from energon_pack.media import MediaConfig, MediaTensors
from energon_pack.media.assembly import MediaItem
from energon_pack.packing.mrope import MRopeConfig
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row import IGNORE_INDEX
from energon_pack.train.hf import HFTarget

TOKENIZER = ByteTokenizer()
# Qwen3-VL geometry (patch 16, mean and std 0.5) with small budgets to keep decoding cheap.
MEDIA = MediaConfig(
    patch_size=16,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    min_pixels=32 * 32 * 4,
    max_pixels=32 * 32 * 64,
)
ENCODER = ConversationEncoder(TOKENIZER, media=MEDIA)
START = TOKENIZER.convert_tokens_to_ids("<|vision_start|>")
END = TOKENIZER.convert_tokens_to_ids("<|vision_end|>")
IMAGE_PAD = TOKENIZER.convert_tokens_to_ids("<|image_pad|>")
VIDEO_PAD = TOKENIZER.convert_tokens_to_ids("<|video_pad|>")
QWEN3 = MRopeConfig.from_tokenizer(TOKENIZER, rule="qwen3_vl")


def tiny_model(family: str, attn: str = "sdpa", layer_types: Sequence[str] = ()) -> PreTrainedModel:
    """A two-layer model of ``family`` with random float64 weights, in training mode."""
    torch.manual_seed(0)
    text: dict[str, Any] = {
        "vocab_size": TOKENIZER.vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 8192,
        "pad_token_id": TOKENIZER.pad_token_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }
    vision: dict[str, Any] = {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
    }
    special = {
        "image_token_id": IMAGE_PAD,
        "video_token_id": VIDEO_PAD,
        "vision_start_token_id": START,
        "vision_end_token_id": END,
    }
    model: PreTrainedModel
    if family == "qwen3_5":
        text.update(
            layer_types=list(layer_types or ("linear_attention", "full_attention")),
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        text["rope_parameters"]["partial_rotary_factor"] = 1.0
        model = Qwen3_5ForConditionalGeneration(
            Qwen3_5Config(text_config=text, vision_config=vision, **special)
        )
    else:
        vision["deepstack_visual_indexes"] = [0]
        if family == "qwen3_vl":
            model = Qwen3VLForConditionalGeneration(
                Qwen3VLConfig(text_config=text, vision_config=vision, **special)
            )
        else:
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
            model = Qwen3VLMoeForConditionalGeneration(
                Qwen3VLMoeConfig(text_config=text, vision_config=vision, **special)
            )
            # grouped_mm, the default on CPU, has no float64 kernel.
            model.set_experts_implementation("eager")
    model.config._attn_implementation = attn
    return model.double().train()


def conversation(key: str, question: str, answer: str, **media: bytes) -> EncodedSample:
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return ENCODER.encode_sample(key, {"json": {"conversations": turns}, **media})


def qwen3_video(key: str, grid: tuple[int, int, int], *, outer: bool, seed: int) -> EncodedSample:
    """A sample with one Qwen3-VL video: per temporal patch ``<{t:.1f} seconds>`` and a block
    of ``h*w/4`` pads; ``outer`` keeps the template's own pair around them (transformers 5.x).
    Its patches are random (the model reads them as they are)."""
    t, h, w = grid
    blocks: list[int] = []
    for patch in range(t):
        blocks += list(f"<{2 * patch + 0.5:.1f} seconds>".encode())
        blocks += [START, *[VIDEO_PAD] * (h * w // 4), END]
    if outer:
        blocks = [START, *blocks, END]
    answer = list(b"it moves")
    ids = torch.tensor([*b"watch ", *blocks, *b" what happens?", *answer])
    mask = torch.zeros_like(ids)
    mask[-len(answer) :] = 1
    generator = torch.Generator().manual_seed(seed)
    patches = torch.randn(t * h * w, MEDIA.patch_dim, generator=generator)
    item = MediaItem(f"{key}.mp4", "video", b"", grid, t * h * w // 4)
    vision = MediaTensors(pixel_values_videos=patches, video_grid_thw=torch.tensor([grid]))
    return EncodedSample(key, ids, mask, media=(item,), vision=vision)


@pytest.fixture(scope="module")
def samples() -> list[EncodedSample]:
    """Images, Qwen3-VL videos (both forms) and text, as one micro-batch."""
    return [
        conversation("image", "look <image> here", "a cat", **{"0.png": image_bytes(64, 48)}),
        qwen3_video("video", (3, 4, 6), outer=True, seed=0),
        conversation("text", "just text, please", "fine, here it is"),
        conversation(
            "two images",
            "<image> and <image>",
            "two of them",
            **{"0.png": image_bytes(40, 90, seed=1), "1.jpg": image_bytes(70, 30, "JPEG")},
        ),
        qwen3_video("bare video", (2, 4, 4), outer=False, seed=1),
    ]


LAYOUTS: dict[str, dict[str, Any]] = {
    "dynamic": {"seq_length": 2048, "pad_to_multiple_of": 8},
    "rows": {
        "seq_length": 176,
        "pad_to_multiple_of": 4,
        "pad_to_max_length": True,
        "pad_cu_seqlens": True,
        "max_segments": 3,
    },
    "one per row": {
        "seq_length": 128,
        "pad_to_max_length": True,
        "pad_cu_seqlens": True,
        "max_segments": 1,
    },
}


def collator(layout: str, **options: Any) -> VLMPackingCollator:
    options.setdefault("position_ids", "mrope")
    options.setdefault("mrope", QWEN3)
    return VLMPackingCollator(**LAYOUTS[layout], encoder=ENCODER, **options)


def alone_inputs(sample: EncodedSample, media: MediaConfig = MEDIA) -> dict[str, Any]:
    """A sample's inputs as a user runs it alone (its media decoded with ``media``, as they
    were encoded): the model computes its own positions."""
    ids = sample.input_ids
    labels = torch.where(sample.loss_mask != 0, ids, IGNORE_INDEX)
    labels[0] = IGNORE_INDEX
    token_types = (ids == IMAGE_PAD).long() + 2 * (ids == VIDEO_PAD).long()
    inputs: dict[str, Any] = {
        "input_ids": ids[None],
        "labels": labels[None],
        "mm_token_type_ids": token_types[None],
        "use_cache": False,
    }
    vision = sample.materialize(media).vision
    if vision is not None:
        inputs.update(vision.tensors())
        inputs.pop("second_per_grid_ts", None)
    return inputs


def one_by_one(
    model: PreTrainedModel, samples: Sequence[EncodedSample], media: MediaConfig = MEDIA
) -> tuple[float, Grads]:
    """Summed ``loss * targets`` and gradients of the samples run alone."""
    model.zero_grad()
    total = 0.0
    for sample in samples:
        inputs = alone_inputs(sample, media)
        targets = int((inputs["labels"] != IGNORE_INDEX).sum())
        out = model(**inputs)
        (out.loss * targets).backward()
        total += float(out.loss.detach()) * targets
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total, grads


def worst_gradient_error(packed: Grads, single: Grads) -> float:
    assert packed.keys() == single.keys()
    return max(
        float((packed[name] - grad).abs().max() / grad.abs().max()) for name, grad in single.items()
    )


CASES = [
    ("qwen3_vl", "sdpa", "dynamic"),
    ("qwen3_vl", "sdpa", "rows"),
    ("qwen3_vl", "eager", "rows"),
    ("qwen3_vl_moe", "sdpa", "dynamic"),
    ("qwen3_vl_moe", "sdpa", "rows"),
]


@pytest.mark.parametrize(("family", "attn", "layout"), CASES)
def test_packed_equals_one_by_one(
    samples: list[EncodedSample], family: str, attn: str, layout: str
) -> None:
    batch = collator(layout).collate(samples)
    assert batch.num_rows == (1 if layout == "dynamic" else 2)
    assert all(len(keys) >= 2 for keys in batch.keys)  # packed rows, not one sample each
    videos = batch.vision.video_grid_thw
    assert videos is not None
    assert videos.tolist() == [[3, 4, 6], [2, 4, 4]]
    model = tiny_model(family, attn)
    inputs = batch.hf_model_inputs(model)
    assert inputs["position_ids"].shape == (4, *batch.input_ids.shape)
    assert inputs["use_cache"] is False
    # The forward needs no mm_token_type_ids (only to compute positions itself) and takes no
    # second_per_grid_ts.
    assert not {"mm_token_type_ids", "second_per_grid_ts"} & inputs.keys()
    assert_same_training_signal(forward_backward(model, inputs), one_by_one(model, samples))


def test_flash_attention_inputs_run_through_sdpa_equal_one_by_one(
    samples: list[EncodedSample],
) -> None:
    # Flash attention cannot run on CPU: its flattened row is run through sdpa, which finds the
    # same segments in the text position row.
    batch = collator("rows").collate(samples)
    rows, width = batch.input_ids.shape
    inputs = batch.hf_model_inputs(HFTarget("qwen3_vl", "flash_attention_2"))
    assert inputs["position_ids"].shape == (4, 1, rows * width)
    assert not {"cu_seq_lens_q", "cu_seq_lens_k"} & inputs.keys()
    model = tiny_model("qwen3_vl")
    assert_same_training_signal(forward_backward(model, inputs), one_by_one(model, samples))


@pytest.fixture(scope="module")
def one_d_batch(samples: list[EncodedSample]) -> CollatedBatch:
    return collator("dynamic", position_ids="1d", mrope=None).collate(samples)


def test_one_d_positions_are_refused_for_an_mrope_model(
    samples: list[EncodedSample], one_d_batch: CollatedBatch
) -> None:
    model = tiny_model("qwen3_vl")
    fix = r"position_ids='1d'.*Pack with position_ids='mrope'.*rule='qwen3_vl'"
    with pytest.raises(ValueError, match=r"a qwen3_vl model takes 3-D mRoPE position ids.*" + fix):
        one_d_batch.hf_model_inputs(model)
    with pytest.raises(ValueError, match=r"a qwen3_vl_moe model takes 3-D mRoPE"):
        collator("dynamic", position_ids="1d", mrope=None, output="hf", hf_model=Qwen3VLMoeConfig())
    # What the refusal prevents: 1-D positions train on another signal than the samples alone.
    wrong = one_d_batch.hf_model_inputs(HFTarget())  # a target that does not know the model
    loss, grads = forward_backward(model, wrong)
    single_loss, single_grads = one_by_one(model, samples)
    assert abs(loss - single_loss) > 1e-6 * single_loss
    assert worst_gradient_error(grads, single_grads) > 1e-3


@pytest.fixture(scope="module")
def image_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared Energon dataset of image and text conversations."""
    root = tmp_path_factory.mktemp("qwen3_images")
    members: list[tuple[str, bytes]] = []
    for index in range(6):
        key = f"s{index:05d}"
        images = index % 3
        question = " ".join(["<image>"] * images) + f" question {index}"
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": f"answer {index}"}]
        members.append((f"{key}.json", json.dumps({"conversations": turns}).encode()))
        for image in range(images):
            png = image_bytes(32 + 16 * index, 96 - 8 * image, seed=index)
            members.append((f"{key}.{image}.png", png))
    maker = fixture_maker()
    maker.write_tar(root / "shard-000000.tar", members)
    maker.prepare_energon(root, [root / "shard-000000.tar"])
    return root


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_energon_packed_batch_equals_one_by_one(image_dataset: Path, family: str) -> None:
    dataset = train_dataset(
        image_dataset,
        6,
        seq_length=512,
        media=MEDIA,
        position_ids="mrope",
        mrope=QWEN3,
        pad_to_max_length=True,
    )
    batch = next(batches(dataset))
    assert len(batch.__keys__) >= 3
    assert batch.image_grid_thw is not None
    model = tiny_model(family)
    inputs = batch.hf_model_inputs(model)
    assert inputs["position_ids"].shape == (4, 1, 512)
    raw = read_samples(image_dataset)
    packed = [ENCODER.encode_sample(key, raw[key]) for key in batch.__keys__]
    assert_same_training_signal(forward_backward(model, inputs), one_by_one(model, packed))


def test_energon_one_d_batch_is_refused_for_an_mrope_model(image_dataset: Path) -> None:
    dataset = train_dataset(image_dataset, 6, seq_length=512, media=MEDIA)
    batch = next(batches(dataset))
    assert batch.mrope_position_ids is None
    with pytest.raises(ValueError, match=r"a qwen3_vl model takes 3-D mRoPE position ids"):
        batch.hf_model_inputs(Qwen3VLConfig())


def test_qwen2_vl_rule_on_qwen3_video_ids_names_the_rule(samples: list[EncodedSample]) -> None:
    qwen2 = replace(QWEN3, rule="qwen2_vl")
    with pytest.raises(ValueError, match=r"video blocks but .*need MRopeConfig\(rule='qwen3_vl'\)"):
        collator("dynamic", mrope=qwen2).collate(samples)


# --- Qwen3.5: linear attention ---------------------------------------------------------------


def segment_logits_shift(model: PreTrainedModel, samples: Sequence[EncodedSample]) -> float:
    """Largest relative change of the last sample's logits, packed behind the others (inputs
    built for a target that does not know the model's layers) vs run alone."""
    batch = collator("dynamic").collate(samples)
    inputs = batch.hf_model_inputs(HFTarget())
    last = samples[-1]
    assert batch.keys[0][-1] == last.key
    start = int(batch.cu_seqlens_padded[0][-2])
    alone = alone_inputs(last)
    with torch.no_grad():
        packed = model(**inputs).logits[0, start : start + last.length]
        single = model(**{k: v for k, v in alone.items() if k != "labels"}).logits[0]
    return float((packed - single).abs().max() / single.abs().max())


def test_qwen3_5_linear_attention_carries_state_across_segments(
    samples: list[EncodedSample],
) -> None:
    text = [samples[2], samples[0]]  # text, then an image sample
    linear = segment_logits_shift(tiny_model("qwen3_5"), text)
    control = segment_logits_shift(tiny_model("qwen3_5", layer_types=["full_attention"] * 2), text)
    assert linear > 1e-3
    assert control < 1e-12


def test_qwen3_5_packed_rows_are_refused_by_name(samples: list[EncodedSample]) -> None:
    model = tiny_model("qwen3_5")
    assert HFTarget.of(model).linear_attention  # read from the text config's layer_types
    assert not HFTarget.of(Qwen3VLConfig()).segment_blind
    text_only = HFTarget.of(Qwen3_5TextConfig())  # Qwen3_5ForCausalLM: 1-D positions, refused
    assert text_only.segment_blind
    assert not text_only.mrope
    batch = collator("rows").collate(samples)
    with pytest.raises(
        ValueError,
        match=r"a qwen3_5 model has linear-attention layers .*row 0 holds 3 segments.*"
        r"max_segments=1, pad_cu_seqlens=True, pad_to_max_length=True",
    ):
        batch.hf_model_inputs(model)
    # By model type alone too (a target built by hand, flash attention included).
    with pytest.raises(ValueError, match="linear-attention"):
        batch.hf_model_inputs(HFTarget("qwen3_5_moe", "flash_attention_2"))


def test_qwen3_5_one_sample_per_row_equals_one_by_one(samples: list[EncodedSample]) -> None:
    batch = collator("one per row").collate(samples)
    assert batch.num_rows == len(samples)
    model = tiny_model("qwen3_5")
    inputs = batch.hf_model_inputs(model)
    assert_same_training_signal(forward_backward(model, inputs), one_by_one(model, samples))
    # Flash attention keeps the rows: flattened, the recurrent state would run across them.
    flash = batch.hf_model_inputs(HFTarget("qwen3_5", "flash_attention_2"))
    assert flash["position_ids"].shape == (4, *batch.input_ids.shape)
    assert not {"cu_seq_lens_q", "cu_seq_lens_k"} & flash.keys()


# Decoded MP4s, sampled and laid out by the Qwen3-VL family's own video rule (timestamped
# per-patch blocks), with budgets small enough for a tiny model.
VIDEO_MEDIA = replace(
    MEDIA,
    video_rule="qwen3_vl",
    video_fps=2.0,
    video_min_frames=4,
    video_min_pixels=32 * 32 * 4,
    video_max_pixels=32 * 32 * 16,
    video_total_pixels=32 * 32 * 256,
)


def video_conversations(media: MediaConfig) -> tuple[ConversationEncoder, list[EncodedSample]]:
    encoder = ConversationEncoder(TOKENIZER, media=media)

    def conversation(key: str, question: str, answer: str, **files: bytes) -> EncodedSample:
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        return encoder.encode_sample(key, {"json": {"conversations": turns}, **files})

    return encoder, [
        conversation(
            "video", "<video> what happens?", "it brightens", **{"0.mp4": video_bytes(frames=12)}
        ),
        conversation("image", "look <image>", "a cat", **{"0.png": image_bytes(64, 48)}),
        conversation("text", "just text", "fine"),
        conversation(
            "both",
            "<image> then <video>",
            "both of them",
            **{"0.png": image_bytes(40, 90), "1.mp4": video_bytes(64, 96, frames=12, fps=6)},
        ),
    ]


@pytest.mark.parametrize("outer", [False, True], ids=["4.57 and 5.25 form", "5.24 form"])
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_decoded_videos_through_the_family_collator_equal_one_by_one(
    family: str, outer: bool
) -> None:
    """The collator given the family (and no ``mrope=``) takes the family's position rule: real
    clips in timestamped per-patch blocks train as one by one."""
    media = replace(VIDEO_MEDIA, video_outer_block=outer)
    encoder, samples = video_conversations(media)
    collate = VLMPackingCollator(
        seq_length=4096, pad_to_multiple_of=8, encoder=encoder, family=family, position_ids="mrope"
    )
    assert collate.mrope is not None
    assert collate.mrope.rule == "qwen3_vl"
    batch = collate.collate(samples)
    assert batch.num_rows == 1
    videos = batch.vision.video_grid_thw
    assert videos is not None
    starts = [int((s.input_ids == START).sum()) for s in samples]
    patches = [t for t, _, _ in videos.tolist()]
    assert starts == [patches[0] + outer, 1, 0, 1 + patches[1] + outer]
    model = tiny_model(family)
    inputs = batch.hf_model_inputs(model)
    assert_same_training_signal(forward_backward(model, inputs), one_by_one(model, samples, media))


def test_family_collator_refuses_one_d_positions_for_model_inputs() -> None:
    with pytest.raises(ValueError, match=r"family='qwen3_vl' and position_ids='1d'.*'mrope'"):
        VLMPackingCollator(seq_length=256, family="qwen3_vl", output="hf")


@pytest.fixture(scope="module")
def video_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared Energon dataset of video, image and text conversations."""
    root = tmp_path_factory.mktemp("qwen3_videos")
    members: list[tuple[str, bytes]] = []
    for index in range(4):
        key = f"s{index:05d}"
        kind = ("<video>", "<image>", "", "<video>")[index]
        turns = [
            {"from": "human", "value": f"{kind} question {index}"},
            {"from": "gpt", "value": f"answer {index}"},
        ]
        members.append((f"{key}.json", json.dumps({"conversations": turns}).encode()))
        if kind == "<video>":
            members.append((f"{key}.0.mp4", video_bytes(frames=8 + 4 * index, fps=4 + index)))
        elif kind == "<image>":
            members.append((f"{key}.0.png", image_bytes(48, 80, seed=index)))
    maker = fixture_maker()
    maker.write_tar(root / "shard-000000.tar", members)
    maker.prepare_energon(root, [root / "shard-000000.tar"])
    return root


def test_energon_decoded_videos_equal_one_by_one(video_dataset: Path) -> None:
    """The Energon task encoder given the family: its packed batch of real clips trains as the
    same samples one by one."""
    dataset = train_dataset(
        video_dataset,
        4,
        seq_length=1024,
        media=VIDEO_MEDIA,
        family="qwen3_vl",
        position_ids="mrope",
        pad_to_max_length=True,
    )
    batch = next(batches(dataset))
    assert len(batch.__keys__) >= 3
    assert batch.video_grid_thw is not None
    model = tiny_model("qwen3_vl")
    encoder, _ = video_conversations(VIDEO_MEDIA)
    raw = read_samples(video_dataset)
    packed = [encoder.encode_sample(key, raw[key]) for key in batch.__keys__]
    inputs = batch.hf_model_inputs(model)
    single = one_by_one(model, packed, VIDEO_MEDIA)
    assert_same_training_signal(forward_backward(model, inputs), single)
