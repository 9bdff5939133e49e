"""Energon's VQAWebdataset / CaptioningWebdataset datasets packed as conversations."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from energon_shards import write_dataset
from helpers import batches, image_bytes, native_pack, train_dataset
from megatron.energon import SimilarityInterleavedSample

from energon_pack.energon import PackingTaskEncoder
from energon_pack.formats.energon_types import MediaKeepingDecoder, typed_sample_row
from energon_pack.formats.native import load_json
from energon_pack.media import MediaConfig, MediaError

VQA_YAML = """__module__: megatron.energon
__class__: VQAWebdataset
field_map:
  image: jpg
  context: json[question]
  answers: json[answers]
  answer_weights: json[weights]
"""
CAPTION_YAML = """__module__: megatron.energon
__class__: CaptioningWebdataset
field_map:
  image: png
  caption: txt
"""


def _native(key: str, question: str, answer: str, image: bytes, ext: str) -> dict[str, bytes]:
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    return {"json": json.dumps({"conversations": turns}).encode(), f"0.{ext}": image}


def _assert_packs_equal_native(root: Path, native: dict[str, dict[str, bytes]]) -> None:
    seen: list[str] = []
    for batch in batches(train_dataset(root, 3)):
        keys = list(batch.__keys__)
        seen += keys
        want = native_pack(native, keys)
        assert torch.equal(batch.input_ids[0], want.row.input_ids)
        assert torch.equal(batch.labels[0], want.row.labels)
        assert torch.equal(batch.pixel_values, want.vision.pixel_values)
        assert torch.equal(batch.image_grid_thw, want.vision.image_grid_thw)
    assert sorted(seen) == sorted(native)


def test_vqa_dataset_packs_as_question_and_weighted_answer(tmp_path: Path) -> None:
    members, native = {}, {}
    for i in range(7):
        image = image_bytes(64 + 8 * i, 48, "JPEG", seed=i)
        answers = [f"no {i}", f"yes {i}"]
        meta = {"question": f"Is it {i}?", "answers": answers, "weights": [0.25, 0.75]}
        members[f"q{i}"] = {"jpg": image, "json": json.dumps(meta).encode()}
        native[f"q{i}"] = _native(f"q{i}", f"<image>\nIs it {i}?", f"yes {i}", image, "jpg")
    _assert_packs_equal_native(
        write_dataset(tmp_path / "vqa", sorted(members.items()), VQA_YAML), native
    )


def test_captioning_dataset_packs_as_image_and_caption(tmp_path: Path) -> None:
    members, native = {}, {}
    for i in range(5):
        image = image_bytes(40, 72 + 4 * i, "PNG", seed=i)
        members[f"c{i}"] = {"png": image, "txt": f"A caption {i}.".encode()}
        native[f"c{i}"] = _native(f"c{i}", "<image>", f"A caption {i}.", image, "png")
    _assert_packs_equal_native(
        write_dataset(tmp_path / "cap", sorted(members.items()), CAPTION_YAML), native
    )


def test_interleaved_samples_are_refused_by_name() -> None:
    sample = SimilarityInterleavedSample(
        __key__="s1",
        __restore_key__=(),
        __subflavors__=None,
        __sources__=None,
        images=[],
        texts=["a"],
        audio=None,
        video=None,
        similarity_matrix=None,
        matched_text_indices=None,
    )
    with pytest.raises(MediaError, match="SimilarityInterleavedSample has no question/answer"):
        typed_sample_row(sample)
    assert typed_sample_row(object()) is None


def test_decoder_parses_json_and_text_only() -> None:
    payload = pickle.dumps({"a": 1})
    raw = {
        "__key__": "k",
        "json": b'{"q": 1}',
        "txt": "é".encode(),
        "jpg": b"\xff\xd8jpeg",
        "pickle": payload,
        "pyd": payload,
        "jsn": b"{not json",
    }
    decoded = MediaKeepingDecoder()(dict(raw))
    assert decoded["json"] == {"q": 1}
    assert decoded["txt"] == "é"
    for name in ("jpg", "pickle", "pyd", "jsn"):  # a malformed JSON stays bytes for the encoder
        assert decoded[name] == raw[name]


def test_a_json_member_over_max_json_bytes_is_not_parsed() -> None:
    """The encoder's limit reaches the decoder, which leaves the member for the encoder to
    report (a 200 MB member is never parsed)."""
    big = json.dumps({"pad": "x" * 200}).encode()
    encoder = PackingTaskEncoder(seq_length=64, media=MediaConfig(max_json_bytes=100))
    decoded = encoder.decoder({"__key__": "k", "json": big, "txt": b"t"})
    assert decoded["json"] == big
    assert decoded["txt"] == "t"
    with pytest.raises(MediaError, match="above max_json_bytes=100") as info:
        load_json("k", decoded["json"], encoder.media)
    assert info.value.kind == "bad_sample"
    assert PackingTaskEncoder(seq_length=64).decoder({"json": big})["json"] == {"pad": "x" * 200}
