"""Bad data never kills a run: crash-proof decoding, every failure a MediaError, full accounting.

Real decoders (decord, Pillow) on the committed crash corpus (files that kill an unguarded
decord, made by ``benchmarks/fuzz_media.py --write-corpus``), real Energon loaders with two
workers, and the collator in a two-worker DataLoader.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import logging
import operator
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from energon_shards import write_dataset
from guard_decoders import filled_frames, fresh_array, labelled_frames, slow_frames
from helpers import (
    SMALL_MEDIA,
    SUPPORT,
    batches,
    image_bytes,
    make_encoder,
    read_samples,
    train_dataset,
    video_bytes,
)
from hf_qwen import qwen_tokenizer
from PIL import Image
from torch.utils.data import DataLoader

from energon_pack import media
from energon_pack.collate import CollatedBatch, VLMPackingCollator
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.energon.task_encoder import PreparedSample
from energon_pack.formats.native import parse_sample
from energon_pack.media import MediaConfig, MediaError
from energon_pack.media.audio import probe_video_audio
from energon_pack.media.audio_decode import decode_audio, played_frames
from energon_pack.media.displayed import displayed_video_header, displayed_videos
from energon_pack.media.errors import medium_label
from energon_pack.media.guard import (
    FramesJob,
    guarded,
    guarded_frames_each,
    helper_pid,
    shutdown_helper,
)
from energon_pack.packing.packed import SkippedSample

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
CORPUS = FIXTURES / "crash_corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())["files"]


def guard(fn: Any, *args: Any, timeout_s: float = 30.0, isolation: Any = "process") -> Any:
    return guarded(
        fn,
        *args,
        key="k",
        member="0.mp4",
        kind="corrupt",
        isolation=isolation,
        timeout_s=timeout_s,
    )


# --- the guard itself -----------------------------------------------------------------------


def test_native_crash_becomes_a_media_error_and_the_next_call_works() -> None:
    with pytest.raises(MediaError, match=r"sample 'k', member '0.mp4'.*SIGSEGV") as info:
        guard(ctypes.string_at, 0)
    assert info.value.kind == "crashed"
    with pytest.raises(MediaError, match="SIGABRT") as info:
        guard(os.abort)
    assert info.value.kind == "crashed"
    assert guard(operator.add, 2, 3) == 5  # a fresh helper took over


def test_hang_becomes_a_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(MediaError, match="decode_timeout_s=1") as info:
        guard(time.sleep, 600, timeout_s=1)
    assert info.value.kind == "timeout"
    assert time.monotonic() - start < 300  # the sleeping helper was killed, not awaited
    assert guard(operator.mul, 4, 5) == 20


@pytest.mark.parametrize("isolation", ["process", "off"])
def test_foreign_exceptions_become_media_errors(isolation: str) -> None:
    with pytest.raises(MediaError, match=r"KeyError: 'x' \[corrupt\]") as info:
        guard(operator.getitem, {}, "x", isolation=isolation)
    assert (info.value.key, info.value.member) == ("k", "0.mp4")


@pytest.mark.parametrize("isolation", ["process", "off"])
def test_memory_errors_propagate_with_the_sample_named(isolation: str) -> None:
    with pytest.raises(MemoryError, match=r"sample 'k', member '0.mp4'"):
        guard(bytearray, 2**62, isolation=isolation)


def test_guarded_decoding_equals_unguarded(demo: dict[str, dict[str, bytes]]) -> None:
    """Results are compared after all calls: a result that still pointed into the decoder's
    reused shared block would have been overwritten by the later calls."""
    off = MediaConfig(decode_isolation="off")
    uint8 = MediaConfig(pixel_dtype="uint8")
    items = [
        (kind, data)
        for key, sample in list(demo.items())[:40]
        for _, kind, data in parse_sample(key, sample).media
    ]
    guarded_results = []
    for kind, data in items:
        if kind == "image":
            guarded_results.append((media.process_image(data), media.process_image(data, uint8)))
        else:
            assert media.probe_video(data) == media.probe_video(data, off)
            guarded_results.append((media.process_video(data), media.process_video(data, uint8)))
    for (kind, data), (float32, raw) in zip(items, guarded_results, strict=True):
        process = media.process_image if kind == "image" else media.process_video
        assert torch.equal(float32[0], process(data, off)[0])
        assert torch.equal(raw[0], process(data, replace(uint8, decode_isolation="off"))[0])
    kinds = Counter(kind for kind, _ in items)
    assert kinds["image"] > 5
    assert kinds["video"] > 1


def test_the_decoder_process_does_not_load_torch(demo: dict[str, dict[str, bytes]]) -> None:
    """It loads Pillow, decord and numpy only: about 80 MiB instead of 320 with torch."""
    key, sample = next(iter(demo.items()))
    for _, kind, data in parse_sample(key, sample).media:
        (media.process_image if kind == "image" else media.process_video)(data)
    pid = helper_pid()
    assert pid is not None
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps
    assert "decord" in maps or "PIL" in maps


def test_the_decoder_process_keeps_freed_memory_for_the_next_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Allocator settings of the helper (Pillow blocks, glibc thresholds); the caller's win."""
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345678")
    shutdown_helper()
    try:
        media.process_image(image_bytes(32, 32))
        pid = helper_pid()
        assert pid is not None
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    finally:
        monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
        shutdown_helper()
    assert env["PILLOW_BLOCKS_MAX"] == "8"
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
    assert env["MALLOC_TRIM_THRESHOLD_"] == "12345678"


