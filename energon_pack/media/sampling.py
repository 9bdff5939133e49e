"""Video rules: which source frames are decoded, the patch grid they give, and the timestamps
written before each temporal patch (no torch: the decoder process loads this).

``MediaConfig.video_rule`` names the rule; :func:`video_rule` gives its object, so callers never
branch on the name. ``"qwen2_vl"`` follows ``Qwen2VLVideoProcessor`` (one vision block per
video); ``"qwen3_vl"`` follows ``Qwen3VLVideoProcessor`` and ``Qwen3VLProcessor`` (one block per
temporal patch, each after its ``<{t:.1f} seconds>`` text).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from energon_pack.media.config import (
    MediaConfig,
    VideoRuleName,
    smart_resize_video,
    video_grid,
)
from energon_pack.media.errors import MediaFailure

__all__ = ["Qwen2VideoRule", "Qwen3VideoRule", "VideoRule", "padded", "video_rule"]


class VideoRule(Protocol):
    """How a family samples, sizes and times the frames of a video."""

    def sample(self, total: int, fps: float, cfg: MediaConfig) -> list[int]:
        """Source frame indices to decode from a clip of ``total`` frames at ``fps``."""
        ...

    def grid(self, height: int, width: int, frames: int, cfg: MediaConfig) -> tuple[int, int, int]:
        """The patch grid ``(t, h, w)`` of ``frames`` sampled frames of that size."""
        ...

    def timestamps(
        self, indices: Sequence[int], fps: float, cfg: MediaConfig
    ) -> tuple[float, ...] | None:
        """Seconds written before each temporal patch's block, or None for one block."""
        ...


def padded(indices: Sequence[int], cfg: MediaConfig) -> list[int]:
    """``indices`` with the last repeated up to a multiple of ``temporal_patch_size``."""
    tp = cfg.temporal_patch_size
    return [*indices, *[indices[-1]] * (-len(indices) % tp)]


@dataclass(frozen=True)
class Qwen2VideoRule:
    """``Qwen2VLVideoProcessor``: ``video_fps`` frames a second in ``[video_min_frames,
    video_max_frames]``, rounded down to a multiple of ``temporal_patch_size``, at evenly
    stepped indices; each frame sized within ``[video_min_pixels, video_max_pixels]`` and all
    under ``video_total_pixels``; no timestamps."""

    def sample(self, total: int, fps: float, cfg: MediaConfig) -> list[int]:
        tp = cfg.temporal_patch_size
        cap = math.floor(min(cfg.video_max_frames, total) / tp) * tp
        wanted = min(max(total / fps * cfg.video_fps, cfg.video_min_frames), cap, total)
        frames = max(tp, math.floor(wanted / tp) * tp)  # short clips repeat frames
        return [i * total // frames for i in range(frames)]

    def grid(self, height: int, width: int, frames: int, cfg: MediaConfig) -> tuple[int, int, int]:
        used = math.ceil(frames / cfg.temporal_patch_size) * cfg.temporal_patch_size
        return video_grid(height, width, used, cfg)

    def timestamps(
        self, indices: Sequence[int], fps: float, cfg: MediaConfig
    ) -> tuple[float, ...] | None:
        return None


@dataclass(frozen=True)
class Qwen3VideoRule:
    """``Qwen3VLVideoProcessor``: ``n = int(total / fps * video_fps)`` clamped to
    ``[video_min_frames, video_max_frames]`` and to ``total``, indices ``linspace(0, total - 1,
    n)`` rounded; ``smart_resize`` over ``t*h*w`` within ``[video_min_pixels,
    video_total_pixels]``; a temporal patch's timestamp is the mean of its first and last
    frame's index over the source fps (``Qwen3VLProcessor``).

    A single frame (which transformers refuses) is sized as ``temporal_patch_size`` frames, the
    count it is padded to.
    """

    def sample(self, total: int, fps: float, cfg: MediaConfig) -> list[int]:
        n = int(total / fps * cfg.video_fps)
        n = min(max(n, cfg.video_min_frames), cfg.video_max_frames, total)
        return [int(i) for i in np.linspace(0, total - 1, n).round().astype(int)]

    def grid(self, height: int, width: int, frames: int, cfg: MediaConfig) -> tuple[int, int, int]:
        tp = cfg.temporal_patch_size
        try:
            rh, rw = smart_resize_video(
                max(frames, tp),
                height,
                width,
                temporal_factor=tp,
                factor=cfg.factor,
                min_pixels=cfg.video_min_pixels,
                max_pixels=cfg.video_total_pixels,
            )
        except ValueError as exc:
            raise MediaFailure("aspect_ratio", str(exc)) from exc
        return math.ceil(frames / tp), rh // cfg.patch_size, rw // cfg.patch_size

    def timestamps(
        self, indices: Sequence[int], fps: float, cfg: MediaConfig
    ) -> tuple[float, ...] | None:
        tp = cfg.temporal_patch_size
        seconds = [index / fps for index in padded(indices, cfg)]
        return tuple((seconds[i] + seconds[i + tp - 1]) / 2 for i in range(0, len(seconds), tp))


_RULES: dict[VideoRuleName, VideoRule] = {
    "qwen2_vl": Qwen2VideoRule(),
    "qwen3_vl": Qwen3VideoRule(),
}


def video_rule(cfg: MediaConfig) -> VideoRule:
    """The rule object of ``cfg.video_rule``."""
    return _RULES[cfg.video_rule]
