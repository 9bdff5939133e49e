"""Qwen2-VL-style pixel processing: decoded levels -> model-ready patches, normalisation.

Conventions match ``transformers``' ``Qwen2VLImageProcessorPil``: RGB conversion (transparency
composited on white), bicubic resize to :func:`~energon_pack.media.smart_resize` dimensions,
rescale by 1/255, CLIP normalisation, and a patch layout
``[grid_t * grid_h * grid_w, 3 * temporal_patch * p * p]``. A still image is repeated to
``temporal_patch_size`` frames (``grid_t == 1``). Grids are returned as ``long`` tensors of shape
``[1, 3]`` so that they concatenate to ``[num_media, 3]``.

Normalisation gives transformers' values bit for bit (float64 rescale, then float32 normalise):
pixels are uint8, so every value is one of 256 per channel. The worker patchifies the uint8
pixels, then normalises the contiguous patches in place in float32. With
``MediaConfig(pixel_dtype="uint8")`` the patches stay uint8 (4x smaller) and the training step
turns them into the very same values with :func:`normalize_pixels`, one gather from a 256-entry
table per channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from energon_pack.media.config import DEFAULT_CONFIG, RESCALE_FACTOR, MediaConfig
from energon_pack.media.decode import (
    decode_image_levels,
    decode_video_levels,
    patch_levels,
    resized_frames,
)
from energon_pack.media.errors import MediaFailure, naming
from energon_pack.media.guard import FramesJob, UInt8Array, alloc_in_process, guarded_decode_each
from energon_pack.media.probe import Frames, frames_plan

__all__ = [
    "decode_patches",
    "frames_patches",
    "normalize_pixels",
    "patches",
    "process_frames",
    "process_image",
    "process_video",
]

E = TypeVar("E")

_NORMALIZE_ROWS = 256
"""Patch rows normalised at a time (about 1.2 MB of float32 at the default patch size)."""


def process_image(
    data: bytes,
    config: MediaConfig | None = None,
    *,
    key: str = "?",
    member: str = "?",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode, resize, normalise and patchify an image.

    Returns ``pixel_values [t*h*w, 3*temporal_patch*p*p]`` (float32, or uint8 and not
    normalised with ``pixel_dtype="uint8"``) and ``image_grid_thw [1, 3]``. With ``out`` (a
    ``[t*h*w, patch_dim]`` tensor of that dtype, e.g. a slice of a packed row's buffer) the
    patches are written there and ``out`` is returned.
    """
    cfg = config or DEFAULT_CONFIG
    job = FramesJob((data, cfg), key, member)
    [(pixels, grid)] = decode_patches(decode_image_levels, [job], cfg, [out])
    return pixels, torch.tensor([list(grid)], dtype=torch.long)


