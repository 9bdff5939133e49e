"""Plot bin fill vs packing buffer size from the bin-fill benchmark's JSON.

Runs ``benchmarks/bin_fill.py`` (20,000 seeded lengths per mix, capacity 8192) unless ``--json``
names figures it already wrote, then draws one panel per length mix: the online packer, a plain
best-fit carry-over packer, the window FFD scheme Megatron-Bridge runs on Energon's packing
buffer, and offline best-fit decreasing (the limit), against the buffer size.

Usage: python benchmarks/plot_fill.py [--json results/bin_fill.json] [--out FILE.png]
(default out: docs/_static/fill_vs_buffer.png)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "docs" / "_static" / "fill_vs_buffer.png"

TITLES = {
    "vlm": "VLM mix (text + 0-2 images)",
    "text_sft": "Text SFT mix (lognormal lengths)",
}
SCHEMES = (
    ("online", "online (OnlineBinPacker)", "-", "o"),
    ("best_fit_carry_over", "best-fit carry-over", "--", "s"),
    ("window_ffd", "window FFD (Megatron-Bridge)", "-.", "^"),
    ("offline_bfd", "offline BFD (limit)", ":", None),
)


def run_benchmark(out: Path) -> None:
    """Run the bin-fill benchmark, which prints its table and writes ``out``."""
    subprocess.run([sys.executable, str(HERE / "bin_fill.py"), "--out", str(out)], check=True)


def plot(records: list[dict[str, Any]], out: Path) -> None:
    """One panel per distribution: bin fill of every scheme against the buffer size."""
    distributions = list(dict.fromkeys(record["distribution"] for record in records))
    fig, axes = plt.subplots(1, len(distributions), figsize=(5.2 * len(distributions), 4.0))
    axes = [axes] if len(distributions) == 1 else list(axes)
    for ax, distribution in zip(axes, distributions, strict=True):
        rows = sorted(
            (r for r in records if r["distribution"] == distribution),
            key=lambda r: r["buffer_size"],
        )
        sizes = [r["buffer_size"] for r in rows]
        for key, label, style, marker in SCHEMES:
            ax.plot(sizes, [r[key] for r in rows], style, marker=marker, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(size) for size in sizes])
        ax.set_ylim(0.4, 1.02)
        ax.set_xlabel("packing buffer size (samples)")
        ax.set_ylabel("bin fill (real tokens / capacity)")
        ax.set_title(TITLES.get(distribution, distribution), fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("Bin fill vs packing buffer size, capacity 8192", fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    # No software metadata, so the same figures give the same file.
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json",
        type=Path,
        help="figures written by benchmarks/bin_fill.py (default: run it into results/)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="PNG to write")
    args = parser.parse_args()

    source = args.json
    if source is None:
        source = HERE / "results" / "bin_fill.json"
        run_benchmark(source)
    records = json.loads(source.read_text())
    plot(records, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
