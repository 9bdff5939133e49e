"""Header-only probing: the patch grid and token count of a medium before any pixel is decoded.

:func:`probe_image` and :func:`probe_video` read only the container/image header, so a packing
buffer can hold compressed bytes and decode only the samples it selected; :func:`probe_frames`
sizes already decoded :class:`Frames`. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from PIL import Image

from energon_pack.media.audio import AUDIO_EXTENSIONS
from energon_pack.media.config import (
    DEFAULT_CONFIG,
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    ImageProbe,
    MediaConfig,
    MediaKind,
    VideoProbe,
    image_grid,
    token_count,
)
from energon_pack.media.decode import (
    displayed_size,
    exif_transpose_method,
    open_image,
    read_video_probe,
    to_rgb,
)
from energon_pack.media.errors import MediaError, MediaFailure, media_errors, naming
from energon_pack.media.guard import guarded_read
from energon_pack.media.sampling import video_rule

__all__ = [
    "Frames",
    "FramesPlan",
    "check_media_count",
    "frames_plan",
    "image_frames",
    "media_kind",
    "probe_frames",
    "probe_image",
    "probe_video",
]


def media_kind(member: str) -> MediaKind | None:
    """``"image"`` / ``"video"`` / ``"audio"`` from a member name's last extension, else
    ``None``."""
    ext = member.rsplit(".", 1)[-1].lower()
    if ext in IMAGE_EXTENSIONS:
        return "image"
    if ext in VIDEO_EXTENSIONS:
        return "video"
    if ext in AUDIO_EXTENSIONS:
        return "audio"
    return None


def check_media_count(key: str, count: int, config: MediaConfig | None = None) -> None:
    """Raise :class:`MediaError` when a sample has more media than ``max_images_per_sample``."""
    cfg = config or DEFAULT_CONFIG
    if count > cfg.max_images_per_sample:
        raise MediaError(
            key,
            "*",
            "too_many",
            f"{count} media members exceed max_images_per_sample={cfg.max_images_per_sample}; "
            "split the sample or raise MediaConfig.max_images_per_sample",
        )


def probe_image(
    data: bytes, config: MediaConfig | None = None, *, key: str = "?", member: str = "?"
) -> ImageProbe:
    """Size, grid and token count of an image from its header; pixels are not decoded.

    The size is that of the image as displayed: EXIF orientations 5-8 swap width and height,
    as transformers' ``load_image`` (Pillow's ``exif_transpose``) turns the pixels.
    """
    cfg = config or DEFAULT_CONFIG
    with media_errors(key, member, "unreadable"):
        with open_image(data, cfg) as img:
            width, height = displayed_size(img, exif_transpose_method(img))
        grid = image_grid(height, width, cfg)
    return ImageProbe(width, height, grid, token_count(grid, cfg))


def probe_video(
    data: bytes, config: MediaConfig | None = None, *, key: str = "?", member: str = "?"
) -> VideoProbe:
    """Frame count, fps, size, grid and token count of a video without decoding pixels.

    decord gives the frame count and average fps from the demuxed index; the frame size comes
    from the MP4/MOV ``stsd`` sample entry, swapped for a 90/270-degree display matrix since
    decord turns such frames upright (falls back to decoding one frame for containers without
    one). An MP4 with several video tracks is ``unsupported``.
    """
    return guarded_read(read_video_probe, data, config or DEFAULT_CONFIG, key=key, member=member)


# --- decoded frames (datasets that store pixel arrays, e.g. Megatron-Bridge's Qwen-VL layout) --


@dataclass(frozen=True)
class Frames:
    """Already decoded RGB pixels of one image or video: ``[T, H, W, 3]`` uint8 as raw bytes.

    An image is one frame. Kept as bytes (not patches) until a pack is chosen, like a
    compressed member; :func:`probe_frames` reads only the shape. ``fps`` is the rate the
    frames of a video were sampled at (they are all used); a rule that writes timestamps
    (``video_rule="qwen3_vl"``) needs it, others take ``MediaConfig.video_fps``.
    """

    data: bytes
    shape: tuple[int, int, int, int]
    fps: float | None = None

    @classmethod
    def from_array(cls, array: np.ndarray[Any, Any], fps: float | None = None) -> Frames:
        """From a ``[T, H, W, 3]`` uint8 array (copied into bytes), sampled at ``fps``."""
        frames = np.ascontiguousarray(array, dtype=np.uint8)
        t, h, w, c = frames.shape
        return cls(frames.tobytes(), (t, h, w, c), fps)

    def array(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The ``[T, H, W, 3]`` uint8 view of :attr:`data`."""
        return np.frombuffer(self.data, dtype=np.uint8).reshape(self.shape)


