"""Lazy media: header probe vs full decode + patchify, bytes held, and speed vs references.

For every image and video of fixtures/vlm_demo: probe time (median of repeats), decode+patchify
time (median of repeats), compressed bytes (what a lazy packing buffer holds) and processed
tensor bytes (what an eager buffer holds). Prints one row per distinct (kind, size, format) and
totals.

Then, per distinct size, side by side and interleaved (CPU time, median of per-round ratios): images
against transformers' ``Qwen2VLImageProcessorPil`` and against their floor (pillow decode + RGB +
bicubic resize), both pixel dtypes; videos against their floor (decord decode of the same frames
+ pillow resize). Every uint8 result, after ``normalize_pixels``, is checked to equal the
float32 one. The ``levels`` column times the paths' stages before their output tensor (decode,
resize, uint8 patch cut): levels/floor is the cut's share, float32/levels the normalisation's.
Writes benchmarks/results/media.json (1 CPU thread).

The guard table compares decoding in the helper process (``decode_isolation="process"``, the
default) with decoding in the calling process (``"off"``), calls interleaved, as the median of
per-item ratios of median times: wall time (what one call waits) and CPU time (this process plus
the helper: what the guard costs a busy loader), and the helper's memory.

The whole-pack row times ``decode_vision`` (what the loaders call) on packs of 8 fixture
samples: guarded, the helper decodes a pack's next file while this process patchifies the last.

The Qwen3-VL table repeats the speed comparison with the ``qwen3_vl`` preset's media settings
(patch 16, its budgets and video rule): images against ``Qwen2VLImageProcessorPil`` with those
settings (pixels checked equal), clips against their floor. ``--only-qwen3`` runs only that
table (benchmarks/results/media_qwen3.json).

Run: .venv/bin/python benchmarks/media.py [--repeats 3] [--rounds 7] [--only-qwen3]

Large outputs (a 720p image's float32 patches are 22 MB) page-fault whenever glibc has just
returned such a block to the system, which it decides from the history of frees; the README's
figures fix that (``MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=268435456``), for
both sides of every comparison.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import decord
import numpy as np
import psutil
import torch
from PIL import Image

from energon_pack import MediaConfig, ModelFamily, media, model_family
from energon_pack.cli.tables import format_table
from energon_pack.formats.native import parse_sample
from energon_pack.media import decode as media_decode
from energon_pack.media import guard as media_guard
from energon_pack.media.assembly import MediaItem, MediaTensors
from energon_pack.media.config import MediaKind

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT / "fixtures" / "vlm_demo"
OUT = Path(__file__).resolve().parent / "results" / "media.json"


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fixture_media() -> list[tuple[str, str, MediaKind, bytes]]:
    """``(key, member, kind, bytes)`` for every media member, in placeholder order."""
    samples: dict[str, dict[str, bytes]] = {}
    for shard in sorted(DATASET.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                key, _, ext = info.name.partition(".")
                handle = tar.extractfile(info)
                if handle is not None:
                    samples.setdefault(key, {})[ext] = handle.read()
    items = []
    for key, sample in samples.items():
        for member, kind, data in parse_sample(key, sample).media:
            assert isinstance(data, bytes)  # a member of a tar, not decoded
            items.append((key, member, kind, data))
    return items


UNGUARDED = media.MediaConfig(decode_isolation="off")


def cpu_seconds() -> float:
    """CPU time of this process and of its decoder helper (Linux: the helper's process CPU
    clock, as ``clock_getcpuclockid`` gives it)."""
    pid = media_guard.helper_pid()
    helper = time.clock_gettime((~pid << 3) | 2) if pid is not None else 0.0
    return time.process_time() + helper


def paired_seconds(
    guarded: Callable[[], object], unguarded: Callable[[], object], repeats: int
) -> dict[str, float]:
    """Median wall and CPU times of ``guarded`` and ``unguarded``, called alternately."""
    times: dict[str, list[float]] = {name: [] for name in ("wall_g", "wall_u", "cpu_g", "cpu_u")}
    for _ in range(repeats):
        for fn, mode in ((unguarded, "u"), (guarded, "g")):
            wall, cpu = time.perf_counter(), cpu_seconds()
            fn()
            times[f"cpu_{mode}"].append(cpu_seconds() - cpu)
            times[f"wall_{mode}"].append(time.perf_counter() - wall)
    return {name: statistics.median(values) for name, values in times.items()}


def measure_guard(kind: str, data: bytes, repeats: int) -> dict[str, float]:
    """Guarded versus unguarded decode (and probe, for videos) times of one item."""
    decode: Callable[..., object]
    probe: Callable[..., object] | None
    if kind == "image":
        decode, probe = media.process_image, None
    else:
        decode, probe = media.process_video, media.probe_video
    t = paired_seconds(lambda: decode(data), lambda: decode(data, UNGUARDED), repeats)
    out = {"guarded_ms": t["wall_g"] * 1e3, "unguarded_ms": t["wall_u"] * 1e3}
    out["guard_ratio"] = t["wall_g"] / t["wall_u"]
    out["guard_cpu_ratio"] = t["cpu_g"] / t["cpu_u"]
    if probe is not None:
        p = paired_seconds(lambda: probe(data), lambda: probe(data, UNGUARDED), repeats)
        out["probe_guard_ratio"] = p["wall_g"] / p["wall_u"]
        out["probe_guard_cpu_ratio"] = p["cpu_g"] / p["cpu_u"]
    return out


def measure(key: str, member: str, kind: str, data: bytes, repeats: int) -> dict[str, Any]:
    """One item's probe/process times and byte counts."""
    if kind == "image":
        iprobe = media.probe_image(data, key=key, member=member)
        probe_s = median_seconds(lambda: media.probe_image(data), repeats * 5)
        process_s = median_seconds(lambda: media.process_image(data), repeats)
        tensors: tuple[torch.Tensor, ...] = media.process_image(data)
        size, tokens, frames = (iprobe.width, iprobe.height), iprobe.tokens, 1
    else:
        vprobe = media.probe_video(data, key=key, member=member)
        probe_s = median_seconds(lambda: media.probe_video(data), repeats * 5)
        process_s = median_seconds(lambda: media.process_video(data), repeats)
        pixels, grid, _ = media.process_video(data)
        tensors = (pixels, grid)
        size, tokens, frames = (vprobe.width, vprobe.height), vprobe.tokens, vprobe.frames
    foot = media.footprint(data, *tensors)
    return {
        "key": key,
        "member": member,
        "kind": kind,
        "format": member.rsplit(".", 1)[-1],
        "width": size[0],
        "height": size[1],
        "frames": frames,
        "tokens": tokens,
        "probe_ms": probe_s * 1e3,
        "process_ms": process_s * 1e3,
        "speedup": process_s / probe_s,
        "compressed_bytes": foot.compressed_bytes,
        "processed_bytes": foot.processed_bytes,
        "bytes_ratio": foot.ratio,
        **measure_guard(kind, data, repeats * 2),
    }


