"""Qwen2-VL-style image and video preprocessing with header-only probing.

Probing (:func:`probe_image`, :func:`probe_video`) reads only the container/image header and
returns the patch grid and the token count, so a packing buffer can hold compressed bytes and
decode (:func:`process_image`, :func:`process_video`) only the samples it selected.

Conventions match ``transformers``' ``Qwen2VLImageProcessorPil``: RGB conversion (transparency
composited on white), bicubic resize to :func:`smart_resize` dimensions, rescale by 1/255, CLIP
normalisation, and a patch layout ``[grid_t * grid_h * grid_w, 3 * temporal_patch * p * p]``.
A still image is repeated to ``temporal_patch_size`` frames (``grid_t == 1``). Grids are returned
as ``long`` tensors of shape ``[1, 3]`` so that they concatenate to ``[num_media, 3]``.
"""

from __future__ import annotations

import io
import logging
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import decord
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from energon_pack.media_guard import Isolation, guarded, media_errors

__all__ = [
    "IMAGE_EXTENSIONS",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "VIDEO_EXTENSIONS",
    "ImageProbe",
    "MediaConfig",
    "MediaError",
    "MediaErrorKind",
    "MediaFootprint",
    "VideoProbe",
    "check_media_count",
    "footprint",
    "media_kind",
    "probe_image",
    "probe_video",
    "process_image",
    "process_video",
    "smart_resize",
    "tensor_nbytes",
]

logger = logging.getLogger("energon_pack.media")

OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
IMAGE_EXTENSIONS: frozenset[str] = frozenset({"jpg", "jpeg", "png", "webp"})
VIDEO_EXTENSIONS: frozenset[str] = frozenset({"mp4"})

MediaErrorKind = Literal[
    "empty",  # zero-byte member
    "unreadable",  # header cannot be parsed (not an image / video)
    "corrupt",  # header parsed but pixel decoding failed (e.g. truncated file)
    "too_large",  # declared pixel count above the bomb guard
    "aspect_ratio",  # aspect ratio above 200 (smart_resize limit)
    "too_many",  # more media in one sample than allowed
    "too_long",  # video longer than the frame / duration limit
    "unsupported",  # member extension is not a known image/video type
    "bad_sample",  # sample JSON missing or malformed
    "crashed",  # the decoder died (e.g. SIGSEGV / SIGABRT in decord) on this member
    "timeout",  # the decoder did not finish within decode_timeout_s
    "placeholder_mismatch",  # <image>/<video> placeholders do not match the media members
]


class MediaError(ValueError):
    """A sample's media cannot be used; the message names the sample key, member and cause."""

    def __init__(self, key: str, member: str, kind: MediaErrorKind, cause: str) -> None:
        super().__init__(f"sample {key!r}, member {member!r}: {cause} [{kind}]")
        self.key = key
        self.member = member
        self.kind: MediaErrorKind = kind
        self.cause = cause

    def __reduce__(self) -> tuple[type[MediaError], tuple[str, str, MediaErrorKind, str]]:
        return type(self), (self.key, self.member, self.kind, self.cause)


