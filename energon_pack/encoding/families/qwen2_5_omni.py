"""Qwen2.5-Omni's thinker (``Qwen2_5OmniProcessor``): images, videos and audio.

The chat template renders ``<|vision_bos|><|IMAGE|><|vision_eos|>`` per image and
``<|audio_bos|><|AUDIO|><|audio_eos|>`` per audio. The processor widens ``<|IMAGE|>`` to
``(h/14)*(w/14)/2**2`` tokens on the size its Qwen2-VL image processor smart-resizes to, and
``<|AUDIO|>`` to one token per audio-encoder output frame
(:mod:`~energon_pack.encoding.families.whisper_audio`). Inputs: ``pixel_values``,
``image_grid_thw``, ``input_features``, ``feature_attention_mask``. A video (where the processor
has its Qwen2-VL video processor) renders ``<|vision_bos|><|VIDEO|><|vision_eos|>``; ``<|VIDEO|>``
widens to ``ceil(frames / temporal_patch_size) * (h/14)*(w/14)/2**2`` tokens for the frames the
video processor samples, on the size it smart-resizes each frame to (``pixel_values_videos``,
``video_grid_thw``, and ``video_second_per_grid``: ``temporal_patch_size`` over the call's
``fps``, 2 by default, as the processor writes it). Packed rows: ``[4, 1, T]`` positions, a text
row restarting per segment over the three mRoPE rows of the model's own ``get_rope_index`` for
each segment alone (its image and video grids, video timing and audio lengths). Audio inside a
video (``load_audio_from_video``) is not served.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import PackingRule, SampledVideo, jsonable
from energon_pack.encoding.families.whisper_audio import WhisperAudioFamily
from energon_pack.media.config import smart_resize

__all__ = ["Qwen25OmniFamily"]


class Qwen25OmniFamily(WhisperAudioFamily):
    """Qwen2.5-Omni's thinker: Qwen2-VL images and Whisper audio, ``[4, 1, T]`` packed
    positions."""

    name: ClassVar[str] = "qwen2_5_omni"
    processor_classes: ClassVar[tuple[str, ...]] = ("Qwen2_5OmniProcessor",)
    packing: ClassVar[PackingRule] = "mrope"
    segment_keys: ClassVar[frozenset[str]] = frozenset(
        {"image_grid_thw", "feature_attention_mask", "video_grid_thw", "video_second_per_grid"}
    )
    image_processor_media: ClassVar[tuple[str, ...] | None] = ()
    takes_videos: ClassVar[bool] = True
    default_video_fps: ClassVar[float] = 2.0
    """The ``fps`` the processor times a video's grids by when its call is given none."""

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``<|IMAGE|>`` repeated ``grid_h * grid_w / merge**2`` times per image."""
        patch = int(self.image_setting("patch_size"))
        merge = int(self.image_setting("merge_size"))
        size = self.image_setting("size")
        least, most = _setting(size, "shortest_edge"), _setting(size, "longest_edge")
        out = []
        for height, width in sizes:
            if self.image_setting("do_resize"):
                height, width = smart_resize(height, width, patch * merge, least, most)
            out.append(self.image_placeholder * ((height // patch) * (width // patch) // merge**2))
        return out

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """``<|VIDEO|>`` repeated ``grid_t * grid_h * grid_w / merge**2`` times per video: its
        kept frames in temporal patches (the last repeated to fill one), each frame resized as
        the video processor resizes it (its pixel cap shared over the frames with
        ``cap_pixels_per_frame``)."""
        setting = self.video_setting
        patch, merge = int(setting("patch_size")), int(setting("merge_size"))
        temporal = int(setting("temporal_patch_size"))
        size = setting("size")
        least, most = _setting(size, "shortest_edge"), _setting(size, "longest_edge")
        token = str(self.video_placeholder)
        out = []
        for video in videos:
            frames = len(video.frames)
            height, width = video.header.height, video.header.width
            if setting("do_resize"):
                cap = most
                if setting("cap_pixels_per_frame"):
                    total = int(int(setting("max_video_tokens")) * (patch * merge) ** 2 * 0.9)
                    cap = max(min(most, total * temporal // frames), int(least * 1.05))
                height, width = smart_resize(height, width, patch * merge, least, cap)
            grid = math.ceil(frames / temporal) * (height // patch) * (width // patch)
            out.append(token * (grid // merge**2))
        return out

    def video_inputs(self, videos: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """The video processor's outputs and ``video_second_per_grid``, one per video:
        ``temporal_patch_size`` over the processor call's ``fps`` (its default 2, not the
        rate the frames were sampled at), as the processor computes it."""
        out = super().video_inputs(videos)
        fps = self._video_kwargs.get("fps") or self.default_video_fps
        seconds = int(self.video_setting("temporal_patch_size")) / fps
        out["video_second_per_grid"] = torch.tensor([seconds] * len(videos))
        return out

    def settings(self) -> dict[str, Any]:
        """The base settings (the image processor's) plus the feature extractor's."""
        out = super().settings()
        out["feature_extractor"] = jsonable(self.processor.feature_extractor.to_dict())
        return out

    def position_ids(
        self, model: Any, input_ids: torch.Tensor, media: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """One segment's ``[4, 1, L]`` positions: ``arange(L)`` (the text row, from which the
        thinker's text model builds the packed causal mask) over the three mRoPE rows of the
        model's own ``get_rope_index`` for this segment alone (its ids, its image and video
        grids, its videos' seconds per grid and its audios' mel lengths). Concatenated along
        the last dim, the segments' positions make a packed row's ``position_ids``; pass no
        attention mask."""
        ids = input_ids.reshape(1, -1)
        rope = getattr(model, "get_rope_index", None) or model.thinker.get_rope_index
        features = media.get("feature_attention_mask")
        with torch.no_grad():
            positions, _ = rope(
                ids,
                image_grid_thw=media.get("image_grid_thw"),
                video_grid_thw=media.get("video_grid_thw"),
                attention_mask=torch.ones_like(ids),
                audio_seqlens=None if features is None else features.sum(-1),
                second_per_grids=media.get("video_second_per_grid"),
            )
        text = torch.arange(ids.shape[1], device=positions.device, dtype=positions.dtype)
        return torch.cat([text.view(1, 1, -1), positions], dim=0)


def _setting(values: Any, key: str) -> int:
    """``values[key]`` of a dict or a transformers ``SizeDict``."""
    found: Any = values.get(key) if isinstance(values, Mapping) else getattr(values, key)
    return int(found)