@pytest.mark.usefixtures("helper_imports_tests")
def test_a_guarded_decoder_must_fill_the_array_it_was_given() -> None:
    with pytest.raises(MediaError, match="must return the array its alloc gave"):
        guarded_frames_each(
            fresh_array,
            [FramesJob(((2, 3),), "k", "0.mp4")],
            use=lambda *_: None,
            kind="corrupt",
            isolation="process",
            timeout_s=30.0,
        )


@pytest.mark.usefixtures("helper_imports_tests")
@pytest.mark.parametrize("isolation", ["process", "off"])
def test_log_lines_of_the_decoder_name_the_medium(isolation: Any) -> None:
    """The decoder knows no names; the boundary gives its log lines the sample's."""
    assert guard(medium_label, isolation=isolation) == "k/0.mp4"
    seen: list[str] = []
    guarded_frames_each(
        labelled_frames,
        [FramesJob((), "s", "1.jpg", nbytes=1), FramesJob((), "t", "2.jpg", nbytes=1)],
        use=lambda _, frames, label: seen.append(label),
        kind="corrupt",
        isolation=isolation,
        timeout_s=30.0,
    )
    assert seen == ["s/1.jpg", "t/2.jpg"]
    assert medium_label() == "?/?"  # outside any boundary


@pytest.fixture
def helper_imports_tests(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A decoder process that can import ``guard_decoders`` (restarted before and after)."""
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))
    shutdown_helper()
    yield
    shutdown_helper()


def run_batch(jobs: list[tuple[int, int, bool]], isolation: Any = "process") -> dict[int, Any]:
    """``(value, size, crash)`` jobs through guarded_frames_each; what ``use`` saw, by index."""
    seen: dict[int, Any] = {}

    def keep(index: int, frames: np.ndarray[Any, Any], extra: int) -> None:
        time.sleep(0.01)  # the helper has written the next job by now: it must not be here
        seen[index] = (frames.copy(), extra)

    guarded_frames_each(
        filled_frames,
        [
            FramesJob((value, (size,), crash), f"s{i}", f"{i}.mp4", nbytes=size)
            for i, (value, size, crash) in enumerate(jobs)
        ],
        use=keep,
        kind="corrupt",
        isolation=isolation,
        timeout_s=30.0,
    )
    return seen


@pytest.mark.usefixtures("helper_imports_tests")
@pytest.mark.parametrize("isolation", ["process", "off"])
def test_a_batch_hands_each_job_its_own_frames(isolation: str) -> None:
    """Job i + 1 is written while use() reads job i: they must not share bytes."""
    jobs = [(i + 1, 1000 + 700 * (i % 3), False) for i in range(7)]
    seen = run_batch(jobs, isolation)
    assert sorted(seen) == list(range(7))
    for index, (value, size, _) in enumerate(jobs):
        frames, extra = seen[index]
        assert extra == value
        assert frames.shape == (size,)
        assert np.all(frames == value)


@pytest.mark.usefixtures("helper_imports_tests")
def test_a_crash_inside_a_batch_names_its_job_and_stops_the_batch() -> None:
    seen: dict[int, Any] = {}
    with pytest.raises(MediaError, match=r"sample 's2', member '2.mp4'.*SIGSEGV") as info:
        seen = run_batch([(1, 100, False), (2, 100, False), (3, 100, True), (4, 100, False)])
    assert info.value.kind == "crashed"
    assert not seen  # run_batch did not return
    assert np.all(run_batch([(5, 64, False)])[0][0] == 5)  # the restarted helper works


@pytest.mark.usefixtures("helper_imports_tests")
def test_frames_larger_than_their_job_planned_are_refused() -> None:
    jobs = [FramesJob((1, (64,), False), "s0", "0.jpg", nbytes=32)]
    with pytest.raises(MediaError, match="planned 32") as info:
        guarded_frames_each(
            filled_frames,
            jobs,
            use=lambda *_: None,
            kind="corrupt",
            isolation="process",
            timeout_s=30.0,
        )
    assert info.value.kind == "corrupt"


@pytest.mark.usefixtures("helper_imports_tests")
def test_a_failing_use_leaves_nothing_in_flight() -> None:
    def fail(index: int, frames: np.ndarray[Any, Any], extra: int) -> None:
        raise RuntimeError("use failed")

    with pytest.raises(RuntimeError, match="use failed"):
        guarded_frames_each(
            filled_frames,
            [FramesJob((v, (10,), False), "s", f"{v}.mp4", nbytes=10) for v in (1, 2, 3)],
            use=fail,
            kind="corrupt",
            isolation="process",
            timeout_s=30.0,
        )
    seen = run_batch([(9, 10, False), (8, 20, False)])
    assert np.all(seen[0][0] == 9)
    assert np.all(seen[1][0] == 8)


@pytest.mark.usefixtures("helper_imports_tests")
def test_a_failing_use_then_a_timeout_leave_a_working_helper() -> None:
    """use() raises while the next job hangs past the timeout: the helper is stopped (while
    the failed job's frames are still referenced) and the next batch gets a new one."""

    def fail(index: int, frames: np.ndarray[Any, Any], extra: int) -> None:
        raise RuntimeError("use failed")

    run_batch([(1, 10, False)])  # the helper has imported this file: only the sleep is slow
    jobs = [FramesJob((1, 0.0), "s", "0.mp4", 10), FramesJob((2, 5.0), "s", "1.mp4", 10)]
    with pytest.raises(RuntimeError, match="use failed"):
        guarded_frames_each(
            slow_frames, jobs, use=fail, kind="corrupt", isolation="process", timeout_s=0.5
        )
    seen = run_batch([(7, 10, False), (6, 20, False)])
    assert np.all(seen[0][0] == 7)
    assert np.all(seen[1][0] == 6)


# --- the crash corpus -------------------------------------------------------------------------


@pytest.fixture
def corpus_memory_layout(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Decoder processes with glibc's default thresholds, as when the corpus was recorded.

    Whether a corpus file's out-of-bounds read segfaults depends on what memory is mapped next
    to it; the thresholds the helper sets by default keep freed memory mapped, so fewer of
    these reads fault there (they are rejected as ``corrupt``/``unreadable`` instead).
    """
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))
    shutdown_helper()
    yield
    shutdown_helper()


def test_corpus_is_what_its_manifest_says() -> None:
    assert len(MANIFEST) >= 10
    for entry in MANIFEST:
        data = (CORPUS / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert entry["unguarded"].startswith("died:")


VIDEO_FORMATS = ("h264", "mpeg4", "h264_aac")


def read_paths(fmt: str) -> list[Callable[[bytes, str], None]]:
    """The ways the fuzzer read a corpus file of ``fmt``, each ``(data, key)``: a video through
    the Qwen presets' probe and decode, the processor families' header and sampled frames, and
    its audio track; an audio file through its decode (the waveform as long as its header
    says)."""

    def qwen(data: bytes, key: str) -> None:
        media.probe_video(data, key=key, member="0.mp4")
        media.process_video(data, key=key, member="0.mp4")

    def family(data: bytes, key: str) -> None:
        header = displayed_video_header(data, key=key, member="0.mp4")
        picked = tuple(sorted({i * header.frames // 4 for i in range(4)}))
        displayed_videos([(key, "0.mp4", data, picked, (header.height, header.width), 0)])

    def track(data: bytes, key: str) -> None:
        if probe_video_audio(data, key, "0.mp4") is not None:
            decode_audio(data, key=key, member="0.mp4")

    def audio(data: bytes, key: str) -> None:
        waveform, probe = decode_audio(data, key=key, member=f"0.{fmt}")
        assert len(waveform) == played_frames(probe, 16000)

    return [qwen, family, track] if fmt in VIDEO_FORMATS else [audio]


@pytest.mark.usefixtures("corpus_memory_layout")
def test_every_corpus_file_is_a_media_error_or_decodes_whole() -> None:
    """Files that once killed an unguarded decoder: on every path that read it, a MediaError
    naming it or a whole result (a video refused on one path at least; audio that FFmpeg
    through PyAV now decodes: a waveform of its header's length); never a crash of this
    process."""
    kinds = Counter()
    for entry in MANIFEST:
        data = (CORPUS / entry["file"]).read_bytes()
        refused: list[MediaError] = []
        for path in read_paths(entry["format"]):
            try:
                path(data, entry["file"])
            except MediaError as error:
                refused.append(error)
        assert all(error.key == entry["file"] for error in refused), refused
        if not refused:
            assert entry["format"] not in VIDEO_FORMATS, entry
            kinds["decoded"] += 1
        kinds.update(error.kind for error in refused[:1])
        kinds["crashed_anywhere"] += any(error.kind == "crashed" for error in refused)
    videos = sum(entry["format"] in VIDEO_FORMATS for entry in MANIFEST)
    assert kinds["crashed_anywhere"] >= videos // 2, kinds
    assert media.probe_video(video_bytes()).frames > 0  # and decoding goes on


# --- parsing ----------------------------------------------------------------------------------


def conversation(value: str = "hi", **extra: Any) -> bytes:
    turns = [{"from": "human", "value": value}, {"from": "gpt", "value": "ok"}]
    return json.dumps({"conversations": turns, **extra}).encode()


def im_as_png() -> bytes:
    out = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # IM is deprecated in Pillow
        Image.new("RGB", (8, 8)).save(out, format="IM")
    return out.getvalue().replace(b"RGB image", b"XYZ image")


def dds_as_png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="DDS")
    return out.getvalue()


BAD_JSON = {
    "deep_list": b"[" * 200_000 + b"]" * 200_000,
    "deep_in_turns": b'{"conversations": [' + b"[" * 30 + b"]" * 30 + b"]}",
    "turns_not_list": json.dumps({"conversations": "hi"}).encode(),
    "value_not_str": json.dumps({"conversations": [{"from": "human", "value": 5}]}).encode(),
    "system_not_str": conversation(system=3),
    "media_not_list": conversation(media="0.jpg"),
}


@pytest.mark.parametrize("name", sorted(BAD_JSON))
def test_broken_json_is_a_bad_sample(name: str) -> None:
    config = MediaConfig(max_json_depth=16)
    with pytest.raises(MediaError, match=rf"sample '{name}', member 'json'") as info:
        parse_sample(name, {"json": BAD_JSON[name]}, config)
    assert info.value.kind == "bad_sample"


def test_json_size_limit() -> None:
    big = conversation("x" * 5000)
    with pytest.raises(MediaError, match="max_json_bytes=1000") as info:
        parse_sample("big", {"json": big}, MediaConfig(max_json_bytes=1000))
    assert info.value.kind == "bad_sample"
    assert parse_sample("big", {"json": big}).turns[0][1] == "x" * 5000


@pytest.mark.parametrize("data", [im_as_png(), dds_as_png()], ids=["im", "dds"])
def test_pil_confusing_files_are_unreadable(data: bytes) -> None:
    with pytest.raises(MediaError, match="not a readable image") as info:
        media.probe_image(data, key="k", member="0.png")
    assert info.value.kind == "unreadable"


# --- real loaders -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo() -> dict[str, dict[str, bytes]]:
    return read_samples(FIXTURES / "vlm_demo")


def bad_samples() -> dict[str, tuple[str, dict[str, bytes]]]:
    """``{key: (kind, members)}`` of samples that must be skipped and counted."""
    video_turn = conversation("<video>describe")
    image_turn = conversation("<image>describe")
    jpeg = image_bytes(320, 240, "JPEG")
    bad: dict[str, tuple[str, dict[str, bytes]]] = {}
    videos = [entry for entry in MANIFEST if entry["format"] in ("h264", "mpeg4")]
    for entry in videos[:4]:
        data = (CORPUS / entry["file"]).read_bytes()
        bad[f"crash_{entry['format']}_{entry['index']}"] = (
            "crashed",
            {"json": video_turn, "0.mp4": data},
        )
    for name, raw in BAD_JSON.items():
        if name != "deep_in_turns":  # within the default max_json_depth
            bad[f"json_{name}"] = ("bad_sample", {"json": raw})
    bad["pil_im"] = ("unreadable", {"json": image_turn, "0.png": im_as_png()})
    bad["pil_dds"] = ("unreadable", {"json": image_turn, "0.png": dds_as_png()})
    bad["truncated_jpeg"] = ("corrupt", {"json": image_turn, "0.jpg": jpeg[: len(jpeg) // 2]})
    return bad


def interleaved(
    demo: dict[str, dict[str, bytes]], good_count: int
) -> tuple[list[tuple[str, dict[str, bytes]]], list[str], Counter[str]]:
    good = [(f"good{index:03d}", members) for index, members in enumerate(demo.values())]
    good = good[:good_count]
    bad = bad_samples()
    samples: list[tuple[str, dict[str, bytes]]] = []
    bad_items = list(bad.items())
    for index, item in enumerate(good):
        samples.append(item)
        if index % 2 == 1 and bad_items:
            key, (_, members) = bad_items.pop(0)
            samples.append((key, members))
    samples += [(key, members) for key, (_, members) in bad_items]
    kinds = Counter(kind for kind, _ in bad.values())
    return samples, [key for key, _ in good], kinds


@pytest.mark.usefixtures("corpus_memory_layout")
def test_energon_two_workers_deliver_every_good_sample_once_and_count_every_bad_one(
    tmp_path: Path, demo: dict[str, dict[str, bytes]]
) -> None:
    samples, good, kinds = interleaved(demo, 24)
    path = write_dataset(tmp_path / "mixed", samples)
    packs = list(batches(train_dataset(path, 4, workers=2)))
    assert Counter(key for pack in packs for key in pack.__keys__) == Counter(good)
    final: dict[int, Any] = {}
    for pack in packs:
        assert pack.packing_stats is not None
        final[pack.packing_stats.worker] = pack.packing_stats
    assert len(final) == 2
    skipped = sum((Counter(stats.skipped) for stats in final.values()), Counter())
    # A corpus file crashes decord on most runs, but not on every one (the crash depends on
    # memory layout): it is then rejected cleanly, under another kind.
    crash_files = kinds.pop("crashed")
    unexplained = skipped - kinds
    assert sum(unexplained.values()) == crash_files
    assert set(unexplained) <= {"crashed", "unreadable", "corrupt"}
    assert unexplained["crashed"] >= 1
    assert skipped - unexplained == kinds
    assert sum(stats.samples for stats in final.values()) == len(good)


def prepared(key: str, members: dict[str, bytes]) -> PreparedSample:
    encoded = make_encoder().encoder.encode_sample(key, members)
    return PreparedSample(
        __key__=key, __restore_key__=(), __subflavors__=None, __sources__=(), encoded=encoded
    )


def test_energon_names_the_failing_sample_by_position_when_keys_repeat() -> None:
    """Keys repeat across shards: the failing sample is found by its place in the pack, so a
    good sample with the same key is not dropped in its stead."""
    encoder = make_encoder()
    members = {"json": conversation("<image>hi"), "0.png": image_bytes(64, 48)}
    good = prepared("000001", members)
    # probed when it entered the buffer, its bytes cut short before the pack decodes it
    (item,) = good.encoded.media
    cut = replace(good.encoded, media=[replace(item, data=item.data[:40])])
    bad = replace(good, encoded=cut)
    with pytest.raises(SkippedSample) as info:
        encoder.pack_selected_samples([good, bad])
    assert (info.value.key, info.value.position, info.value.reason) == ("000001", 1, "unreadable")
    assert "sample '000001', member '0.png'" in str(info.value)
    packed = encoder.pack_selected_samples([good, good])
    assert packed.__keys__ == ["000001", "000001"]


def test_skips_after_the_last_pack_reach_the_trainer(
    tmp_path: Path, demo: dict[str, dict[str, bytes]]
) -> None:
    good = [(f"good{i}", members) for i, members in enumerate(list(demo.values())[:3])]
    _, truncated = bad_samples()["truncated_jpeg"]  # probes fine, fails at decode
    tail = [(f"tail{i}", truncated) for i in range(3)]
    path = write_dataset(tmp_path / "tail", good + tail)
    packs = list(batches(train_dataset(path, 1)))  # each good sample leaves in its own pack
    assert [pack.__keys__ for pack in packs[:-1]] == [[key] for key, _ in good]
    last = packs[-1]
    assert last.__keys__ == []  # the summary pack: padding only
    assert not last.loss_mask.any()
    assert last.packing_stats is not None
    assert last.packing_stats.skipped == {"corrupt": len(tail)}


def test_all_media_failing_at_decode_time_stops_the_run(tmp_path: Path) -> None:
    jpeg = image_bytes(320, 240, "JPEG")
    members = {"json": conversation("<image>describe"), "0.jpg": jpeg[: len(jpeg) // 2]}
    path = write_dataset(tmp_path / "all_bad", [(f"bad{i:03d}", members) for i in range(30)])
    with pytest.raises(RuntimeError, match=r"10 samples in a row .*kinds: corrupt x10"):
        list(batches(train_dataset(path, 4, max_consecutive_skips=10)))


class Items(torch.utils.data.Dataset[tuple[str, dict[str, bytes]]]):
    def __init__(self, items: list[tuple[str, dict[str, bytes]]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[str, dict[str, bytes]]:
        return self.items[index]


@pytest.mark.usefixtures("corpus_memory_layout")
def test_collator_in_two_worker_dataloader_loses_nothing(
    demo: dict[str, dict[str, bytes]],
) -> None:
    samples, good, kinds = interleaved(demo, 24)
    bad = bad_samples()
    collate = VLMPackingCollator(
        16384,
        pad_to_multiple_of=8,
        pad_to_max_length=True,
        encoder=ConversationEncoder(media=SMALL_MEDIA),
        on_media_error="skip",
    )
    loader = DataLoader(Items(samples), batch_size=4, num_workers=2, collate_fn=collate)
    batches_: list[CollatedBatch] = list(loader)
    delivered = Counter(key for batch in batches_ for row in batch.keys for key in row)
    assert delivered == Counter(good)
    skipped = [key for batch in batches_ for key in batch.skipped_keys]
    assert Counter(bad[key][0] for key in skipped) == kinds
    assert len(skipped) == len(bad)


# --- text that must not stop a run (issue 27) -------------------------------------------------


def text_samples(
    demo: dict[str, dict[str, bytes]], hf: bool
) -> tuple[list[tuple[str, dict[str, bytes]]], list[str], dict[str, str]]:
    """Good and bad samples whose text, not media, is the trouble: ``(samples in order, good
    keys, {bad key: kind})``. Placeholders in a system prompt are text; a lone surrogate
    (valid escaped JSON) cannot be tokenised; an HF tokenizer reads vision-token text as the
    token, which no medium backs."""
    png = image_bytes(64, 48)
    good = [(f"good{index}", members) for index, members in enumerate(list(demo.values())[:3])]
    good.append(("system_image", {"json": conversation(system="Use <image> tags")}))
    good.append(
        ("system_both", {"json": conversation("<image>hi", system="<video> <image>"), "0.png": png})
    )
    bad = {
        "cut_turn": ("bad_sample", {"json": conversation("cut emoji \ud83d")}),
        "cut_system": ("bad_sample", {"json": conversation(system="cut emoji \ud83d")}),
    }
    if hf:
        bad["pad_text"] = ("placeholder_mismatch", {"json": conversation("a <|image_pad|> b")})
        bad["pad_extra"] = (
            "placeholder_mismatch",
            {"json": conversation("<image><|vision_start|>hi"), "0.png": png},
        )
    samples = [*good[:2], *[(key, members) for key, (_, members) in bad.items()], *good[2:]]
    return samples, [key for key, _ in good], {key: kind for key, (kind, _) in bad.items()}


def records_naming(records: list[logging.LogRecord], key: str) -> int:
    return sum(repr(key) in record.getMessage() for record in records)


@pytest.mark.parametrize("hf", [False, True], ids=["byte", "hf"])
def test_energon_counts_each_text_failure_once_by_key(
    tmp_path: Path,
    demo: dict[str, dict[str, bytes]],
    hf: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    samples, good, bad = text_samples(demo, hf)
    path = write_dataset(tmp_path / "text", samples)
    tokenizer = qwen_tokenizer() if hf else None
    with caplog.at_level(logging.WARNING, logger="energon_pack"):
        packs = list(batches(train_dataset(path, 4, tokenizer=tokenizer)))
    assert Counter(key for pack in packs for key in pack.__keys__) == Counter(good)
    stats = packs[-1].packing_stats
    assert stats is not None
    assert stats.skipped == dict(Counter(bad.values()))
    for key in bad:
        assert records_naming(caplog.records, key) == 1, key


def test_energon_takes_placeholders_in_the_system_prompt_setting_as_text(
    tmp_path: Path, demo: dict[str, dict[str, bytes]]
) -> None:
    keys = list(demo)[:3]
    path = write_dataset(tmp_path / "plain", [(key, demo[key]) for key in keys])
    dataset = train_dataset(path, 4, system_prompt="Use <image> tags")
    packs = list(batches(dataset))
    assert Counter(key for pack in packs for key in pack.__keys__) == Counter(keys)
    assert packs[-1].packing_stats is not None
    assert packs[-1].packing_stats.skipped == {}


@pytest.mark.parametrize("hf", [False, True], ids=["byte", "hf"])
def test_collator_skips_each_text_failure_once_by_key(
    demo: dict[str, dict[str, bytes]], hf: bool, caplog: pytest.LogCaptureFixture
) -> None:
    samples, good, bad = text_samples(demo, hf)
    tokenizer = qwen_tokenizer() if hf else None
    encoder = ConversationEncoder(tokenizer, media=SMALL_MEDIA, system_prompt="Use <video>")
    collate = VLMPackingCollator(16384, encoder=encoder, on_media_error="skip")
    loader = DataLoader(Items(samples), batch_size=5, collate_fn=collate)
    with caplog.at_level(logging.WARNING, logger="energon_pack"):
        batches_: list[CollatedBatch] = list(loader)
    delivered = Counter(key for batch in batches_ for row in batch.keys for key in row)
    assert delivered == Counter(good)
    assert Counter(key for batch in batches_ for key in batch.skipped_keys) == Counter(list(bad))
    for key in bad:
        assert records_naming(caplog.records, key) == 1, key
    strict = VLMPackingCollator(16384, encoder=encoder)
    for key, members in samples:
        if key in bad:
            with pytest.raises(MediaError, match=f"sample {key!r}") as info:
                strict([samples[0], (key, members)])
            assert info.value.kind == bad[key]
