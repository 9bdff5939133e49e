"""LLaVA-OneVision (``LlavaOnevisionProcessor``, Qwen2 text backbone, SigLIP vision tower).

Each ``<image>`` placeholder becomes a run of ``<image>`` tokens, nothing around it. A sample
with one image is tiled (anyres): base view ``num_image_tokens`` plus the unpadded grid of the
best ``image_grid_pinpoints`` resolution (shrunk past ``anyres_max_N``) with one newline token
per grid row. A sample with two or more images gives each ``num_image_tokens + 1`` (730 for
the released 729), untiled. ``vision_feature_select_strategy="default"`` takes one off each.

Each ``<video>`` becomes ``frames x ceil(side / 2)**2 + 1`` ``<video>`` tokens (each frame's
patch grid pooled by 2, one newline per video). The model stacks a batch's videos into one
``[videos, frames, 3, H, W]`` tensor, so every video must keep the same frame count: the video
processor must sample a fixed ``num_frames``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch.nn import functional
from transformers.image_processing_utils import select_best_resolution

from energon_pack.encoding.families.base import ProcessorFamily, SampledVideo, joined, jsonable

__all__ = ["LlavaOnevisionFamily"]

_HEADER = re.compile(r"<\|im_start\|>assistant ?\n")
_END = "<|im_end|>"


def _setting(values: Any, key: str) -> Any:
    """``values[key]`` of a dict or a transformers ``SizeDict`` (None when unset)."""
    if isinstance(values, Mapping):
        return values.get(key)
    return getattr(values, key, None)


class LlavaOnevisionFamily(ProcessorFamily):
    """LLaVA-OneVision: anyres tiling for a lone image, one fixed-size view per image when a
    sample holds several; ``pixel_values`` ``[images, patches, 3, H, W]`` padded to the most
    patches, with ``image_sizes`` and the per-sample ``batch_num_images``."""

    name: ClassVar[str] = "llava_onevision"
    processor_classes: ClassVar[tuple[str, ...]] = ("LlavaOnevisionProcessor",)
    takes_videos: ClassVar[bool] = True

    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        if processor.num_image_tokens is None:
            raise ValueError("LlavaOnevisionProcessor.num_image_tokens is not set")

    def settings(self) -> dict[str, Any]:
        """The base settings plus the processor-level ones that change token counts."""
        out = super().settings()
        out["processor"] = jsonable(
            {
                "num_image_tokens": self.processor.num_image_tokens,
                "vision_feature_select_strategy": self.processor.vision_feature_select_strategy,
                "vision_aspect_ratio": self.processor.vision_aspect_ratio,
            }
        )
        return out

    def _patch_size(self) -> tuple[int, int]:
        """``(height, width)`` of each processed patch (``pixel_values[0][0]``): the crop size
        when center-cropping, else ``size`` (``shortest_edge`` gives a square)."""
        image_processor = self.processor.image_processor
        crop = image_processor.crop_size
        if image_processor.do_center_crop and crop:
            return int(_setting(crop, "height")), int(_setting(crop, "width"))
        size = image_processor.size
        if _setting(size, "height") and _setting(size, "width"):
            return int(_setting(size, "height")), int(_setting(size, "width"))
        edge = int(_setting(size, "shortest_edge"))
        return edge, edge

    def _tiled_tokens(self, height: int, width: int) -> int:
        """Features of a lone (anyres-tiled) image, before the select-strategy adjustment."""
        pinpoints = self.processor.image_processor.image_grid_pinpoints
        best_height, best_width = select_best_resolution((height, width), pinpoints)
        patch_height, patch_width = self._patch_size()
        base = int(self.processor.num_image_tokens)
        side = int(math.sqrt(base))
        current_height = side * (best_height // patch_height)
        current_width = side * (best_width // patch_width)
        if width / height > current_width / current_height:
            new_height = int(round(height * (current_width / width), 7))
            current_height -= ((current_height - new_height) // 2) * 2
        else:
            new_width = int(round(width * (current_height / height), 7))
            current_width -= ((current_width - new_width) // 2) * 2
        unpadded, newlines = current_height * current_width, current_height
        # the processor's own parse: a character-set strip of "anyres_max_N"
        max_patches = int(str(self.processor.vision_aspect_ratio).strip("anyres_max_"))  # noqa: B005
        ratio = math.sqrt(current_height * current_width / (max_patches * side**2))
        if ratio > 1.1:
            unpadded = int(current_height // ratio) * int(current_width // ratio)
            newlines = int(current_height // ratio)
        return int(unpadded + newlines + base)

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``<image>`` repeated per image: tiled count for a lone image, ``num_image_tokens +
        1`` each when the sample holds several; one fewer under the ``"default"`` strategy."""
        drop = 1 if self.processor.vision_feature_select_strategy == "default" else 0
        token = self.image_placeholder
        if len(sizes) == 1:
            height, width = sizes[0]
            return [token * (self._tiled_tokens(height, width) - drop)]
        each = int(self.processor.num_image_tokens) + 1 - drop
        return [token * each for _ in sizes]

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """``<video>`` repeated ``frames x pooled**2 + 1`` times per video; a ValueError unless
        the video processor samples a fixed ``num_frames`` (the model takes one frame count
        per batch)."""
        fixed = self.video_setting("do_sample_frames") and self.video_setting("num_frames")
        if not fixed or self.video_setting("fps") is not None:
            raise ValueError(
                "LLaVA-OneVision stacks a row's videos into one tensor, so each must keep the "
                "same frame count: set the video processor's do_sample_frames=True and "
                "num_frames (not fps)"
            )
        side = math.ceil(int(math.sqrt(int(self.processor.num_image_tokens))) / 2)
        token = str(self.processor.video_token)
        return [token * (len(video.frames) * side * side + 1) for video in videos]

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """From after each ``<|im_start|>assistant`` header (the released template writes
        ``assistant \\n`` in turns, the generation prompt ``assistant\\n``) through
        ``<|im_end|>``."""
        spans = []
        position = 0
        while match := _HEADER.search(text, position):
            stop = text.find(_END, match.end())
            if stop < 0:
                break
            spans.append((match.end(), stop + len(_END)))
            position = stop + len(_END)
        return spans

    def row_inputs(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One packed row's media: ``pixel_values`` zero-padded on the patch dimension to the
        most patches in the row then joined on images (as the processor pads a batch),
        ``image_sizes`` joined, and ``batch_num_images`` one count per sample with images, so
        each sample keeps its own tiled / untiled rule."""
        out: dict[str, torch.Tensor] = {}
        videos = [s["pixel_values_videos"] for s in samples if "pixel_values_videos" in s]
        if videos:
            out["pixel_values_videos"] = joined(videos)
        present = [sample for sample in samples if "pixel_values" in sample]
        if not present:
            return out
        values = [sample["pixel_values"] for sample in present]
        most = max(int(value.shape[1]) for value in values)
        pixels = [
            functional.pad(value, (0, 0) * 3 + (0, most - value.shape[1])) for value in values
        ]
        return {
            **out,
            "pixel_values": torch.cat(pixels),
            "image_sizes": torch.cat([sample["image_sizes"] for sample in present]),
            "batch_num_images": torch.cat([sample["batch_num_images"] for sample in present]),
        }
