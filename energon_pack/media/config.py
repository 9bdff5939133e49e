"""Media settings, limits, probe results and sizing rules (no torch: the decoder process loads
this).

Defaults follow the Qwen2-VL processors; :func:`smart_resize` is their sizing rule,
:func:`image_grid` / :func:`video_grid` the patch grids it gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

from energon_pack.checks import check_int, check_number, check_numbers
from energon_pack.media.errors import MediaFailure

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_CONFIG",
    "IMAGE_EXTENSIONS",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "PIXEL_DTYPES",
    "RESCALE_FACTOR",
    "RUNTIME_FIELDS",
    "VIDEO_EXTENSIONS",
    "VIDEO_RULES",
    "ImageProbe",
    "Isolation",
    "MediaConfig",
    "MediaKind",
    "PixelDtype",
    "VideoProbe",
    "VideoRuleName",
    "image_grid",
    "smart_resize",
    "smart_resize_video",
    "token_count",
    "video_grid",
]

OPENAI_CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
IMAGE_EXTENSIONS: frozenset[str] = frozenset({"jpg", "jpeg", "png", "webp"})
VIDEO_EXTENSIONS: frozenset[str] = frozenset({"mp4"})
RESCALE_FACTOR = 1 / 255
"""transformers' ``rescale_factor`` of 8-bit pixels."""


MediaKind = Literal["image", "video", "audio"]
"""What a sample's medium is."""
Isolation = Literal["process", "off"]
"""``"process"``: native decoding in the helper process; ``"off"``: in the calling process."""
PixelDtype = Literal["float32", "uint8"]
PIXEL_DTYPES: tuple[PixelDtype, ...] = ("float32", "uint8")
VideoRuleName = Literal["qwen2_vl", "qwen3_vl"]
"""How videos are sampled, sized and laid out in tokens (:mod:`energon_pack.media.sampling`)."""
VIDEO_RULES: tuple[VideoRuleName, ...] = ("qwen2_vl", "qwen3_vl")
_INT_FIELDS = (
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "min_pixels",
    "max_pixels",
    "video_min_frames",
    "video_max_frames",
    "video_min_pixels",
    "video_max_pixels",
    "video_total_pixels",
    "max_image_pixels",
    "max_images_per_sample",
    "max_video_source_frames",
    "max_json_bytes",
    "max_json_depth",
)
_FLOAT_FIELDS = ("video_fps", "max_video_seconds", "decode_timeout_s")


@dataclass(frozen=True)
class MediaConfig:
    """Preprocessing settings and limits; defaults follow the Qwen2-VL processors.

    Image sizing uses ``min_pixels``/``max_pixels`` (``Qwen2VLImageProcessor``). Videos are sampled
    at ``video_fps`` within ``[video_min_frames, video_max_frames]`` (rounded down to a multiple of
    ``temporal_patch_size``) and each frame is resized within ``[video_min_pixels,
    video_max_pixels]``, further capped so that all frames together stay under
    ``video_total_pixels`` (``Qwen2VLVideoProcessor`` with ``cap_pixels_per_frame=True``).
    That is ``video_rule="qwen2_vl"``. With ``video_rule="qwen3_vl"`` (``Qwen3VLVideoProcessor``)
    ``int(frames / fps * video_fps)`` frames are sampled, clamped to ``[video_min_frames,
    video_max_frames]`` and to the clip's frame count, spread evenly over the clip
    (``linspace(0, frames - 1, n)`` rounded), an odd count padded with the last frame; all
    frames together are resized within ``[video_min_pixels, video_total_pixels]`` counted over
    ``t*h*w`` (``video_max_pixels`` is not used), and each temporal patch is its own vision block
    preceded by its timestamp text (:mod:`energon_pack.media.tokens`), as transformers 4.57 and
    5.25 write it; ``video_outer_block=True`` keeps the outer ``<|vision_start|>`` /
    ``<|vision_end|>`` pair that transformers 5.0 to 5.24 write around those blocks. A model
    family preset (:func:`energon_pack.model_family`) sets all of these for its checkpoints.
    Limits reject a sample before decoding: ``max_image_pixels`` (decoded-size bomb guard, also
    applied to video frames), ``max_images_per_sample``, ``max_video_source_frames`` and
    ``max_video_seconds``.

    ``pixel_dtype`` is the dtype of the patches handed out: ``"float32"`` (normalised, what a
    model takes as it is) or ``"uint8"`` (raw pixels, 4x smaller through workers, shared memory
    and the loader; the training step must call :func:`energon_pack.media.normalize_pixels`
    on them).

    ``decode_isolation="process"`` (default) runs decord and Pillow's pixel decoding in a helper
    process (:mod:`energon_pack.media.guard`), so a native crash or a hang past
    ``decode_timeout_s`` becomes a :class:`~energon_pack.media.MediaError` (``crashed`` /
    ``timeout``) instead of killing the run; ``"off"`` decodes in the calling process.
    ``max_json_bytes`` and ``max_json_depth`` bound the parsing of a sample's JSON member.
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
    video_rule: VideoRuleName = "qwen2_vl"
    video_outer_block: bool = False
    video_frames_fps: float | None = None
    decode_isolation: Isolation = "process"
    decode_timeout_s: float = 60.0
    max_json_bytes: int = 16 * 2**20
    max_json_depth: int = 64

    def __post_init__(self) -> None:
        if self.pixel_dtype not in PIXEL_DTYPES:
            raise ValueError(
                f"MediaConfig.pixel_dtype must be one of {list(PIXEL_DTYPES)}, got "
                f"{self.pixel_dtype!r}; use 'uint8' to ship raw pixels and normalise them in the "
                "training step with energon_pack.media.normalize_pixels"
            )
        defaults = {f.name: f.default for f in fields(self)}
        for name in _INT_FIELDS:
            fix = f"pass an int >= 1, e.g. {name}={defaults[name]!r} (the default)"
            check_int(f"MediaConfig.{name}", getattr(self, name), fix=fix)
        for name in _FLOAT_FIELDS:
            fix = f"pass a finite number > 0, e.g. {name}={defaults[name]!r} (the default)"
            check_number(f"MediaConfig.{name}", getattr(self, name), fix=fix)
        check_numbers(
            "MediaConfig.image_mean",
            self.image_mean,
            length=3,
            fix="pass the (R, G, B) means of the model's processor, e.g. OPENAI_CLIP_MEAN",
        )
        check_numbers(
            "MediaConfig.image_std",
            self.image_std,
            length=3,
            above=0.0,
            fix="pass the (R, G, B) standard deviations of the model's processor, e.g. "
            "OPENAI_CLIP_STD (pixels are divided by them)",
        )
        if self.video_rule not in VIDEO_RULES:
            raise ValueError(
                f"MediaConfig.video_rule must be one of {list(VIDEO_RULES)}, got "
                f"{self.video_rule!r}; use a model family preset "
                "(energon_pack.model_family(...).media) to get the rule of a checkpoint"
            )
        if not isinstance(self.video_outer_block, bool):
            raise ValueError(
                f"MediaConfig.video_outer_block must be True or False, got "
                f"{self.video_outer_block!r}; True writes the Qwen3-VL video form of "
                "transformers 5.0 to 5.24"
            )
        if self.video_frames_fps is not None:
            check_number(
                "MediaConfig.video_frames_fps",
                self.video_frames_fps,
                fix="pass the rate decoded frames were sampled at (e.g. 2.0), or None",
            )
        if self.decode_isolation not in ("process", "off"):
            raise ValueError(
                f"MediaConfig.decode_isolation must be 'process' or 'off', got "
                f"{self.decode_isolation!r}; 'process' guards against native decoder crashes"
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

    def settings(self) -> dict[str, object]:
        """Every field that decides what a sample's media become (tokens, grids, pixels), by
        name: all but :data:`RUNTIME_FIELDS`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in RUNTIME_FIELDS}

    @property
    def torch_pixel_dtype(self) -> torch.dtype:
        """``pixel_dtype`` as a torch dtype."""
        import torch  # here, not at the top: the decoder process never imports torch

        dtype: torch.dtype = getattr(torch, self.pixel_dtype)
        return dtype