def helper_memory() -> dict[str, float]:
    """RSS and USS of this process's decoder helper, in MiB."""
    pid = media_guard.helper_pid()
    if pid is None:
        raise SystemExit("the decoder helper is not running")
    info = psutil.Process(pid).memory_full_info()
    return {"rss_mib": info.rss / 2**20, "uss_mib": info.uss / 2**20}


@dataclass(frozen=True)
class PackSample:
    """A fixture sample as :func:`energon_pack.media.decode_vision` reads it."""

    key: str
    media: list[MediaItem]
    vision: MediaTensors | None = None


def fixture_packs(per_pack: int) -> list[list[PackSample]]:
    """The fixture samples with media, probed, in packs of ``per_pack`` consecutive samples."""
    samples: dict[str, list[media.MediaItem]] = {}
    for key, member, kind, data in fixture_media():
        if kind == "image":
            probe: media.ImageProbe | media.VideoProbe = media.probe_image(data)
            seconds = None
        else:
            probe = media.probe_video(data)
            seconds = probe.second_per_grid_t
        item = media.MediaItem(member, kind, data, probe.grid_thw, probe.tokens, seconds)
        samples.setdefault(key, []).append(item)
    ordered = [PackSample(key, items) for key, items in samples.items()]
    return [ordered[i : i + per_pack] for i in range(0, len(ordered), per_pack)]


