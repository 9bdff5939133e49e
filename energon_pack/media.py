"""Qwen2-VL-style image and video preprocessing with header-only probing.

Probing (:func:`probe_image`, :func:`probe_video`) reads only the container/image header and
returns the patch grid and the token count, so a packing buffer can hold compressed bytes and
decode (:func:`process_image`, :func:`process_video`) only the samples it selected.

Conventions match ``transformers``' ``Qwen2VLImageProcessorPil``: RGB conversion (transparency
composited on white), bicubic resize to :func:`smart_resize` dimensions, rescale by 1/255, CLIP
normalisation, and a patch layout ``[grid_t * grid_h * grid_w, 3 * temporal_patch * p * p]``.
A still image is repeated to ``temporal_patch_size`` frames (``grid_t == 1``). Grids are returned
as ``long`` tensors of shape ``[1, 3]`` so that they concatenate to ``[num_media, 3]``.

Normalisation gives transformers' values bit for bit (float64 rescale, then float32 normalise):
pixels are uint8, so every value is one of 256 per channel. The worker patchifies the uint8
pixels, then normalises the contiguous patches in place in float32. With
``MediaConfig(pixel_dtype="uint8")`` the patches stay uint8 (4x smaller) and the training step
turns them into the very same values with :func:`normalize_pixels`, one gather from a 256-entry
table per channel.

:func:`decode_vision` decodes the media of the samples of a pack straight into one tensor per
field (:class:`VisionInputs`), from the compressed bytes and probed grids (:class:`MediaItem`).
"""

from __future__ import annotations

import io
import logging
import math
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from typing import Any, Literal, Protocol, TypeVar

import decord
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from energon_pack.media_guard import (
    Alloc,
    Isolation,
    UInt8Array,
    alloc_in_process,
    guarded,
    guarded_frames,
    media_errors,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "VIDEO_EXTENSIONS",
    "Frames",
    "ImageProbe",
    "MediaConfig",
    "MediaError",
    "MediaErrorKind",
    "MediaFootprint",
    "MediaItem",
    "PixelDtype",
    "VideoProbe",
    "VisionInputs",
    "check_media_count",
    "decode_vision",
    "footprint",
    "image_frames",
    "media_grids",
    "media_kind",
    "normalize_pixels",
    "probe_frames",
    "probe_image",
    "probe_video",
    "process_frames",
    "process_image",
    "process_video",
    "smart_resize",
    "tensor_nbytes",
]

logger = logging.getLogger("energon_pack.media")

E = TypeVar("E")
R = TypeVar("R")

OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
IMAGE_EXTENSIONS: frozenset[str] = frozenset({"jpg", "jpeg", "png", "webp"})
VIDEO_EXTENSIONS: frozenset[str] = frozenset({"mp4"})
RESCALE_FACTOR = 1 / 255
"""transformers' ``rescale_factor`` of 8-bit pixels."""

