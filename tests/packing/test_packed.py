from __future__ import annotations

import torch
from helpers import image_bytes, video_bytes

from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.packing.packed import pack_samples
from energon_pack.packing.row import unpack


def test_media_follow_segment_order_and_tokens_round_trip() -> None:
    encoder = ConversationEncoder()
    samples = [
        encoder.encode_sample(
            "a",
            {"json": {"conversations": [{"from": "human", "value": "<image>x"}]},
             "0.png": image_bytes(64, 64)},
        ),
        encoder.encode_sample("b", {"json": {"conversations": [{"from": "gpt", "value": "y"}]}}),
        encoder.encode_sample(
            "c",
            {"json": {"conversations": [{"from": "human", "value": "<video><image>"}]},
             "0.mp4": video_bytes(), "1.jpg": image_bytes(130, 90, "JPEG")},
        ),
    ]  # fmt: skip
    packed = pack_samples(samples, seq_length=4096, pad_to_multiple_of=8)
    assert packed.keys == ("a", "b", "c")
    vision = packed.vision
    assert vision.image_grid_thw is not None
    assert vision.video_grid_thw is not None
    assert vision.pixel_values is not None
    assert vision.image_grid_thw.tolist() == [[1, 4, 4], [1, 6, 10]]  # a's image, then c's
    assert vision.video_grid_thw.tolist() == [list(samples[2].media[0].grid_thw)]
    assert vision.pixel_values.shape[0] == 16 + 60
    pad = encoder.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    pads = int((packed.row.input_ids == pad).sum())
    assert pads == int(vision.image_grid_thw.prod(dim=1).sum()) // 4
    for sample, back in zip(samples, unpack(packed.row), strict=True):
        assert torch.equal(back["input_ids"], sample.input_ids)
    flat = packed.to_dict()
    assert flat["keys"] == ["a", "b", "c"]
    assert set(flat) >= {"input_ids", "cu_seqlens", "pixel_values", "video_grid_thw"}


def test_text_only_pack_has_no_media() -> None:
    encoder = ConversationEncoder()
    sample = encoder.encode_sample(
        "t", {"json": {"conversations": [{"from": "gpt", "value": "z"}]}}
    )
    packed = pack_samples([sample, sample], seq_length=512)
    assert packed.vision.tensors() == {}
    assert packed.row.cu_seqlens.tolist() == [0, sample.length, 2 * sample.length]
