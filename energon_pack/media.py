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

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from typing import Any, Literal, Protocol, TypeVar

import numpy as np
import torch
from PIL import Image

from energon_pack.media_config import (
    IMAGE_EXTENSIONS,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    RESCALE_FACTOR,
    VIDEO_EXTENSIONS,
    ImageProbe,
    MediaConfig,
    MediaError,
    MediaErrorKind,
    PixelDtype,
    VideoProbe,
    smart_resize,
)
from energon_pack.media_decode import (
    decode_image_levels,
    decode_levels,
    decode_video_levels,
    image_grid,
    level_bytes,
    open_image,
    patch_levels,
    read_video_probe,
    resized_frames,
    to_rgb,
    token_count,
    video_grid,
)
from energon_pack.media_guard import (
    FramesJob,
    UInt8Array,
    alloc_in_process,
    guarded,
    guarded_frames,
    guarded_frames_each,
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

E = TypeVar("E")
R = TypeVar("R")

_DEFAULT = MediaConfig()
_NORMALIZE_ROWS = 256
"""Patch rows normalised at a time (about 1.2 MB of float32 at the default patch size)."""


@dataclass(frozen=True)
class MediaFootprint:
    """Bytes held before (compressed member) and after (processed tensors) decoding."""

    compressed_bytes: int
    processed_bytes: int

    @property
    def ratio(self) -> float:
        """``compressed_bytes / processed_bytes`` (about 0.01 for a 720p JPEG)."""
        return self.compressed_bytes / self.processed_bytes if self.processed_bytes else 0.0


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
    with media_errors(key, member, "unreadable"), open_image(data, cfg, key, member) as img:
        width, height = img.size
    grid = image_grid(height, width, cfg, key, member)
    return ImageProbe(width, height, grid, token_count(grid, cfg))


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
        pixels = _patches(levels, cfg, out, key, member)
        return pixels, torch.tensor([list(grid)], dtype=torch.long)

    return _guarded_frames(decode_image_levels, data, cfg, key, member, use=patches)


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
        read_video_probe,
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
        pixels = _patches(levels, cfg, out, key, member)
        grid = torch.tensor([list(plan.grid_thw)], dtype=torch.long)
        return pixels, grid, plan.second_per_grid_t

    return _guarded_frames(decode_video_levels, data, cfg, key, member, use=patches)


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
    encoded: list[tuple[str, MediaItem, torch.Tensor]] = []  # (key, item, slot) of file bytes
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
            if isinstance(item.data, Frames):
                process_frames(
                    item.data, item.kind, cfg, key=sample.key, member=item.member, out=slot
                )
            else:
                encoded.append((sample.key, item, slot))
    _decode_into(encoded, cfg)
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


def _decode_into(encoded: list[tuple[str, MediaItem, torch.Tensor]], cfg: MediaConfig) -> None:
    """Decode media files into their slots, as one batch through the decoder process (it
    decodes the next file while this process patchifies the last)."""

    def patches(index: int, levels: UInt8Array, _: object) -> None:
        key, item, slot = encoded[index]
        _patches(levels, cfg, slot, key, item.member)

    jobs = []
    for key, item, slot in encoded:
        assert isinstance(item.data, bytes)  # Frames are processed in this process
        args = (item.data, cfg, key, item.member, item.kind)
        nbytes = level_bytes(item.kind, slot.shape[0], cfg)
        jobs.append(FramesJob(args, key, item.member, nbytes))
    guarded_frames_each(
        decode_levels,
        jobs,
        use=patches,
        kind="corrupt",
        isolation=cfg.decode_isolation,
        timeout_s=cfg.decode_timeout_s,
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


def _patches(
    levels: UInt8Array, cfg: MediaConfig, out: torch.Tensor | None, key: str, member: str
) -> torch.Tensor:
    """uint8 patch levels (:func:`patch_levels`) of ``key``/``member`` -> patches of
    ``cfg.pixel_dtype``.

    Always writes a new tensor (or ``out``, which must hold exactly those patches): ``levels``
    may be a view of the decoder's shared block. A still's temporal repeat is a copy of whole
    ``p*p`` runs. float32 values are ``x / 255``, ``- mean``, ``/ std`` in float32, made in
    place in the output (a still's first temporal copy): ``x / 255`` in float32 equals
    transformers' float32(float64(x) * (1/255)) for every 8-bit level and the mean/std steps are
    the same float32 operations, so the values are those of :func:`_normalization_table`
    (checked level by level in the tests). The three passes run on :data:`_NORMALIZE_ROWS` rows
    at a time, which stay in the CPU cache.
    """
    rows = levels.shape[0]
    repeat = cfg.patch_dim // levels.shape[1]
    out = _checked_out(out, rows, cfg, key, member)
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
        grid = image_grid(height, width, cfg, key, member)
        return grid, token_count(grid, cfg), None
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
    grid = video_grid(height, width, used, cfg, key, member)
    return grid, token_count(grid, cfg), tp / cfg.video_fps


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
    resized = resized_frames(frames.array(), (gw * cfg.patch_size, gh * cfg.patch_size))
    wanted = gt * cfg.temporal_patch_size
    if 1 < len(resized) < wanted:  # a clip padded with its last frame (a still is repeated)
        resized += [resized[-1]] * (wanted - len(resized))
    return _patches(patch_levels(resized, cfg, alloc_in_process), cfg, out, key, member)


def image_frames(image: Image.Image) -> Frames:
    """A decoded PIL image as :class:`Frames`, converted to RGB as :func:`process_image` does
    (transparency composited on white), so it gives the same pixels as its file."""
    return Frames.from_array(np.asarray(to_rgb(image))[None])
