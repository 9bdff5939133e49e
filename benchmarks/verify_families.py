"""``energon-pack verify`` on every documented family: verdicts, errors and wall time.

Each family's checkpoint directory (config.json, tokenizer, processor files; no weights) is
built by the test suite's builders: the Qwen models and a text model with the real Qwen
tokenizer, the processor families from their family tests' processors. ``verify_packing`` runs
with its CPU defaults (eager and sdpa, float64, the shipped demo data) once per seed; the
families whose processors load only with torchvision run in the test suite's torchvision child
process. Per family it reports the verdicts, the worst loss, logits, gradient and leak errors
over the seeds, how many seeds raised a false alarm (a family documented exact that did not come
out exact), and the median wall time of one run (cutting, encoding, every implementation).
Qwen3.5 is the refused linear-attention model: its leak is measured, not a false alarm.

Torch runs on one thread.

Usage: python benchmarks/verify_families.py [--seeds 3] [--out results/verify_families.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
# The family tests' builders (tests/encoding) and the shared test helpers (tests/support).
sys.path[:0] = [str(ROOT / "tests" / "encoding"), str(ROOT / "tests" / "support")]

from model_dirs import BUILDERS, model_dir, verify_runs  # noqa: E402
from torchvision_child import available, run_in_child  # noqa: E402
from torchvision_models import NAMES as TORCHVISION_FAMILIES  # noqa: E402

from energon_pack.cli.tables import format_table  # noqa: E402

REFUSED = ("qwen3_5",)
"""Models the library refuses to pack: verify measures their leak."""


def summary(name: str, reports: list[dict[str, Any]]) -> dict[str, Any]:
    results = [result for report in reports for result in report["results"]]

    def worst(field: str) -> float | None:
        values = [r[field] for r in results if r[field] is not None]
        return max(values) if values else None

    verdicts = sorted({f"{r['attn_implementation']}:{r['verdict']}" for r in results})
    exact = all(r["verdict"] == "exact" for r in results)
    alarms = sum(any(r["verdict"] != "exact" for r in report["results"]) for report in reports)
    return {
        "family": name,
        "model_class": reports[0]["model_class"],
        "layer_types": sorted(set(reports[0]["layer_types"])),
        "verdicts": verdicts,
        "exact": exact,
        "false_alarms": 0 if name in REFUSED else alarms,
        "seeds": len(reports),
        "loss_error": worst("loss_error"),
        "logits_error": worst("logits_error"),
        "gradient_error": worst("gradient_error"),
        "leak": worst("leak"),
        "median_seconds": statistics.median(report["seconds"] for report in reports),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="runs per family (seeds 0..N-1)")
    parser.add_argument("--families", help="comma-separated subset (default: all)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/verify_families.json"
    )
    args = parser.parse_args()
    every = [*BUILDERS, *TORCHVISION_FAMILIES]
    chosen = args.families.split(",") if args.families else every
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {every}")
    torch.set_num_threads(1)
    seeds = list(range(args.seeds))
    found: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in BUILDERS:
            if name in chosen:
                found[name] = verify_runs(model_dir(Path(scratch) / name, name), seeds)
    in_child = [name for name in TORCHVISION_FAMILIES if name in chosen]
    if in_child and available():
        job = {"names": in_child, "seeds": seeds}
        child = run_in_child("torchvision_models:verify_families", job, timeout=3600)
        child.pop("child_seconds")
        found.update(child)
    rows = [summary(name, reports) for name, reports in found.items()]

    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.1e}"

    print(
        format_table(
            ["family", "verdicts", "false alarms", "loss", "logits", "gradient", "leak", "s"],
            [
                [
                    row["family"],
                    " ".join(row["verdicts"]),
                    f"{row['false_alarms']}/{row['seeds']}",
                    number(row["loss_error"]),
                    number(row["logits_error"]),
                    number(row["gradient_error"]),
                    number(row["leak"]),
                    f"{row['median_seconds']:.1f}",
                ]
                for row in rows
            ],
        )
    )
    if in_child and not available():
        print("(the reference torchvision is not installed: its families were not run)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seeds": seeds, "families": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
