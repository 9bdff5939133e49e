"""Qwen2.5-Omni's thinker (``Qwen2_5OmniProcessor``): images and audio.

The chat template renders ``<|vision_bos|><|IMAGE|><|vision_eos|>`` per image and
``<|audio_bos|><|AUDIO|><|audio_eos|>`` per audio. The processor widens ``<|IMAGE|>`` to
``(h/14)*(w/14)/2**2`` tokens on the size its Qwen2-VL image processor smart-resizes to, and
``<|AUDIO|>`` to one token per audio-encoder output frame
(:mod:`~energon_pack.encoding.families.whisper_audio`). Inputs: ``pixel_values``,
``image_grid_thw``, ``input_features``, ``feature_attention_mask``. Packed rows: ``[4, 1, T]``
positions, a text row restarting per segment over the three mRoPE rows of the model's own
``get_rope_index`` for each segment alone (its image grids and audio lengths). Videos (and audio
inside them) are not served yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from energon_pack.encoding.families.base import PackingRule, jsonable
from energon_pack.encoding.families.whisper_audio import WhisperAudioFamily
from energon_pack.media.config import smart_resize

__all__ = ["Qwen25OmniFamily"]


class Qwen25OmniFamily(WhisperAudioFamily):
    """Qwen2.5-Omni's thinker: Qwen2-VL images and Whisper audio, ``[4, 1, T]`` packed
    positions."""

    name: ClassVar[str] = "qwen2_5_omni"
    processor_classes: ClassVar[tuple[str, ...]] = ("Qwen2_5OmniProcessor",)
    packing: ClassVar[PackingRule] = "mrope"
    segment_keys: ClassVar[frozenset[str]] = frozenset({"image_grid_thw", "feature_attention_mask"})
    image_processor_media: ClassVar[tuple[str, ...] | None] = ()

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
        model's own ``get_rope_index`` for this segment alone (its ids, its
        ``image_grid_thw`` and its audios' mel lengths). Concatenated along the last dim, the
        segments' positions make a packed row's ``position_ids``; pass no attention mask."""
        ids = input_ids.reshape(1, -1)
        rope = getattr(model, "get_rope_index", None) or model.thinker.get_rope_index
        features = media.get("feature_attention_mask")
        with torch.no_grad():
            positions, _ = rope(
                ids,
                image_grid_thw=media.get("image_grid_thw"),
                attention_mask=torch.ones_like(ids),
                audio_seqlens=None if features is None else features.sum(-1),
            )
        text = torch.arange(ids.shape[1], device=positions.device, dtype=positions.dtype)
        return torch.cat([text.view(1, 1, -1), positions], dim=0)


def _setting(values: Any, key: str) -> int:
    """``values[key]`` of a dict or a transformers ``SizeDict``."""
    found: Any = values.get(key) if isinstance(values, Mapping) else getattr(values, key)
    return int(found)
