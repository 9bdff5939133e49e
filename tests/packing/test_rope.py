from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers import image_bytes, video_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

from energon_pack.encoding.chatml import ByteTokenizer, ConversationEncoder
from energon_pack.media import MediaTensors
from energon_pack.packing.mrope import MRopeConfig, mrope_position_ids, packed_mrope_position_ids
from energon_pack.packing.packed import EncodedSample, mrope_for_packed, pack_samples
from energon_pack.packing.row import build_packed_row

TOKENIZER = ByteTokenizer()
START = TOKENIZER.convert_tokens_to_ids("<|vision_start|>")
END = TOKENIZER.convert_tokens_to_ids("<|vision_end|>")
IMAGE = TOKENIZER.convert_tokens_to_ids("<|image_pad|>")
VIDEO = TOKENIZER.convert_tokens_to_ids("<|video_pad|>")
QWEN2 = MRopeConfig.from_tokenizer(TOKENIZER)


class _RopeIndex:
    """Just enough of a transformers Qwen-VL model to call its get_rope_index (no weights)."""

    def __init__(self, model: Any, config: Any) -> None:
        self.config = config
        self._model = model

    def __call__(self, sample: dict[str, Any]) -> tuple[torch.Tensor, int]:
        ids = sample["input_ids"]
        types = torch.zeros_like(ids)
        types[ids == IMAGE] = 1
        types[ids == VIDEO] = 2
        kwargs = {"image_grid_thw": sample["image"], "video_grid_thw": sample["video"]}
        if self._model is Qwen2_5_VLModel:
            kwargs["second_per_grid_ts"] = sample["seconds"]
        positions, deltas = self._model.get_rope_index(
            self, ids[None], types[None], attention_mask=torch.ones_like(ids)[None], **kwargs
        )
        return positions[:, 0], int(deltas[0, 0])

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._model.get_vision_position_ids(self, *args, **kwargs)  # type: ignore[no-any-return]


def _hf(tokens_per_second: int | None) -> _RopeIndex:
    if tokens_per_second is None:
        config = Qwen2VLConfig(
            vision_config={"spatial_merge_size": 2},
            vision_start_token_id=START,
            image_token_id=IMAGE,
            video_token_id=VIDEO,
        )
        return _RopeIndex(Qwen2VLModel, config)
    config_25 = Qwen2_5_VLConfig(
        vision_config={"spatial_merge_size": 2, "tokens_per_second": tokens_per_second},
        vision_start_token_id=START,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
    )
    return _RopeIndex(Qwen2_5_VLModel, config_25)


def _ours(sample: dict[str, Any], config: MRopeConfig) -> tuple[torch.Tensor, int]:
    return mrope_position_ids(
        sample["input_ids"], sample["image"], sample["video"], sample["seconds"], config
    )


def _encoded(value: str, media: dict[str, bytes]) -> EncodedSample:
    conversation = {
        "conversations": [{"from": "human", "value": value}, {"from": "gpt", "value": "ok"}]
    }
    return ConversationEncoder().encode_sample("s", {"json": conversation, **media}).materialize()


def _as_input(sample: EncodedSample, seconds: float | None = None) -> dict[str, Any]:
    vision = sample.vision or MediaTensors()
    spg = vision.second_per_grid_ts
    if seconds is not None and spg is not None:
        spg = torch.full_like(spg, seconds)
    return {
        "input_ids": sample.input_ids,
        "image": vision.image_grid_thw,
        "video": vision.video_grid_thw,
        "seconds": spg,
    }


@pytest.fixture(scope="module")
def encoded() -> dict[str, EncodedSample]:
    video = video_bytes()
    return {
        "text": _encoded("just text", {}),
        "one image": _encoded("look <image> here", {"0.png": image_bytes(64, 64)}),
        "images": _encoded(
            "<image>a<image>b <image>",
            {
                "0.png": image_bytes(64, 64),
                "1.jpg": image_bytes(130, 90, "JPEG"),
                "2.png": image_bytes(60, 200),
            },
        ),
        "video": _encoded("<video> what happens?", {"0.mp4": video}),
        "video and images": _encoded(
            "<image> then <video> and <image>",
            {"0.png": image_bytes(90, 40), "1.mp4": video, "2.png": image_bytes(64, 64)},
        ),
    }


