"""Seeded media fuzzer: mutated MP4 (H.264, MPEG-4, H.264 with an AAC track), JPEG, PNG, WebP and
audio (WAV, FLAC, MP3, Ogg Opus, M4A) through probe + decode (images also through the processor
families' header size and upright decode; videos also through the processor families' header
and sampled-frame decode and the audio track's probe and decode; audio through ``probe_audio``
and ``decode_audio``). Each path of a file runs to its own end or first error.

Small seed files are written with PyAV / Pillow, then every file ``i`` of a format is mutated
by its own generator ``(seed, format, i)``: random bytes flipped, truncation, bytes overwritten
inside the ``moov`` box (videos) or the header, box sizes / chunk lengths set to random values,
chunks duplicated or deleted. Each file goes through the public API (``probe_*`` then
``process_*``) in persistent child processes; a child that dies is counted and restarted, one that
does not answer within ``--hang-s`` is killed and counted as a hang. Anything but a clean result
or a :class:`~energon_pack.MediaError` is counted as an escaped exception.

    .venv/bin/python benchmarks/fuzz_media.py --videos 5000 --images 5000 --audios 5000
    .venv/bin/python benchmarks/fuzz_media.py --videos 1500 --images 0 --isolation off  # unguarded
    .venv/bin/python benchmarks/fuzz_media.py --write-corpus   # regression corpus, see below

``--write-corpus`` fuzzes with ``decode_isolation="off"`` and adds the files that killed the
unguarded child to ``fixtures/crash_corpus/`` (named ``<format>-<index>.<ext>``, listed with how
they died in ``manifest.json``, whose earlier files stay); the same seed and index always give
the same bytes.
Writes ``benchmarks/results/fuzz_media.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing as mp
import signal
import statistics
import struct
import sys
import time
from collections import Counter
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image, ImageDraw

from energon_pack.cli.tables import format_table
from energon_pack.media import (
    MediaConfig,
    MediaError,
    probe_image,
    probe_video,
    process_image,
    process_video,
)
from energon_pack.media.audio import probe_audio, probe_video_audio
from energon_pack.media.audio_decode import decode_audio
from energon_pack.media.displayed import (
    displayed_image_size,
    displayed_images,
    displayed_video_header,
    displayed_videos,
)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
from audio_files import encode_audio  # noqa: E402  (the tests' audio writer)
from audio_files import signal as audio_signal  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "fuzz_media.json"
CORPUS = ROOT / "fixtures" / "crash_corpus"
SEED = 12
VIDEO_FORMATS = ("h264", "mpeg4", "h264_aac")
IMAGE_FORMATS = ("jpeg", "png", "webp")
AUDIO_FORMATS = ("wav", "flac", "mp3", "opus", "m4a")
EXTENSIONS = {"h264": "mp4", "mpeg4": "mp4", "jpeg": "jpg", "png": "png", "webp": "webp"}
EXTENSIONS |= {"wav": "wav", "flac": "flac", "mp3": "mp3", "opus": "ogg", "m4a": "m4a"}
EXTENSIONS |= {"h264_aac": "mp4"}  # last: the formats before keep their mutation streams
# Small frames keep the fuzzer fast; the native decoders see the same code paths.
FUZZ_CONFIG = MediaConfig(
    min_pixels=28 * 28,
    video_min_pixels=28 * 28,
    video_max_pixels=56 * 56,
    video_max_frames=8,
    decode_timeout_s=10.0,
)


# --- seed files -----------------------------------------------------------------------------


def _frames(width: int, height: int, count: int) -> list[np.ndarray[Any, Any]]:
    frames = []
    for i in range(count):
        img = Image.new("RGB", (width, height), (40 + 10 * i, 90, 160))
        draw = ImageDraw.Draw(img)
        draw.ellipse((4 * i, 6, 4 * i + 20, 26), fill=(230, 200, 40))
        frames.append(np.asarray(img))
    return frames


def seed_video(codec: str) -> bytes:
    """A 12-frame 64x48 MP4 at 6 fps, single-threaded encoder settings; ``h264_aac`` with a
    2-second 16 kHz mono AAC track."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        options = {"x264-params": "threads=1:mbtree=0:rc-lookahead=0:bframes=0"}
        h264 = codec.startswith("h264")
        stream = container.add_stream(
            "libx264" if h264 else "mpeg4",
            rate=6,
            options=options if h264 else {"threads": "1"},
        )
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        track = (
            container.add_stream("aac", rate=16000, layout="mono") if codec == "h264_aac" else None
        )
        for rgb in _frames(64, 48, 12):
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if track is not None:
            wave = audio_signal(16000, 32000, sweep=True)
            sound = av.AudioFrame.from_ndarray(wave[None], format="fltp", layout="mono")
            sound.sample_rate = 16000
            for packet in [*track.encode(sound), *track.encode(None)]:
                container.mux(packet)
    return buf.getvalue()


