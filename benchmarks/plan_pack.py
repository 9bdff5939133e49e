"""A whole-dataset plan against first fit decreasing and the online packer; its pack step cost.

The three seeded VLM mixes of benchmarks/vision_budget.py (short-turns, long-turns,
small-images; 32,000 samples each by default), at seq 8192 and 16384. Caps as there: V = 1.5x
the uncapped mean vision tokens per pack, K = ceil(1.5x its mean media); samples alone over a
cap are left out of every scheme. Per configuration:

  ffd            first fit decreasing on the lengths alone (no caps): the fill to match
  online         the online packer at buffer 64 under the caps with balance, one stream, its
                 end-of-stream flush included (every pack counted, as the plan counts them)
  plan           energon_pack.plan.pack: pack_rows (caps + balance) and lay_out_steps

Figures: fill (every pack counted), the plan's fill minus ffd's (goal >= -0.001), the plan's
straggler ratio at 8 and 64 ranks with its floor (energon_pack.straggler_floor over the plan's
steps; goal <= floor + 0.02) and the seconds of the pack step (pack_rows + lay_out_steps, one
core). Then the pack step's time and, in a second run, its peak memory (tracemalloc) on
--scale synthetic samples without and with the caps and balance. Last, on --partition-check
samples under the caps, the fill of pack_rows' partitions (PARTITION_ROWS each) against one
global first fit over all of them (goal: within 0.001), with the seconds of each.

Usage: python benchmarks/plan_pack.py [--samples N] [--streams a,b] [--seq-lengths a,b]
       [--scale N] [--scale-only] [--partition-check N]
       [--out benchmarks/results/plan_pack.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
import tracemalloc
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vision_budget import STREAMS

from energon_pack import OnlineBinPacker, PackingWarning, RowLayout, VisionBudget
from energon_pack.cli.tables import format_table
from energon_pack.packing.bins import first_fit_decreasing, groups_fill
from energon_pack.packing.synthetic import VisionSample, vision_mix
from energon_pack.plan import pack as plan_pack
from energon_pack.plan.pack import lay_out_steps, pack_rows
from energon_pack.plan.spec import PlanSpec

RANKS = (8, 64)
ONLINE_BUFFER = 64


def online_fill(samples: Sequence[VisionSample], seq: int, budget: VisionBudget) -> float:
    """The online packer's fill over every pack it emits, the flush included."""
    packer = OnlineBinPacker(seq, ONLINE_BUFFER, overlong="skip", vision=budget)
    used = packs = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        for index, s in enumerate(samples):
            for b in packer.push(index, s.length, vision_tokens=s.vision_tokens, media=s.media):
                used, packs = used + b.used, packs + 1
        for b in packer.flush():
            used, packs = used + b.used, packs + 1
    return used / (packs * seq)


def plan_figures(samples: Sequence[VisionSample], seq: int, budget: VisionBudget) -> dict[str, Any]:
    lengths = [s.length for s in samples]
    vision = [s.vision_tokens for s in samples]
    media = [s.media for s in samples]
    out: dict[str, Any] = {}
    for ranks in RANKS:
        spec = PlanSpec(RowLayout(seq), budget, data_parallel_size=ranks)
        start = time.perf_counter()
        groups = pack_rows(lengths, vision, media, spec)
        pack_vision = [sum(vision[i] for i in g) for g in groups]
        largest = [max(vision[i] for i in g) for g in groups]
        steps = lay_out_steps(pack_vision, largest, spec)
        seconds = time.perf_counter() - start
        assert all(
            budget.fits(pv, sum(media[i] for i in g))
            for pv, g in zip(pack_vision, groups, strict=True)
        )
        out["fill"] = groups_fill(groups, lengths, seq)
        out["packs"] = len(groups)
        out[f"straggler_{ranks}"] = steps.straggler
        out[f"floor_{ranks}"] = steps.floor
        out[f"seconds_{ranks}"] = seconds
    return out


def compare(stream: str, seq: int, count: int) -> dict[str, Any]:
    samples = vision_mix(count, seed=0, cap=seq, **STREAMS[stream])
    uncapped = first_fit_decreasing([s.length for s in samples], seq)
    packs = len(uncapped)
    budget = VisionBudget(
        max_vision_tokens=int(1.5 * sum(s.vision_tokens for s in samples) / packs),
        max_media=math.ceil(1.5 * sum(s.media for s in samples) / packs),
        balance=True,
    )
    kept = [s for s in samples if budget.fits(s.vision_tokens, s.media)]
    lengths = [s.length for s in kept]
    ffd = groups_fill(first_fit_decreasing(lengths, seq), lengths, seq)
    row = {
        "stream": stream,
        "seq": seq,
        "kept": len(kept),
        "max_vision_tokens": budget.max_vision_tokens,
        "max_media": budget.max_media,
        "ffd": ffd,
        "online_64": online_fill(kept, seq, budget),
        **plan_figures(kept, seq, budget),
    }
    row["plan_minus_ffd"] = row["fill"] - ffd
    return row