def image_frames(image: Image.Image) -> Frames:
    """A decoded PIL image as :class:`Frames`, converted to RGB and turned upright by its EXIF
    orientation as :func:`~energon_pack.media.process_image` does (transparency composited on
    white), so it gives the same pixels as its file."""
    rgb = to_rgb(image)
    method = exif_transpose_method(image)
    return Frames.from_array(np.asarray(rgb if method is None else rgb.transpose(method))[None])


def probe_frames(
    frames: Frames,
    kind: Literal["image", "video"],
    config: MediaConfig | None = None,
    *,
    key: str = "?",
    member: str = "?",
) -> FramesPlan:
    """Grid ``(t, h, w)``, token count, seconds per temporal patch and timestamps of decoded
    frames.

    An image is sized like :func:`probe_image`. A video's frames are taken as already sampled
    (all are used; the last is repeated up to a multiple of ``temporal_patch_size``, as
    transformers does) at ``frames.fps`` (else ``video_frames_fps``, else ``video_fps``, which
    a rule with timestamps refuses), sized and timed by the
    config's video rule (:mod:`energon_pack.media.sampling`) as :func:`probe_video` does.
    """
    with naming(key, member):
        return frames_plan(frames, kind, config or DEFAULT_CONFIG)


@dataclass(frozen=True)
class FramesPlan:
    """What :func:`probe_frames` tells of decoded frames (the last two for videos only)."""

    grid_thw: tuple[int, int, int]
    tokens: int
    second_per_grid_t: float | None = None
    timestamps: tuple[float, ...] | None = None


def frames_plan(frames: Frames, kind: Literal["image", "video"], cfg: MediaConfig) -> FramesPlan:
    """:func:`probe_frames`, its failures not yet named."""
    count, height, width, channels = frames.shape
    if channels != 3 or min(frames.shape) <= 0 or len(frames.data) != math.prod(frames.shape):
        raise MediaFailure("bad_sample", f"frames of shape {frames.shape}; expected [T, H, W, 3]")
    if width * height > cfg.max_image_pixels:
        raise MediaFailure(
            "too_large", f"{width}x{height} pixels exceed max_image_pixels={cfg.max_image_pixels}"
        )
    if kind == "image":
        if count != 1:
            raise MediaFailure("bad_sample", f"an image with {count} frames")
        grid = image_grid(height, width, cfg)
        return FramesPlan(grid, token_count(grid, cfg))
    tp = cfg.temporal_patch_size
    if math.ceil(count / tp) * tp > cfg.video_max_frames:
        raise MediaFailure(
            "too_long",
            f"{count} frames exceed video_max_frames={cfg.video_max_frames}; sample fewer frames "
            "or raise MediaConfig.video_max_frames",
        )
    rule = video_rule(cfg)
    grid = rule.grid(height, width, count, cfg)
    given = frames.fps if frames.fps is not None else cfg.video_frames_fps
    fps = cfg.video_fps if given is None else given
    timestamps = rule.timestamps(range(count), fps, cfg)
    if timestamps is not None and given is None:
        raise MediaFailure(
            "bad_sample",
            f"decoded video frames without their fps; video_rule={cfg.video_rule!r} writes "
            "each temporal patch's timestamp, which needs it: pass Frames(..., fps=...) or "
            "MediaConfig(video_frames_fps=...) (the rate the frames were sampled at)",
        )
    return FramesPlan(grid, token_count(grid, cfg), tp / fps, timestamps)
