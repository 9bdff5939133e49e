"""Megatron-Bridge's Qwen-VL WebDataset layout: same packs as the native layout, safe pickles."""

from __future__ import annotations

import builtins
import io
import json
import pickle
import tarfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    SMALL_MEDIA,
    batches,
    image_bytes,
    load_script,
    native_pack,
    read_samples,
    train_dataset,
)
from PIL import Image

from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.formats.safe_pickle import load_arrays
from energon_pack.media import Frames, MediaError

# The fixture's videos hold the frames the native path samples at the default frame rate.
MEDIA = replace(SMALL_MEDIA, video_fps=2.0)
TENSORS = (
    "input_ids",
    "labels",
    "loss_mask",
    "cu_seqlens",
    "cu_seqlens_padded",
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
)


@pytest.fixture(scope="module")
def bridge_path(fixtures_dir: Path) -> Path:
    return fixtures_dir / "bridge_qwenvl"


def test_energon_epoch_equals_the_native_layout(bridge_path: Path, vlm_demo_path: Path) -> None:
    native = read_samples(vlm_demo_path)
    seen: list[str] = []
    dataset = train_dataset(bridge_path, 4, media=MEDIA, seq_length=8192)
    videos = 0
    for batch in batches(dataset):
        keys = list(batch.__keys__)
        seen += keys
        expected = native_pack(native, keys, MEDIA)
        row = expected.row
        for name in TENSORS:
            want = getattr(row, name, None)
            if want is None:
                want = getattr(expected.vision, name)
            got = getattr(batch, name)
            got = got[0] if name in ("input_ids", "labels", "loss_mask") else got
            if want is None:
                assert got is None, name
            else:
                assert torch.equal(got, want.to(got.dtype)), (keys, name)
        if batch.video_grid_thw is not None:
            videos += len(batch.video_grid_thw)
            # the layout has no frame rate: frames count as sampled at video_fps
            assert batch.second_per_grid_ts.tolist() == [1.0] * len(batch.video_grid_thw)
    assert sorted(seen) == sorted(read_samples(bridge_path))
    assert len(seen) == len(set(seen)) == 32
    assert videos == 6


def test_fixture_is_reproducible(fixtures_dir: Path, bridge_path: Path, tmp_path: Path) -> None:
    generator = load_script(fixtures_dir / "make_bridge_fixture.py")
    native = read_samples(fixtures_dir / "vlm_demo")
    keys = sorted(read_samples(bridge_path))[:16]
    shards = generator.write_bridge_dataset({k: native[k] for k in keys}, tmp_path)
    assert [s.name for s in shards] == ["bridge-000000.tar"]
    assert shards[0].read_bytes() == (bridge_path / "bridge-000000.tar").read_bytes()


def _turns(text: str = "<image>\nWhat is it?") -> bytes:
    return json.dumps(
        [{"from": "human", "value": text}, {"from": "gpt", "value": "A cat."}]
    ).encode()


def _rgb(width: int, height: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_probe_reads_shapes_and_decoding_waits_for_materialize() -> None:
    image = _rgb(90, 64)
    sample = {"json": _turns(), "jpgs": pickle.dumps([image]), "videos": pickle.dumps([])}
    encoded = ConversationEncoder(media=MEDIA).encode_sample("k", sample)
    (item,) = encoded.media
    assert isinstance(item.data, Frames)
    assert item.member == "jpgs[0]"
    assert item.data.shape == (1, 64, 90, 3)
    assert not encoded.is_materialized
    assert encoded.nbytes == encoded.input_ids.numel() * 8 * 2 + image.nbytes
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    native = {"json": json.dumps({"conversations": json.loads(_turns())}), "0.png": png.getvalue()}
    same = ConversationEncoder(media=MEDIA).encode_sample("k", native)
    assert torch.equal(encoded.input_ids, same.input_ids)
    got, want = encoded.materialize(MEDIA).vision, same.materialize(MEDIA).vision
    assert got is not None
    assert want is not None
    assert torch.equal(got.pixel_values, want.pixel_values)


def test_qwen_vl_utils_style_float_chw_frames_and_other_pickle_protocols() -> None:
    frames = [_rgb(64, 48, seed) for seed in range(3)]
    chw_float = [f.transpose(2, 0, 1).astype(np.float32) for f in frames]
    encoder = ConversationEncoder(media=MEDIA)

    def encode(videos: Any, protocol: int) -> Any:
        sample = {
            "json": _turns("<video>\nWhat happens?"),
            "jpgs": pickle.dumps([], protocol=protocol),
            "videos": pickle.dumps(videos, protocol=protocol),
        }
        return encoder.encode_sample("k", sample).materialize(MEDIA)

    base = encode([frames], 4)
    # 3 frames are padded with the last one to 4 (two temporal patches)
    assert base.media[0].grid_thw[0] == 2
    for other in (encode([chw_float], 5), encode([np.stack(frames)], 2)):
        assert torch.equal(other.input_ids, base.input_ids)
        assert other.vision is not None
        assert base.vision is not None
        assert torch.equal(other.vision.pixel_values_videos, base.vision.pixel_values_videos)


def test_json_object_with_messages_and_system() -> None:
    meta = {
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Yo"},
        ],
    }
    sample = {"json": json.dumps(meta).encode(), "jpgs": pickle.dumps([_rgb(64, 64)])}
    encoded = ConversationEncoder(media=MEDIA).encode_sample("k", sample)
    text = ConversationEncoder().tokenizer.decode(encoded.input_ids.tolist())  # type: ignore[attr-defined]
    assert text.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
    )
    assert text.endswith("<|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n")