def seed_image(fmt: str) -> bytes:
    """A 64x48 image; PNG as a palette image with transparency (more decoder paths)."""
    img = Image.fromarray(_frames(64, 48, 3)[2])
    buf = io.BytesIO()
    if fmt == "png":
        palette = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        palette.save(buf, format="PNG", transparency=0)
    elif fmt == "jpeg":
        img.save(buf, format="JPEG", quality=80)
    else:
        img.save(buf, format="WEBP", quality=70, method=0)
    return buf.getvalue()


def seed_files() -> dict[str, bytes]:
    """The unmutated file of every format."""
    seeds = {codec: seed_video(codec) for codec in VIDEO_FORMATS}
    seeds.update({fmt: seed_image(fmt) for fmt in IMAGE_FORMATS})
    seeds.update({fmt: encode_audio(fmt, 16000, 1, 6000, sweep=True) for fmt in AUDIO_FORMATS})
    return seeds


# --- mutations ------------------------------------------------------------------------------


def _box_region(data: bytes, box: bytes) -> tuple[int, int]:
    """Byte range of a top-level MP4 box (the whole file if absent)."""
    pos = 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[pos : pos + 8])
        if kind == box:
            return pos, min(len(data), pos + max(size, 8))
        if size < 8:
            break
        pos += size
    return 0, len(data)


def mutate(data: bytes, fmt: str, index: int, seed: int = SEED) -> bytes:
    """Mutated copy of ``data``: the same ``(seed, fmt, index)`` always gives the same bytes."""
    rng = np.random.default_rng([seed, list(EXTENSIONS).index(fmt), index])
    out = bytearray(data)
    start, end = _box_region(data, b"moov") if fmt in VIDEO_FORMATS else (0, min(len(data), 256))
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 6))
        if not out:
            break
        if op == 0:  # flip random bytes anywhere
            for pos in rng.integers(0, len(out), int(rng.integers(1, 9))):
                out[int(pos)] ^= int(rng.integers(1, 256))
        elif op == 1 and len(out) > 1:  # truncate
            del out[int(rng.integers(1, len(out))) :]
        elif op in (2, 3):  # random bytes inside moov / the header
            hi = min(end, len(out))
            if hi > start:
                for pos in rng.integers(start, hi, int(rng.integers(1, 17))):
                    out[int(pos)] = int(rng.integers(0, 256))
        elif op == 4:  # a 32-bit size / count field set to an extreme value
            hi = min(end, len(out)) - 4
            if hi > start:
                pos = int(rng.integers(start, hi))
                value = int(rng.choice([0, 1, 7, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF]))
                out[pos : pos + 4] = struct.pack(">I", value)
        else:  # duplicate or delete a chunk
            a = int(rng.integers(0, len(out)))
            b = min(len(out), a + int(rng.integers(1, 64)))
            if rng.random() < 0.5:
                out[a:a] = out[a:b]
            else:
                del out[a:b]
    return bytes(out)


# --- running --------------------------------------------------------------------------------


def run_one(data: bytes, fmt: str, config: MediaConfig) -> str:
    """Outcome of every path of probe + decode: ``ok``, ``media:<kind>`` (the first path's
    error) or ``escaped:<type>`` (any path's)."""
    member = f"0.{EXTENSIONS[fmt]}"
    errors = []
    for path in _paths(fmt):
        try:
            path(data, member, config)
        except MediaError as error:
            errors.append(f"media:{error.kind}")
        except Exception as exc:  # the fuzzer's purpose is to catch anything that escapes
            return f"escaped:{type(exc).__name__}: {exc}"[:200]
    return errors[0] if errors else "ok"


def _paths(fmt: str) -> list[Any]:
    """The independent ways a file of ``fmt`` is read, each ``(data, member, config)``."""
    if fmt in VIDEO_FORMATS:
        return [_qwen_video, _family_video, _video_track]
    if fmt in AUDIO_FORMATS:
        return [_audio]
    return [_qwen_image, _family_image]


