"""Native decoding of untrusted media bytes: Pillow and decord, numpy out, no torch.

These functions run in the decoder process (:mod:`energon_pack.media_guard`), or in the calling
process with ``decode_isolation="off"``. They probe video containers, decode and resize pixels
to the probed grid, and write the uint8 patch levels (:func:`patch_levels`) into the array an
:data:`~energon_pack.media_guard.Alloc` gives; :mod:`energon_pack.media` turns levels into
model-ready patches.
"""

from __future__ import annotations

import io
import logging
import math
import struct
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import decord
import numpy as np
from PIL import Image, UnidentifiedImageError

from energon_pack.media_config import MediaConfig, MediaError, VideoProbe, smart_resize
from energon_pack.media_guard import Alloc, UInt8Array

__all__ = [
    "IMAGE_FORMATS",
    "decode_image_levels",
    "decode_levels",
    "decode_video_levels",
    "image_grid",
    "level_bytes",
    "open_image",
    "patch_levels",
    "read_video_probe",
    "resized_frames",
    "to_rgb",
    "token_count",
    "video_grid",
]

logger = logging.getLogger("energon_pack.media")

# Pillow formats tried on an image member: what web data really holds (misnamed extensions
# included), not the dozens of rare formats whose parsers would see untrusted bytes.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def decode_image_levels(
    data: bytes, cfg: MediaConfig, key: str, member: str, alloc: Alloc
) -> tuple[UInt8Array, tuple[int, int, int]]:
    """Patch levels (:func:`patch_levels`) of the image resized to the probed grid, written
    into ``alloc``, and the grid (runs in the decoder process)."""
    with open_image(data, cfg, key, member) as img:
        width, height = img.size
        _, gh, gw = image_grid(height, width, cfg, key, member)
        size = (gw * cfg.patch_size, gh * cfg.patch_size)
        try:
            rgb = to_rgb(img)
            resized = rgb if rgb.size == size else rgb.resize(size, Image.Resampling.BICUBIC)
            pixels = np.asarray(resized)
        except (OSError, ValueError, SyntaxError) as exc:
            raise MediaError(key, member, "corrupt", f"cannot decode image: {exc}") from exc
    return patch_levels([pixels], cfg, alloc), (1, gh, gw)


def decode_levels(
    data: bytes,
    cfg: MediaConfig,
    key: str,
    member: str,
    kind: Literal["image", "video"],
    alloc: Alloc,
) -> tuple[UInt8Array, tuple[int, int, int] | VideoProbe]:
    """:func:`decode_image_levels` or :func:`decode_video_levels`, by ``kind``."""
    if kind == "image":
        return decode_image_levels(data, cfg, key, member, alloc)
    return decode_video_levels(data, cfg, key, member, alloc)


def level_bytes(kind: Literal["image", "video"], rows: int, cfg: MediaConfig) -> int:
    """Bytes of the patch levels of a medium of ``rows`` patches (a still's are not repeated)."""
    frames = 1 if kind == "image" else cfg.temporal_patch_size
    return rows * 3 * frames * cfg.patch_size * cfg.patch_size


def read_video_probe(data: bytes, cfg: MediaConfig, key: str, member: str) -> VideoProbe:
    """:func:`energon_pack.media.probe_video` (runs in the decoder process)."""
    reader = _open_video(data, key, member)
    width, height = _video_size(reader, data, key, member)
    return _video_plan(reader, width, height, cfg, key, member)


def decode_video_levels(
    data: bytes, cfg: MediaConfig, key: str, member: str, alloc: Alloc
) -> tuple[UInt8Array, VideoProbe]:
    """Patch levels (:func:`patch_levels`) of the sampled frames resized to the probed grid,
    written into ``alloc``, and the plan (runs in the decoder process)."""
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
    return patch_levels(resized_frames(batch, size), cfg, alloc), plan


def open_image(data: bytes, cfg: MediaConfig, key: str, member: str) -> Image.Image:
    """Open (header only) an image of one of :data:`IMAGE_FORMATS` within ``max_image_pixels``."""
    if not data:
        raise MediaError(key, member, "empty", "zero-byte image")
    try:
        with warnings.catch_warnings():
            # Our own pixel limit below replaces PIL's warning threshold.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
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


