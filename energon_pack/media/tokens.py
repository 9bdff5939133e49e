"""A medium's vision tokens: the one place where a probed medium becomes token ids.

An image, and a video without timestamps, is one block ``<|vision_start|>`` + pads +
``<|vision_end|>``. A video with timestamps (``video_rule="qwen3_vl"``) is one block per
temporal patch, each preceded by the text ``<{t:.1f} seconds>``, as ``Qwen3VLProcessor`` of
transformers 4.57 (the release the Qwen3-VL checkpoints came with) writes it: the blocks replace
the template's ``<|vision_start|><|video_pad|><|vision_end|>`` whole. transformers 5.x keeps that
outer pair around the blocks; ``MediaConfig(video_outer_block=True)`` writes that form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from energon_pack.media.assembly import MediaItem
from energon_pack.media.config import MediaConfig

__all__ = ["VisionTokenIds", "timestamp_text", "vision_blocks", "vision_tokens"]


@dataclass(frozen=True)
class VisionTokenIds:
    """The tokenizer's ids of the vision special tokens."""

    vision_start: int
    vision_end: int
    image_pad: int
    video_pad: int


def timestamp_text(seconds: float) -> str:
    """The text before a temporal patch's block: ``<{seconds:.1f} seconds>``."""
    return f"<{seconds:.1f} seconds>"


def vision_blocks(item: MediaItem, cfg: MediaConfig) -> int:
    """``<|vision_start|>`` tokens (as many ``<|vision_end|>``) that :func:`vision_tokens` writes
    for ``item``."""
    if item.timestamps is None:
        return 1
    return len(item.timestamps) + int(cfg.video_outer_block)


def vision_tokens(
    item: MediaItem, ids: VisionTokenIds, text: Callable[[str], list[int]], cfg: MediaConfig
) -> list[int]:
    """The token ids of ``item``: its vision block(s) with ``t*h*w / merge_size**2`` pads in
    all (``merge_size`` of ``cfg``), timestamps tokenised by ``text`` (each on its own,
    between special tokens)."""
    pad = ids.image_pad if item.kind == "image" else ids.video_pad
    if item.timestamps is None:
        return [ids.vision_start, *[pad] * item.tokens, ids.vision_end]
    t, h, w = item.grid_thw
    if len(item.timestamps) != t:
        raise ValueError(
            f"medium {item.member!r} has {len(item.timestamps)} timestamps for a grid of {t} "
            "temporal patches; probe it with the config it is encoded with"
        )
    block = [ids.vision_start, *[pad] * (h * w // cfg.merge_size**2), ids.vision_end]
    out: list[int] = []
    for seconds in item.timestamps:
        out += text(timestamp_text(seconds)) + block
    if cfg.video_outer_block:
        out = [ids.vision_start, *out, ids.vision_end]
    return out