def _qwen_video(data: bytes, member: str, config: MediaConfig) -> None:
    probe_video(data, config, key="fuzz", member=member)
    process_video(data, config, key="fuzz", member=member)


def _family_video(data: bytes, member: str, config: MediaConfig) -> None:
    """The processor families' path: the upright header, then four sampled frames."""
    header = displayed_video_header(data, config, key="fuzz", member=member)
    picked = tuple(sorted({i * header.frames // 4 for i in range(4)}))
    displayed_videos([("fuzz", member, data, picked, (header.height, header.width), 0)], config)


def _video_track(data: bytes, member: str, config: MediaConfig) -> None:
    """An Omni family's read of the video's audio track (``load_audio_from_video``)."""
    if probe_video_audio(data, "fuzz", member) is not None:
        decode_audio(data, key="fuzz", member=member, config=config)


def _audio(data: bytes, member: str, config: MediaConfig) -> None:
    probe_audio(data, "fuzz", member)
    decode_audio(data, key="fuzz", member=member, config=config)


def _qwen_image(data: bytes, member: str, config: MediaConfig) -> None:
    probe_image(data, config, key="fuzz", member=member)
    process_image(data, config, key="fuzz", member=member)


def _family_image(data: bytes, member: str, config: MediaConfig) -> None:
    size = displayed_image_size(data, config, key="fuzz", member=member)
    displayed_images([("fuzz", member, data, size, 0)], config)


def _child(conn: Connection, seeds: dict[str, bytes], config: MediaConfig) -> None:
    import torch

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            fmt, index = conn.recv()
        except EOFError:
            return
        data = mutate(seeds[fmt], fmt, index)
        start = time.perf_counter()
        outcome = run_one(data, fmt, config)
        conn.send((outcome, time.perf_counter() - start))


class _Worker:
    """A persistent child process, restarted after it dies or hangs."""

    def __init__(self, seeds: dict[str, bytes], config: MediaConfig) -> None:
        self.seeds, self.config = seeds, config
        self.job: tuple[str, int] | None = None
        self.sent = 0.0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child, args=(child_conn, self.seeds, self.config))
        self.proc.start()
        child_conn.close()

    def send(self, job: tuple[str, int]) -> None:
        self.job, self.sent = job, time.perf_counter()
        self.conn.send(job)

    def restart(self) -> int | None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        code = self.proc.exitcode
        self.conn.close()
        self._start()
        return code

    def stop(self) -> None:
        self.conn.close()
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


def fuzz(
    jobs: list[tuple[str, int]],
    seeds: dict[str, bytes],
    config: MediaConfig,
    workers: int,
    hang_s: float,
) -> list[dict[str, Any]]:
    """Run every job; one record per file: format, index, outcome, seconds."""
    pool = [_Worker(seeds, config) for _ in range(workers)]
    todo = list(reversed(jobs))
    records: list[dict[str, Any]] = []
    try:
        for worker in pool:
            if todo:
                worker.send(todo.pop())
        while any(w.job is not None for w in pool):
            for worker in pool:
                if worker.job is None:
                    continue
                fmt, index = worker.job
                record: dict[str, Any] | None = None
                try:
                    if worker.conn.poll(0.05):
                        outcome, seconds = worker.conn.recv()
                        record = {"format": fmt, "index": index, "outcome": outcome}
                        record["seconds"] = seconds
                    elif time.perf_counter() - worker.sent > hang_s:
                        worker.restart()
                        record = {"format": fmt, "index": index, "outcome": "hang"}
                        record["seconds"] = hang_s
                except (EOFError, OSError):
                    code = worker.restart()
                    record = {"format": fmt, "index": index, "outcome": f"died:{code}"}
                    record["seconds"] = time.perf_counter() - worker.sent
                if record is not None:
                    records.append(record)
                    worker.job = None
                    if todo:
                        worker.send(todo.pop())
                    if len(records) % 500 == 0:
                        print(f"  {len(records)}/{len(jobs)} files", flush=True)
    finally:
        for worker in pool:
            worker.stop()
    return records


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per format: files, deaths, hangs, escaped exceptions, outcomes, time per file."""
    rows = []
    for fmt in EXTENSIONS:
        chosen = [r for r in records if r["format"] == fmt]
        if not chosen:
            continue
        outcomes = Counter(r["outcome"].split(":")[0] for r in chosen)
        kinds = Counter(r["outcome"][6:] for r in chosen if r["outcome"].startswith("media:"))
        seconds = sorted(r["seconds"] for r in chosen)
        rows.append(
            {
                "format": fmt,
                "files": len(chosen),
                "ok": outcomes["ok"],
                "media_errors": outcomes["media"],
                "crashed_caught": kinds["crashed"],
                "timeouts_caught": kinds["timeout"],
                "deaths": outcomes["died"],
                "hangs": outcomes["hang"],
                "escaped": outcomes["escaped"],
                "median_ms": statistics.median(seconds) * 1e3,
                "p99_ms": seconds[int(0.99 * (len(seconds) - 1))] * 1e3,
                "kinds": dict(kinds),
            }
        )
    return rows


def write_corpus(records: list[dict[str, Any]], seeds: dict[str, bytes]) -> None:
    """The files that killed the unguarded child, added to the manifest's (a crash depends on
    memory layout, so a file that crashed once is kept though this run's child survived it)."""
    CORPUS.mkdir(parents=True, exist_ok=True)
    manifest_path = CORPUS / "manifest.json"
    kept = json.loads(manifest_path.read_text())["files"] if manifest_path.exists() else []
    entries = [entry for entry in kept if (CORPUS / entry["file"]).is_file()]
    known = {entry["file"] for entry in entries}
    for r in sorted(records, key=lambda r: (r["format"], r["index"])):
        if not r["outcome"].startswith(("died", "hang")):
            continue
        data = mutate(seeds[r["format"]], r["format"], r["index"])
        name = f"{r['format']}-{r['index']:05d}.{EXTENSIONS[r['format']]}"
        if name in known:
            continue
        (CORPUS / name).write_bytes(data)
        entries.append(
            {
                "file": name,
                "format": r["format"],
                "index": r["index"],
                "seed": SEED,
                "unguarded": r["outcome"],
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    entries.sort(key=lambda entry: (entry["format"], entry["index"]))
    manifest = {
        "made_by": "benchmarks/fuzz_media.py --write-corpus",
        "files": entries,
    }
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    added = len(entries) - len(known)
    print(f"{CORPUS.relative_to(ROOT)} holds {len(entries)} files ({added} added)")


def main() -> None:
    """Fuzz, print the table, write the JSON (and the corpus with ``--write-corpus``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--videos", type=int, default=1000)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--audios", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--isolation", choices=("process", "off"), default="process")
    parser.add_argument("--hang-s", type=float, default=120.0)
    parser.add_argument(
        "--video-rule",
        choices=("qwen2_vl", "qwen3_vl"),
        default="qwen2_vl",
        help="frame sampling and sizing rule of the probe and decode (MediaConfig.video_rule)",
    )
    parser.add_argument("--write-corpus", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.write_corpus:
        args.isolation = "off"
    if args.isolation == "off" and args.out == OUT:
        args.out = OUT.with_name("fuzz_media_unguarded.json")
    config = replace(FUZZ_CONFIG, decode_isolation=args.isolation, video_rule=args.video_rule)
    seeds = seed_files()
    jobs = []
    for count, formats in (
        (args.videos, VIDEO_FORMATS),
        (args.images, IMAGE_FORMATS),
        (args.audios, AUDIO_FORMATS),
    ):
        jobs += [(formats[i % len(formats)], i // len(formats)) for i in range(count)]
    start = time.perf_counter()
    records = fuzz(jobs, seeds, config, args.workers, args.hang_s)
    wall = time.perf_counter() - start
    rows = summarize(records)
    headers = ["format", "files", "ok", "MediaError", "crashed", "timeout", "deaths", "hangs"]
    headers += ["escaped", "median ms", "p99 ms"]
    table = [[r[h] for h in list(rows[0])[:11]] for r in rows] if rows else []
    print(format_table(headers, table))
    escaped = sorted({r["outcome"] for r in records if r["outcome"].startswith("escaped")})
    for line in escaped[:20]:
        print(" ", line)
    print(f"{len(records)} files in {wall:.0f} s, isolation={args.isolation}")
    report = {
        "seed": SEED,
        "isolation": args.isolation,
        "config": str(config),
        "wall_s": wall,
        "summary": rows,
        "escaped": escaped,
        "failures": [r for r in records if r["outcome"].startswith(("died", "hang", "escaped"))],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.write_corpus:
        write_corpus(records, seeds)


if __name__ == "__main__":
    main()
