"""``MRopeConfig(rule="qwen3_vl")`` equals transformers' ``get_rope_index`` of Qwen3-VL,
Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE, on single sequences and on packed rows that mix images,
videos (one block per temporal patch behind its timestamp text) and text-only samples.

Both video forms are covered: the one transformers 5.0-5.24 write (the template's outer
``<|vision_start|>``/``<|vision_end|>`` kept around the per-frame blocks) and the bare per-frame
blocks. The position rule reads only the pad runs, so both must give the reference's ids.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from chat_templates import QWEN3_VL
from hypothesis import given, settings
from hypothesis import strategies as st
from real_qwen import real_qwen_tokenizer
from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3VLConfig, Qwen3VLMoeConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel
from transformers.video_utils import VideoMetadata

from energon_pack.collate import VLMPackingCollator
from energon_pack.encoding.chatml import ByteTokenizer
from energon_pack.packing.mrope import (
    MRopeConfig,
    mrope_position_ids,
    mrope_setting,
    packed_mrope_position_ids,
)
from energon_pack.packing.row import build_packed_row

TOKENIZER = ByteTokenizer()
START = TOKENIZER.convert_tokens_to_ids("<|vision_start|>")
END = TOKENIZER.convert_tokens_to_ids("<|vision_end|>")
IMAGE = TOKENIZER.convert_tokens_to_ids("<|image_pad|>")
VIDEO = TOKENIZER.convert_tokens_to_ids("<|video_pad|>")
QWEN3 = MRopeConfig.from_tokenizer(TOKENIZER, rule="qwen3_vl")

MODELS: dict[str, tuple[Any, Any]] = {
    "qwen3_vl": (Qwen3VLModel, Qwen3VLConfig),
    "qwen3_vl_moe": (Qwen3VLMoeModel, Qwen3VLMoeConfig),
    "qwen3_5": (Qwen3_5Model, Qwen3_5Config),
    "qwen3_5_moe": (Qwen3_5MoeModel, Qwen3_5MoeConfig),
}


class _RopeIndex:
    """Just enough of a transformers model to call its ``get_rope_index`` (no weights)."""

    def __init__(self, family: str) -> None:
        model, config = MODELS[family]
        self._model = model
        self.config = config(vision_config={"spatial_merge_size": 2})

    def __call__(
        self, ids: torch.Tensor, image: torch.Tensor | None, video: torch.Tensor | None, pads: Any
    ) -> tuple[torch.Tensor, int]:
        image_pad, video_pad = pads
        types = (ids == image_pad).long() + 2 * (ids == video_pad).long()
        positions, deltas = self._model.get_rope_index(
            self, ids[None], types[None], image_grid_thw=image, video_grid_thw=video
        )
        return positions[:, 0], int(deltas[0, 0])

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._model.get_vision_position_ids(self, *args, **kwargs)  # type: ignore[no-any-return]


REFERENCES = {family: _RopeIndex(family) for family in MODELS}


def _grids(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def _optional(table: torch.Tensor) -> torch.Tensor | None:
    return table if table.numel() else None


_TEXT = st.lists(st.integers(0, 255), max_size=5)


@st.composite
def _sequences(draw: st.DrawFn) -> dict[str, Any]:
    """Text, images and Qwen3-VL-form videos (per temporal patch: timestamp text + block)."""
    ids: list[int] = list(draw(st.lists(st.integers(0, 255), min_size=1, max_size=12)))
    images: list[list[int]] = []
    videos: list[list[int]] = []
    outer = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        h, w = draw(st.sampled_from([2, 4, 6])), draw(st.sampled_from([2, 4, 6]))
        pads = h * w // 4
        if draw(st.booleans()):
            t = draw(st.integers(1, 4))
            videos.append([t, h, w])
            ids += [START] if outer else []
            for _ in range(t):
                stamp = draw(st.lists(st.integers(0, 255), min_size=1, max_size=4))
                ids += [*stamp, START, *[VIDEO] * pads, END]
            ids += [END] if outer else []
        else:
            images.append([1, h, w])
            ids += [START, *[IMAGE] * pads, END]
        ids += draw(_TEXT)
    return {
        "input_ids": torch.tensor(ids),
        "loss_mask": torch.ones(len(ids)),
        "image": _grids(images),
        "video": _grids(videos),
    }


def _reference(family: str, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
    return REFERENCES[family](
        sample["input_ids"],
        _optional(sample["image"]),
        _optional(sample["video"]),
        (IMAGE, VIDEO),
    )


@settings(max_examples=60, deadline=None)
@given(sample=_sequences(), family=st.sampled_from(list(MODELS)))
def test_single_sequence_matches_get_rope_index(sample: dict[str, Any], family: str) -> None:
    expected, expected_delta = _reference(family, sample)
    positions, delta = mrope_position_ids(
        sample["input_ids"], sample["image"], sample["video"], None, QWEN3
    )
    assert torch.equal(positions, expected)
    assert delta == expected_delta


@settings(max_examples=60, deadline=None)
@given(
    samples=st.lists(_sequences(), min_size=1, max_size=5),
    multiple=st.sampled_from([1, 4, 8]),
    static=st.booleans(),
    family=st.sampled_from(list(MODELS)),
)
def test_packed_row_matches_get_rope_index_per_segment(
    samples: list[dict[str, Any]], multiple: int, static: bool, family: str
) -> None:
    used = sum(-(-s["input_ids"].numel() // multiple) * multiple for s in samples)
    options: dict[str, Any] = {"seq_length": used, "pad_to_multiple_of": multiple}
    if static:
        options.update(
            seq_length=used + 2 * multiple,
            pad_to_max_length=True,
            pad_cu_seqlens=True,
            max_segments=len(samples) + 2,
        )
    row = build_packed_row(samples, pad_token_id=TOKENIZER.pad_token_id, **options)
    positions, deltas = packed_mrope_position_ids(
        row.input_ids,
        row.cu_seqlens_padded,
        row.cu_seqlens,
        torch.cat([s["image"] for s in samples]),
        torch.cat([s["video"] for s in samples]),
        None,
        QWEN3,
    )
    offsets = row.cu_seqlens_padded.tolist()
    for i, sample in enumerate(samples):
        expected, delta = _reference(family, sample)
        start, length = offsets[i], sample["input_ids"].numel()
        assert torch.equal(positions[:, start : start + length], expected), i
        assert int(deltas[i]) == delta, i
        gap = torch.arange(offsets[i + 1] - start - length) + int(expected.max()) + 1
        assert torch.equal(positions[:, start + length : offsets[i + 1]], gap.expand(3, -1))


class _ProcessorRule:
    """Just enough of ``Qwen3VLProcessor`` to call its ``replace_image_token`` and
    ``replace_video_token`` (the text that replaces a medium's pad token), without its image
    and video processors."""

    image_token = "<|image_pad|>"
    video_token = "<|video_pad|>"
    vision_start_token = "<|vision_start|>"
    vision_end_token = "<|vision_end|>"
    image_processor = SimpleNamespace(merge_size=2)
    video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
    _calculate_timestamps = Qwen3VLProcessor._calculate_timestamps

    def expand(self, text: str, images: list[list[int]], videos: list[Any], outer: bool) -> str:
        """``text`` rendered by the chat template with its media expanded. ``outer``: as
        transformers 5.x does (only the pad token replaced, so the template's own
        ``<|vision_start|>``/``<|vision_end|>`` stay around the per-frame blocks); else as
        transformers 4.57 does (the template's whole video block replaced)."""
        pending = {"image": iter(images), "video": iter(videos)}
        video_block = "<|vision_start|><|video_pad|><|vision_end|>"
        out = []
        for part in re.split(f"({re.escape(self.image_token)}|{re.escape(video_block)})", text):
            if part == self.image_token:
                grid = torch.tensor([next(pending["image"])])
                out.append(Qwen3VLProcessor.replace_image_token(self, {"image_grid_thw": grid}, 0))
            elif part == video_block:
                grid, frames, fps = next(pending["video"])
                metadata = VideoMetadata(total_num_frames=max(frames) + 1, fps=fps)
                metadata.frames_indices = list(frames)
                inputs = {"video_grid_thw": torch.tensor([grid]), "video_metadata": [metadata]}
                blocks = Qwen3VLProcessor.replace_video_token(self, inputs, 0)
                out.append(f"<|vision_start|>{blocks}<|vision_end|>" if outer else blocks)
            else:
                out.append(part)
        return "".join(out)


def _turn(role: str, *media: str, text: str) -> dict[str, Any]:
    return {
        "role": role,
        "content": [*({"type": m} for m in media), {"type": "text", "text": text}],
    }


@pytest.mark.parametrize("outer", [True, False], ids=["transformers 5.x", "transformers 4.57"])
def test_real_template_row_of_images_video_and_text_matches_all_references(outer: bool) -> None:
    tokenizer = real_qwen_tokenizer(chat_template=QWEN3_VL)
    config = MRopeConfig.from_tokenizer(tokenizer, rule="qwen3_vl")
    pads = (config.image_token_id, config.video_token_id)
    # Six frames sampled from a 30 fps clip: three temporal patches of 2x2 merged tokens.
    video = ([3, 4, 4], [0, 15, 45, 60, 90, 119], 30.0)
    conversations: list[tuple[list[dict[str, Any]], list[list[int]], list[Any]]] = [
        (
            [_turn("user", "image", text="What is shown?"), _turn("assistant", text="A cat.")],
            [[1, 4, 6]],
            [],
        ),
        (
            [
                _turn("user", "video", text="What happens?"),
                _turn("assistant", text="It brightens."),
                _turn("user", "image", text="And here?"),
                _turn("assistant", text="It fades."),
            ],
            [[1, 6, 4]],
            [video],
        ),
        ([_turn("user", text="Just text, please."), _turn("assistant", text="Fine.")], [], []),
    ]
    rule = _ProcessorRule()
    samples = []
    for messages, images, videos in conversations:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        text = rule.expand(rendered, images, videos, outer)
        ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))
        samples.append(
            {"input_ids": ids, "loss_mask": torch.ones_like(ids), "image": _grids(images)}
            | {"video": _grids([v[0] for v in videos])}
        )
    video_text = tokenizer.decode(samples[1]["input_ids"])
    assert "<0.2 seconds><|vision_start|>" in video_text  # the mean of frames 0 and 15 / 30 fps
    assert video_text.count("seconds>") == 3
    # Timestamps are text: "<0.2 seconds>" is several ordinary tokens before each block.
    video_ids = samples[1]["input_ids"]
    assert int((video_ids == config.vision_start_token_id).sum()) == 3 + int(outer) + 1
    row = build_packed_row(
        samples, pad_token_id=tokenizer.pad_token_id, seq_length=512, pad_to_multiple_of=8
    )
    positions, deltas = packed_mrope_position_ids(
        row.input_ids,
        row.cu_seqlens_padded,
        row.cu_seqlens,
        torch.cat([s["image"] for s in samples]),
        torch.cat([s["video"] for s in samples]),
        torch.tensor([2.0]),  # a second_per_grid_ts the batch may carry is not read
        config,
    )
    offsets = row.cu_seqlens_padded.tolist()
    for family, reference in REFERENCES.items():
        for i, sample in enumerate(samples):
            ids = sample["input_ids"]
            expected, delta = reference(
                ids, _optional(sample["image"]), _optional(sample["video"]), pads
            )
            got = positions[:, offsets[i] : offsets[i] + ids.numel()]
            assert torch.equal(got, expected), (family, i)
            assert int(deltas[i]) == delta, (family, i)
    # Each frame is positioned as a one-frame grid: the temporal row is flat inside a block.
    video_positions = positions[:, offsets[1] : offsets[1] + video_ids.numel()]
    frames = video_positions[:, video_ids == config.video_token_id].reshape(3, 3, 4)
    assert (frames[0] == frames[0, :, :1]).all()
    assert frames[1, 0].tolist() == [frames[1, 0, 0]] * 2 + [frames[1, 0, 0] + 1] * 2