def to_rgb(img: Image.Image) -> Image.Image:
    """The image in RGB as transformers' ``convert_to_rgb`` makes it: transparency composited
    onto white (one masked paste onto a white image, equal to transformers' ``alpha_composite``
    for every value and alpha). An RGB image without transparency is returned as it is."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img if img.mode == "RGBA" else img.convert("RGBA")
        rgb = Image.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba)
        return rgb
    return img if img.mode == "RGB" else img.convert("RGB")


def image_grid(
    height: int, width: int, cfg: MediaConfig, key: str, member: str
) -> tuple[int, int, int]:
    """The patch grid ``(1, h, w)`` of an image of that size."""
    try:
        rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ValueError as exc:
        raise MediaError(key, member, "aspect_ratio", str(exc)) from exc
    return 1, rh // cfg.patch_size, rw // cfg.patch_size


def video_grid(
    height: int, width: int, frames: int, cfg: MediaConfig, key: str, member: str
) -> tuple[int, int, int]:
    """The patch grid of ``frames`` sampled frames (a multiple of ``temporal_patch_size``) of
    that size: each within ``video_min_pixels`` and ``video_max_pixels``, all together under
    ``video_total_pixels``."""
    frame_budget = max(
        min(cfg.video_max_pixels, cfg.video_total_pixels * cfg.temporal_patch_size // frames),
        int(cfg.video_min_pixels * 1.05),
    )
    try:
        rh, rw = smart_resize(height, width, cfg.factor, cfg.video_min_pixels, frame_budget)
    except ValueError as exc:
        raise MediaError(key, member, "aspect_ratio", str(exc)) from exc
    return frames // cfg.temporal_patch_size, rh // cfg.patch_size, rw // cfg.patch_size


def token_count(grid: tuple[int, int, int], cfg: MediaConfig) -> int:
    """LLM tokens of a patch grid (``merge_size**2`` patches per token)."""
    t, h, w = grid
    return t * h * w // (cfg.merge_size * cfg.merge_size)


def resized_frames(frames: Iterable[UInt8Array], size: tuple[int, int]) -> list[UInt8Array]:
    """HWC RGB frames at ``size`` (width, height): resized bicubic by Pillow, or as they are
    when they have that size already (Pillow's resize to the same size is a copy)."""
    out = []
    for frame in frames:
        if (frame.shape[1], frame.shape[0]) == size:
            out.append(frame)
        else:
            resized = Image.fromarray(frame).resize(size, Image.Resampling.BICUBIC)
            out.append(np.asarray(resized))
    return out


def patch_levels(frames: Sequence[UInt8Array], cfg: MediaConfig, alloc: Alloc) -> UInt8Array:
    """HWC RGB frames -> uint8 patch levels ``[t*h*w, C*tp*p*p]`` in an array from ``alloc``.

    ``tp`` is ``temporal_patch_size`` for a clip (a multiple of it in frames) and 1 for a
    still, which :mod:`energon_pack.media` repeats. One transposing copy per frame, straight
    from the frame's interleaved RGB (numpy's strided copy is faster here than torch's).
    """
    height, width = frames[0].shape[:2]
    tp = 1 if len(frames) == 1 else cfg.temporal_patch_size
    p, m = cfg.patch_size, cfg.merge_size
    gt, gh, gw = len(frames) // tp, height // p, width // p
    levels = alloc((gt * gh * gw, 3 * tp * p * p))
    # [t, h/m, w/m, m, m, C, tp, p, p]: the order of the rows and values of a patch.
    target = levels.reshape(gt, gh // m, gw // m, m, m, 3, tp, p, p)
    for index, frame in enumerate(frames):
        rgb = frame.reshape(gh // m, m, p, gw // m, m, p, 3)
        np.copyto(target[index // tp, ..., index % tp, :, :], rgb.transpose(0, 3, 1, 4, 6, 2, 5))
    return levels


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
    if hasattr(frames, "numpy"):  # decord's torch bridge, set by the caller
        return np.asarray(frames.numpy(), dtype=np.uint8)
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
    grid = video_grid(height, width, frames, cfg, key, member)
    sampled_fps = frames / duration
    return VideoProbe(
        frames=frames,
        fps=fps,
        width=width,
        height=height,
        grid_thw=grid,
        tokens=token_count(grid, cfg),
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