@dataclass(frozen=True)
class MediaConfig:
    """Preprocessing settings and limits; defaults follow the Qwen2-VL processors.

    Image sizing uses ``min_pixels``/``max_pixels`` (``Qwen2VLImageProcessor``). Videos are sampled
    at ``video_fps`` within ``[video_min_frames, video_max_frames]`` (rounded down to a multiple of
    ``temporal_patch_size``) and each frame is resized within ``[video_min_pixels,
    video_max_pixels]``, further capped so that all frames together stay under
    ``video_total_pixels`` (``Qwen2VLVideoProcessor`` with ``cap_pixels_per_frame=True``).
    Limits reject a sample before decoding: ``max_image_pixels`` (decoded-size bomb guard, also
    applied to video frames), ``max_images_per_sample``, ``max_video_source_frames`` and
    ``max_video_seconds``.

    ``decode_isolation="process"`` (default) runs decord and Pillow's pixel decoding in a helper
    process (:mod:`energon_pack.media_guard`), so a native crash or a hang past
    ``decode_timeout_s`` becomes a :class:`MediaError` (``crashed`` / ``timeout``) instead of
    killing the run; ``"off"`` decodes in the calling process. ``max_json_bytes`` and
    ``max_json_depth`` bound the parsing of a sample's JSON member.
    """

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    video_total_pixels: int = int(128000 * 28 * 28 * 0.9)
    max_image_pixels: int = 8192 * 8192
    max_images_per_sample: int = 32
    max_video_source_frames: int = 64 * 1024
    max_video_seconds: float = 3600.0
    decode_isolation: Isolation = "process"
    decode_timeout_s: float = 60.0
    max_json_bytes: int = 16 * 2**20
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        positive = {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "video_fps": self.video_fps,
            "video_min_frames": self.video_min_frames,
            "video_max_frames": self.video_max_frames,
            "video_min_pixels": self.video_min_pixels,
            "video_max_pixels": self.video_max_pixels,
            "video_total_pixels": self.video_total_pixels,
            "max_image_pixels": self.max_image_pixels,
            "max_images_per_sample": self.max_images_per_sample,
            "max_video_source_frames": self.max_video_source_frames,
            "max_video_seconds": self.max_video_seconds,
            "decode_timeout_s": self.decode_timeout_s,
            "max_json_bytes": self.max_json_bytes,
            "max_json_depth": self.max_json_depth,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"MediaConfig.{name} must be > 0, got {value}")
        if self.decode_isolation not in ("process", "off"):
            raise ValueError(
                f"MediaConfig.decode_isolation must be 'process' or 'off', got "
                f"{self.decode_isolation!r}"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"MediaConfig.min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})"
            )
        if self.video_min_pixels > self.video_max_pixels:
            raise ValueError(
                f"MediaConfig.video_min_pixels ({self.video_min_pixels}) exceeds "
                f"video_max_pixels ({self.video_max_pixels})"
            )
        if self.video_max_frames < self.temporal_patch_size:
            raise ValueError(
                f"MediaConfig.video_max_frames ({self.video_max_frames}) must be at least "
                f"temporal_patch_size ({self.temporal_patch_size})"
            )

    @property
    def factor(self) -> int:
        """Side multiple of resized media: ``patch_size * merge_size``."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per patch row: ``3 * temporal_patch_size * patch_size**2``."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size


_DEFAULT = MediaConfig()
# Pillow formats tried on an image member: what web data really holds (misnamed extensions
# included), not the dozens of rare formats whose parsers would see untrusted bytes.
_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


@dataclass(frozen=True)
class ImageProbe:
    """Header facts of an image: source size, patch grid ``(t, h, w)`` and LLM token count."""

    width: int
    height: int
    grid_thw: tuple[int, int, int]
    tokens: int


@dataclass(frozen=True)
class VideoProbe:
    """Metadata facts of a video: source and sampled frames, grid ``(t, h, w)``, token count.

    ``frames`` is the sampled frame count (a multiple of ``temporal_patch_size``), ``fps`` the
    source average frame rate, ``second_per_grid_t`` the seconds covered by one temporal patch.
    """

    frames: int
    fps: float
    width: int
    height: int
    grid_thw: tuple[int, int, int]
    tokens: int
    source_frames: int
    duration: float
    second_per_grid_t: float


@dataclass(frozen=True)
class MediaFootprint:
    """Bytes held before (compressed member) and after (processed tensors) decoding."""

    compressed_bytes: int
    processed_bytes: int

    @property
    def ratio(self) -> float:
        """``compressed_bytes / processed_bytes`` (about 0.01 for a 720p JPEG)."""
        return self.compressed_bytes / self.processed_bytes if self.processed_bytes else 0.0


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """Qwen2-VL target ``(height, width)``: multiples of ``factor`` within the pixel bounds.

    Same results as ``transformers``' ``smart_resize``; raises ``ValueError`` for non-positive
    sizes or an aspect ratio above 200.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got height={height}, width={width}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            "absolute aspect ratio must be smaller than 200, got "
            f"{max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def media_kind(member: str) -> Literal["image", "video"] | None:
    """``"image"``/``"video"`` from a member name's last extension, else ``None``."""
    ext = member.rsplit(".", 1)[-1].lower()
    if ext in IMAGE_EXTENSIONS:
        return "image"
    if ext in VIDEO_EXTENSIONS:
        return "video"
    return None


