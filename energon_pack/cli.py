"""The ``energon-pack`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from energon_pack.binpack import OnlineBinPacker, best_fit_decreasing, groups_fill
from energon_pack.synthetic import DISTRIBUTIONS, lengths_for
from energon_pack.tables import format_table


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _cmd_demo(args: argparse.Namespace) -> int:
    distributions = DISTRIBUTIONS if args.distribution == "all" else (args.distribution,)
    results = []
    for distribution in distributions:
        lengths = lengths_for(distribution, args.samples, seed=args.seed, cap=args.capacity)
        offline = groups_fill(best_fit_decreasing(lengths, args.capacity), lengths, args.capacity)
        rows = []
        for buffer_size in args.buffer_sizes:
            packer = OnlineBinPacker(args.capacity, buffer_size)
            for index, length in enumerate(lengths):
                packer.push(index, length)
            packer.flush()
            stats = packer.stats
            rows.append(
                [buffer_size, stats.bin_fill, offline, stats.items_per_bin, stats.mean_wait]
            )
            results.append(
                {
                    "distribution": distribution,
                    "buffer_size": buffer_size,
                    "bin_fill": stats.bin_fill,
                    "offline_bfd_bin_fill": offline,
                    "items_per_bin": stats.items_per_bin,
                    "mean_wait": stats.mean_wait,
                    "max_wait": stats.max_wait,
                }
            )
        mean = sum(lengths) / len(lengths)
        print(
            f"\n{distribution}: {len(lengths)} samples, mean length {mean:.0f}, "
            f"capacity {args.capacity}"
        )
        headers = ["buffer", "bin fill", "offline BFD", "items/bin", "mean wait"]
        print(format_table(headers, rows))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="energon-pack", description="Online sequence packing for Megatron-Energon."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="stream synthetic sample lengths through the online packer; bin fill vs buffer size",
    )
    demo.add_argument("--distribution", choices=[*DISTRIBUTIONS, "all"], default="all")
    demo.add_argument("--capacity", type=int, default=8192, help="seq_length (default 8192)")
    demo.add_argument("--samples", type=int, default=20000)
    demo.add_argument("--buffer-sizes", type=_int_list, default=[4, 8, 16, 32, 64, 128])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", help="also write the results to this JSON file")
    demo.set_defaults(run=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``energon-pack``."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except ValueError as error:
        print(f"energon-pack: error: {error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
