"""Nemotron-H Omni (``NemotronH_Omni_Reasoning_V3Processor``): images, videos and audio into a
hybrid Mamba-2 / attention language model.

The chat template renders ``<image>``, ``<video>`` and ``<so_embedding>`` for the media. The
processor widens an image to ``<img>`` + ``<image>`` x ``gh * gw / merge**2`` + ``</img>``, on
the patch grid ``(gh, gw)`` its image processor resizes the image to: the image's own grid of
16-pixel patches scaled into the call's patch budget (the context length's, clamped to
``[min_num_patches, max_num_patches]``, at least ``min_num_patches`` per image of the sample)
with both sides multiples of ``merge``. A video becomes one line per tubelet of
``video_temporal_patch_dim`` frames, ``Frame i sampled at s seconds and frame j sampled at t
seconds: `` + ``<img>`` + ``<image>`` x (tokens of one frame tile) + ``</img>``, the tile an
aspect-keeping grid near ``video_target_num_patches``; the times are each frame's source index
times ``int(1000 / fps)`` milliseconds. An audio becomes ``<so_start>`` + ``<so_embedding>`` x
the Parakeet encoder's frames (``1 + samples // hop`` mel frames through its stride-2
subsampling) + ``<so_end>``. Inputs: ``pixel_values``, ``image_grid_hw``,
``pixel_values_videos`` (a sample's videos stacked), ``input_features``,
``input_features_mask``.

Packing is refused: the language model's Mamba-2 layers run over a row without sample
boundaries on transformers' PyTorch path, so a sample's state flows into the next, and the
model's video pruning (``video_pruning_rate``) drops tokens inside the forward. Rows hold one
sample each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import (
    Measured,
    PackingRule,
    SampledVideo,
    delimited_spans,
    joined,
    jsonable,
)
from energon_pack.encoding.families.frame_audio import FrameAudioFamily
from energon_pack.media.audio import AudioProbe
from energon_pack.media.audio_decode import played_frames

__all__ = ["NemotronHOmniFamily"]


class NemotronHOmniFamily(FrameAudioFamily):
    """Nemotron-H Omni: RADIO image and video tiles, Parakeet audio, packing refused."""

    name: ClassVar[str] = "nemotron_h_omni"
    processor_classes: ClassVar[tuple[str, ...]] = ("NemotronH_Omni_Reasoning_V3Processor",)
    packing: ClassVar[PackingRule] = "refused"
    refusal: ClassVar[str | None] = (
        "its Mamba-2 layers run over a packed row without sample boundaries (transformers "
        "passes them none), so one sample's state flows into the next, and its video pruning "
        "drops tokens inside the model"
    )
    takes_videos: ClassVar[bool] = True
    image_processor_media: ClassVar[tuple[str, ...] | None] = ()

    def media_expansions(self, measured: Sequence[Measured]) -> list[str]:
        """The base expansions; a sample holding both an image and a video is a ValueError
        (the model fills the same token with both, and refuses such a sample)."""
        kinds = {type(shape) for shape in measured}
        if tuple in kinds and SampledVideo in kinds:
            raise ValueError(
                "the Nemotron-H Omni model takes no sample holding both an image and a video "
                "(their features fill the same token); split the sample"
            )
        return super().media_expansions(measured)

    def _merge(self, setting: Any) -> int:
        """The pixel-shuffle factor of a ``downsample_ratio`` setting."""
        return round(1 / float(setting))

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``<img>`` + ``<image>`` x the merged patches of each image's grid + ``</img>``."""
        patch = int(self.image_setting("patch_size"))
        merge = self._merge(self.image_setting("downsample_ratio"))
        least = int(self.image_setting("min_num_patches"))
        most = int(self.image_setting("max_num_patches"))
        budget = max((int(self.image_setting("max_model_len")) - 4) * merge**2, least * len(sizes))
        budget = max(min(budget, most) if most else budget, least)
        out = []
        for height, width in sizes:
            rows, columns = _patch_grid(height, width, patch, merge, least, budget)
            out.append(self._tile(rows * columns // merge**2))
        return out

    def _tile(self, tokens: int) -> str:
        """``<img>`` + ``tokens`` image tokens + ``</img>``."""
        start, end = self.processor.image_start_token, self.processor.image_end_token
        return f"{start}{self.image_placeholder * tokens}{end}"

    @property
    def video_token_ids(self) -> frozenset[int]:
        """A video's frames fill ``<image>`` tokens (the tokenizer has no video token)."""
        return self.vision_token_ids if self.video_placeholder is not None else frozenset()

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """Per tubelet of each video, its frames' times and one tile; a ValueError where a
        sample's videos differ in tubelets or tile (the processor stacks them)."""
        temporal = int(self.processor.video_temporal_patch_dim)
        shapes = {(math.ceil(len(v.frames) / temporal), self._video_tile(v)) for v in videos}
        if len(shapes) > 1:
            raise ValueError(
                f"a sample's videos must have the same number of tubelets and tile size, "
                f"got {sorted(shapes)} (the processor stacks them)"
            )
        return [self._video_text(video, temporal) for video in videos]

    def _video_tile(self, video: SampledVideo) -> tuple[int, int]:
        """``(rows, columns)`` of patches of each frame: aspect-keeping near the target."""
        setting = self.video_setting
        target, divisor = (
            int(setting("video_target_num_patches")),
            self._merge(setting("downsample_ratio")),
        )
        height, width = video.header.height, video.header.width
        if not setting("video_maintain_aspect_ratio"):
            side = max(divisor, int(math.sqrt(target)) // divisor * divisor)
            return side, side
        aspect = width / max(height, 1)
        rows, columns = (
            max(round(math.sqrt(target / aspect)), 1),
            max(round(math.sqrt(target * aspect)), 1),
        )
        if divisor > 1:
            up_rows = rows + (divisor - rows % divisor if rows % divisor else 0)
            up_columns = columns + (divisor - columns % divisor if columns % divisor else 0)
            if up_rows * up_columns <= target:
                return up_rows, up_columns
            return max(divisor, rows - rows % divisor), max(divisor, columns - columns % divisor)
        return rows, columns

    def _video_text(self, video: SampledVideo, temporal: int) -> str:
        rows, columns = self._video_tile(video)
        tile = self._tile(
            rows * columns // self._merge(self.video_setting("downsample_ratio")) ** 2
        )
        fps = video.header.fps or None
        step_ms = int(1000.0 / fps) if fps is not None else 0
        count = len(video.frames)
        lines = []
        for group in range(math.ceil(count / temporal)):
            parts = []
            for offset in range(min(temporal, count - group * temporal)):
                index = group * temporal + offset
                prefix = "Frame" if offset == 0 else "frame"
                if fps is None:
                    parts.append(f"{prefix} {index + 1}")
                else:
                    seconds = int(video.frames[index]) * step_ms / 1000.0
                    parts.append(f"{prefix} {index + 1} sampled at {seconds:.2f} seconds")
            lines.append(" and ".join(parts) + ": " + tile)
        return "\n".join(lines)

    def video_inputs(self, videos: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """``pixel_values_videos`` ``[videos, tubelets, temporal * 3, H, W]``: the video
        processor on each video's kept frames, in tubelets of ``video_temporal_patch_dim``."""
        kwargs = {
            "temporal_patch_size": int(self.processor.video_temporal_patch_dim),
            **self._video_kwargs,
            "do_sample_frames": False,
            "return_tensors": "pt",
        }
        for name in ("num_frames", "fps", "return_metadata"):
            kwargs.pop(name, None)
        outs = [self.processor.video_processor(videos=[video], **kwargs) for video in videos]
        return {"pixel_values_videos": joined([out["pixel_values_videos"] for out in outs])}

    @property
    def audio_rate(self) -> int:
        """The rate the processor's audio is at (``audio_sampling_rate``)."""
        return int(self.processor.audio_sampling_rate)

    def audio_expansions(self, probes: Sequence[AudioProbe]) -> list[str]:
        """``<so_start>`` + ``<so_embedding>`` x the encoder's frames + ``<so_end>``."""
        processor = self.processor
        return [
            f"{processor.audio_start_token}{self.audio_placeholder * self._audio_tokens(p)}"
            f"{processor.audio_end_token}"
            for p in probes
        ]

    def _audio_tokens(self, probe: AudioProbe) -> int:
        """The Parakeet encoder's frames of an audio: ``1 + samples // hop`` mel frames through
        ``log2(subsampling)`` convolutions of stride 2, at least one."""
        processor = self.processor
        length = 1 + played_frames(probe, self.audio_rate) // int(processor.audio_hop_length)
        kernel = int(getattr(processor, "audio_subsampling_conv_kernel_size", 3))
        stride = int(getattr(processor, "audio_subsampling_conv_stride", 2))
        padding = (kernel - 1) // 2 * 2 - kernel
        for _ in range(int(math.log2(int(processor.audio_subsampling_factor)))):
            length = (length + padding) // stride + 1
        return max(1, length)

    def row_inputs(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The rows' media joined (audio as :class:`FrameAudioFamily` pads it); a ValueError
        where the videos of the rows differ in tubelets or tile (the model stacks a batch's
        videos: train such rows in micro-batches of one)."""
        shapes = {
            tuple(s["pixel_values_videos"].shape[1:]) for s in samples if "pixel_values_videos" in s
        }
        if len(shapes) > 1:
            raise ValueError(
                f"the {self.name} model stacks a micro-batch's videos, and these rows' differ "
                f"({sorted(shapes)}); use a micro-batch of one row"
            )
        return super().row_inputs(samples)

    def settings(self) -> dict[str, Any]:
        """The base settings plus the feature extractor's and the processor's audio and
        tubelet settings."""
        out = super().settings()
        processor = self.processor
        out["feature_extractor"] = jsonable(processor.feature_extractor.to_dict())
        out["processor"] = {
            name: jsonable(getattr(processor, name, None))
            for name in (
                "audio_sampling_rate",
                "audio_subsampling_factor",
                "audio_hop_length",
                "video_temporal_patch_dim",
            )
        }
        return out

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """From after each ``<|im_start|>assistant\\n`` through its ``<|im_end|>``."""
        return delimited_spans(text, "<|im_start|>assistant\n", "<|im_end|>")


def _patch_grid(
    height: int, width: int, patch: int, merge: int, least: int, most: int
) -> tuple[int, int]:
    """The ``(rows, columns)`` patch grid the image processor resizes an image to: its own
    grid (``round(side / patch + 0.5)``, as the processor rounds it: a part patch counted
    whole, and an odd whole count one more) scaled down into ``most`` patches and up to
    ``least``, each side then rounded to a multiple of ``merge`` (up where the budget
    allows)."""
    rows, columns = round(height / patch + 0.5), round(width / patch + 0.5)
    scale = min(math.sqrt(most / (rows * columns)), 1.0)
    rows, columns = math.floor(scale * rows), math.floor(scale * columns)
    if most > least and rows * columns < least:
        if rows * columns == 0:  # the processor divides by zero here
            raise ValueError(
                f"a {height}x{width} image scales to no patch row or column in a budget of "
                f"{most} patches: its aspect ratio is too extreme for the processor"
            )
        scale = math.sqrt(least / (rows * columns))
        rows, columns = math.ceil(scale * rows), math.ceil(scale * columns)
    if rows % merge:
        if (rows + merge - rows % merge) * columns <= most:
            rows += merge - rows % merge
        else:
            rows = max(merge, rows - rows % merge)
    if columns % merge:
        if rows * (columns + merge - columns % merge) <= most:
            columns += merge - columns % merge
        else:
            columns = max(merge, columns - columns % merge)
    return rows, columns