def measure_pack_guard(per_pack: int, repeats: int) -> dict[str, float]:
    """Guarded versus unguarded ``decode_vision`` of whole packs (the loaders' call): the
    helper decodes the next file while this process patchifies the last."""
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    packs = fixture_packs(per_pack)
    for pack in packs:
        guarded = partial(media.decode_vision, pack)
        t = paired_seconds(guarded, partial(media.decode_vision, pack, UNGUARDED), repeats)
        ratios["wall"].append(t["wall_g"] / t["wall_u"])
        ratios["cpu"].append(t["cpu_g"] / t["cpu_u"])
    return {
        "packs": len(packs),
        "samples_per_pack": per_pack,
        "median_guard_ratio": statistics.median(ratios["wall"]),
        "median_guard_cpu_ratio": statistics.median(ratios["cpu"]),
    }


def summary(rows: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """Totals and medians over one kind of media."""
    chosen = [r for r in rows if r["kind"] == kind]
    compressed = sum(r["compressed_bytes"] for r in chosen)
    processed = sum(r["processed_bytes"] for r in chosen)
    return {
        "kind": kind,
        "items": len(chosen),
        "compressed_bytes": compressed,
        "processed_bytes": processed,
        "bytes_ratio": compressed / processed,
        "median_probe_ms": statistics.median(r["probe_ms"] for r in chosen),
        "median_process_ms": statistics.median(r["process_ms"] for r in chosen),
        "median_speedup": statistics.median(r["speedup"] for r in chosen),
        "median_unguarded_ms": statistics.median(r["unguarded_ms"] for r in chosen),
        "median_guarded_ms": statistics.median(r["guarded_ms"] for r in chosen),
        "median_guard_ratio": statistics.median(r["guard_ratio"] for r in chosen),
        "median_guard_cpu_ratio": statistics.median(r["guard_cpu_ratio"] for r in chosen),
        "median_probe_guard_ratio": statistics.median(
            r.get("probe_guard_ratio", 1.0) for r in chosen
        ),
        "median_probe_guard_cpu_ratio": statistics.median(
            r.get("probe_guard_cpu_ratio", 1.0) for r in chosen
        ),
    }


# In-process decoding: CPU time of the calling process is what these rows compare (the guard's
# cost is its own table).
FLOAT = media.MediaConfig(decode_isolation="off")
UINT8 = media.MediaConfig(pixel_dtype="uint8", decode_isolation="off")
SPEED_HEADERS = ["kind", "size", "HF ms", "f32 ms", "u8 ms", "levels ms", "floor ms"]
SPEED_HEADERS += ["f32 vs HF", "u8 vs HF", "f32/floor", "u8/floor", "levels/floor"]
GUARD_HEADERS = ["kind", "items", "unguarded ms", "guarded ms", "guard wall", "guard CPU"]
GUARD_HEADERS += ["probe guard wall", "probe guard CPU"]


def image_floor(data: bytes) -> np.ndarray[Any, Any]:
    """Decode + RGB (transparency on white, as transformers does, done the fastest way known to
    give its values: ``media_decode.to_rgb``) + bicubic resize to the probed size (none when the
    image has that size): what any image processor must do."""
    _, gh, gw = media.probe_image(data).grid_thw
    with Image.open(io.BytesIO(data)) as img:
        size = (gw * FLOAT.patch_size, gh * FLOAT.patch_size)
        rgb = media_decode.to_rgb(img)
        return np.asarray(rgb if rgb.size == size else rgb.resize(size, Image.Resampling.BICUBIC))


def video_floor(data: bytes, indices: list[int], size: tuple[int, int]) -> np.ndarray[Any, Any]:
    """decord decode of the given frames + pillow resize of each (none when a frame has that
    size already), stacked (frames and size planned beforehand, outside the timing): what any
    video processor must do."""
    reader = decord.VideoReader(io.BytesIO(data), num_threads=1)
    frames = reader.get_batch(indices).asnumpy()
    return np.stack(media_decode.resized_frames(frames, size))


def video_plan(data: bytes) -> tuple[list[int], tuple[int, int]]:
    """The frame indices and the resized ``(width, height)`` that process_video uses."""
    probe = media.probe_video(data)
    indices = [i * probe.source_frames // probe.frames for i in range(probe.frames)]
    _, gh, gw = probe.grid_thw
    return indices, (gw * FLOAT.patch_size, gh * FLOAT.patch_size)


def levels(data: bytes, kind: Literal["image", "video"]) -> Callable[[], object]:
    """Decode + resize + the uint8 patch cut (``media_decode.decode_levels``, in this process)
    into one array reused across calls: the paths' stages before the output tensor."""
    kept: dict[tuple[int, ...], np.ndarray[Any, np.dtype[np.uint8]]] = {}

    def alloc(shape: tuple[int, ...]) -> np.ndarray[Any, np.dtype[np.uint8]]:
        return kept.setdefault(shape, np.empty(shape, dtype=np.uint8))

    return partial(media_decode.decode_levels, data, FLOAT, kind, alloc)


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds of each function per round, the functions run one after another every round.

    CPU time of this process (all threads), not wall time: on a shared machine the time spent
    waiting for a core would otherwise dominate the differences.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    return times


def median_ratio(times: dict[str, list[float]], slow: str, fast: str) -> float:
    """Median over rounds of ``slow / fast``."""
    return statistics.median(a / b for a, b in zip(times[slow], times[fast], strict=True))


def check_uint8(
    float_pixels: torch.Tensor, uint8_pixels: torch.Tensor, config: media.MediaConfig | None = None
) -> None:
    """uint8 patches normalise to exactly the float32 patches."""
    if not torch.equal(media.normalize_pixels(uint8_pixels, config or UINT8), float_pixels):
        raise SystemExit("normalize_pixels(uint8) differs from the float32 path")


def versus_references(rows: list[dict[str, Any]], rounds: int) -> list[dict[str, Any]]:
    """Per distinct image/video size: our paths against transformers and the decode floor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    hf = Qwen2VLImageProcessorPil(min_pixels=FLOAT.min_pixels, max_pixels=FLOAT.max_pixels)

    def hf_image(data: bytes) -> object:
        with Image.open(io.BytesIO(data)) as img:
            return hf(img, return_tensors="np")

    by_size: dict[tuple[str, int, int], bytes] = {}
    for item, row in zip(fixture_media(), rows, strict=True):
        if row["kind"] == "video" or row["width"] * row["height"] >= 640 * 480:
            by_size.setdefault((row["kind"], row["width"], row["height"]), item[3])
    results = []
    for (kind, width, height), data in sorted(by_size.items()):
        if kind == "image":
            check_uint8(media.process_image(data, FLOAT)[0], media.process_image(data, UINT8)[0])
            fns: dict[str, Callable[[], object]] = {
                "reference": partial(hf_image, data),
                "float32": partial(media.process_image, data, FLOAT),
                "uint8": partial(media.process_image, data, UINT8),
                "levels": levels(data, "image"),
                "floor": partial(image_floor, data),
            }
        else:
            check_uint8(media.process_video(data, FLOAT)[0], media.process_video(data, UINT8)[0])
            fns = {
                "float32": partial(media.process_video, data, FLOAT),
                "uint8": partial(media.process_video, data, UINT8),
                "levels": levels(data, "video"),
                "floor": partial(video_floor, data, *video_plan(data)),
            }
        times = interleaved(fns, rounds)
        result: dict[str, Any] = {"kind": kind, "width": width, "height": height}
        result |= {f"{name}_ms": statistics.median(t) * 1e3 for name, t in times.items()}
        for path in ("float32", "uint8", "levels"):
            if "reference" in times and path != "levels":
                result[f"{path}_speedup_vs_reference"] = median_ratio(times, "reference", path)
            result[f"{path}_over_floor"] = median_ratio(times, path, "floor")
        results.append(result)
    return results


def qwen3_media() -> MediaConfig:
    """Qwen3-VL's media settings, decoded in this process."""
    family = model_family("qwen3_vl")
    assert isinstance(family, ModelFamily)  # a name gives a model family
    return family.media_config(decode_isolation="off")


QWEN3 = qwen3_media()
QWEN3_UINT8 = replace(QWEN3, pixel_dtype="uint8")


def qwen3_video_floor_args(data: bytes) -> tuple[list[int], tuple[int, int]]:
    """The frames (``linspace`` rule, last repeated) and size the Qwen3-VL path decodes."""
    probe = media.probe_video(data, QWEN3)
    _, gh, gw = probe.grid_thw
    return list(probe.frame_indices), (gw * QWEN3.patch_size, gh * QWEN3.patch_size)


def distinct_sizes() -> dict[tuple[str, int, int], bytes]:
    """One fixture medium per distinct (kind, width, height): every clip size, images from
    640x480 up (from their probes)."""
    by_size: dict[tuple[str, int, int], bytes] = {}
    for _, _, kind, data in fixture_media():
        probe = media.probe_image(data) if kind == "image" else media.probe_video(data)
        if kind == "video" or probe.width * probe.height >= 640 * 480:
            by_size.setdefault((kind, probe.width, probe.height), data)
    return by_size


def versus_qwen3(rounds: int) -> list[dict[str, Any]]:
    """Qwen3-VL geometry (patch 16, 0.5/0.5, its pixel budgets and video rule): our paths
    against transformers' image processor for Qwen3-VL (``Qwen2VLImageProcessorPil`` with the
    checkpoint's settings, as transformers maps ``qwen3_vl``) and the video decode floor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    hf = Qwen2VLImageProcessorPil(
        patch_size=QWEN3.patch_size,
        merge_size=QWEN3.merge_size,
        temporal_patch_size=QWEN3.temporal_patch_size,
        image_mean=list(QWEN3.image_mean),
        image_std=list(QWEN3.image_std),
        size={"shortest_edge": QWEN3.min_pixels, "longest_edge": QWEN3.max_pixels},
    )

    def hf_image(data: bytes) -> Any:
        with Image.open(io.BytesIO(data)) as img:
            return hf(img, return_tensors="pt")

    results = []
    for (kind, width, height), data in sorted(distinct_sizes().items()):
        if kind == "image":
            ours = media.process_image(data, QWEN3)[0]
            check_uint8(ours, media.process_image(data, QWEN3_UINT8)[0], QWEN3_UINT8)
            reference = torch.as_tensor(hf_image(data)["pixel_values"])
            if not torch.equal(ours, reference):
                raise SystemExit(f"Qwen3-VL pixels of the {width}x{height} image differ")
            fns: dict[str, Callable[[], object]] = {
                "reference": partial(hf_image, data),
                "float32": partial(media.process_image, data, QWEN3),
                "uint8": partial(media.process_image, data, QWEN3_UINT8),
            }
        else:
            ours = media.process_video(data, QWEN3)[0]
            check_uint8(ours, media.process_video(data, QWEN3_UINT8)[0], QWEN3_UINT8)
            fns = {
                "float32": partial(media.process_video, data, QWEN3),
                "uint8": partial(media.process_video, data, QWEN3_UINT8),
                "floor": partial(video_floor, data, *qwen3_video_floor_args(data)),
            }
        times = interleaved(fns, rounds)
        result: dict[str, Any] = {"kind": kind, "width": width, "height": height}
        result |= {f"{name}_ms": statistics.median(t) * 1e3 for name, t in times.items()}
        for path in ("float32", "uint8"):
            if "reference" in times:
                result[f"{path}_speedup_vs_reference"] = median_ratio(times, "reference", path)
            else:
                result[f"{path}_over_floor"] = median_ratio(times, path, "floor")
        results.append(result)
    return results


QWEN3_HEADERS = ["kind", "size", "HF ms", "f32 ms", "u8 ms", "floor ms", "f32 vs HF"]
QWEN3_HEADERS += ["u8 vs HF", "f32/floor", "u8/floor"]


def print_qwen3(results: list[dict[str, Any]]) -> None:
    print(
        format_table(
            QWEN3_HEADERS,
            [
                [
                    r["kind"],
                    f"{r['width']}x{r['height']}",
                    r.get("reference_ms", "-"),
                    r["float32_ms"],
                    r["uint8_ms"],
                    r.get("floor_ms", "-"),
                    r.get("float32_speedup_vs_reference", "-"),
                    r.get("uint8_speedup_vs_reference", "-"),
                    r.get("float32_over_floor", "-"),
                    r.get("uint8_over_floor", "-"),
                ]
                for r in results
            ],
        )
    )
    print("(Qwen3-VL geometry; HF: Qwen2VLImageProcessorPil with the Qwen3-VL checkpoint's")
    print(" settings, its pixels equal ours; video floor: decord decode of the Qwen3-VL frames +")
    print(" resize)")


def main() -> None:
    """Measure, print and write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per size")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--only-qwen3",
        action="store_true",
        help="measure only the Qwen3-VL geometry rows (written to media_qwen3.json)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.only_qwen3:
        qwen3 = versus_qwen3(args.rounds)
        print_qwen3(qwen3)
        out = args.out.with_name("media_qwen3.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"config": str(QWEN3), "versus_qwen3": qwen3}, indent=2) + "\n")
        print(f"\nwrote {out}")
        return
    rows = [measure(*item, repeats=args.repeats) for item in fixture_media()]

    seen: set[tuple[str, int, int, str]] = set()
    table = []
    for r in sorted(rows, key=lambda r: (r["kind"], -r["width"] * r["height"], r["format"])):
        ident = (r["kind"], r["width"], r["height"], r["format"])
        if ident in seen:
            continue
        seen.add(ident)
        table.append(
            [
                r["kind"],
                f"{r['width']}x{r['height']}",
                r["format"],
                r["frames"],
                r["tokens"],
                r["probe_ms"],
                r["process_ms"],
                round(r["speedup"]),
                f"{r['compressed_bytes'] / 1024:.1f}",
                f"{r['processed_bytes'] / 1024:.1f}",
                r["bytes_ratio"],
            ]
        )
    headers = ["kind", "size", "fmt", "frames", "tokens", "probe ms", "process ms", "x faster"]
    headers += ["held KiB", "patches KiB", "held/patches"]
    print(format_table(headers, table))
    summaries = [summary(rows, "image"), summary(rows, "video")]
    print()
    print(
        format_table(
            ["kind", "items", "held MiB", "patches MiB", "held/patches", "probe ms", "process ms"],
            [
                [
                    s["kind"],
                    s["items"],
                    f"{s['compressed_bytes'] / 2**20:.2f}",
                    f"{s['processed_bytes'] / 2**20:.1f}",
                    s["bytes_ratio"],
                    s["median_probe_ms"],
                    s["median_process_ms"],
                ]
                for s in summaries
            ],
        )
    )
    speed = versus_references(rows, args.rounds)
    qwen3 = versus_qwen3(args.rounds)
    print()
    print(
        format_table(
            SPEED_HEADERS,
            [
                [
                    r["kind"],
                    f"{r['width']}x{r['height']}",
                    r.get("reference_ms", "-"),
                    r["float32_ms"],
                    r["uint8_ms"],
                    r["levels_ms"],
                    r["floor_ms"],
                    r.get("float32_speedup_vs_reference", "-"),
                    r.get("uint8_speedup_vs_reference", "-"),
                    r["float32_over_floor"],
                    r["uint8_over_floor"],
                    r["levels_over_floor"],
                ]
                for r in speed
            ],
        )
    )
    print("(HF: Qwen2VLImageProcessorPil; floor: decode + resize only; levels: decode + resize +")
    print(" uint8 patch cut into a reused array; uint8 == float32 after normalize_pixels, checked")
    print(" for every size)")
    print()
    print_qwen3(qwen3)
    print()
    print(
        format_table(
            GUARD_HEADERS,
            [
                [
                    s["kind"],
                    s["items"],
                    s["median_unguarded_ms"],
                    s["median_guarded_ms"],
                    f"{s['median_guard_ratio']:.3f}x",
                    f"{s['median_guard_cpu_ratio']:.3f}x",
                ]
                + (
                    [
                        f"{s['median_probe_guard_ratio']:.3f}x",
                        f"{s['median_probe_guard_cpu_ratio']:.3f}x",
                    ]
                    if s["kind"] == "video"
                    else ["-", "-"]
                )
                for s in summaries
            ],
        )
    )
    packs = measure_pack_guard(8, args.repeats * 2)
    print(
        f"whole packs ({packs['packs']} packs of {packs['samples_per_pack']} samples, "
        f"decode_vision): guard wall {packs['median_guard_ratio']:.3f}x, "
        f"guard CPU {packs['median_guard_cpu_ratio']:.3f}x"
    )
    helper = helper_memory()
    print(
        f"decoder helper process: RSS {helper['rss_mib']:.0f} MiB, USS {helper['uss_mib']:.0f} MiB"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "config": str(media.MediaConfig()),
        "summary": summaries,
        "helper_memory": helper,
        "pack_guard": packs,
        "versus_references": speed,
        "versus_qwen3": qwen3,
        "items": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
