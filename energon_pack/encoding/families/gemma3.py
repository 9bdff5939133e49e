"""Gemma 3 (``Gemma3Processor``): each ``<start_of_image>`` the template renders becomes
``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x ``image_seq_length`` +
``<end_of_image>\\n\\n`` (a text replacement: the ``\\n\\n`` tokenise with the neighbouring
text), whatever the image size. With pan-and-scan on, an image cut into ``n`` crops becomes
``Here is the original image {seq} and here are some crops to help you see better `` + ``n``
more such sequences joined by spaces. Model inputs: ``pixel_values [images + crops, 3, H, W]``,
``token_type_ids [L]`` (1 on the soft tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from energon_pack.encoding.families.base import (
    PackingRule,
    ProcessorFamily,
    delimited_spans,
    jsonable,
)
from energon_pack.encoding.families.masks import segment_masks

__all__ = ["Gemma3Family"]

_PAN_AND_SCAN_KEYS = (
    "do_pan_and_scan",
    "pan_and_scan_min_crop_size",
    "pan_and_scan_max_num_crops",
    "pan_and_scan_min_ratio_to_activate",
)


class Gemma3Family(ProcessorFamily):
    """Gemma 3 through ``Gemma3Processor`` (see the module docstring).

    A packed row trains exactly only with per-layer-type 4-D block masks
    (:meth:`attention_masks`): with positions alone, the model's sliding-window layers index
    the bidirectional image overlay with per-segment positions, so images of later segments
    get the wrong attention pattern.
    """

    name: ClassVar[str] = "gemma3"
    processor_classes: ClassVar[tuple[str, ...]] = ("Gemma3Processor",)
    packing: ClassVar[PackingRule] = "block_mask"
    token_keys: ClassVar[frozenset[str]] = frozenset({"token_type_ids"})

    HEADER: ClassVar[str] = "<start_of_turn>model\n"
    """What opens an assistant reply in the Gemma turn format."""
    END: ClassVar[str] = "<end_of_turn>"
    """What closes every turn."""

    @property
    def image_placeholder(self) -> str:
        """The processor's ``boi_token`` (``<start_of_image>``)."""
        return str(self.processor.boi_token)

    @property
    def vision_token_ids(self) -> frozenset[int]:
        """The soft-token id (``tokenizer.image_token_id``) that the vision features fill."""
        return frozenset({int(self.tokenizer.image_token_id)})

    def settings(self) -> dict[str, Any]:
        """The base settings plus the soft-token count and the effective pan-and-scan ones."""
        out = super().settings()
        out["image_seq_length"] = int(self.processor.image_seq_length)
        out["pan_and_scan"] = jsonable({key: self.image_setting(key) for key in _PAN_AND_SCAN_KEYS})
        return out

    def crops(self, height: int, width: int) -> int:
        """Pan-and-scan crops of an image (0 when off or not activated); the arithmetic of
        ``Gemma3ImageProcessor.pan_and_scan`` on the size alone."""
        if not self.image_setting("do_pan_and_scan"):
            return 0
        min_crop = int(self.image_setting("pan_and_scan_min_crop_size"))
        max_crops = int(self.image_setting("pan_and_scan_max_num_crops"))
        min_ratio = float(self.image_setting("pan_and_scan_min_ratio_to_activate"))
        if width >= height:
            if width / height < min_ratio:
                return 0
            crops_w = min(math.floor(width / min_crop), math.floor(width / height + 0.5))
            crops_w = min(max_crops, max(2, crops_w))
            crops_h = 1
        else:
            if height / width < min_ratio:
                return 0
            crops_h = min(math.floor(height / min_crop), math.floor(height / width + 0.5))
            crops_h = min(max_crops, max(2, crops_h))
            crops_w = 1
        crop_w = math.ceil(width / crops_w)
        crop_h = math.ceil(height / crops_h)
        if min(crop_w, crop_h) < min_crop:
            return 0
        return crops_w * crops_h

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``\\n\\n<boi>`` + soft tokens + ``<eoi>\\n\\n`` per image (and per crop)."""
        tokenizer = self.tokenizer
        soft = str(tokenizer.image_token) * int(self.processor.image_seq_length)
        sequence = f"\n\n{tokenizer.boi_token}{soft}{tokenizer.eoi_token}\n\n"
        out = []
        for height, width in sizes:
            crops = self.crops(int(height), int(width))
            if not crops:
                out.append(sequence)
            else:
                out.append(
                    f"Here is the original image {sequence} and here are some crops to help you "
                    "see better " + " ".join([sequence] * crops)
                )
        return out

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """From after each ``<start_of_turn>model\\n`` through its ``<end_of_turn>`` and the
        newline after it: what the Gemma training templates' generation markers enclose."""
        return delimited_spans(text, self.HEADER, self.END, trailing="\n")

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``token_type_ids``: 1 on the soft tokens, 0 elsewhere (as the processor writes)."""
        ids = torch.tensor(sorted(self.vision_token_ids), dtype=input_ids.dtype)
        return {"token_type_ids": torch.isin(input_ids, ids).long()}

    def attention_masks(
        self, model: Any, segment_lengths: Sequence[int], input_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The ``attention_mask`` dict for a packed row of ``input_ids`` (``[T]``, segments of
        ``segment_lengths``): ``{"full_attention": [1, 1, T, T], "sliding_attention": [1, 1,
        T, T]}``, block-diagonal per segment, causal inside, each image's soft tokens
        bidirectional among themselves in both layer types, the sliding layers also within the
        config's ``sliding_window`` (:func:`~energon_pack.encoding.families.masks.segment_masks`).
        """
        if getattr(model.config.get_text_config(), "use_bidirectional_attention", False):
            raise ValueError("gemma3 packing: use_bidirectional_attention is not supported")
        image = self.token_inputs(input_ids.reshape(-1))["token_type_ids"] == 1
        return segment_masks(
            model, segment_lengths, image, full_attention_images=True, family="gemma3"
        )