def pack_step(columns: tuple[list[int], list[int], list[int]], spec: PlanSpec) -> None:
    groups = pack_rows(*columns, spec)
    pack_vision = [sum(columns[1][i] for i in g) for g in groups]
    lay_out_steps(pack_vision, pack_vision, spec)


def scale(count: int) -> list[dict[str, Any]]:
    """The pack step's seconds, then (a second run, under tracemalloc, which slows Python
    down) its peak traced memory, on ``count`` short-turns samples."""
    samples = vision_mix(count, seed=0, cap=8192, text_median=150)
    lengths = [s.length for s in samples]
    vision = [s.vision_tokens for s in samples]
    media = [s.media for s in samples]
    rows = []
    for name, budget in (
        ("tokens only", VisionBudget()),
        ("caps + balance", VisionBudget(max_vision_tokens=5000, max_media=12, balance=True)),
    ):
        kept = [i for i in range(count) if budget.fits(vision[i], media[i])]
        spec = PlanSpec(RowLayout(8192), budget, data_parallel_size=8)
        columns = ([lengths[i] for i in kept], [vision[i] for i in kept], [media[i] for i in kept])

        start = time.perf_counter()
        pack_step(columns, spec)
        seconds = time.perf_counter() - start
        tracemalloc.start()
        pack_step(columns, spec)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rows.append(
            {"scheme": name, "samples": len(kept), "seconds": seconds, "peak_mb": peak / 2**20}
        )
    return rows


def partition_check(count: int) -> dict[str, Any]:
    """Fill and seconds of the capped pack step (no balance) in partitions and globally."""
    samples = vision_mix(count, seed=0, cap=8192, text_median=150)
    budget = VisionBudget(max_vision_tokens=5000, max_media=12)
    kept = [s for s in samples if budget.fits(s.vision_tokens, s.media)]
    columns = ([s.length for s in kept], [s.vision_tokens for s in kept], [s.media for s in kept])
    spec = PlanSpec(RowLayout(8192), budget)
    out: dict[str, Any] = {"samples": len(kept), "partition_rows": plan_pack.PARTITION_ROWS}
    partition_rows = plan_pack.PARTITION_ROWS
    for name, rows in (("partitions", partition_rows), ("global", len(kept) + 1)):
        plan_pack.PARTITION_ROWS = rows
        try:
            start = time.perf_counter()
            groups = pack_rows(*columns, spec)
            out[f"seconds_{name}"] = time.perf_counter() - start
        finally:
            plan_pack.PARTITION_ROWS = partition_rows
        out[f"fill_{name}"] = groups_fill(groups, columns[0], 8192)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=32000)
    parser.add_argument("--streams", default=",".join(STREAMS))
    parser.add_argument("--seq-lengths", default="8192,16384")
    parser.add_argument(
        "--scale", type=int, default=400_000, help="samples of the cost run (0: none)"
    )
    parser.add_argument("--scale-only", action="store_true", help="only the cost run")
    parser.add_argument(
        "--partition-check",
        type=int,
        default=1_000_000,
        help="samples of the partitions-against-global fill check (0: none)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/plan_pack.json"))
    args = parser.parse_args()
    rows = [
        compare(stream, int(seq), args.samples)
        for stream in args.streams.split(",")
        for seq in args.seq_lengths.split(",")
        if not args.scale_only
    ]
    if rows:
        print(
            format_table(
                [
                    "stream",
                    "seq",
                    "ffd",
                    "online 64",
                    "plan",
                    "plan - ffd",
                    "DP 8 (floor)",
                    "DP 64 (floor)",
                    "s",
                ],
                [
                    [
                        r["stream"],
                        r["seq"],
                        f"{r['ffd']:.4f}",
                        f"{r['online_64']:.4f}",
                        f"{r['fill']:.4f}",
                        f"{r['plan_minus_ffd']:+.4f}",
                        f"{r['straggler_8']:.3f} ({r['floor_8']:.3f})",
                        f"{r['straggler_64']:.3f} ({r['floor_64']:.3f})",
                        f"{r['seconds_8']:.1f}",
                    ]
                    for r in rows
                ],
            )
        )
    costs = scale(args.scale) if args.scale else []
    if costs:
        print()
        print(
            format_table(
                ["pack step", "samples", "seconds", "µs/sample", "peak MB"],
                [
                    [
                        c["scheme"],
                        c["samples"],
                        f"{c['seconds']:.1f}",
                        f"{1e6 * c['seconds'] / c['samples']:.1f}",
                        f"{c['peak_mb']:.0f}",
                    ]
                    for c in costs
                ],
            )
        )
    check = partition_check(args.partition_check) if args.partition_check else {}
    if check:
        print()
        print(
            format_table(
                ["caps, no balance", "samples", "fill", "seconds"],
                [
                    [
                        f"{name} of {check['partition_rows']:,}" if name == "partitions" else name,
                        check["samples"],
                        f"{check[f'fill_{name}']:.5f}",
                        f"{check[f'seconds_{name}']:.1f}",
                    ]
                    for name in ("partitions", "global")
                ],
            )
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"configurations": rows, "scale": costs, "partition_check": check}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
