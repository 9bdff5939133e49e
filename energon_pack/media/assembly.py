"""A pack's media: :func:`decode_vision` decodes the media of the samples of a pack straight into
one tensor per field (:class:`MediaTensors`), from the compressed bytes (or decoded
:class:`~energon_pack.media.Frames`) and probed grids of each :class:`MediaItem`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from energon_pack._moved import renamed
from energon_pack.media.audio_decode import Waveform
from energon_pack.media.config import DEFAULT_CONFIG, MediaConfig, MediaKind
from energon_pack.media.decode import decode_levels, level_bytes
from energon_pack.media.errors import naming
from energon_pack.media.guard import FramesJob
from energon_pack.media.pixels import decode_patches, frames_patches
from energon_pack.media.probe import Frames

__all__ = [
    "MediaFootprint",
    "MediaItem",
    "MediaSample",
    "MediaTensors",
    "decode_vision",
    "footprint",
    "media_grids",
    "tensor_nbytes",
]


@dataclass(frozen=True)
class MediaFootprint:
    """Bytes held before (compressed member) and after (processed tensors) decoding."""

    compressed_bytes: int
    processed_bytes: int

    @property
    def ratio(self) -> float:
        """``compressed_bytes / processed_bytes`` (about 0.01 for a 720p JPEG)."""
        return self.compressed_bytes / self.processed_bytes if self.processed_bytes else 0.0


def tensor_nbytes(*tensors: torch.Tensor) -> int:
    """Bytes held by the given tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def footprint(data: bytes, *tensors: torch.Tensor) -> MediaFootprint:
    """Compressed size of ``data`` versus the bytes of its processed tensors."""
    return MediaFootprint(len(data), tensor_nbytes(*tensors))


@dataclass(frozen=True)
class MediaItem:
    """One image, video or audio of a sample: compressed bytes (or decoded :class:`Frames` /
    :class:`~energon_pack.media.audio_decode.Waveform`) plus what the probe told. An audio's
    ``tokens`` are its encoder tokens in the language model's sequence (``grid_thw`` is then
    ``(1, 1, tokens)``)."""

    member: str
    kind: MediaKind
    data: bytes | Frames | Waveform
    grid_thw: tuple[int, int, int]
    tokens: int
    second_per_grid_t: float | None = None
    """Seconds covered by one temporal patch (videos only)."""
    timestamps: tuple[float, ...] | None = None
    """Seconds written before each temporal patch's vision block (``video_rule="qwen3_vl"``);
    None: the medium is one block (see :func:`energon_pack.media.vision_tokens`)."""
    size: tuple[int, int] | None = None
    """``(height, width)`` as displayed, for a processor family's image or video (its processor
    resizes it at materialisation; ``grid_thw`` is then ``(frames, height, width)``)."""
    frame_indices: tuple[int, ...] | None = None
    """The source frames a processor family's video keeps (its video processor's sampling)."""
    audio_tokens: int = 0
    """Tokens of a video's own audio track among ``tokens`` (a processor family that loads
    the audio of videos); 0: none read."""

    @property
    def nbytes(self) -> int:
        """Bytes the payload holds."""
        return len(self.data) if isinstance(self.data, bytes) else len(self.data.data)

    @property
    def visual_kind(self) -> Literal["image", "video"]:
        """``kind`` of an image or video; a ValueError for audio, which the patch pipeline of
        the Qwen-VL presets never takes (their encoders refuse it)."""
        if self.kind == "audio":
            raise ValueError(f"medium {self.member!r} is audio, not an image or video")
        return self.kind


@dataclass(frozen=True)
class MediaTensors:
    """Decoded, patchified media of one sample, one packed row or a micro-batch of rows, in
    placeholder order: pixel patches, grids and video timings, one tensor per field."""

    pixel_values: torch.Tensor | None = None
    """``[sum of image grid products, 3*t*p*p]`` float32 (uint8 with
    ``MediaConfig(pixel_dtype="uint8")``, see :func:`~energon_pack.media.normalize_pixels`), or
    None without images."""
    image_grid_thw: torch.Tensor | None = None
    """``[images, 3]`` long."""
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    """``[videos]`` float32: seconds covered by one temporal patch of each video."""

    @classmethod
    def concat(cls, parts: Sequence[MediaTensors]) -> MediaTensors:
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


if TYPE_CHECKING:  # the old name, for type checkers
    VisionInputs = MediaTensors
    __all__ += ["VisionInputs"]
else:  # the old name, with a DeprecationWarning
    __getattr__ = renamed(__name__, "VisionInputs")


class MediaSample(Protocol):
    """What :func:`decode_vision` reads of a sample (e.g. an ``EncodedSample``)."""

    @property
    def key(self) -> str: ...
    @property
    def media(self) -> Sequence[MediaItem]: ...
    @property
    def vision(self) -> MediaTensors | None: ...


def decode_vision(
    samples: Sequence[MediaSample], config: MediaConfig | None = None, *, shared: bool = False
) -> MediaTensors:
    """The media of ``samples``, in order, decoded straight into one tensor per field.

    Each image and video is patchified into its slice of ``pixel_values`` /
    ``pixel_values_videos``, sized from the probed grids, so a packed row's pixels exist once.
    Already materialised samples are copied in. ``shared=True`` allocates the pixels in shared
    memory (where a DataLoader worker would copy the batch anyway).
    Raises :class:`~energon_pack.media.MediaError` naming the sample and member on bad media,
    with ``position`` the index of that sample in ``samples`` (keys may repeat).
    """
    cfg = config or DEFAULT_CONFIG
    items = [item for s in samples for item in s.media]
    pixels = {
        kind: _alloc([i for i in items if i.kind == kind], cfg, shared)
        for kind in ("image", "video")
    }
    offsets = {"image": 0, "video": 0}
    jobs: list[FramesJob] = []  # media files, decoded as one batch
    slots: list[torch.Tensor] = []  # where each job's patches go
    for position, sample in enumerate(samples):
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
            kind = item.visual_kind
            rows = math.prod(item.grid_thw)
            slot = _slot(pixels[kind], offsets[kind], rows)
            offsets[kind] += rows
            if isinstance(item.data, Frames):  # decoded already: patchified in this process
                with naming(sample.key, item.member, position=position):
                    frames_patches(item.data, kind, cfg, slot)
            else:
                nbytes = level_bytes(kind, rows, cfg)
                args = (item.data, cfg, kind)
                jobs.append(FramesJob(args, sample.key, item.member, nbytes, position))
                slots.append(slot)
    # The decoder process decodes the next file while this process patchifies the last.
    decode_patches(decode_levels, jobs, cfg, slots)
    grids = media_grids(samples)
    return replace(grids, pixel_values=pixels["image"], pixel_values_videos=pixels["video"])


def media_grids(samples: Sequence[MediaSample]) -> MediaTensors:
    """The grids and video timings of ``samples``' media, in order, from their probes only."""
    images = [item for s in samples for item in s.media if item.kind == "image"]
    videos = [item for s in samples for item in s.media if item.kind == "video"]
    seconds = [item.second_per_grid_t or 0.0 for item in videos]
    return MediaTensors(
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
