"""Lazy media: header probe vs full decode + patchify, and bytes held before vs after.

For every image and video of fixtures/vlm_demo: probe time (median of repeats), decode+patchify
time (median of repeats), compressed bytes (what a lazy packing buffer holds) and processed
tensor bytes (what an eager buffer holds). Prints one row per distinct (kind, size, format) and
totals, and writes benchmarks/results/media.json with every item (1 CPU thread).

The guard table compares decoding in the helper process (``decode_isolation="process"``, the
default) with decoding in the calling process (``"off"``), calls interleaved, as the median of
per-item ratios of median times.

Run: .venv/bin/python benchmarks/media.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from energon_pack import media
from energon_pack.sample import parse_sample
from energon_pack.tables import format_table

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


def fixture_media() -> list[tuple[str, str, str, bytes]]:
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
            items.append((key, member, kind, data))
    return items


UNGUARDED = media.MediaConfig(decode_isolation="off")


def paired_seconds(
    guarded: Callable[[], object], unguarded: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Median wall times of ``guarded`` and ``unguarded``, called alternately."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, bucket in ((unguarded, times[1]), (guarded, times[0])):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def measure_guard(kind: str, data: bytes, repeats: int) -> dict[str, float]:
    """Guarded versus unguarded decode (and probe, for videos) times of one item."""
    if kind == "image":
        decode, probe = media.process_image, None
    else:
        decode, probe = media.process_video, media.probe_video
    guarded_s, unguarded_s = paired_seconds(
        lambda: decode(data), lambda: decode(data, UNGUARDED), repeats
    )
    out = {"guarded_ms": guarded_s * 1e3, "unguarded_ms": unguarded_s * 1e3}
    out["guard_ratio"] = guarded_s / unguarded_s
    if probe is not None:
        pg, pu = paired_seconds(lambda: probe(data), lambda: probe(data, UNGUARDED), repeats)
        out["probe_guard_ratio"] = pg / pu
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
        "median_probe_guard_ratio": statistics.median(
            r.get("probe_guard_ratio", 1.0) for r in chosen
        ),
    }


def main() -> None:
    """Measure, print and write the JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
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
    print()
    print(
        format_table(
            ["kind", "items", "unguarded ms", "guarded ms", "guard ratio", "probe guard ratio"],
            [
                [
                    s["kind"],
                    s["items"],
                    s["median_unguarded_ms"],
                    s["median_guarded_ms"],
                    f"{s['median_guard_ratio']:.3f}x",
                    f"{s['median_probe_guard_ratio']:.3f}x" if s["kind"] == "video" else "-",
                ]
                for s in summaries
            ],
        )
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"config": str(media.MediaConfig()), "summary": summaries, "items": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
