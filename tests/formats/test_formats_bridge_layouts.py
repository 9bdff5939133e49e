"""Megatron-Bridge's ChatML sample layouts, read as its converters write them.

Each ``fixtures/bridge_layouts/<layout>`` holds native ``vlm_demo`` samples in one Bridge layout
(``make_bridge_fixture.py``). Read through a real Energon loader (its ``crude.yaml``: the same
shards as ``CrudeWebdataset``), every sample arrives once, none is skipped, and each pack equals
the pack of the same native samples. Bridge's own ``ChatMLWebdataset`` reading of the same
``dataset.yaml`` is tested against Bridge in ``tests/bridge``.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    SMALL_MEDIA,
    image_bytes,
    load_script,
    make_encoder,
    native_pack,
    read_samples,
    savable_loader,
)
from megatron.energon import WorkerConfig, get_train_dataset

from energon_pack.formats import parse_any
from energon_pack.formats.bridge import is_bridge_sample
from energon_pack.formats.energon_types import MediaKeepingDecoder, NamedMember
from energon_pack.media import Frames, MediaError

LAYOUTS = ("mantis", "tutorial", "llava", "text")
ROW = ("input_ids", "labels", "loss_mask", "position_ids", "cu_seqlens", "cu_seqlens_padded")
MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def layout_loader(path: Path, **overrides: Any) -> Any:
    dataset = get_train_dataset(
        path,
        dataset_config="crude.yaml",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        packing_buffer_size=4,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=make_encoder(**overrides),
        repeat=False,
    )
    return savable_loader(dataset)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_packs_as_the_native_samples(
    layout: str, fixtures_dir: Path, vlm_demo_path: Path
) -> None:
    path = fixtures_dir / "bridge_layouts" / layout
    native = read_samples(vlm_demo_path)
    seen: list[str] = []
    stats = None
    for batch in layout_loader(path):
        keys = list(batch.__keys__)
        seen += keys
        stats = batch.packing_stats
        expected = native_pack(native, keys, SMALL_MEDIA)
        for name in ROW:
            got = getattr(batch, name)
            got = got[0] if got.dim() == 2 else got
            assert torch.equal(got, getattr(expected.row, name)), (layout, keys, name)
        for name in MEDIA:
            want, got = getattr(expected.vision, name), getattr(batch, name)
            assert (got is None) == (want is None), (layout, name)
            assert want is None or torch.equal(got, want), (layout, keys, name)
    shipped = read_samples(path)
    assert len(seen) == len(set(seen)) == len(shipped) >= 7
    assert set(seen) == set(shipped)
    assert stats is not None
    assert dict(stats.skipped) == {}


@pytest.mark.parametrize("layout", ["mantis", "tutorial", "llava"])
def test_image_files_stay_compressed_until_packed(layout: str, fixtures_dir: Path) -> None:
    """Parsing keeps each image as its file's bytes (probed later from the header)."""
    for key, members in read_samples(fixtures_dir / "bridge_layouts" / layout).items():
        assert is_bridge_sample(members)
        raw = parse_any(key, members)
        assert raw.media, key
        files = pickle.loads(members["jpgs"]) if layout == "mantis" else [members[raw.media[0][0]]]
        assert [payload for _, _, payload in raw.media] == files
        assert all(isinstance(payload, bytes) for _, _, payload in raw.media)


def test_mantis_items_are_named_by_list_position(fixtures_dir: Path) -> None:
    key, members = next(iter(read_samples(fixtures_dir / "bridge_layouts" / "mantis").items()))
    names = [name for name, _, _ in parse_any(key, members).media]
    assert names == [f"jpgs[{i}]" for i in range(len(names))]


def test_text_only_json_list_has_no_media(fixtures_dir: Path) -> None:
    for key, members in read_samples(fixtures_dir / "bridge_layouts" / "text").items():
        assert set(members) == {"json"}
        assert json.loads(members["json"])[0]["from"]
        assert parse_any(key, members).media == ()


def test_legacy_arrays_and_file_bytes_mix_in_one_list() -> None:
    png = image_bytes(32, 32)
    array = np.zeros((28, 28, 3), np.uint8)
    turns = [{"from": "human", "value": "<image><image>"}, {"from": "gpt", "value": "two"}]
    raw = parse_any("k", {"json": json.dumps(turns), "jpgs": pickle.dumps([png, array])})
    assert raw.media[0] == ("jpgs[0]", "image", png)
    assert isinstance(raw.media[1][2], Frames)
    assert raw.media[1][0] == "jpgs[1]"


def test_video_of_encoded_frames_is_refused_by_name() -> None:
    turns = [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "a clip"}]
    sample = {"json": json.dumps(turns), "videos": pickle.dumps([[b"\xff\xd8jpeg", b"\xff\xd8"]])}
    with pytest.raises(MediaError, match=r"videos\[0\].*list of encoded frames.*video.mp4"):
        parse_any("k", sample)


def test_pickled_byte_lists_run_no_code() -> None:
    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (eval, ("1/0",))

    turns = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]
    sample = {"json": json.dumps(turns), "jpgs": pickle.dumps([b"\x89PNG", Boom()])}
    with pytest.raises(MediaError, match=r"builtins\.eval.*nothing in it is run") as error:
        parse_any("k", sample)
    assert error.value.kind == "unsupported"
    assert error.value.member == "jpgs"


def test_placeholder_mismatch_names_the_members() -> None:
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    turns.append({"role": "assistant", "content": "one"})
    sample = {"conversation.json": json.dumps(turns).encode(), "image.png": b"\x89PNG"}
    with pytest.raises(MediaError, match=r"2 <image> .* 1 images \['image.png'\]") as error:
        parse_any("k", sample)
    assert error.value.kind == "placeholder_mismatch"
    assert error.value.member == "conversation.json"


def test_chatml_decoder_keeps_media_compressed_under_their_names(fixtures_dir: Path) -> None:
    """The decoder given to Bridge's ``ChatMLWebdataset`` datasets: JSON parsed, every other
    member its bytes under its own name (``field_map`` renames it to ``imgs`` / ``videos``)."""
    decoder = MediaKeepingDecoder(keep_names=True)
    for layout in ("mantis", "tutorial"):
        for key, members in read_samples(fixtures_dir / "bridge_layouts" / layout).items():
            decoded = decoder({"__key__": key, **members})
            for name, data in members.items():
                if name.endswith("json"):
                    assert decoded[name] == json.loads(data)
                else:
                    assert decoded[name] == NamedMember(name, data)


def test_layouts_regenerate_byte_identical(fixtures_dir: Path, tmp_path: Path) -> None:
    maker = load_script(fixtures_dir / "make_bridge_fixture.py")
    fresh = maker.write_layouts(maker.read_native(fixtures_dir / "vlm_demo"), tmp_path)
    assert sorted(fresh) == sorted(LAYOUTS)
    for layout, path in fresh.items():
        shipped = fixtures_dir / "bridge_layouts" / layout
        for name in (f"{layout}-000000.tar", ".nv-meta/dataset.yaml", ".nv-meta/crude.yaml"):
            assert (path / name).read_bytes() == (shipped / name).read_bytes(), (layout, name)