PixelDtype = Literal["float32", "uint8"]
_PIXEL_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "uint8": torch.uint8}

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

    ``pixel_dtype`` is the dtype of the patches handed out: ``"float32"`` (normalised, what a
    model takes as it is) or ``"uint8"`` (raw pixels, 4x smaller through workers, shared memory
    and the loader; the training step must call :func:`normalize_pixels` on them).

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
    pixel_dtype: PixelDtype = "float32"
    decode_isolation: Isolation = "process"
    decode_timeout_s: float = 60.0
    max_json_bytes: int = 16 * 2**20
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        if self.pixel_dtype not in _PIXEL_DTYPES:
            raise ValueError(
                f"MediaConfig.pixel_dtype must be one of {sorted(_PIXEL_DTYPES)}, got "
                f"{self.pixel_dtype!r}; use 'uint8' to ship raw pixels and normalise them in the "
                "training step with energon_pack.media.normalize_pixels"
            )
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

    @property
    def torch_pixel_dtype(self) -> torch.dtype:
        """``pixel_dtype`` as a torch dtype."""
        return _PIXEL_DTYPES[self.pixel_dtype]


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

    Returns ``pixel_values [t*h*w, 3*temporal_patch*p*p]`` (float32, or uint8 and not
    normalised with ``pixel_dtype="uint8"``) and ``image_grid_thw [1, 3]``. With ``out`` (a
    ``[t*h*w, patch_dim]`` tensor of that dtype, e.g. a slice of a packed row's buffer) the
    patches are written there and ``out`` is returned.
    """
    cfg = config or _DEFAULT

    def patches(
        levels: UInt8Array, grid: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        target = _checked_out(out, levels.shape[0], cfg, key, member)
        pixels = _patches(torch.from_numpy(levels), cfg, target)
        return pixels, torch.tensor([list(grid)], dtype=torch.long)

    return _guarded_frames(_decode_image, data, cfg, key, member, use=patches)


def probe_video(
    data: bytes, config: MediaConfig | None = None, *, key: str = "?", member: str = "?"
) -> VideoProbe:
    """Frame count, fps, size, grid and token count of a video without decoding pixels.

    decord gives the frame count and average fps from the demuxed index; the frame size comes
    from the MP4/MOV ``stsd`` sample entry (falls back to decoding one frame for containers
    without one).
    """
    cfg = config or _DEFAULT
    probe: VideoProbe = guarded(
        _probe_video,
        data,
        cfg,
        key,
        member,
        key=key,
        member=member,
        kind="unreadable",
        isolation=cfg.decode_isolation,
        timeout_s=cfg.decode_timeout_s,
    )
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

    Returns ``pixel_values_videos [t*h*w, 3*temporal_patch*p*p]`` (float32, or uint8 with
    ``pixel_dtype="uint8"``), ``video_grid_thw [1, 3]`` and ``second_per_grid_t`` (seconds per
    temporal patch). ``out`` works as in :func:`process_image`.
    """
    cfg = config or _DEFAULT

    def patches(levels: UInt8Array, plan: VideoProbe) -> tuple[torch.Tensor, torch.Tensor, float]:
        target = _checked_out(out, levels.shape[0], cfg, key, member)
        pixels = _patches(torch.from_numpy(levels), cfg, target)
        grid = torch.tensor([list(plan.grid_thw)], dtype=torch.long)
        return pixels, grid, plan.second_per_grid_t

    return _guarded_frames(_decode_video, data, cfg, key, member, use=patches)


def tensor_nbytes(*tensors: torch.Tensor) -> int:
    """Bytes held by the given tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def footprint(data: bytes, *tensors: torch.Tensor) -> MediaFootprint:
    """Compressed size of ``data`` versus the bytes of its processed tensors."""
    return MediaFootprint(len(data), tensor_nbytes(*tensors))


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


@dataclass(frozen=True)
class Frames:
    """Already decoded RGB pixels of one image or video: ``[T, H, W, 3]`` uint8 as raw bytes.

    An image is one frame. Kept as bytes (not patches) until a pack is chosen, like a
    compressed member; :func:`probe_frames` reads only the shape.
    """

    data: bytes
    shape: tuple[int, int, int, int]

    @classmethod
    def from_array(cls, array: np.ndarray[Any, Any]) -> Frames:
        """From a ``[T, H, W, 3]`` uint8 array (copied into bytes)."""
        frames = np.ascontiguousarray(array, dtype=np.uint8)
        t, h, w, c = frames.shape
        return cls(frames.tobytes(), (t, h, w, c))

    def array(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The ``[T, H, W, 3]`` uint8 view of :attr:`data`."""
        return np.frombuffer(self.data, dtype=np.uint8).reshape(self.shape)


@dataclass(frozen=True)
class MediaItem:
    """One image or video of a sample: compressed bytes (or decoded :class:`Frames`) plus what
    the probe told."""

    member: str
    kind: Literal["image", "video"]
    data: bytes | Frames
    grid_thw: tuple[int, int, int]
    tokens: int
    second_per_grid_t: float | None = None
    """Seconds covered by one temporal patch (videos only)."""

    @property
    def nbytes(self) -> int:
        """Bytes the payload holds."""
        return len(self.data) if isinstance(self.data, bytes) else len(self.data.data)


@dataclass(frozen=True)
class VisionInputs:
    """Decoded, patchified media of one sample (or one packed row), in placeholder order."""

    pixel_values: torch.Tensor | None = None
    """``[sum of image grid products, 3*t*p*p]`` float32 (uint8 with
    ``MediaConfig(pixel_dtype="uint8")``, see :func:`normalize_pixels`), or None without images."""
    image_grid_thw: torch.Tensor | None = None
    """``[images, 3]`` long."""
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    """``[videos]`` float32: seconds covered by one temporal patch of each video."""

    @classmethod
    def concat(cls, parts: Sequence[VisionInputs]) -> VisionInputs:
        """The media of ``parts`` one after the other (images and videos each in order)."""

        def cat(name: str) -> torch.Tensor | None:
            tensors = [getattr(part, name) for part in parts if getattr(part, name) is not None]
            return torch.cat(tensors) if tensors else None

        return cls(**{f.name: cat(f.name) for f in fields(cls)})

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(*self.tensors().values())


class MediaSample(Protocol):
    """What :func:`decode_vision` reads of a sample (e.g. an ``EncodedSample``)."""

    @property
    def key(self) -> str: ...
    @property
    def media(self) -> Sequence[MediaItem]: ...
    @property
    def vision(self) -> VisionInputs | None: ...


def decode_vision(
    samples: Sequence[MediaSample], config: MediaConfig | None = None, *, shared: bool = False
) -> VisionInputs:
    """The media of ``samples``, in order, decoded straight into one tensor per field.

    Each image and video is patchified into its slice of ``pixel_values`` /
    ``pixel_values_videos``, sized from the probed grids, so a packed row's pixels exist once.
    Already materialised samples are copied in. ``shared=True`` allocates the pixels in shared
    memory (where a DataLoader worker would copy the batch anyway).
    Raises :class:`~energon_pack.media.MediaError` naming the sample and member on bad media.
    """
    cfg = config or MediaConfig()
    items = [item for s in samples for item in s.media]
    pixels = {
        kind: _alloc([i for i in items if i.kind == kind], cfg, shared)
        for kind in ("image", "video")
    }
    offsets = {"image": 0, "video": 0}
    for sample in samples:
        vision = sample.vision
        if vision is not None:  # materialised already: copy its blocks in
            for kind, block in (
                ("image", vision.pixel_values),
                ("video", vision.pixel_values_videos),
            ):
                if block is not None:
                    if block.dtype != cfg.torch_pixel_dtype:
                        raise ValueError(
                            f"sample {sample.key!r} was materialised with {block.dtype} pixels "
                            f"but this pack uses pixel_dtype={cfg.pixel_dtype!r}; materialise "
                            "with the packer's MediaConfig"
                        )
                    start = offsets[kind]
                    _slot(pixels[kind], start, block.shape[0]).copy_(block)
                    offsets[kind] += block.shape[0]
            continue
        for item in sample.media:
            rows = math.prod(item.grid_thw)
            slot = _slot(pixels[item.kind], offsets[item.kind], rows)
            offsets[item.kind] += rows
            key, member = sample.key, item.member
            if isinstance(item.data, Frames):
                process_frames(item.data, item.kind, cfg, key=key, member=member, out=slot)
            else:
                decode = process_image if item.kind == "image" else process_video
                decode(item.data, cfg, key=key, member=member, out=slot)
    grids = media_grids(samples)
    return replace(grids, pixel_values=pixels["image"], pixel_values_videos=pixels["video"])


def media_grids(samples: Sequence[MediaSample]) -> VisionInputs:
    """The grids and video timings of ``samples``' media, in order, from their probes only."""
    images = [item for s in samples for item in s.media if item.kind == "image"]
    videos = [item for s in samples for item in s.media if item.kind == "video"]
    seconds = [item.second_per_grid_t or 0.0 for item in videos]
    return VisionInputs(
        image_grid_thw=_grids(images),
        video_grid_thw=_grids(videos),
        second_per_grid_ts=torch.tensor(seconds, dtype=torch.float32) if videos else None,
    )


def _alloc(items: list[MediaItem], cfg: MediaConfig, shared: bool) -> torch.Tensor | None:
    if not items:
        return None
    rows = sum(math.prod(i.grid_thw) for i in items)
    out = torch.empty((rows, cfg.patch_dim), dtype=cfg.torch_pixel_dtype)
    if shared:
        out.share_memory_()  # type: ignore[no-untyped-call]
    return out


def _slot(pixels: torch.Tensor | None, start: int, rows: int) -> torch.Tensor:
    assert pixels is not None  # allocated from the same items
    return pixels[start : start + rows]


def _grids(items: list[MediaItem]) -> torch.Tensor | None:
    return torch.tensor([list(i.grid_thw) for i in items], dtype=torch.long) if items else None


# --- internals ------------------------------------------------------------------------------


def _guarded_frames(
    fn: Callable[..., tuple[UInt8Array, E]],
    data: bytes,
    cfg: MediaConfig,
    key: str,
    member: str,
    use: Callable[[UInt8Array, E], R],
) -> R:
    """``use(*fn(data, cfg, key, member, alloc))``, ``fn`` in the decoder process (see
    :mod:`media_guard`); failures of ``fn`` are ``MediaError`` kind ``corrupt``."""
    return guarded_frames(
        fn,
        data,
        cfg,
        key,
        member,
        use=use,
        key=key,
        member=member,
        kind="corrupt",
        isolation=cfg.decode_isolation,
        timeout_s=cfg.decode_timeout_s,
    )


def _decode_image(
    data: bytes, cfg: MediaConfig, key: str, member: str, alloc: Alloc
) -> tuple[UInt8Array, tuple[int, int, int]]:
    """Patch levels (:func:`_patch_levels`) of the image resized to the probed grid, written
    into ``alloc``, and the grid (runs in the decoder process)."""
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
    return _patch_levels([resized], cfg, alloc), (1, gh, gw)


def _probe_video(data: bytes, cfg: MediaConfig, key: str, member: str) -> VideoProbe:
    """:func:`probe_video` (runs in the decoder process)."""
    reader = _open_video(data, key, member)
    width, height = _video_size(reader, data, key, member)
    return _video_plan(reader, width, height, cfg, key, member)


def _decode_video(
    data: bytes, cfg: MediaConfig, key: str, member: str, alloc: Alloc
) -> tuple[UInt8Array, VideoProbe]:
    """Patch levels (:func:`_patch_levels`) of the sampled frames resized to the probed grid,
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
    resized = [Image.fromarray(f).resize(size, Image.Resampling.BICUBIC) for f in batch]
    return _patch_levels(resized, cfg, alloc), plan


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


def _patch_levels(frames: Sequence[Image.Image], cfg: MediaConfig, alloc: Alloc) -> UInt8Array:
    """RGB frames -> uint8 patch levels ``[t*h*w, C*tp*p*p]`` in an array from ``alloc``.

    ``tp`` is ``temporal_patch_size`` for a clip (a multiple of it in frames) and 1 for a
    still, which :func:`_patches` repeats. One transposing copy per frame, straight from the
    frame's interleaved RGB (numpy's strided copy is faster here than torch's).
    """
    width, height = frames[0].size
    tp = 1 if len(frames) == 1 else cfg.temporal_patch_size
    p, m = cfg.patch_size, cfg.merge_size
    gt, gh, gw = len(frames) // tp, height // p, width // p
    levels = alloc((gt * gh * gw, 3 * tp * p * p))
    # [t, h/m, w/m, m, m, C, tp, p, p]: the order of the rows and values of a patch.
    target = levels.reshape(gt, gh // m, gw // m, m, m, 3, tp, p, p)
    for index, frame in enumerate(frames):
        rgb = np.asarray(frame).reshape(gh // m, m, p, gw // m, m, p, 3)
        np.copyto(target[index // tp, ..., index % tp, :, :], rgb.transpose(0, 3, 1, 4, 6, 2, 5))
    return levels


def _patches(levels: torch.Tensor, cfg: MediaConfig, out: torch.Tensor | None) -> torch.Tensor:
    """uint8 patch levels (:func:`_patch_levels`) -> patches of ``cfg.pixel_dtype``.

    Always writes a new tensor (or ``out``): ``levels`` may be a view of the decoder's shared
    block. A still's temporal repeat is a copy of whole ``p*p`` runs. float32 values are
    ``x / 255``, ``- mean``, ``/ std`` in float32 on contiguous patches: ``x / 255`` in float32
    equals transformers' float32(float64(x) * (1/255)) for every 8-bit level and the mean/std
    steps are the same float32 operations, so the values are those of
    :func:`_normalization_table` (checked level by level in the tests).
    """
    rows = levels.shape[0]
    repeat = cfg.patch_dim // levels.shape[1]
    if out is None:
        out = torch.empty((rows, cfg.patch_dim), dtype=cfg.torch_pixel_dtype)
    by_channel = levels.view(rows, 3, 1, -1)
    if cfg.pixel_dtype == "uint8":
        out.view(rows, 3, repeat, -1).copy_(by_channel.expand(-1, -1, repeat, -1))
        return out
    values = out.view(rows, 3, 1, -1) if repeat == 1 else torch.empty(by_channel.shape)
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(cfg.image_std, dtype=torch.float32).view(1, 3, 1, 1)
    torch.div(by_channel, 255.0, out=values).sub_(mean).div_(std)
    if repeat > 1:
        out.view(rows, 3, repeat, -1).copy_(values.expand(-1, -1, repeat, -1))
    return out


def _checked_out(
    out: torch.Tensor | None, rows: int, cfg: MediaConfig, key: str, member: str
) -> torch.Tensor | None:
    if out is None or (out.shape == (rows, cfg.patch_dim) and out.dtype == cfg.torch_pixel_dtype):
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


# --- decoded frames (datasets that store pixel arrays, e.g. Megatron-Bridge's Qwen-VL layout) --


def probe_frames(
    frames: Frames,
    kind: Literal["image", "video"],
    config: MediaConfig | None = None,
    *,
    key: str = "?",
    member: str = "?",
) -> tuple[tuple[int, int, int], int, float | None]:
    """Grid ``(t, h, w)``, token count and (videos) seconds per temporal patch of decoded frames.

    An image is sized like :func:`probe_image`. A video's frames are taken as already sampled
    (all are used; the last is repeated up to a multiple of ``temporal_patch_size``, as
    transformers does) at ``video_fps``, each sized like :func:`probe_video` sizes frames.
    """
    cfg = config or _DEFAULT
    count, height, width, channels = frames.shape
    if channels != 3 or min(frames.shape) <= 0 or len(frames.data) != math.prod(frames.shape):
        raise MediaError(
            key, member, "bad_sample", f"frames of shape {frames.shape}; expected [T, H, W, 3]"
        )
    if width * height > cfg.max_image_pixels:
        raise MediaError(
            key,
            member,
            "too_large",
            f"{width}x{height} pixels exceed max_image_pixels={cfg.max_image_pixels}",
        )
    if kind == "image":
        if count != 1:
            raise MediaError(key, member, "bad_sample", f"an image with {count} frames")
        grid = _image_grid(height, width, cfg, key, member)
        return grid, _tokens(grid, cfg), None
    tp = cfg.temporal_patch_size
    used = math.ceil(count / tp) * tp
    if used > cfg.video_max_frames:
        raise MediaError(
            key,
            member,
            "too_long",
            f"{count} frames exceed video_max_frames={cfg.video_max_frames}; sample fewer frames "
            "or raise MediaConfig.video_max_frames",
        )
    budget = max(
        min(cfg.video_max_pixels, cfg.video_total_pixels * tp // used),
        int(cfg.video_min_pixels * 1.05),
    )
    try:
        rh, rw = smart_resize(height, width, cfg.factor, cfg.video_min_pixels, budget)
    except ValueError as exc:
        raise MediaError(key, member, "aspect_ratio", str(exc)) from exc
    grid = (used // tp, rh // cfg.patch_size, rw // cfg.patch_size)
    return grid, _tokens(grid, cfg), tp / cfg.video_fps


def process_frames(
    frames: Frames,
    kind: Literal["image", "video"],
    config: MediaConfig | None = None,
    *,
    key: str = "?",
    member: str = "?",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Resize, normalise and patchify decoded frames (grid as :func:`probe_frames` says).

    Same pixels as :func:`process_image` / :func:`process_video` give for the same RGB frames.
    Returns (or writes into ``out``) ``[t*h*w, patch_dim]`` of ``cfg.pixel_dtype``.
    """
    cfg = config or _DEFAULT
    (gt, gh, gw), _, _ = probe_frames(frames, kind, cfg, key=key, member=member)
    size = (gw * cfg.patch_size, gh * cfg.patch_size)
    resized = [
        Image.fromarray(frame).resize(size, Image.Resampling.BICUBIC) for frame in frames.array()
    ]
    wanted = gt * cfg.temporal_patch_size
    if 1 < len(resized) < wanted:  # a clip padded with its last frame (a still is repeated)
        resized += [resized[-1]] * (wanted - len(resized))
    levels = torch.from_numpy(_patch_levels(resized, cfg, alloc_in_process))
    return _patches(levels, cfg, _checked_out(out, gt * gh * gw, cfg, key, member))


def image_frames(image: Image.Image) -> Frames:
    """A decoded PIL image as :class:`Frames`, converted to RGB as :func:`process_image` does
    (transparency composited on white), so it gives the same pixels as its file."""
    return Frames.from_array(np.asarray(_to_rgb(image))[None])
