"""Offline packing: time and packing efficiency of BFD / FFD on synthetic text SFT lengths, and
the full pipeline (JSONL -> tokens spilled to disk -> packed .npy directory) on a pre-tokenised
file, so that token streaming is measured too.

Lengths: energon_pack.packing.synthetic.text_sft_lengths (lognormal, mean about 900, clipped to the
capacity). Packing timings cover best_fit_decreasing / first_fit_decreasing only.
Targets: efficiency >= 0.995 and < 10 s for 1M lengths.

Usage: python benchmarks/offline.py [--counts 100000,1000000] [--pipeline-samples 20000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from energon_pack.cli.tables import format_table
from energon_pack.offline.build import pack_offline
from energon_pack.offline.spec import PackingSpec
from energon_pack.packing.bins import best_fit_decreasing, first_fit_decreasing
from energon_pack.packing.synthetic import text_sft_lengths

PACKERS = {"bfd": best_fit_decreasing, "ffd": first_fit_decreasing}


def bench_packing(count: int, capacity: int, seed: int) -> list[dict[str, object]]:
    """Seconds and efficiency (real tokens over packs * capacity) of each packer."""
    lengths = text_sft_lengths(count, seed=seed, cap=capacity)
    rows: list[dict[str, object]] = []
    for name, pack in PACKERS.items():
        start = time.perf_counter()
        groups = pack(lengths, capacity)
        seconds = time.perf_counter() - start
        rows.append(
            {
                "lengths": count,
                "algorithm": name,
                "packs": len(groups),
                "efficiency": sum(lengths) / (len(groups) * capacity),
                "seconds": seconds,
            }
        )
    return rows


def bench_pipeline(count: int, capacity: int, seed: int) -> dict[str, object]:
    """pack_offline on a pre-tokenised JSONL of ``count`` sequences (file writing not timed)."""
    lengths = text_sft_lengths(count, seed=seed, cap=capacity)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "pretokenised.jsonl"
        with source.open("w") as out:
            for n in lengths:
                ids = [rng.randrange(32000) for _ in range(n)]
                prompt = n // 3
                mask = [0] * prompt + [1] * (n - prompt)
                out.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
        size_mb = source.stat().st_size / 1e6
        start = time.perf_counter()
        result = pack_offline(source, Path(tmp) / "packed", PackingSpec(capacity))
        seconds = time.perf_counter() - start
    return {
        "sequences": count,
        "tokens": result.tokens,
        "input_mb": round(size_mb),
        "packs": result.packs,
        "packing_efficiency_percent": result.metadata.packing_efficiency,
        "seconds": seconds,
        "tokens_per_second": result.tokens / seconds,
    }


def _counts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=_counts, default=[100_000, 1_000_000])
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--pipeline-samples", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "offline.json"))
    args = parser.parse_args()

    packing = [row for n in args.counts for row in bench_packing(n, args.capacity, args.seed)]
    print(f"packing lengths only, capacity {args.capacity} (targets: >= 0.995, < 10 s at 1M)")
    headers = ["lengths", "algorithm", "packs", "efficiency", "seconds"]
    print(format_table(headers, [[row[h] for h in headers] for row in packing]))

    pipeline = bench_pipeline(args.pipeline_samples, args.capacity, args.seed)
    print("\nfull pipeline, pre-tokenised JSONL -> packed directory (BFD)")
    cells = [f"{v:,.0f}" if k == "tokens_per_second" else v for k, v in pipeline.items()]
    print(format_table(list(pipeline), [cells]))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"capacity": args.capacity, "seed": args.seed, "packing": packing}
    report["pipeline"] = pipeline
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