class _Payload:
    """Unpickling this calls ``open(path, "w")``: it creates the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return builtins.open, (str(self.path), "w")


def test_a_pickle_that_would_run_code_is_refused_without_running(tmp_path: Path) -> None:
    proof = tmp_path / "proof"
    pickle.loads(pickle.dumps([_Payload(proof)]))  # the payload works with plain pickle
    assert proof.exists()
    marker = tmp_path / "marker"
    payload = pickle.dumps([_Payload(marker)])
    sample = {"json": _turns(), "jpgs": payload, "videos": pickle.dumps([])}
    with pytest.raises(MediaError, match=r"member 'jpgs'.*io\.open") as error:
        ConversationEncoder().encode_sample("evil", sample)
    assert error.value.kind == "unsupported"
    assert not marker.exists()
    with pytest.raises(MediaError, match=r"io\.open"):
        load_arrays(pickle.dumps([[_rgb(8, 8), _Payload(marker)]]), "evil", "videos")
    assert not marker.exists()


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (pickle.dumps({"a": 1}), "pickle holds a dict, not a list"),
        (pickle.dumps([np.array(["x"], dtype=object)]), "pickle holds object"),
        (pickle.dumps([np.zeros((4, 4, 3), dtype=np.int64)]), "pickle holds int64"),
        (pickle.dumps(["image.jpg"]), "pickle holds str"),
        (b"not a pickle", "not a readable pickle"),
    ],
)
def test_bad_pickles_are_media_errors(payload: bytes, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        load_arrays(payload, "k", "jpgs")


@pytest.mark.parametrize(
    ("sample", "message", "kind"),
    [
        (
            {"jpgs": pickle.dumps([])},
            "1 <image> and 0 <video> and 0 <audio> placeholders but 0 images",
            "placeholder_mismatch",
        ),
        (
            {"jpgs": pickle.dumps([np.zeros((8, 8), np.uint8)])},
            r"expected an \[H, W, 3\] array",
            "bad_sample",
        ),
        ({"jpgs": pickle.dumps([np.zeros((8, 8, 4), np.uint8)])}, "not RGB", "bad_sample"),
        ({"jpgs": pickle.dumps([_rgb(8, 2000)])}, "aspect ratio", "aspect_ratio"),
    ],
)
def test_bad_bridge_samples_name_key_and_member(
    sample: dict[str, bytes], message: str, kind: str
) -> None:
    with pytest.raises(MediaError, match=message) as error:
        ConversationEncoder(media=MEDIA).encode_sample("k9", {"json": _turns(), **sample})
    assert error.value.key == "k9"
    assert error.value.kind == kind


def test_native_samples_are_unchanged_by_the_dispatch() -> None:
    sample = {
        "json": json.dumps({"conversations": json.loads(_turns())}),
        "0.png": image_bytes(64, 64),
    }
    encoded = ConversationEncoder().encode_sample("k", sample)
    assert isinstance(encoded.media[0].data, bytes)


def test_energon_skips_and_counts_a_malicious_pickle(tmp_path: Path, fixtures_dir: Path) -> None:
    marker = tmp_path / "marker"
    root = tmp_path / "data"
    root.mkdir()
    members = {
        "good": {"json": _turns(), "jpgs": pickle.dumps([_rgb(64, 64)])},
        "evil": {"json": _turns(), "jpgs": pickle.dumps([_Payload(marker)])},
        "text": {"json": _turns("Hi"), "jpgs": pickle.dumps([]), "videos": pickle.dumps([])},
    }
    with tarfile.open(root / "part-0.tar", "w") as tar:
        for key, sample in members.items():
            for name, data in sample.items():
                info = tarfile.TarInfo(f"{key}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    load_script(fixtures_dir / "make_fixtures.py").prepare_energon(root, [root / "part-0.tar"])
    packs = list(batches(train_dataset(root, 4, media=MEDIA)))
    assert sorted(key for batch in packs for key in batch.__keys__) == ["good", "text"]
    stats = packs[-1].packing_stats
    assert stats is not None
    assert stats.skipped == {"unsupported": 1}
    assert not marker.exists()
