"""TRL / transformers chat rows and LLaVA JSON through the collator: same rows as native."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from helpers import SMALL_MEDIA, image_bytes, read_samples
from PIL import Image
from torch.utils.data import DataLoader

from energon_pack import VLMPackingCollator
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.formats import ChatDataset
from energon_pack.formats.native import parse_sample
from energon_pack.media import MediaError, media_kind

_PLACEHOLDER = re.compile(r"(<image>|<video>)")
Native = dict[str, dict[str, bytes]]


@pytest.fixture(scope="module")
def native(vlm_demo_path: Path) -> Native:
    samples = read_samples(vlm_demo_path)
    return {key: samples[key] for key in sorted(samples)[:24]}


def _parts(text: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for piece in _PLACEHOLDER.split(text):
        if piece in ("<image>", "<video>"):
            parts.append({"type": piece[1:-1], "text": None})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _trl_row(key: str, members: dict[str, bytes]) -> dict[str, Any]:
    raw = parse_sample(key, members)
    messages = [{"role": "system", "content": _parts(raw.system)}] if raw.system else []
    messages += [{"role": role, "content": _parts(text)} for role, text in raw.turns]
    images = [{"bytes": data, "path": None} for _, kind, data in raw.media if kind == "image"]
    videos = [data for _, kind, data in raw.media if kind == "video"]
    return {"id": key, "messages": messages, "images": images, "videos": videos}


def _collator() -> VLMPackingCollator:
    return VLMPackingCollator(
        16384, pad_to_multiple_of=8, encoder=ConversationEncoder(media=SMALL_MEDIA)
    )


def _batches(dataset: Any) -> Iterator[Any]:
    yield from DataLoader(dataset, batch_size=4, collate_fn=_collator())


def _assert_same(got: Any, want: Any) -> None:
    assert got.keys == want.keys
    for name, tensor in want.to_dict().items():
        other = got.to_dict()[name]
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(other, tensor), name
        elif isinstance(tensor, tuple) and tensor and isinstance(tensor[0], torch.Tensor):
            assert all(torch.equal(a, b) for a, b in zip(other, tensor, strict=True)), name
        else:
            assert other == tensor, name


def test_trl_rows_of_a_datasets_dataset_equal_native(native: Native) -> None:
    rows = [_trl_row(key, members) for key, members in native.items()]
    table = datasets.Dataset.from_list(rows).cast_column(
        "images", datasets.Sequence(datasets.Image())
    )
    assert isinstance(table[0]["images"][0], Image.Image)  # decoded by datasets
    pairs = [(key, members) for key, members in native.items()]
    seen = []
    for got, want in zip(_batches(ChatDataset(table)), _batches(pairs), strict=True):
        _assert_same(got, want)
        seen += [key for row in got.keys for key in row]
    assert seen == list(native)
    assert any(name.endswith(".mp4") for key in seen for name in native[key])


def test_llava_json_with_an_image_folder_equals_native(native: Native, tmp_path: Path) -> None:
    root = tmp_path / "images"
    records, pairs = [], []
    for key, members in native.items():
        raw = parse_sample(key, members)
        if any(kind == "video" for _, kind, _ in raw.media):
            continue
        paths = []
        for member, _, data in raw.media:
            path = root / key / member
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            paths.append(f"{key}/{member}")
        record: dict[str, Any] = {
            "id": key,
            "conversations": [{"from": role, "value": text} for role, text in raw.turns],
        }
        if raw.system is not None:
            record["system"] = raw.system
        if paths:
            record["image"] = paths[0] if len(paths) == 1 else paths
        records.append(record)
        pairs.append((key, members))
    (tmp_path / "llava.json").write_text(json.dumps(records))
    dataset = ChatDataset(tmp_path / "llava.json", media_root=root)
    assert len(dataset) == len(pairs) > 8
    for got, want in zip(_batches(dataset), _batches(pairs), strict=True):
        _assert_same(got, want)


def test_pil_images_in_a_plain_list_give_the_files_pixels() -> None:
    rgba = Image.new("RGBA", (70, 50), (10, 200, 30, 100))
    png = io.BytesIO()
    rgba.save(png, format="PNG")
    content = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    row = {
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": "Green."}]},
        ],
        "images": [rgba],
    }
    turns = [{"from": "human", "value": "<image>What is it?"}, {"from": "gpt", "value": "Green."}]
    native = {"json": json.dumps({"conversations": turns}), "0.png": png.getvalue()}
    rows = ChatDataset([row, row])
    got = _collator()([rows[0], rows[1]])
    want = _collator()([("0", native), ("1", native)])
    _assert_same(got, want)


def _row(image: Any) -> dict[str, Any]:
    return {
        "id": "r1",
        "conversations": [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "Yo"}],
        "image": image,
    }


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/etc/passwd", "must be relative to the media root"),
        ("../outside.png", "without '..'"),
        ("sub/../../outside.png", "without '..'"),
        ("link.png", "leads out of the media root"),
        ("missing.png", "not found"),
    ],
)
def test_media_paths_stay_inside_the_root(tmp_path: Path, path: str, message: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "outside.png").write_bytes(image_bytes(32, 32))
    (root / "link.png").symlink_to(tmp_path / "outside.png")
    key, row = ChatDataset([_row(path)], media_root=root)[0]
    with pytest.raises(MediaError, match=re.escape(message)) as error:
        ConversationEncoder().encode_sample(key, row)
    assert (error.value.key, error.value.member) == ("r1", "image")
    skipping = VLMPackingCollator(1024, on_media_error="skip")
    good = ChatDataset([{**_row("ok.png"), "id": "r2"}], media_root=root)
    (root / "ok.png").write_bytes(image_bytes(32, 32))
    batch = skipping([(key, row), good[0]])
    assert batch.skipped_keys == ("r1",)
    assert batch.keys == (("r2",),)


def test_unresolved_paths_and_mismatches_are_media_errors() -> None:
    with pytest.raises(MediaError, match="needs media_root"):
        ConversationEncoder().encode_sample(*ChatDataset([_row("a.png")])[0])
    with pytest.raises(MediaError, match="is not resolved"):
        ConversationEncoder().encode_sample("r", _row("a.png"))
    with pytest.raises(MediaError, match="1 image placeholders or parts but 2 items"):
        ConversationEncoder().encode_sample("r", _row([image_bytes(8, 8), image_bytes(8, 8)]))
    assert media_kind("x.png") == "image"


def test_collator_takes_rows_without_chat_dataset() -> None:
    batch = _collator()([_row(image_bytes(8, 8)), {**_row(image_bytes(8, 8)), "id": None}])
    assert batch.keys == (("r1", "row[1]"),)
