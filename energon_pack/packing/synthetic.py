"""Seeded synthetic length streams that look like real training data (for demo and benchmarks)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

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


@dataclass(frozen=True)
class VisionSample:
    """One synthetic sample's size: tokens (vision tokens included), vision tokens, media."""

    length: int
    vision_tokens: int
    media: int


_ASPECTS = (1.0, 4 / 3, 3 / 2, 16 / 9, 3 / 4, 9 / 16)


def _image_tokens(rng: random.Random, edge: tuple[int, int]) -> int:
    """Qwen2.5-VL tokens of one image whose long edge is drawn from ``edge`` (28-px cells)."""
    long_edge = rng.uniform(*edge)
    aspect = rng.choice(_ASPECTS)
    width, height = (
        (long_edge, long_edge / aspect) if aspect >= 1 else (long_edge * aspect, long_edge)
    )
    return max(1, round(width / 28)) * max(1, round(height / 28))


def vision_mix(
    count: int,
    *,
    seed: int = 0,
    cap: int = 8192,
    image_share: float = 0.12,
    max_images: int = 8,
    edge: tuple[int, int] = (640, 1280),
    text_median: int = 550,
    small_images: int = 0,
    small_edge: tuple[int, int] = (224, 448),
) -> list[VisionSample]:
    """VLM SFT with uneven vision load: lognormal text (as :func:`text_sft_lengths`); a share
    of the samples carries 1 to ``max_images`` images (more images rarer) whose long edge is
    640-1280 px, each 2 tokens of markers plus its Qwen2-VL / Qwen2.5-VL tokens (28-px cells).
    With ``small_images``, each sample without large images carries 0 to ``small_images`` small
    images (long edge ``small_edge``; more images rarer, a median of 1 at 4): many samples with
    a few small images and a heavy tail of large ones. Images are dropped from a sample until it
    fits ``cap``."""
    rng = random.Random(seed)
    weights = [1 / k for k in range(1, max_images + 1)]
    small_weights = [1 / (k + 1) for k in range(small_images + 1)]
    out = []
    for _ in range(count):
        text = min(cap, 8 + int(rng.lognormvariate(math.log(text_median), 1.0)))
        images: list[int] = []
        if rng.random() < image_share:
            wanted = rng.choices(range(1, max_images + 1), weights)[0]
            images = [_image_tokens(rng, edge) for _ in range(wanted)]
        elif small_images:
            wanted = rng.choices(range(small_images + 1), small_weights)[0]
            images = [_image_tokens(rng, small_edge) for _ in range(wanted)]
        while images and text + sum(images) + 2 * len(images) > cap:
            images.pop()
        vision = sum(images)
        out.append(VisionSample(text + vision + 2 * len(images), vision, len(images)))
    return out
