"""Start-up time of the ``energon-pack`` commands that should answer at once: ``--help``,
``tune --help``, ``check-config`` and an argument error, each run as a child process
(``python -m energon_pack.cli ...`` in the tree given, so two checkouts compare with one
interpreter and environment). Runs are interleaved (every command of every tree once, then
again), so a load change on the machine hits all alike; the table gives the median wall time of
``--runs`` start-ups, beside a bare ``python -c pass``.

Usage: python benchmarks/cli_startup.py [--tree DIR ...] [--runs 10] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from energon_pack.cli.tables import format_table

COMMANDS: dict[str, list[str]] = {
    "--help": ["--help"],
    "tune --help": ["tune", "--help"],
    "check-config": ["check-config", "--seq-length", "8192", "--tp", "2", "--sp"],
    "argument error": ["tune", "--bufer-sizes", "4"],
}
"""Name -> the arguments of ``energon-pack``."""
CASES: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    **{name: ["-m", "energon_pack.cli", *argv] for name, argv in COMMANDS.items()},
}
"""Name -> the interpreter's arguments: the bare interpreter, then each command."""


def start_up(tree: Path, argv: list[str]) -> float:
    """Wall seconds of one ``python ARGV`` run in ``tree``."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, *argv],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    return time.perf_counter() - start


def measure(trees: list[Path], runs: int) -> dict[str, dict[str, list[float]]]:
    """Tree -> case name -> the seconds of each run, interleaved across trees and cases."""
    seconds: dict[str, dict[str, list[float]]] = {str(t): {n: [] for n in CASES} for t in trees}
    for _ in range(runs):
        for name, argv in CASES.items():
            for tree in trees:
                seconds[str(tree)][name].append(start_up(tree, argv))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        type=Path,
        action="append",
        help="checkout to run (repeatable; default: this one)",
    )
    parser.add_argument("--runs", type=int, default=10, help="start-ups per command and tree")
    parser.add_argument("--json", type=Path, help="also write every run's seconds here")
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.tree or [Path(__file__).resolve().parents[1]]]
    seconds = measure(trees, args.runs)
    headers = ["command", *(f"{tree} (s, median)" for tree in trees)]
    rows = [
        [name, *(statistics.median(seconds[str(tree)][name]) for tree in trees)] for name in CASES
    ]
    print(f"median of {args.runs} start-ups, {sys.executable}")
    print(format_table(headers, rows))
    if args.json:
        record = {
            "python": sys.executable,
            "runs": args.runs,
            "cases": CASES,
            "seconds": seconds,
            "median": {
                tree: {name: statistics.median(runs) for name, runs in cases.items()}
                for tree, cases in seconds.items()
            },
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