def process_video(
    data: bytes,
    config: MediaConfig | None = None,
    *,
    key: str = "?",
    member: str = "?",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Decode sampled frames, resize, normalise and patchify a video.

    Returns ``pixel_values_videos [t*h*w, 3*temporal_patch*p*p]`` (float32, or uint8 with
    ``pixel_dtype="uint8"``), ``video_grid_thw [1, 3]`` and ``second_per_grid_t`` (seconds per
    temporal patch). ``out`` works as in :func:`process_image`.
    """
    cfg = config or DEFAULT_CONFIG
    job = FramesJob((data, cfg), key, member)
    [(pixels, plan)] = decode_patches(decode_video_levels, [job], cfg, [out])
    grid = torch.tensor([list(plan.grid_thw)], dtype=torch.long)
    return pixels, grid, plan.second_per_grid_t


def process_frames(
    frames: Frames,
    kind: Literal["image", "video"],
    config: MediaConfig | None = None,
    *,
    key: str = "?",
    member: str = "?",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Resize, normalise and patchify decoded frames (grid as
    :func:`~energon_pack.media.probe_frames` says).

    Same pixels as :func:`process_image` / :func:`process_video` give for the same RGB frames.
    Returns (or writes into ``out``) ``[t*h*w, patch_dim]`` of ``cfg.pixel_dtype``.
    """
    with naming(key, member):
        return frames_patches(frames, kind, config or DEFAULT_CONFIG, out)


def decode_patches(
    decode: Callable[..., tuple[UInt8Array, E]],
    jobs: Sequence[FramesJob],
    cfg: MediaConfig,
    outs: Sequence[torch.Tensor | None],
) -> list[tuple[torch.Tensor, E]]:
    """The patches of each job's ``decode(*job.args, alloc)`` (written into ``outs[i]`` where
    given) and what else ``decode`` returns; decoded in the decoder process (see
    :mod:`energon_pack.media.guard`), failures name the job's sample (an unexpected one is kind
    ``corrupt``)."""
    decoded: list[tuple[torch.Tensor, E]] = []

    def use(index: int, levels: UInt8Array, extra: E) -> None:
        decoded.append((patches(levels, cfg, outs[index]), extra))

    guarded_decode_each(decode, jobs, cfg, use=use)
    return decoded


def frames_patches(
    frames: Frames, kind: Literal["image", "video"], cfg: MediaConfig, out: torch.Tensor | None
) -> torch.Tensor:
    """:func:`process_frames`, its failures not yet named."""
    gt, gh, gw = frames_plan(frames, kind, cfg).grid_thw
    resized = resized_frames(frames.array(), (gw * cfg.patch_size, gh * cfg.patch_size))
    wanted = gt * cfg.temporal_patch_size
    if 1 < len(resized) < wanted:  # a clip padded with its last frame (a still is repeated)
        resized += [resized[-1]] * (wanted - len(resized))
    return patches(patch_levels(resized, cfg, alloc_in_process), cfg, out)


def normalize_pixels(
    pixels: torch.Tensor,
    config: MediaConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """uint8 patches (``pixel_dtype="uint8"``) -> the values of the float32 path, in ``dtype``.

    ``pixels`` is ``pixel_values`` or ``pixel_values_videos`` ``[P, patch_dim]`` uint8; the
    result is ``[P, patch_dim]`` on ``device`` (default: where ``pixels`` are), equal to what
    ``pixel_dtype="float32"`` gives (cast to ``dtype``). The uint8 tensor moves to the device
    first (4x fewer bytes), then one gather from the per-channel table makes the values.
    """
    if pixels.dtype != torch.uint8 or pixels.ndim != 2 or pixels.shape[1] != config.patch_dim:
        raise ValueError(
            f"normalize_pixels takes uint8 patches [P, {config.patch_dim}] (patch_dim of the "
            f"given MediaConfig), got {pixels.dtype} {tuple(pixels.shape)}; pass the "
            "pixel_values of MediaConfig(pixel_dtype='uint8') with the same MediaConfig"
        )
    target = torch.device(device) if device is not None else pixels.device
    table = torch.from_numpy(_normalization_table(config.image_mean, config.image_std))
    table = table.to(device=target, dtype=dtype).flatten()  # channel c, level x at 256*c + x
    index = pixels.to(target, non_blocking=True).to(torch.int32).view(pixels.shape[0], 3, -1)
    index.add_(torch.arange(0, 3 * 256, 256, dtype=torch.int32, device=target).view(1, 3, 1))
    return torch.index_select(table, 0, index.flatten()).view(pixels.shape)


def patches(levels: UInt8Array, cfg: MediaConfig, out: torch.Tensor | None) -> torch.Tensor:
    """uint8 patch levels (:func:`~energon_pack.media.decode.patch_levels`) -> patches of
    ``cfg.pixel_dtype``.

    Always writes a new tensor (or ``out``, which must hold exactly those patches, else a
    ``corrupt`` :class:`~energon_pack.media.errors.MediaFailure`): ``levels`` may be a view of
    the decoder's shared block. A still's temporal repeat is a copy of whole ``p*p`` runs.
    float32 values are ``x / 255``, ``- mean``, ``/ std`` in float32, made in place in the
    output (a still's first temporal copy): ``x / 255`` in float32 equals transformers'
    float32(float64(x) * (1/255)) for every 8-bit level and the mean/std steps are the same
    float32 operations, so the values are those of :func:`_normalization_table` (checked level
    by level in the tests). The three passes run on :data:`_NORMALIZE_ROWS` rows at a time,
    which stay in the CPU cache.
    """
    rows = levels.shape[0]
    repeat = cfg.patch_dim // levels.shape[1]
    out = _checked_out(out, rows, cfg)
    if out is None:
        out = torch.empty((rows, cfg.patch_dim), dtype=cfg.torch_pixel_dtype)
    by_channel = torch.from_numpy(levels).view(rows, 3, 1, -1)
    by_repeat = out.view(rows, 3, repeat, -1)
    if cfg.pixel_dtype == "uint8":
        by_repeat.copy_(by_channel.expand(-1, -1, repeat, -1))
        return out
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(cfg.image_std, dtype=torch.float32).view(1, 3, 1, 1)
    for start in range(0, rows, _NORMALIZE_ROWS):
        stop = min(start + _NORMALIZE_ROWS, rows)
        first = by_repeat[start:stop, :, :1]  # a still's other temporal copies follow it
        torch.div(by_channel[start:stop], 255.0, out=first).sub_(mean).div_(std)
        if repeat > 1:
            by_repeat[start:stop, :, 1:].copy_(first.expand(-1, -1, repeat - 1, -1))
    return out


# --- internals ------------------------------------------------------------------------------


def _checked_out(out: torch.Tensor | None, rows: int, cfg: MediaConfig) -> torch.Tensor | None:
    if out is None or (out.shape == (rows, cfg.patch_dim) and out.dtype == cfg.torch_pixel_dtype):
        return out
    raise MediaFailure(
        "corrupt",
        f"decodes to {rows} patches of {cfg.patch_dim} values but its slot holds "
        f"{tuple(out.shape)} {out.dtype}; the probe and the decode disagree (same MediaConfig?)",
    )


@cache
def _normalization_table(
    mean: tuple[float, ...], std: tuple[float, ...]
) -> np.ndarray[Any, np.dtype[np.float32]]:
    """``[C, 256]`` float32: the normalised value of every 8-bit level, per channel.

    Rounded like transformers: rescale in float64, cast to float32, then ``(x - mean) / std``
    in float32 with float32 mean/std.
    """
    levels = (np.arange(256, dtype=np.float64) * RESCALE_FACTOR).astype(np.float32)
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    table: np.ndarray[Any, np.dtype[np.float32]] = (levels[None, :] - mean32) / std32
    return table