def check_media_count(key: str, count: int, config: MediaConfig | None = None) -> None:
    """Raise :class:`MediaError` when a sample has more media than ``max_images_per_sample``."""
    cfg = config or _DEFAULT
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
    """Size, grid and token count of an image from its header; pixels are not decoded."""
    cfg = config or _DEFAULT
    with media_errors(key, member, "unreadable"), _open_image(data, cfg, key, member) as img:
        width, height = img.size
    grid = _image_grid(height, width, cfg, key, member)
    return ImageProbe(width, height, grid, _tokens(grid, cfg))


def process_image(
    data: bytes,
    config: MediaConfig | None = None,
    *,
    key: str = "?",
    member: str = "?",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode, resize, normalise and patchify an image.

    Returns ``pixel_values [t*h*w, 3*temporal_patch*p*p] float32`` and ``image_grid_thw [1, 3]``.
    With ``out`` (a float32 ``[t*h*w, patch_dim]`` tensor, e.g. a slice of a packed row's
    buffer) the patches are written there and ``out`` is returned.
    """
    cfg = config or _DEFAULT
    (rgb,) = _guarded(_decode_image, data, cfg, key, member, kind="corrupt")
    gh, gw = rgb.shape[0] // cfg.patch_size, rgb.shape[1] // cfg.patch_size
    frame = torch.from_numpy(rgb).permute(2, 0, 1)
    normalized = _normalize(frame.unsqueeze(0), cfg)  # a still: one frame, repeated as a view
    still = normalized.expand(cfg.temporal_patch_size, -1, -1, -1)
    pixels = _patchify(still, cfg, _checked_out(out, gh * gw, cfg, key, member))
    return pixels, torch.tensor([[1, gh, gw]], dtype=torch.long)


def probe_video(
    data: bytes, config: MediaConfig | None = None, *, key: str = "?", member: str = "?"
) -> VideoProbe:
    """Frame count, fps, size, grid and token count of a video without decoding pixels.

    decord gives the frame count and average fps from the demuxed index; the frame size comes
    from the MP4/MOV ``stsd`` sample entry (falls back to decoding one frame for containers
    without one).
    """
    cfg = config or _DEFAULT
    probe: VideoProbe = _guarded(_probe_video, data, cfg, key, member, kind="unreadable")
    return probe


def process_video(
    data: bytes,
    config: MediaConfig | None = None,
    *,
    key: str = "?",
    member: str = "?",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Decode sampled frames, resize, normalise and patchify a video.

    Returns ``pixel_values_videos [t*h*w, 3*temporal_patch*p*p] float32``,
    ``video_grid_thw [1, 3]`` and ``second_per_grid_t`` (seconds per temporal patch).
    """
    cfg = config or _DEFAULT
    resized, plan = _guarded(_decode_video, data, cfg, key, member, kind="corrupt")
    frames = torch.from_numpy(resized).permute(0, 3, 1, 2)
    rows = plan.grid_thw[0] * plan.grid_thw[1] * plan.grid_thw[2]
    pixels = _patchify(_normalize(frames, cfg), cfg, _checked_out(out, rows, cfg, key, member))
    grid = torch.tensor([list(plan.grid_thw)], dtype=torch.long)
    return pixels, grid, plan.second_per_grid_t


def tensor_nbytes(*tensors: torch.Tensor) -> int:
    """Bytes held by the given tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def footprint(data: bytes, *tensors: torch.Tensor) -> MediaFootprint:
    """Compressed size of ``data`` versus the bytes of its processed tensors."""
    return MediaFootprint(len(data), tensor_nbytes(*tensors))


# --- internals ------------------------------------------------------------------------------


def _guarded(fn: Any, data: bytes, cfg: MediaConfig, key: str, member: str, kind: Any) -> Any:
    """``fn(data, cfg, key, member)`` in the decoder process (see :mod:`media_guard`)."""
    return guarded(
        fn,
        data,
        cfg,
        key,
        member,
        key=key,
        member=member,
        kind=kind,
        isolation=cfg.decode_isolation,
        timeout_s=cfg.decode_timeout_s,
    )


def _decode_image(
    data: bytes, cfg: MediaConfig, key: str, member: str
) -> tuple[np.ndarray[Any, np.dtype[np.uint8]]]:
    """RGB uint8 ``[H, W, 3]`` resized to the probed grid (runs in the decoder process)."""
    with _open_image(data, cfg, key, member) as img:
        width, height = img.size
        _, gh, gw = _image_grid(height, width, cfg, key, member)
        try:
            rgb = _to_rgb(img)
            resized = rgb.resize(
                (gw * cfg.patch_size, gh * cfg.patch_size), Image.Resampling.BICUBIC
            )
        except (OSError, ValueError, SyntaxError) as exc:
            raise MediaError(key, member, "corrupt", f"cannot decode image: {exc}") from exc
    return (np.array(resized, dtype=np.uint8),)


def _probe_video(data: bytes, cfg: MediaConfig, key: str, member: str) -> VideoProbe:
    """:func:`probe_video` (runs in the decoder process)."""
    reader = _open_video(data, key, member)
    width, height = _video_size(reader, data, key, member)
    return _video_plan(reader, width, height, cfg, key, member)


def _decode_video(
    data: bytes, cfg: MediaConfig, key: str, member: str
) -> tuple[np.ndarray[Any, np.dtype[np.uint8]], VideoProbe]:
    """Sampled frames, RGB uint8 ``[T, H, W, 3]`` resized to the probed grid, and the plan
    (runs in the decoder process)."""
    reader = _open_video(data, key, member)
    width, height = _video_size(reader, data, key, member)
    plan = _video_plan(reader, width, height, cfg, key, member)
    indices = _sample_indices(plan.source_frames, plan.frames)
    try:
        batch = _as_numpy(reader.get_batch(indices))
    except MemoryError:
        raise
    except Exception as exc:  # decord raises its own DECORDError and RuntimeErrors
        raise MediaError(key, member, "corrupt", f"cannot decode video frames: {exc}") from exc
    if batch.shape[1:3] != (height, width):
        logger.warning(
            "%s/%s: decoded frames are %dx%d, header says %dx%d; resizing to the probed grid",
            key,
            member,
            batch.shape[2],
            batch.shape[1],
            width,
            height,
        )
    _, gh, gw = plan.grid_thw
    size = (gw * cfg.patch_size, gh * cfg.patch_size)
    resized = np.stack(
        [np.asarray(Image.fromarray(f).resize(size, Image.Resampling.BICUBIC)) for f in batch]
    )
    return resized, plan


def _open_image(data: bytes, cfg: MediaConfig, key: str, member: str) -> Image.Image:
    if not data:
        raise MediaError(key, member, "empty", "zero-byte image")
    try:
        with warnings.catch_warnings():
            # Our own pixel limit below replaces PIL's warning threshold.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=_IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise MediaError(
            key,
            member,
            "too_large",
            f"header declares a decompression bomb ({exc}); max_image_pixels="
            f"{cfg.max_image_pixels}",
        ) from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, struct.error) as exc:
        raise MediaError(key, member, "unreadable", f"not a readable image: {exc}") from exc
    width, height = img.size
    if width * height > cfg.max_image_pixels:
        img.close()
        raise MediaError(
            key,
            member,
            "too_large",
            f"header declares {width}x{height} = {width * height} pixels, above "
            f"max_image_pixels={cfg.max_image_pixels}; downscale the image or raise "
            "MediaConfig.max_image_pixels",
        )
    return img


def _to_rgb(img: Image.Image) -> Image.Image:
    # Same as transformers' convert_to_rgb: transparency is composited onto white.
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _image_grid(
    height: int, width: int, cfg: MediaConfig, key: str, member: str
) -> tuple[int, int, int]:
    try:
        rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ValueError as exc:
        raise MediaError(key, member, "aspect_ratio", str(exc)) from exc
    return 1, rh // cfg.patch_size, rw // cfg.patch_size


def _tokens(grid: tuple[int, int, int], cfg: MediaConfig) -> int:
    t, h, w = grid
    return t * h * w // (cfg.merge_size * cfg.merge_size)


def _normalize(frames: torch.Tensor, cfg: MediaConfig) -> torch.Tensor:
    """uint8 ``[T, C, H, W]`` -> float32, rounded like transformers (float64 rescale first).

    One frame and channel at a time, so the float64 scratch stays one plane, not the clip.
    """
    out = torch.empty(frames.shape, dtype=torch.float32)
    for t in range(frames.shape[0]):
        for c, (mean, std) in enumerate(zip(cfg.image_mean, cfg.image_std, strict=True)):
            plane = (frames[t, c].to(torch.float64) * (1 / 255)).to(torch.float32)
            torch.div(plane.sub_(mean), std, out=out[t, c])
    return out


def _patchify(
    frames: torch.Tensor, cfg: MediaConfig, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Float ``[T, C, H, W]`` (T a multiple of temporal_patch_size) -> ``[t*h*w, patch_dim]``,
    written into ``out`` when given (one copy, no intermediate)."""
    n, c, height, width = frames.shape
    tp, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    gt, gh, gw = n // tp, height // p, width // p
    patches = frames.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
    patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    if out is None:
        return patches.reshape(gt * gh * gw, c * tp * p * p).contiguous()
    out.view(patches.shape).copy_(patches)
    return out


def _checked_out(
    out: torch.Tensor | None, rows: int, cfg: MediaConfig, key: str, member: str
) -> torch.Tensor | None:
    if out is None or (out.shape == (rows, cfg.patch_dim) and out.dtype == torch.float32):
        return out
    raise MediaError(
        key,
        member,
        "corrupt",
        f"decodes to {rows} patches of {cfg.patch_dim} values but its slot holds "
        f"{tuple(out.shape)} {out.dtype}; the probe and the decode disagree (same MediaConfig?)",
    )


def _open_video(data: bytes, key: str, member: str) -> Any:
    if not data:
        raise MediaError(key, member, "empty", "zero-byte video")
    try:
        return decord.VideoReader(io.BytesIO(data), num_threads=1)
    except MemoryError:
        raise
    except Exception as exc:  # decord raises DECORDError / RuntimeError / AssertionError
        raise MediaError(key, member, "unreadable", f"not a readable video: {exc}") from exc


def _video_size(reader: Any, data: bytes, key: str, member: str) -> tuple[int, int]:
    """``(width, height)`` from the MP4 header, else from decoding the first frame."""
    size = _mp4_video_size(data)
    if size is not None:
        return size
    logger.debug("%s/%s: no MP4 sample entry, decoding one frame for the size", key, member)
    try:
        frame = _as_numpy(reader[0])
    except MemoryError:
        raise
    except Exception as exc:
        raise MediaError(key, member, "corrupt", f"cannot decode the first frame: {exc}") from exc
    return int(frame.shape[1]), int(frame.shape[0])


def _as_numpy(frames: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    # Works for every decord bridge without touching the global bridge setting.
    if hasattr(frames, "asnumpy"):
        return np.asarray(frames.asnumpy(), dtype=np.uint8)
    if isinstance(frames, torch.Tensor):
        return frames.numpy().astype(np.uint8, copy=False)
    return np.asarray(frames, dtype=np.uint8)


def _video_plan(
    reader: Any, width: int, height: int, cfg: MediaConfig, key: str, member: str
) -> VideoProbe:
    total = len(reader)
    fps = float(reader.get_avg_fps())
    if not (math.isfinite(fps) and fps > 0) or total <= 0:
        raise MediaError(key, member, "unreadable", f"video reports {total} frames at {fps} fps")
    duration = total / fps
    if total > cfg.max_video_source_frames or duration > cfg.max_video_seconds:
        raise MediaError(
            key,
            member,
            "too_long",
            f"{total} frames / {duration:.1f} s exceed max_video_source_frames="
            f"{cfg.max_video_source_frames} or max_video_seconds={cfg.max_video_seconds}; "
            "cut the clip or raise the limits",
        )
    if width * height > cfg.max_image_pixels:
        raise MediaError(
            key,
            member,
            "too_large",
            f"frames of {width}x{height} pixels exceed max_image_pixels={cfg.max_image_pixels}",
        )
    frames = _num_frames(total, fps, cfg)
    frame_budget = max(
        min(cfg.video_max_pixels, cfg.video_total_pixels * cfg.temporal_patch_size // frames),
        int(cfg.video_min_pixels * 1.05),
    )
    try:
        rh, rw = smart_resize(height, width, cfg.factor, cfg.video_min_pixels, frame_budget)
    except ValueError as exc:
        raise MediaError(key, member, "aspect_ratio", str(exc)) from exc
    grid = (frames // cfg.temporal_patch_size, rh // cfg.patch_size, rw // cfg.patch_size)
    sampled_fps = frames / duration
    return VideoProbe(
        frames=frames,
        fps=fps,
        width=width,
        height=height,
        grid_thw=grid,
        tokens=_tokens(grid, cfg),
        source_frames=total,
        duration=duration,
        second_per_grid_t=cfg.temporal_patch_size / sampled_fps,
    )


def _num_frames(total: int, fps: float, cfg: MediaConfig) -> int:
    """Frames to sample (Qwen2-VL rule), at least one temporal patch (short clips repeat)."""
    tp = cfg.temporal_patch_size
    cap = math.floor(min(cfg.video_max_frames, total) / tp) * tp
    wanted = min(max(total / fps * cfg.video_fps, cfg.video_min_frames), cap, total)
    return max(tp, math.floor(wanted / tp) * tp)


def _sample_indices(total: int, frames: int) -> list[int]:
    return [i * total // frames for i in range(frames)]


def _mp4_video_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of the first video track's sample entry in an MP4/MOV, if any."""
    moov = _find_box(data, 0, len(data), b"moov")
    if moov is None:
        return None
    for trak in _iter_boxes(data, *moov, b"trak"):
        mdia = _find_box(data, *trak, b"mdia")
        if mdia is None:
            continue
        hdlr = _find_box(data, *mdia, b"hdlr")
        if hdlr is None or data[hdlr[0] + 8 : hdlr[0] + 12] != b"vide":
            continue
        stbl = None
        minf = _find_box(data, *mdia, b"minf")
        if minf is not None:
            stbl = _find_box(data, *minf, b"stbl")
        stsd = _find_box(data, *stbl, b"stsd") if stbl is not None else None
        if stsd is None or stsd[1] - stsd[0] < 8 + 8 + 32:
            continue
        # stsd: version/flags(4) count(4); entry: size(4) type(4) reserved(6) ref(2)
        # pre_defined(2) reserved(2) pre_defined(12) width(2) height(2)
        entry = stsd[0] + 8
        width, height = struct.unpack(">HH", data[entry + 32 : entry + 36])
        if width and height:
            return width, height
    return None


def _iter_boxes(data: bytes, start: int, end: int, kind: bytes) -> list[tuple[int, int]]:
    """Payload ranges ``(start, end)`` of child boxes of type ``kind`` in ``data[start:end]``."""
    found: list[tuple[int, int]] = []
    pos = start
    while pos + 8 <= end:
        size, box = struct.unpack(">I4s", data[pos : pos + 8])
        header = 8
        if size == 1 and pos + 16 <= end:
            size = struct.unpack(">Q", data[pos + 8 : pos + 16])[0]
            header = 16
        elif size == 0:
            size = end - pos
        if size < header or pos + size > end:
            break
        if box == kind:
            found.append((pos + header, pos + size))
        pos += size
    return found


def _find_box(data: bytes, start: int, end: int, kind: bytes) -> tuple[int, int] | None:
    boxes = _iter_boxes(data, start, end, kind)
    return boxes[0] if boxes else None
