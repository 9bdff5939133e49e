"""The Energon path end to end on the shipped fixture datasets (real loaders, real decoding)."""

from __future__ import annotations

import json
import pickle
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    SMALL_MEDIA,
    SUPPORT,
    LoaderRun,
    assert_resume_equivalent,
    batches,
    make_encoder,
    read_samples,
    savable_loader,
    torchrun,
    train_dataset,
)
from megatron.energon import WorkerConfig, get_train_dataset, get_val_dataset

from energon_pack import BufferConfig, PackingWarning
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.energon import CarryOverPackingDataset
from energon_pack.media import normalize_pixels
from energon_pack.packing.mrope import MRopeConfig, mrope_position_ids


@pytest.fixture(scope="module")
def demo_samples(vlm_demo_path: Path) -> dict[str, dict[str, bytes]]:
    return read_samples(vlm_demo_path)


def emitted_keys(dataset: Any) -> Counter[str]:
    return Counter(key for batch in batches(dataset) for key in batch.__keys__)


@pytest.mark.parametrize("buffer", [1, 2, 7, 16, 64])
def test_every_sample_leaves_exactly_once(
    vlm_demo_path: Path, demo_samples: dict[str, Any], buffer: int
) -> None:
    assert emitted_keys(train_dataset(vlm_demo_path, buffer)) == Counter(list(demo_samples))


def test_exactly_once_with_two_workers(vlm_demo_path: Path, demo_samples: dict[str, Any]) -> None:
    assert emitted_keys(train_dataset(vlm_demo_path, 7, workers=2)) == Counter(list(demo_samples))


def test_two_ranks_cover_the_epoch_once(vlm_demo_path: Path, demo_samples: dict[str, Any]) -> None:
    ranks = [emitted_keys(train_dataset(vlm_demo_path, 16, rank=r, world_size=2)) for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1])
    assert ranks[0] + ranks[1] == Counter(list(demo_samples))


def test_validation_loader_flushes_everything(
    vlm_demo_path: Path, demo_samples: dict[str, Any]
) -> None:
    dataset = get_val_dataset(
        vlm_demo_path,
        split_part="train",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        packing_buffer_size=16,
        task_encoder=make_encoder(),
    )
    assert emitted_keys(dataset) == Counter(list(demo_samples))


def test_packs_fit_and_media_follow_segment_order(
    vlm_demo_path: Path, demo_samples: dict[str, Any]
) -> None:
    encoder = ConversationEncoder(media=SMALL_MEDIA)
    image_pad = encoder.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    video_pad = encoder.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    fills = []
    for batch in batches(train_dataset(vlm_demo_path, 16)):
        tokens = batch.input_ids.shape[1]
        assert batch.input_ids.shape == batch.labels.shape == batch.loss_mask.shape
        assert tokens <= 8192
        assert batch.cu_seqlens_padded[-1] == tokens
        assert batch.cu_seqlens.dtype == torch.int32
        assert torch.all(batch.cu_seqlens_padded % 8 == 0)
        fills.append(tokens / 8192)
        singles = [encoder.encode_sample(k, demo_samples[k]) for k in batch.__keys__]
        lengths = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).tolist()
        assert lengths == [s.length for s in singles]
        images = [m.grid_thw for s in singles for m in s.media if m.kind == "image"]
        videos = [m.grid_thw for s in singles for m in s.media if m.kind == "video"]
        if images:
            assert batch.image_grid_thw is not None
            assert batch.pixel_values is not None
            assert [tuple(g) for g in batch.image_grid_thw.tolist()] == images
            assert batch.pixel_values.shape[0] == int(batch.image_grid_thw.prod(dim=1).sum())
            assert int((batch.input_ids == image_pad).sum()) == batch.pixel_values.shape[0] // 4
        else:
            assert batch.pixel_values is None
        if videos:
            assert batch.video_grid_thw is not None
            assert batch.pixel_values_videos is not None
            assert [tuple(g) for g in batch.video_grid_thw.tolist()] == videos
            patches = int(batch.video_grid_thw.prod(dim=1).sum())
            assert batch.pixel_values_videos.shape[0] == patches
            assert int((batch.input_ids == video_pad).sum()) == patches // 4
    assert sum(fills[:-3]) / len(fills[:-3]) > 0.97  # the last packs are the flush remainder


@pytest.mark.parametrize(("workers", "at"), [(0, 3), (2, 5)])
def test_resume_reproduces_the_pack_stream(vlm_demo_path: Path, workers: int, at: int) -> None:
    steps = [LoaderRun.step] * (at + 6)
    assert_resume_equivalent(
        lambda: LoaderRun(vlm_demo_path, workers=workers),
        steps,
        at,
        save=LoaderRun.save,
        load=LoaderRun.load,
        roundtrip=lambda state: pickle.loads(pickle.dumps(state)),
    )