def test_qwen2_form_ids_and_rule_mismatches_name_the_fix() -> None:
    qwen2_form = torch.tensor([7, START, *[VIDEO] * 12, END, 8])  # one block, grid (3, 4, 4)
    per_frame = torch.tensor([7, *[1, START, *[VIDEO] * 4, END] * 3, 8])
    video = torch.tensor([[3, 4, 4]])
    with pytest.raises(
        ValueError,
        match=r"1 video blocks but video_grid_thw holds 3 temporal patches .*rule='qwen2_vl'",
    ):
        mrope_position_ids(qwen2_form, None, video, None, QWEN3)
    qwen2 = replace(QWEN3, rule="qwen2_vl")
    with pytest.raises(ValueError, match=r"3 video blocks but .* 1 rows.*rule='qwen3_vl'"):
        mrope_position_ids(per_frame, None, video, None, qwen2)
    with pytest.raises(ValueError, match=r"the video block at token 2 has 12 .* = 4"):
        mrope_position_ids(qwen2_form, None, torch.tensor([[1, 4, 4]]), None, QWEN3)


def test_rule_validation() -> None:
    with pytest.raises(ValueError, match=r"rule='qwen3_vl'\) takes no tokens_per_second"):
        replace(QWEN3, tokens_per_second=2)
    with pytest.raises(ValueError, match="rule must be 'qwen2_vl'"):
        replace(QWEN3, rule="qwen4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rule='qwen2_5_vl'\) needs tokens_per_second"):
        replace(QWEN3, rule="qwen2_5_vl")
    assert MRopeConfig.from_tokenizer(TOKENIZER).rule == "qwen2_vl"


def test_qwen2_5_vl_rule_is_the_one_block_rule_with_its_frame_spacing() -> None:
    ids = torch.tensor([7, START, *[VIDEO] * 12, END, 8])
    video, seconds = torch.tensor([[3, 4, 4]]), torch.tensor([0.5])
    qwen2_5 = replace(QWEN3, rule="qwen2_5_vl", tokens_per_second=2)
    positions, _ = mrope_position_ids(ids, None, video, seconds, qwen2_5)
    same, _ = mrope_position_ids(ids, None, video, seconds, replace(qwen2_5, rule="qwen2_vl"))
    assert torch.equal(positions, same)
    assert positions[0, 2:14].tolist() == [2 + i // 4 for i in range(12)]  # 2 tokens/s x 0.5 s


def test_an_mrope_config_with_one_d_positions_is_refused() -> None:
    assert mrope_setting("mrope", QWEN3, TOKENIZER) is QWEN3
    assert mrope_setting("1d", None, TOKENIZER) is None
    with pytest.raises(
        ValueError, match=r"rule='qwen3_vl'.*position_ids='1d'.*position_ids=MRopeConfig"
    ):
        VLMPackingCollator(64, mrope=QWEN3)
