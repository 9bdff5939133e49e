"""Bin fill vs packing buffer size: the online packer against the window scheme and offline BFD.

Schemes, side by side on the same seeded length streams:
  online      energon_pack.OnlineBinPacker (carry-over, default settings, except that the buffer is
              bounded by its count alone, BufferConfig(min_rows=None), so that each column is
              the size named; by default a buffer of short samples grows to two rows' worth)
  best-fit    a plain best-fit carry-over packer: each sample goes to the fullest open bin it
              fits, a bin leaves when less than 1% free, the fullest leaves when the buffer is full
  window-ffd  the scheme Megatron-Bridge runs on Energon's packing buffer: fill the buffer, run
              first-fit decreasing over it, emit every group it forms, refill
  offline     best-fit decreasing over the whole stream (the limit)

Usage: python benchmarks/bin_fill.py [--samples N] [--capacity C] [--out results/bin_fill.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from energon_pack import BufferConfig, OnlineBinPacker, best_fit_decreasing, first_fit_decreasing
from energon_pack.cli.tables import format_table
from energon_pack.packing.bins import groups_fill
from energon_pack.packing.synthetic import DISTRIBUTIONS, lengths_for

BUFFER_SIZES = (4, 8, 16, 32, 64, 128, 256)


def online(lengths: list[int], capacity: int, buffer_size: int) -> tuple[float, float]:
    """Bin fill and microseconds per item of the online packer."""
    packer = OnlineBinPacker(capacity, buffer_size, buffer=BufferConfig(min_rows=None))
    start = time.perf_counter()
    for key, length in enumerate(lengths):
        packer.push(key, length)
    packer.flush()
    elapsed = time.perf_counter() - start
    return packer.stats.bin_fill, elapsed / len(lengths) * 1e6


def best_fit_carry_over(lengths: list[int], capacity: int, buffer_size: int) -> float:
    """Bin fill of a plain best-fit packer with carried-over open bins."""
    open_bins: list[list[int]] = []  # [used, count] per open bin
    left: list[int] = []  # used tokens of each emitted bin
    for length in lengths:
        fitting = [b for b in open_bins if b[0] + length <= capacity]
        if fitting:
            target = max(fitting, key=lambda b: b[0])
        else:
            target = [0, 0]
            open_bins.append(target)
        target[0] += length
        target[1] += 1
        for b in [b for b in open_bins if capacity - b[0] < capacity // 100]:
            open_bins.remove(b)
            left.append(b[0])
        while sum(b[1] for b in open_bins) >= buffer_size:
            fullest = max(open_bins, key=lambda b: b[0])
            open_bins.remove(fullest)
            left.append(fullest[0])
    left += [b[0] for b in open_bins]
    return sum(left) / (len(left) * capacity)


def window_ffd(lengths: list[int], capacity: int, buffer_size: int) -> float:
    """Bin fill of FFD over consecutive windows of ``buffer_size`` samples, emitting all."""
    used = bins = 0
    for start in range(0, len(lengths), buffer_size):
        window = lengths[start : start + buffer_size]
        groups = first_fit_decreasing(window, capacity)
        used += sum(window)
        bins += len(groups)
    return used / (bins * capacity)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--capacity", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bin_fill.json"))
    args = parser.parse_args()

    records = []
    for distribution in DISTRIBUTIONS:
        lengths = lengths_for(distribution, args.samples, seed=args.seed, cap=args.capacity)
        limit = groups_fill(best_fit_decreasing(lengths, args.capacity), lengths, args.capacity)
        rows = []
        for buffer_size in BUFFER_SIZES:
            fill, micros = online(lengths, args.capacity, buffer_size)
            record = {
                "distribution": distribution,
                "buffer_size": buffer_size,
                "online": fill,
                "best_fit_carry_over": best_fit_carry_over(lengths, args.capacity, buffer_size),
                "window_ffd": window_ffd(lengths, args.capacity, buffer_size),
                "offline_bfd": limit,
                "online_us_per_item": micros,
            }
            records.append(record)
            rows.append([buffer_size, *list(record.values())[2:]])
        mean = sum(lengths) / len(lengths)
        print(
            f"\n{distribution}: {len(lengths)} samples, mean {mean:.0f} tokens, "
            f"capacity {args.capacity}"
        )
        headers = ["buffer", "online", "best-fit", "window-ffd", "offline", "us/item"]
        print(format_table(headers, rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