def test_resume_while_samples_are_carried_over(vlm_demo_path: Path) -> None:
    """The resume point is chosen where the buffer holds candidates waiting for later packs."""
    run = LoaderRun(vlm_demo_path)
    wrapper = _wrapper(run.dataset)
    at = 0
    while not wrapper._buffer_seqs:
        run.step()
        at += 1
        assert at < 30, "no resume point with carried-over samples found"
    steps = [LoaderRun.step] * (at + 5)
    assert_resume_equivalent(
        lambda: LoaderRun(vlm_demo_path),
        steps,
        at,
        save=LoaderRun.save,
        load=LoaderRun.load,
        roundtrip=lambda state: pickle.loads(pickle.dumps(state)),
    )


def _wrapper(dataset: Any) -> CarryOverPackingDataset[Any, Any]:
    while not isinstance(dataset, CarryOverPackingDataset):
        dataset = dataset.dataset
    return dataset


def test_buffer_holds_compressed_samples_only(vlm_demo_path: Path) -> None:
    dataset = train_dataset(vlm_demo_path, 32)
    wrapper = _wrapper(dataset)
    seen_media = 0
    for batch in batches(dataset):
        buffered = [sample.encoded for sample in wrapper._buffer.buffer]
        seen_media += sum(len(e.media) for e in buffered)
        assert all(e.vision is None for e in buffered)
        assert batch.packing_stats is not None
        assert batch.packing_stats.buffer_bytes < 2_000_000
    assert seen_media > 0


def test_restore_sample_rebuilds_a_pack(vlm_demo_path: Path) -> None:
    loader = savable_loader(train_dataset(vlm_demo_path, 16))
    iterator = iter(loader)
    for _ in range(4):
        next(iterator)
    batch = next(iterator)
    again = loader.restore_sample(batch.__restore_key__)
    assert again.__keys__ == batch.__keys__
    assert torch.equal(again.input_ids, batch.input_ids)
    assert torch.equal(again.cu_seqlens, batch.cu_seqlens)
    assert batch.pixel_values is not None
    assert torch.equal(again.pixel_values, batch.pixel_values)


