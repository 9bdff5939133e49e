"""Soak: a long Energon run over real images and videos, watching memory and file descriptors.

A repeating train loader over the shipped fixture (`fixtures/vlm_demo`: JPEG, PNG and MP4
members) with 2 workers streams until --samples samples were packed. Every --every samples the
RSS and open file descriptors of the main process, each loader worker and each decoder helper
process are read with psutil. After a warm-up (--warmup samples) the RSS slope of each process
is fitted by least squares and reported in MB per 10,000 samples. At the end the loader's workers
are stopped and the loader deleted; the processes and descriptors left are counted.

With --trace the same loader runs in this process (no workers), and ``tracemalloc`` records
where the memory allocated after the warm-up and still held at the end was allocated, summed by
source file: what a slope is made of.

Usage: python benchmarks/soak.py [--samples 30000] [--vision-budget] [--trace] [--out ...]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

import psutil
from megatron.energon import SavableDataLoader, WorkerConfig, get_savable_loader, get_train_dataset

from energon_pack import MediaConfig, PackingTaskEncoder, VisionBudget
from energon_pack.cli.tables import format_table
from energon_pack.tune import stop_workers

ROOT = Path(__file__).resolve().parent.parent
MB = 1024 * 1024
TRACED_FILES = 8
"""Source files --trace lists, most memory first."""


def readings(main: psutil.Process) -> dict[str, tuple[float, int]]:
    """``{role: (rss MB, open fds)}`` of the main process and all its descendants."""
    out = {"main": (main.memory_info().rss / MB, main.num_fds())}
    for child in main.children(recursive=True):
        try:
            parent = child.parent()
            role = "worker" if parent is not None and parent.pid == main.pid else "decoder"
            out[f"{role} {child.pid}"] = (child.memory_info().rss / MB, child.num_fds())
        except psutil.NoSuchProcess:
            continue
    return out


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of ``(samples, MB)``, in MB per 10,000 samples."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread * 1e4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=30000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=5000)
    parser.add_argument("--buffer", type=int, default=16)
    parser.add_argument(
        "--vision-budget",
        action="store_true",
        help="pack with max_vision_tokens=300, max_media=6, vision_balance=True",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="run in this process (no workers) and trace where the memory held at the end was "
        "allocated after the warm-up",
    )
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = parser.parse_args()

    budget = (
        VisionBudget(max_vision_tokens=300, max_media=6, balance=True)
        if args.vision_budget
        else VisionBudget()
    )
    if args.trace:
        traced(loader_of(budget, args.buffer, workers=0), args)
        return
    main_process = psutil.Process(os.getpid())
    baseline_fds = main_process.num_fds()
    loader = loader_of(budget, args.buffer, workers=2)
    series: dict[str, list[tuple[int, float]]] = {}
    fds: dict[str, list[int]] = {}
    samples = packs = 0
    next_reading = 0
    start = time.perf_counter()
    for batch in loader:
        samples += len(batch.__keys__)
        packs += 1
        if samples >= next_reading:
            next_reading += args.every
            for role, (rss, open_fds) in readings(main_process).items():
                series.setdefault(role, []).append((samples, rss))
                fds.setdefault(role, []).append(open_fds)
        if samples >= args.samples:
            break
    elapsed = time.perf_counter() - start
    stop_workers(loader)
    del loader
    gc.collect()
    time.sleep(1)
    left = main_process.children(recursive=True)
    rows = []
    records = []
    for role, points in series.items():
        steady = [p for p in points if p[0] >= args.warmup]
        record = {
            "process": role,
            "readings": len(points),
            "rss_mb_first": points[0][1],
            "rss_mb_after_warmup": steady[0][1] if steady else None,
            "rss_mb_last": points[-1][1],
            "slope_mb_per_10k": slope(steady) if len(steady) >= 3 else None,
            "fds_min": min(fds[role]),
            "fds_max": max(fds[role]),
            "series": points,
        }
        records.append(record)
        rows.append(
            [
                role,
                len(points),
                f"{record['rss_mb_first']:.0f}",
                "-" if steady == [] else f"{steady[0][1]:.0f}",
                f"{record['rss_mb_last']:.0f}",
                "-" if record["slope_mb_per_10k"] is None else f"{record['slope_mb_per_10k']:+.2f}",
                f"{record['fds_min']}-{record['fds_max']}",
            ]
        )
    print(
        f"{samples} samples in {packs} packs, {elapsed:.0f} s ({samples / elapsed:.0f} samples/s), "
        f"buffer {args.buffer}, 2 workers, vision budget {'on' if budget.active else 'off'}"
    )
    headers = ["process", "readings", "RSS MB first", "after warm-up", "last", "MB / 10k", "fds"]
    print(format_table(headers, rows))
    end_fds = main_process.num_fds()
    print(
        f"after the loader is deleted: {len(left)} child processes left, main process fds "
        f"{end_fds} (before the loader: {baseline_fds})"
    )
    result = {
        "samples": samples,
        "packs": packs,
        "seconds": elapsed,
        "vision_budget": budget.settings(),
        "processes": records,
        "children_left": len(left),
        "fds_before": baseline_fds,
        "fds_after": end_fds,
    }
    write_result(args.out, result)


def loader_of(budget: VisionBudget, buffer: int, *, workers: int) -> SavableDataLoader[Any]:
    """The repeating train loader over the fixture, packing with ``budget``."""
    encoder = PackingTaskEncoder(
        seq_length=8192,
        pad_to_multiple_of=8,
        media=MediaConfig(max_pixels=64 * 28 * 28, video_max_frames=4),
        overlong="skip",
        vision=budget,
    )
    dataset = get_train_dataset(
        ROOT / "fixtures" / "vlm_demo",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
        batch_size=1,
        packing_buffer_size=buffer,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=True,
    )
    return get_savable_loader(dataset)


def traced(loader: SavableDataLoader[Any], args: argparse.Namespace) -> None:
    """Stream ``args.samples`` samples in this process; print and write the memory allocated
    after ``args.warmup`` samples and still held at the end, by source file."""
    logging.getLogger("energon_pack").setLevel(logging.ERROR)  # skips are counted, not read
    samples = traced_from = 0
    start: tracemalloc.Snapshot | None = None
    objects: list[int] = []
    for batch in loader:
        samples += len(batch.__keys__)
        if start is None and samples >= args.warmup:
            gc.collect()
            objects.append(len(gc.get_objects()))
            tracemalloc.start(1)
            start = tracemalloc.take_snapshot()
            traced_from = samples
        if samples >= args.samples:
            break
    gc.collect()
    if start is None:
        raise SystemExit(f"--samples {args.samples} ends before --warmup {args.warmup}")
    objects.append(len(gc.get_objects()))
    end = tracemalloc.take_snapshot()
    tracemalloc.stop()
    measured = samples - traced_from
    grown = end.compare_to(start, "filename")
    rows = [
        [g.traceback[0].filename, f"{g.size_diff / MB * 1e4 / measured:+.2f}", f"{g.count_diff:+d}"]
        for g in grown[:TRACED_FILES]
    ]
    total = sum(g.size_diff for g in grown) / MB * 1e4 / measured
    print(
        f"in one process, {measured} samples after a warm-up of {traced_from}: {total:+.2f} MB per "
        f"10k samples held (traced), Python objects {objects[0]} -> {objects[1]}"
    )
    print(format_table(["allocated in", "MB / 10k", "blocks"], rows))
    result = {
        "samples": measured,
        "warmup": traced_from,
        "traced_mb_per_10k": total,
        "objects": objects,
        "by_file": [
            {"file": g.traceback[0].filename, "bytes": g.size_diff, "blocks": g.count_diff}
            for g in grown[:TRACED_FILES]
        ],
    }
    write_result(args.out, result)


def write_result(path: str, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON to ``path`` (its folder made as needed) and say so."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
