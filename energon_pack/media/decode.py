"""Native decoding of untrusted media bytes: Pillow and decord, numpy out, no torch.

These functions run in the decoder process (:mod:`energon_pack.media.guard`), or in the calling
process with ``decode_isolation="off"``. They probe video containers, decode and resize pixels
to the probed grid, and write the uint8 patch levels (:func:`patch_levels`) into the array an
:data:`~energon_pack.media.guard.Alloc` gives; :mod:`energon_pack.media.pixels` turns levels
into model-ready patches. Bad media raise :class:`~energon_pack.media.errors.MediaFailure`; the
caller's boundary names the sample.
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

from energon_pack.media.config import MediaConfig, VideoProbe, image_grid, token_count, video_grid
from energon_pack.media.errors import MediaFailure, medium_label
from energon_pack.media.guard import Alloc, UInt8Array

__all__ = [
    "IMAGE_FORMATS",
    "decode_image_levels",
    "decode_levels",
    "decode_video_levels",
    "level_bytes",
    "open_image",
    "patch_levels",
    "read_video_probe",
    "resized_frames",
    "to_rgb",
]

logger = logging.getLogger("energon_pack.media")

# Pillow formats tried on an image member: what web data really holds (misnamed extensions
# included), not the dozens of rare formats whose parsers would see untrusted bytes.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def decode_image_levels(
    data: bytes, cfg: MediaConfig, alloc: Alloc
) -> tuple[UInt8Array, tuple[int, int, int]]:
    """Patch levels (:func:`patch_levels`) of the image resized to the probed grid, written
    into ``alloc``, and the grid (runs in the decoder process)."""
    with open_image(data, cfg) as img:
        width, height = img.size
        _, gh, gw = image_grid(height, width, cfg)
        size = (gw * cfg.patch_size, gh * cfg.patch_size)
        try:
            rgb = to_rgb(img)
            resized = rgb if rgb.size == size else rgb.resize(size, Image.Resampling.BICUBIC)
            pixels = np.asarray(resized)
        except (OSError, ValueError, SyntaxError) as exc:
            raise MediaFailure("corrupt", f"cannot decode image: {exc}") from exc
    return patch_levels([pixels], cfg, alloc), (1, gh, gw)


def decode_levels(
    data: bytes, cfg: MediaConfig, kind: Literal["image", "video"], alloc: Alloc
) -> tuple[UInt8Array, tuple[int, int, int] | VideoProbe]:
    """:func:`decode_image_levels` or :func:`decode_video_levels`, by ``kind``."""
    if kind == "image":
        return decode_image_levels(data, cfg, alloc)
    return decode_video_levels(data, cfg, alloc)


def level_bytes(kind: Literal["image", "video"], rows: int, cfg: MediaConfig) -> int:
    """Bytes of the patch levels of a medium of ``rows`` patches (a still's are not repeated)."""
    frames = 1 if kind == "image" else cfg.temporal_patch_size
    return rows * 3 * frames * cfg.patch_size * cfg.patch_size


def read_video_probe(data: bytes, cfg: MediaConfig) -> VideoProbe:
    """:func:`energon_pack.media.probe_video` (runs in the decoder process)."""
    reader = _open_video(data)
    width, height = _video_size(reader, data)
    return _video_plan(reader, width, height, cfg)


def decode_video_levels(
    data: bytes, cfg: MediaConfig, alloc: Alloc
) -> tuple[UInt8Array, VideoProbe]:
    """Patch levels (:func:`patch_levels`) of the sampled frames resized to the probed grid,
    written into ``alloc``, and the plan (runs in the decoder process)."""
    reader = _open_video(data)
    width, height = _video_size(reader, data)
    plan = _video_plan(reader, width, height, cfg)
    indices = _sample_indices(plan.source_frames, plan.frames)
    try:
        batch = _as_numpy(reader.get_batch(indices))
    except MemoryError:
        raise
    except Exception as exc:  # decord raises its own DECORDError and RuntimeErrors
        raise MediaFailure("corrupt", f"cannot decode video frames: {exc}") from exc
    if batch.shape[1:3] != (height, width):
        logger.warning(
            "%s: decoded frames are %dx%d, header says %dx%d; resizing to the probed grid",
            medium_label(),
            batch.shape[2],
            batch.shape[1],
            width,
            height,
        )
    _, gh, gw = plan.grid_thw
    size = (gw * cfg.patch_size, gh * cfg.patch_size)
    return patch_levels(resized_frames(batch, size), cfg, alloc), plan


def open_image(data: bytes, cfg: MediaConfig) -> Image.Image:
    """Open (header only) an image of one of :data:`IMAGE_FORMATS` within ``max_image_pixels``."""
    if not data:
        raise MediaFailure("empty", "zero-byte image")
    try:
        with warnings.catch_warnings():
            # Our own pixel limit below replaces PIL's warning threshold.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise MediaFailure(
            "too_large",
            f"header declares a decompression bomb ({exc}); max_image_pixels="
            f"{cfg.max_image_pixels}",
        ) from exc
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, struct.error) as exc:
        raise MediaFailure("unreadable", f"not a readable image: {exc}") from exc
    width, height = img.size
    if width * height > cfg.max_image_pixels:
        img.close()
        raise MediaFailure(
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
    still, which :mod:`energon_pack.media.pixels` repeats. One transposing copy per frame, straight
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


def _open_video(data: bytes) -> Any:
    if not data:
        raise MediaFailure("empty", "zero-byte video")
    try:
        return decord.VideoReader(io.BytesIO(data), num_threads=1)
    except MemoryError:
        raise
    except Exception as exc:  # decord raises DECORDError / RuntimeError / AssertionError
        raise MediaFailure("unreadable", f"not a readable video: {exc}") from exc


def _video_size(reader: Any, data: bytes) -> tuple[int, int]:
    """``(width, height)`` from the MP4 header, else from decoding the first frame."""
    size = _mp4_video_size(data)
    if size is not None:
        return size
    logger.debug("%s: no MP4 sample entry, decoding one frame for the size", medium_label())
    try:
        frame = _as_numpy(reader[0])
    except MemoryError:
        raise
    except Exception as exc:
        raise MediaFailure("corrupt", f"cannot decode the first frame: {exc}") from exc
    return int(frame.shape[1]), int(frame.shape[0])


def _as_numpy(frames: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    # Works for every decord bridge without touching the global bridge setting.
    if hasattr(frames, "asnumpy"):
        return np.asarray(frames.asnumpy(), dtype=np.uint8)
    if hasattr(frames, "numpy"):  # decord's torch bridge, set by the caller
        return np.asarray(frames.numpy(), dtype=np.uint8)
    return np.asarray(frames, dtype=np.uint8)


def _video_plan(reader: Any, width: int, height: int, cfg: MediaConfig) -> VideoProbe:
    total = len(reader)
    fps = float(reader.get_avg_fps())
    if not (math.isfinite(fps) and fps > 0) or total <= 0:
        raise MediaFailure("unreadable", f"video reports {total} frames at {fps} fps")
    duration = total / fps
    if total > cfg.max_video_source_frames or duration > cfg.max_video_seconds:
        raise MediaFailure(
            "too_long",
            f"{total} frames / {duration:.1f} s exceed max_video_source_frames="
            f"{cfg.max_video_source_frames} or max_video_seconds={cfg.max_video_seconds}; "
            "cut the clip or raise the limits",
        )
    if width * height > cfg.max_image_pixels:
        raise MediaFailure(
            "too_large",
            f"frames of {width}x{height} pixels exceed max_image_pixels={cfg.max_image_pixels}",
        )
    frames = _num_frames(total, fps, cfg)
    grid = video_grid(height, width, frames, cfg)
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