DEFAULT_CONFIG = MediaConfig()
"""The settings of calls given no ``config``."""
RUNTIME_FIELDS = frozenset({"decode_isolation", "decode_timeout_s"})
"""The :class:`MediaConfig` fields that decide how media are decoded (in which process, for
how long), not what they become."""


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

    ``frames`` is the sampled frame count, ``frame_indices`` the source frames decoded (the
    last repeated up to a multiple of ``temporal_patch_size``), ``fps`` the source average
    frame rate, ``second_per_grid_t`` the seconds covered by one temporal patch; ``tokens`` counts
    the pad tokens. ``timestamps`` (``video_rule="qwen3_vl"``) are the seconds written before
    each temporal patch's block, None where the video is one block.
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
    frame_indices: tuple[int, ...] = ()
    timestamps: tuple[float, ...] | None = None


def _check_aspect_ratio(height: int, width: int) -> None:
    """The processors' limit: a ``ValueError`` for an aspect ratio above 200."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            "absolute aspect ratio must be smaller than 200, got "
            f"{max(height, width) / min(height, width)}"
        )


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
    _check_aspect_ratio(height, width)
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


def smart_resize_video(
    frames: int,
    height: int,
    width: int,
    *,
    temporal_factor: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Qwen3-VL video target ``(height, width)``: multiples of ``factor`` with
    ``frames * height * width`` within the pixel bounds (``frames`` rounded to a multiple of
    ``temporal_factor`` for the check, as transformers' Qwen3-VL ``smart_resize`` does; sides
    below ``factor`` are scaled up first). Raises ``ValueError`` for fewer frames than
    ``temporal_factor``, non-positive sizes or an aspect ratio above 200."""
    if frames < temporal_factor:
        raise ValueError(f"{frames} frames; the rule needs at least {temporal_factor}")
    if height <= 0 or width <= 0:
        raise ValueError(f"frame size must be positive, got height={height}, width={width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect_ratio(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(height: int, width: int, cfg: MediaConfig) -> tuple[int, int, int]:
    """The patch grid ``(1, h, w)`` of an image of that size."""
    try:
        rh, rw = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ValueError as exc:
        raise MediaFailure("aspect_ratio", str(exc)) from exc
    return 1, rh // cfg.patch_size, rw // cfg.patch_size


def video_grid(height: int, width: int, frames: int, cfg: MediaConfig) -> tuple[int, int, int]:
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
        raise MediaFailure("aspect_ratio", str(exc)) from exc
    return frames // cfg.temporal_patch_size, rh // cfg.patch_size, rw // cfg.patch_size


def token_count(grid: tuple[int, int, int], cfg: MediaConfig) -> int:
    """LLM tokens of a patch grid (``merge_size**2`` patches per token)."""
    t, h, w = grid
    return t * h * w // (cfg.merge_size * cfg.merge_size)
