"""Native decoding of untrusted media bytes: Pillow and decord, numpy out, no torch.

These functions run in the decoder process (:mod:`energon_pack.media.guard`), or in the calling
process with ``decode_isolation="off"``. They probe video containers, decode and resize pixels
to the probed grid, and write the uint8 patch levels (:func:`patch_levels`) into the array an
:data:`~energon_pack.media.guard.Alloc` gives; :mod:`energon_pack.media.pixels` turns levels
into model-ready patches. Bad media raise :class:`~energon_pack.media.errors.MediaFailure`; the
caller's boundary names the sample. What decord and FFmpeg print to the terminal while they
open or decode a video (``moov atom not found``) goes into that failure's message instead.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import struct
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import decord
import numpy as np
from PIL import ExifTags, Image, UnidentifiedImageError

from energon_pack.media.config import MediaConfig, VideoProbe, image_grid, token_count
from energon_pack.media.errors import MediaFailure, medium_label
from energon_pack.media.guard import Alloc, UInt8Array
from energon_pack.media.sampling import padded, video_rule

__all__ = [
    "IMAGE_FORMATS",
    "VideoHeader",
    "decode_image_levels",
    "decode_levels",
    "decode_video_frames",
    "decode_video_levels",
    "displayed_size",
    "exif_transpose_method",
    "level_bytes",
    "open_image",
    "patch_levels",
    "read_video_header",
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
    """Patch levels (:func:`patch_levels`) of the image, turned upright by its EXIF orientation
    (:func:`exif_transpose_method`) and resized to the probed grid, written into ``alloc``, and
    the grid (runs in the decoder process)."""
    with open_image(data, cfg) as img:
        method = exif_transpose_method(img)
        width, height = displayed_size(img, method)
        _, gh, gw = image_grid(height, width, cfg)
        size = (gw * cfg.patch_size, gh * cfg.patch_size)
        try:
            rgb = upright_rgb(img, method)
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
    written into ``alloc``, and the plan (runs in the decoder process). Frames of another size
    than the probed one are ``corrupt``."""
    reader = _open_video(data)
    width, height = _video_size(reader, data)
    plan = _video_plan(reader, width, height, cfg)
    native: list[str] = []
    try:
        with _native_messages(native):
            batch = _as_numpy(reader.get_batch(list(plan.frame_indices)))
    except MemoryError:
        raise
    except Exception as exc:  # decord raises its own DECORDError and RuntimeErrors
        raise MediaFailure("corrupt", f"cannot decode video frames: {exc}{_said(native)}") from exc
    if batch.shape[1:3] != (height, width):
        # The token layout was built from the probed size: never stretch to it.
        raise MediaFailure(
            "corrupt",
            f"decoded frames are {batch.shape[2]}x{batch.shape[1]} but the MP4 header sizes "
            f"them {width}x{height} (sample entry and display matrix)",
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
    except UnidentifiedImageError as exc:  # its message names the BytesIO object, not the data
        raise MediaFailure(
            "unreadable",
            f"not a readable image: its {len(data)} bytes are none of {', '.join(IMAGE_FORMATS)}",
        ) from exc
    except (OSError, ValueError, SyntaxError, struct.error) as exc:
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


_EXIF_TRANSPOSES = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
"""EXIF Orientation -> the transpose that shows the image upright (Pillow's ``exif_transpose``)."""
_SWAPPING = frozenset(
    (
        Image.Transpose.TRANSPOSE,
        Image.Transpose.TRANSVERSE,
        Image.Transpose.ROTATE_90,
        Image.Transpose.ROTATE_270,
    )
)
"""The transposes that swap width and height (EXIF orientations 5-8)."""


def exif_transpose_method(img: Image.Image) -> Image.Transpose | None:
    """The transpose Pillow's ``exif_transpose`` (thus transformers' ``load_image``) applies
    for the image's EXIF Orientation tag (EXIF or XMP), read from what opening the header gave:
    no pixel is decoded (a PNG's ``eXIf`` chunk after the pixel data is not seen)."""
    # Image.getexif reads img.info only; PNG's override would decode the pixels first.
    orientation = Image.Image.getexif(img).get(ExifTags.Base.Orientation, 1)
    return _EXIF_TRANSPOSES.get(orientation) if isinstance(orientation, int) else None


def displayed_size(img: Image.Image, method: Image.Transpose | None) -> tuple[int, int]:
    """``(width, height)`` of the image after the transpose ``method``."""
    width, height = img.size
    return (height, width) if method in _SWAPPING else (width, height)


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


def upright_rgb(img: Image.Image, method: Image.Transpose | None) -> Image.Image:
    """``img`` in RGB (:func:`to_rgb`), turned by its EXIF transpose ``method``; decodes the
    pixels, so a corrupt file raises here."""
    rgb = to_rgb(img)
    return rgb if method is None else rgb.transpose(method)


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
    native: list[str] = []
    try:
        with _native_messages(native):
            return decord.VideoReader(io.BytesIO(data), num_threads=1)
    except MemoryError:
        raise
    except Exception as exc:  # decord raises DECORDError / RuntimeError / AssertionError
        raise MediaFailure("unreadable", f"not a readable video: {exc}{_said(native)}") from exc


_NATIVE_PREFIX = re.compile(r"^(?:\[[^\]]*\]\s*)+|^\S+\.cc:\d+:\s*")
"""FFmpeg's ``[mov,mp4,... @ 0x55...]`` and decord's ``[21:11:48] src/...cc:83:`` prefixes."""
_STDERR = threading.Lock()


@contextlib.contextmanager
def _native_messages(into: list[str]) -> Iterator[None]:
    """Append to ``into`` what native code writes to file descriptor 2 meanwhile (decord's and
    FFmpeg's messages, one line each, without their prefixes) instead of letting it reach the
    terminal; each is also logged at debug level."""
    with _STDERR, tempfile.TemporaryFile() as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            for line in log.read().decode(errors="replace").splitlines():
                message = _NATIVE_PREFIX.sub("", _NATIVE_PREFIX.sub("", line.strip()))
                if message:
                    logger.debug("%s: decoder said: %s", medium_label(), message)
                    into.append(message)


def _said(native: Sequence[str]) -> str:
    """`` (decoder: ...)``, what the native decoder printed, for a failure's message."""
    return f" (decoder: {'; '.join(native)})" if native else ""


def _video_size(reader: Any, data: bytes) -> tuple[int, int]:
    """``(width, height)`` from the MP4 header, else from decoding the first frame."""
    size = _mp4_video_size(data)
    if size is not None:
        return size
    logger.debug("%s: no MP4 sample entry, decoding one frame for the size", medium_label())
    native: list[str] = []
    try:
        with _native_messages(native):
            frame = _as_numpy(reader[0])
    except MemoryError:
        raise
    except Exception as exc:
        raise MediaFailure(
            "corrupt", f"cannot decode the first frame: {exc}{_said(native)}"
        ) from exc
    return int(frame.shape[1]), int(frame.shape[0])


def _as_numpy(frames: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    # Works for every decord bridge without touching the global bridge setting.
    if hasattr(frames, "asnumpy"):
        return np.asarray(frames.asnumpy(), dtype=np.uint8)
    if hasattr(frames, "numpy"):  # decord's torch bridge, set by the caller
        return np.asarray(frames.numpy(), dtype=np.uint8)
    return np.asarray(frames, dtype=np.uint8)


@dataclass(frozen=True)
class VideoHeader:
    """A video's frame count, average frame rate and upright frame size, within the limits of
    a :class:`MediaConfig`."""

    frames: int
    fps: float
    width: int
    height: int

    @property
    def duration(self) -> float:
        """Seconds played."""
        return self.frames / self.fps


def read_video_header(data: bytes, cfg: MediaConfig) -> VideoHeader:
    """:class:`VideoHeader` of a video, nothing decoded but where the container has no MP4
    sample entry (runs in the decoder process)."""
    reader = _open_video(data)
    width, height = _video_size(reader, data)
    return _checked_header(reader, width, height, cfg)


def decode_video_frames(
    data: bytes, indices: Sequence[int], size: tuple[int, int], cfg: MediaConfig, alloc: Alloc
) -> tuple[UInt8Array, None]:
    """The frames at ``indices`` as ``[T, H, W, 3]`` uint8, upright, written into ``alloc``
    (runs in the decoder process); frames of another ``(height, width)`` than ``size``, the
    header's, are ``corrupt``; the limits of ``cfg`` hold as at the probe."""
    reader = _open_video(data)
    _checked_header(reader, size[1], size[0], cfg)
    native: list[str] = []
    try:
        with _native_messages(native):
            batch = _as_numpy(reader.get_batch(list(indices)))
    except MemoryError:
        raise
    except Exception as exc:  # decord raises its own DECORDError and RuntimeErrors
        raise MediaFailure("corrupt", f"cannot decode video frames: {exc}{_said(native)}") from exc
    if batch.shape[1:3] != size:
        raise MediaFailure(
            "corrupt",
            f"decoded frames are {batch.shape[2]}x{batch.shape[1]} but the header sizes them "
            f"{size[1]}x{size[0]}",
        )
    frames = alloc(batch.shape)
    np.copyto(frames, batch)
    return frames, None


def _checked_header(reader: Any, width: int, height: int, cfg: MediaConfig) -> VideoHeader:
    """The header of an open video; ``unreadable``, ``too_long`` or ``too_large`` outside
    ``cfg``'s limits."""
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
    return VideoHeader(total, fps, width, height)


def _video_plan(reader: Any, width: int, height: int, cfg: MediaConfig) -> VideoProbe:
    header = _checked_header(reader, width, height, cfg)
    total, fps, duration = header.frames, header.fps, header.duration
    rule = video_rule(cfg)
    sampled = rule.sample(total, fps, cfg)
    grid = rule.grid(height, width, len(sampled), cfg)
    return VideoProbe(
        frames=len(sampled),
        fps=fps,
        width=width,
        height=height,
        grid_thw=grid,
        tokens=token_count(grid, cfg),
        source_frames=total,
        duration=duration,
        second_per_grid_t=cfg.temporal_patch_size / (len(sampled) / duration),
        frame_indices=tuple(padded(sampled, cfg)),
        timestamps=rule.timestamps(sampled, fps, cfg),
    )


def _mp4_video_size(data: bytes) -> tuple[int, int] | None:
    """``(width, height)`` of the frames decord decodes from an MP4/MOV, from its header only.

    The size is the video track's sample entry (``stsd``), swapped when decord turns the frames
    (:func:`_decord_rotation` of the track's display matrix is 90 or 270 degrees). A file with
    more than one video track is ``unsupported``: FFmpeg picks the track decord decodes by
    bitrate and probing, which the header cannot tell reliably. ``None`` without a sample entry.
    """
    moov = _find_box(data, 0, len(data), b"moov")
    if moov is None:
        return None
    movie = _box_matrix(data, _find_box(data, *moov, b"mvhd"), 20)
    tracks = []
    for trak in _iter_boxes(data, *moov, b"trak"):
        size = _sample_entry_size(data, trak)
        if size is not None:
            track = _box_matrix(data, _find_box(data, *trak, b"tkhd"), 24)
            tracks.append((size, _decord_rotation(_compose(track, movie))))
    if len(tracks) > 1:
        raise MediaFailure(
            "unsupported",
            f"MP4 with {len(tracks)} video tracks: which one decord decodes cannot be told "
            "from the header; keep one video track (ffmpeg -map 0:v:0 -c copy)",
        )
    if not tracks:
        return None
    [((width, height), rotation)] = tracks
    return (height, width) if rotation in (90, 270) else (width, height)


def _sample_entry_size(data: bytes, trak: tuple[int, int]) -> tuple[int, int] | None:
    """``(width, height)`` of a video track's first sample entry, ``None`` for other tracks."""
    mdia = _find_box(data, *trak, b"mdia")
    if mdia is None:
        return None
    hdlr = _find_box(data, *mdia, b"hdlr")
    if hdlr is None or data[hdlr[0] + 8 : hdlr[0] + 12] != b"vide":
        return None
    stbl = None
    minf = _find_box(data, *mdia, b"minf")
    if minf is not None:
        stbl = _find_box(data, *minf, b"stbl")
    stsd = _find_box(data, *stbl, b"stsd") if stbl is not None else None
    if stsd is None or stsd[1] - stsd[0] < 8 + 8 + 32:
        return None
    # stsd: version/flags(4) count(4); entry: size(4) type(4) reserved(6) ref(2)
    # pre_defined(2) reserved(2) pre_defined(12) width(2) height(2)
    entry = stsd[0] + 8
    width, height = struct.unpack(">HH", data[entry + 32 : entry + 36])
    return (width, height) if width and height else None


_IDENTITY = (1 << 16, 0, 0, 0, 1 << 16, 0, 0, 0, 1 << 30)


def _box_matrix(data: bytes, box: tuple[int, int] | None, v0_offset: int) -> tuple[int, ...]:
    """The display matrix of an ``mvhd`` / ``tkhd`` payload (identity if absent or short).

    ``v0_offset`` is where the times end in a version-0 box (20 in ``mvhd``, 24 in ``tkhd``;
    version 1 has 12 more bytes); 16 bytes of rate/volume/layer fields follow, then the matrix.
    """
    if box is None or box[0] >= box[1]:
        return _IDENTITY
    start = box[0] + v0_offset + (12 if data[box[0]] == 1 else 0) + 16
    if start + 36 > box[1]:
        return _IDENTITY
    return struct.unpack(">9i", data[start : start + 36])


def _compose(track: tuple[int, ...], movie: tuple[int, ...]) -> tuple[int, ...]:
    """``track x movie`` in the matrices' fixed point (16.16, 16.16, 2.30 by row), as FFmpeg's
    MP4 demuxer applies the movie matrix after the track's."""
    shifts = (16, 16, 30)
    return tuple(
        sum((track[3 * i + e] * movie[3 * e + j]) >> shifts[e] for e in range(3))
        for i in range(3)
        for j in range(3)
    )


def _decord_rotation(matrix: tuple[int, ...]) -> int:
    """Degrees decord 0.6.0 turns frames by for a display matrix: FFmpeg's ``rotate`` tag
    (clockwise, in [0, 360), printed with ``%g``), cut to an integer; decord turns frames for
    90, 180 and 270 only (measured: 89.9991 is not turned, 90.0009 is)."""
    a, b, _, c, d = (v / 65536 for v in matrix[:5])
    scale_x, scale_y = math.hypot(a, c), math.hypot(b, d)
    if scale_x == 0 or scale_y == 0:
        return 0
    angle = math.degrees(math.atan2(b / scale_y, a / scale_x))
    if angle < 0:
        angle += 360
    return math.trunc(float(f"{angle:g}"))


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
