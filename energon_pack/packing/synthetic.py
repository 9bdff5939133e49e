"""Seeded synthetic length streams that look like real training data (for demo and benchmarks)."""

from __future__ import annotations

import math
import random

DISTRIBUTIONS = ("vlm", "text_sft")


def text_sft_lengths(count: int, *, seed: int = 0, cap: int = 8192) -> list[int]:
    """Text SFT: lognormal token counts, mean about 900, long right tail, clipped to ``cap``."""
    rng = random.Random(seed)
    return [min(cap, 8 + int(rng.lognormvariate(math.log(550), 1.0))) for _ in range(count)]


def vlm_lengths(count: int, *, seed: int = 0, cap: int = 8192) -> list[int]:
    """VLM SFT: lognormal text (mean about 900) plus 0-2 images of 64-1600 tokens each
    (log-uniform), mean about 1400 tokens per sample, clipped to ``cap``."""
    rng = random.Random(seed)
    lo, hi = math.log(64), math.log(1600)
    lengths = []
    for _ in range(count):
        tokens = 16 + int(rng.lognormvariate(math.log(600), 0.9))
        for _ in range(rng.randrange(3)):
            tokens += int(math.exp(rng.uniform(lo, hi)))
        lengths.append(min(cap, tokens))
    return lengths


def lengths_for(distribution: str, count: int, *, seed: int = 0, cap: int = 8192) -> list[int]:
    """Lengths of one of :data:`DISTRIBUTIONS`."""
    if distribution == "vlm":
        return vlm_lengths(count, seed=seed, cap=cap)
    if distribution == "text_sft":
        return text_sft_lengths(count, seed=seed, cap=cap)
    raise ValueError(f"unknown length distribution {distribution!r}; choose one of {DISTRIBUTIONS}")
