"""Time build_packed_row: 64 sequences, 32,768 tokens in all, into one THD row (1 CPU thread).

Prints a table and writes benchmarks/results/layout.json. Target: best time < 2 ms.
Run: .venv/bin/python benchmarks/layout.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from energon_pack.cli.tables import format_table
from energon_pack.packing.row import build_packed_row

NUM_SEQUENCES = 64
TOTAL_TOKENS = 32768
REPEATS = 300
TARGET_MS = 2.0
RESULTS = Path(__file__).resolve().parent / "results" / "layout.json"


def make_sequences(kind: str) -> list[dict[str, Any]]:
    """64 sequences of varied lengths summing to exactly TOTAL_TOKENS."""
    generator = torch.Generator().manual_seed(0)
    weights = torch.rand(NUM_SEQUENCES, generator=generator) + 0.25
    lengths = (weights / weights.sum() * TOTAL_TOKENS).long().clamp(min=1)
    lengths[-1] += TOTAL_TOKENS - int(lengths.sum())
    sequences: list[dict[str, Any]] = []
    for length in lengths.tolist():
        ids = torch.randint(0, 150_000, (length,), generator=generator)
        mask = (torch.rand(length, generator=generator) < 0.7).float()
        if kind == "numpy":
            sequences.append({"input_ids": ids.numpy(), "loss_mask": mask.numpy()})
        else:
            sequences.append({"input_ids": ids, "loss_mask": mask})
    return sequences


CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("tensors, multiple 1", "tensor", {"seq_length": TOTAL_TOKENS}),
    (
        "tensors, multiple 8",
        "tensor",
        {"seq_length": TOTAL_TOKENS + 8 * 64, "pad_to_multiple_of": 8},
    ),
    (
        "tensors, multiple 8, fixed width + static cu_seqlens",
        "tensor",
        {
            "seq_length": 34816,
            "pad_to_multiple_of": 8,
            "pad_to_max_length": True,
            "pad_cu_seqlens": True,
            "max_segments": 128,
        },
    ),
    ("numpy, multiple 8", "numpy", {"seq_length": TOTAL_TOKENS + 8 * 64, "pad_to_multiple_of": 8}),
]


def main() -> None:
    torch.set_num_threads(1)
    rows = []
    results = []
    for name, kind, options in CASES:
        sequences = make_sequences(kind)
        build_packed_row(sequences, **options)  # warm-up
        times = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            build_packed_row(sequences, **options)
            times.append((time.perf_counter() - start) * 1e3)
        best, median = min(times), statistics.median(times)
        rows.append([name, f"{best:.3f}", f"{median:.3f}", "yes" if best < TARGET_MS else "NO"])
        results.append(
            {
                "case": name,
                "input": kind,
                "options": options,
                "sequences": NUM_SEQUENCES,
                "tokens": TOTAL_TOKENS,
                "repeats": REPEATS,
                "best_ms": best,
                "median_ms": median,
                "target_ms": TARGET_MS,
            }
        )
    print(
        f"build_packed_row: {NUM_SEQUENCES} sequences, {TOTAL_TOKENS} tokens, 1 thread, "
        f"best of {REPEATS}"
    )
    print(format_table(["case", "best ms", "median ms", f"< {TARGET_MS} ms"], rows))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