def test_broken_samples_are_skipped_counted_and_logged(
    broken_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = json.loads((broken_path / "expected.json").read_text())["samples"]
    good = {key for key, info in expected.items() if info["ok"]}
    kinds = Counter(info["kind"] for info in expected.values() if not info["ok"])
    with caplog.at_level("WARNING", logger="energon_pack.energon"):
        packs = list(batches(train_dataset(broken_path, 4)))
    assert Counter(k for batch in packs for k in batch.__keys__) == Counter(good)
    stats = packs[-1].packing_stats
    assert stats is not None
    assert Counter(stats.skipped) == kinds
    logged = "\n".join(record.getMessage() for record in caplog.records)
    for key, info in expected.items():
        if not info["ok"]:
            assert key in logged
            assert info["member"] in logged


def test_a_flood_of_bad_samples_stops_the_run(broken_path: Path) -> None:
    with pytest.raises(RuntimeError, match="3 samples in a row were skipped"):
        list(batches(train_dataset(broken_path, 4, max_consecutive_skips=3)))


def test_overlong_samples_error_or_skip(vlm_demo_path: Path, demo_samples: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"sample 'demo\d+' has \d+ tokens .* seq_length=2048"):
        list(batches(train_dataset(vlm_demo_path, 8, seq_length=2048, overlong="error")))
    packs = list(batches(train_dataset(vlm_demo_path, 8, seq_length=2048)))  # skip: the default
    stats = packs[-1].packing_stats
    assert stats is not None
    kept = sum(len(batch.__keys__) for batch in packs)
    assert stats.skipped["overlong"] > 0
    assert kept + stats.skipped["overlong"] == len(demo_samples)
    assert all(batch.input_ids.shape[1] <= 2048 for batch in packs)


def test_packing_stats_count_packs_that_left_with_the_buffer_full(vlm_demo_path: Path) -> None:
    """Four samples cannot fill a 32768-token row: bounded at four, every pack leaves because
    the buffer is full. A 32-sample buffer fills 8192-token rows, and they leave full enough."""
    bounded = BufferConfig(min_rows=None)
    with pytest.warns(PackingWarning, match="candidate buffer was full"):
        packs = list(batches(train_dataset(vlm_demo_path, 4, seq_length=32768, buffer=bounded)))
    stats = packs[-1].packing_stats
    assert stats is not None
    assert stats.bin_fill < 0.2
    assert stats.left_buffer_full >= stats.packs - 3  # the last ones leave in the flush
    grown = list(batches(train_dataset(vlm_demo_path, 4, seq_length=32768)))[-1].packing_stats
    assert grown is not None
    assert grown.bin_fill > 0.9
    packs = list(batches(train_dataset(vlm_demo_path, 32, seq_length=8192)))
    stats = packs[-1].packing_stats
    assert stats is not None
    assert stats.bin_fill > 0.95
    assert stats.left_buffer_full <= stats.packs // 10


def test_packing_stats_time_the_packer_per_sample(vlm_demo_path: Path) -> None:
    """Each pack reports the microseconds the worker's packer took per sample so far: more than
    none, and far less than the whole pass took per sample (the packer is a small part of it,
    beside reading, encoding and decoding)."""
    start = time.perf_counter()
    packs = list(batches(train_dataset(vlm_demo_path, 32)))
    whole = (time.perf_counter() - start) * 1e6
    stats = [pack.packing_stats for pack in packs]
    assert all(s is not None and s.pack_us_per_sample > 0 for s in stats)
    last = stats[-1]
    assert last is not None
    assert last.pack_us_per_sample * last.samples < whole / 4


def test_batch_size_must_be_one(vlm_demo_path: Path) -> None:
    with pytest.raises(ValueError, match="batch_size must be 1, got batch_size=2"):
        get_train_dataset(
            vlm_demo_path,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
            batch_size=2,
            packing_buffer_size=8,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=make_encoder(),
        )


def test_bad_packing_settings_fail_at_construction() -> None:
    with pytest.raises(ValueError, match=r"max_bytes \(packing_buffer_bytes\)"):
        make_encoder(packing_buffer_bytes=0)


def test_byte_bound_keeps_the_buffer_small(vlm_demo_path: Path) -> None:
    packs = list(batches(train_dataset(vlm_demo_path, 64, packing_buffer_bytes=200_000)))
    assert all(
        b.packing_stats is not None and b.packing_stats.buffer_bytes <= 200_000 for b in packs
    )


def test_torchrun_two_ranks_cover_the_epoch(
    vlm_demo_path: Path, demo_samples: dict[str, Any], tmp_path: Path
) -> None:
    script = SUPPORT / "distributed_epoch.py"
    out = tmp_path / "keys.json"
    torchrun(script, vlm_demo_path, out)
    per_rank = json.loads(out.read_text())
    assert len(per_rank) == 2
    assert not set(per_rank[0]) & set(per_rank[1])
    assert Counter(per_rank[0] + per_rank[1]) == Counter(list(demo_samples))


def test_mrope_ids_restart_per_segment_with_its_own_grids(
    vlm_demo_path: Path, demo_samples: dict[str, Any]
) -> None:
    encoder = ConversationEncoder(media=SMALL_MEDIA)
    config = MRopeConfig.from_tokenizer(encoder.tokenizer)
    dataset = train_dataset(vlm_demo_path, 16, position_ids="mrope")
    batch = next(iter(savable_loader(dataset)))
    assert batch.mrope_position_ids is not None
    assert batch.rope_deltas is not None
    assert batch.mrope_position_ids.shape == (3, 1, batch.input_ids.shape[1])
    starts = batch.cu_seqlens_padded.tolist()
    for index, key in enumerate(batch.__keys__):
        single = encoder.encode_sample(key, demo_samples[key]).materialize(SMALL_MEDIA)
        assert single.vision is not None
        vision = single.vision
        expected, delta = mrope_position_ids(
            single.input_ids,
            vision.image_grid_thw,
            vision.video_grid_thw,
            vision.second_per_grid_ts,
            config,
        )
        got = batch.mrope_position_ids[:, 0, starts[index] : starts[index] + single.length]
        assert torch.equal(got, expected)
        assert int(batch.rope_deltas[index]) == delta


@pytest.mark.parametrize(("decode", "workers"), [("lazy", 1), ("eager", 0)])
def test_uint8_pixels_normalise_to_the_float_batches(
    vlm_demo_path: Path, decode: str, workers: int
) -> None:
    """Same packs; uint8 pixels through the loader (shared memory with a worker) normalise to
    exactly the float32 batches."""
    raw_media = replace(SMALL_MEDIA, pixel_dtype="uint8")
    floats = batches(train_dataset(vlm_demo_path, 16, workers=workers, decode=decode))
    raws = batches(
        train_dataset(vlm_demo_path, 16, workers=workers, decode=decode, media=raw_media)
    )
    seen = 0
    for expected, got in zip(floats, raws, strict=True):
        assert got.__keys__ == expected.__keys__
        for name in ("pixel_values", "pixel_values_videos"):
            want, have = getattr(expected, name), getattr(got, name)
            assert (want is None) == (have is None), name
            if have is not None:
                assert have.dtype == torch.uint8
                assert torch.equal(normalize_pixels(have, raw_media), want), name
                seen += 1
    assert seen > 10