CASES = ["text", "one image", "images", "video", "video and images"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    ("tokens_per_second", "seconds"), [(None, None), (2, None), (25, None), (2, 0.5), (25, 1 / 3)]
)
def test_matches_transformers_get_rope_index(
    encoded: dict[str, EncodedSample],
    case: str,
    tokens_per_second: int | None,
    seconds: float | None,
) -> None:
    sample = _as_input(encoded[case], seconds)
    expected, expected_delta = _hf(tokens_per_second)(sample)
    config = MRopeConfig.from_tokenizer(
        TOKENIZER, tokens_per_second=tokens_per_second, text_after_vision="spatial"
    )
    positions, delta = _ours(sample, config)
    assert positions.dtype == torch.long
    assert torch.equal(positions, expected)
    assert delta == expected_delta
    # The default rule ("max") agrees wherever a block's temporal span stays within its spatial one.
    default, default_delta = _ours(sample, replace(config, text_after_vision="max"))
    if "video" not in case or tokens_per_second is None:
        assert torch.equal(default, expected)
        assert default_delta == expected_delta


def test_text_after_a_long_video_continues_past_its_last_frame() -> None:
    # 3 temporal patches of 2x2 merged tokens at 25 tokens/s and 1 s per patch: t = 0, 25, 50.
    ids = torch.tensor([7, START, *[VIDEO] * 12, END, 8])
    video = torch.tensor([[3, 4, 4]])
    seconds = torch.tensor([1.0])
    config = MRopeConfig.from_tokenizer(TOKENIZER, tokens_per_second=25)
    positions, delta = mrope_position_ids(ids, None, video, seconds, config)
    start = 2
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[0, 2:14].tolist() == [start + 25 * (i // 4) for i in range(12)]
    assert positions[1, 2:14].tolist() == [start + (i % 4) // 2 for i in range(12)]
    assert positions[2, 2:14].tolist() == [start + i % 2 for i in range(12)]
    assert positions[:, 14:].tolist() == [[53, 54]] * 3  # max 52 + 1
    assert delta == 54 + 1 - 16
    spatial, spatial_delta = mrope_position_ids(
        ids, None, video, seconds, replace(config, text_after_vision="spatial")
    )
    assert spatial[:, 14:].tolist() == [[4, 5]] * 3  # start + max(h, w) / 2, transformers >= 5.3
    assert spatial_delta == 52 + 1 - 16


# --- packed rows ------------------------------------------------------------------------------


def _reference(sample: dict[str, Any], config: MRopeConfig) -> tuple[torch.Tensor, int]:
    """Token-by-token mRoPE of one sequence (Qwen's reference rule, text resumes at max + 1)."""
    ids = sample["input_ids"].tolist()
    grids = {IMAGE: iter(_rows(sample["image"])), VIDEO: iter(_rows(sample["video"]))}
    seconds = iter(sample["seconds"].tolist() if sample["seconds"] is not None else [])
    out: list[list[int]] = []
    nxt, i = 0, 0
    while i < len(ids):
        if ids[i] not in grids:
            out.append([nxt] * 3)
            nxt, i = nxt + 1, i + 1
            continue
        t, h, w = next(grids[ids[i]])
        step = 1.0
        if ids[i] == VIDEO and config.tokens_per_second is not None:
            step = float(torch.tensor(next(seconds)) * config.tokens_per_second)
        for f in range(t):
            tf = int(torch.tensor(float(f)) * torch.tensor(step))
            out += [[nxt + tf, nxt + y, nxt + x] for y in range(h // 2) for x in range(w // 2)]
        i += t * h * w // 4
        nxt = max(max(p) for p in out) + 1
    positions = torch.tensor(out).T.contiguous()
    return positions, int(positions.max()) + 1 - len(ids)


def _rows(table: torch.Tensor | None) -> list[list[int]]:
    return [] if table is None else table.tolist()


@st.composite
def _sequences(draw: st.DrawFn) -> dict[str, Any]:
    ids: list[int] = list(draw(st.lists(st.integers(0, 255), min_size=1, max_size=12)))
    images: list[list[int]] = []
    videos: list[list[int]] = []
    seconds: list[float] = []
    for _ in range(draw(st.integers(0, 3))):
        video = draw(st.booleans())
        t = draw(st.integers(1, 3)) if video else 1
        h, w = draw(st.sampled_from([2, 4, 6])), draw(st.sampled_from([2, 4, 6]))
        (videos if video else images).append([t, h, w])
        if video:
            seconds.append(draw(st.sampled_from([0.25, 0.5, 1.0, 1 / 3, 2.0])))
        pad = VIDEO if video else IMAGE
        ids += [START, *[pad] * (t * h * w // 4), END]
        ids += draw(st.lists(st.integers(0, 255), max_size=5))
    return {
        "input_ids": torch.tensor(ids),
        "loss_mask": torch.ones(len(ids)),
        "image": torch.tensor(images, dtype=torch.long).reshape(-1, 3),
        "video": torch.tensor(videos, dtype=torch.long).reshape(-1, 3),
        "seconds": torch.tensor(seconds, dtype=torch.float32),
    }


_CONFIGS = st.builds(
    MRopeConfig.from_tokenizer,
    st.just(TOKENIZER),
    tokens_per_second=st.sampled_from([None, 2, 25]),
    text_after_vision=st.sampled_from(["max", "spatial"]),
)


@settings(max_examples=60, deadline=None)
@given(sample=_sequences(), tokens_per_second=st.sampled_from([None, 2, 25]))
def test_single_sequence_matches_references(
    sample: dict[str, Any], tokens_per_second: int | None
) -> None:
    config = MRopeConfig.from_tokenizer(TOKENIZER, tokens_per_second=tokens_per_second)
    positions, delta = _ours(sample, config)
    expected, expected_delta = _reference(sample, config)
    assert torch.equal(positions, expected)
    assert delta == expected_delta
    spatial, spatial_delta = _ours(sample, replace(config, text_after_vision="spatial"))
    hf, hf_delta = _hf(tokens_per_second)(sample)
    assert torch.equal(spatial, hf)
    assert spatial_delta == hf_delta


def _cat(tables: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(tables))


@settings(max_examples=80, deadline=None)
@given(
    samples=st.lists(_sequences(), min_size=1, max_size=5),
    multiple=st.sampled_from([1, 4, 8]),
    static=st.booleans(),
    config=_CONFIGS,
)
def test_packed_row_is_the_concatenation_of_its_sequences(
    samples: list[dict[str, Any]], multiple: int, static: bool, config: MRopeConfig
) -> None:
    used = sum(-(-s["input_ids"].numel() // multiple) * multiple for s in samples)
    options: dict[str, Any] = {"seq_length": used, "pad_to_multiple_of": multiple}
    if static:
        options = {
            "seq_length": used + 2 * multiple,
            "pad_to_multiple_of": multiple,
            "pad_to_max_length": True,
            "pad_cu_seqlens": True,
            "max_segments": len(samples) + 2,
        }
    row = build_packed_row(samples, pad_token_id=TOKENIZER.pad_token_id, **options)
    positions, deltas = packed_mrope_position_ids(
        row.input_ids,
        row.cu_seqlens_padded,
        row.cu_seqlens,
        _cat([s["image"] for s in samples]),
        _cat([s["video"] for s in samples]),
        _cat([s["seconds"] for s in samples]),
        config,
    )
    assert positions.shape == (3, row.input_ids.numel())
    assert deltas.shape == (row.cu_seqlens.numel() - 1,)
    offsets = row.cu_seqlens_padded.tolist()
    for i, sample in enumerate(samples):
        expected, delta = _ours(sample, config)
        length = sample["input_ids"].numel()
        start, stop = offsets[i], offsets[i + 1]
        assert torch.equal(positions[:, start : start + length], expected)
        assert int(deltas[i]) == delta
        gap = torch.arange(stop - start - length) + int(expected.max()) + 1
        assert torch.equal(positions[:, start + length : stop], gap.expand(3, -1))
    assert deltas[len(samples) :].tolist() == [0] * (deltas.numel() - len(samples))


def test_mrope_for_packed_sample(encoded: dict[str, EncodedSample]) -> None:
    samples = [encoded["video and images"], encoded["text"], encoded["images"]]
    packed = pack_samples(samples, seq_length=4096, pad_to_multiple_of=8, pad_to_max_length=True)
    config = MRopeConfig.from_tokenizer(TOKENIZER, tokens_per_second=2)
    positions, deltas = mrope_for_packed(packed, config)
    assert positions.shape == (3, 4096)
    offsets = packed.row.cu_seqlens_padded.tolist()
    for i, sample in enumerate(samples):
        expected, delta = _ours(_as_input(sample), config)
        assert torch.equal(positions[:, offsets[i] : offsets[i] + sample.length], expected)
        assert int(deltas[i]) == delta
    assert positions[:, -1].tolist() == [4096 - offsets[-2] - 1 + int(deltas[-1])] * 3


def test_config_from_tokenizer_and_validation() -> None:
    assert (QWEN2.vision_start_token_id, QWEN2.image_token_id, QWEN2.video_token_id) == (
        START,
        IMAGE,
        VIDEO,
    )
    assert QWEN2.spatial_merge_size == 2
    assert QWEN2.tokens_per_second is None
    with pytest.raises(ValueError, match="spatial_merge_size"):
        replace(QWEN2, spatial_merge_size=0)
    with pytest.raises(ValueError, match="tokens_per_second"):
        replace(QWEN2, tokens_per_second=0)
    with pytest.raises(ValueError, match="must differ"):
        replace(QWEN2, video_token_id=IMAGE)


# --- errors -----------------------------------------------------------------------------------


def _two_segments() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    first = [1, START, *[IMAGE] * 4, END, 2]  # grid (1, 4, 4)
    second = [3, START, *[IMAGE] * 6, END, START, *[IMAGE] * 1, END]  # grids (1, 4, 6), (1, 2, 2)
    ids = torch.tensor(first + second)
    bounds = torch.tensor([0, len(first), len(first) + len(second)])
    return ids, bounds, torch.tensor([[1, 4, 4], [1, 4, 6], [1, 2, 2]])


def test_block_count_mismatch_names_segment_and_counts() -> None:
    ids, bounds, grids = _two_segments()
    with pytest.raises(ValueError, match=r"segment 1: .* hold 3 image blocks but .* has 2 rows"):
        packed_mrope_position_ids(ids, bounds, bounds, grids[:2], None, None, QWEN2)
    with pytest.raises(ValueError, match=r"segment 1: .* hold 3 image blocks but .* has 4 rows"):
        packed_mrope_position_ids(
            ids, bounds, bounds, torch.cat((grids, grids[:1])), None, None, QWEN2
        )
    with pytest.raises(ValueError, match=r"segment 0: .* 0 video blocks but .* has 1 rows"):
        mrope_position_ids(ids[:8], grids[:1], torch.tensor([[2, 2, 2]]), None, QWEN2)


def test_pad_count_mismatch_names_block_and_expected_count() -> None:
    ids, bounds, grids = _two_segments()
    swapped = grids[[0, 2, 1]]
    with pytest.raises(ValueError, match=r"segment 1: the image block at token 2 has 6 .* = 1"):
        packed_mrope_position_ids(ids, bounds, bounds, swapped, None, None, QWEN2)
    with pytest.raises(ValueError, match=r"multiples of spatial_merge_size=2"):
        mrope_position_ids(ids[:8], torch.tensor([[1, 4, 3]]), None, None, QWEN2)


def test_pads_without_vision_start_and_bad_boundaries() -> None:
    with pytest.raises(ValueError, match=r"segment 0: <\|image_pad\|> tokens at token 1"):
        mrope_position_ids(
            torch.tensor([1, IMAGE, END]), torch.tensor([[1, 2, 2]]), None, None, QWEN2
        )
    ids, bounds, grids = _two_segments()
    # A segment may not begin inside a block: its first pad token has no <|vision_start|>.
    cut = torch.tensor([0, 2, ids.numel()])
    with pytest.raises(ValueError, match=r"segment 1: <\|image_pad\|> tokens at token 0"):
        packed_mrope_position_ids(ids, cut, cut, grids, None, None, QWEN2)
    with pytest.raises(ValueError, match="from 0 to the row length"):
        packed_mrope_position_ids(ids, bounds[:-1], bounds[:-1], grids, None, None, QWEN2)
    with pytest.raises(ValueError, match=r"segment 0: real length 9"):
        packed_mrope_position_ids(ids, bounds, torch.tensor([0, 9, 9]), grids, None, None, QWEN2)
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 values but there are 1"):
        mrope_position_ids(
            torch.tensor([START, VIDEO, END]),
            None,
            torch.tensor([[1, 2, 2]]),
            torch.tensor([1.0, 2.0]),
            replace(QWEN2, tokens_per_second=2),
        )
