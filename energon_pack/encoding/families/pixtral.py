"""Pixtral / Mistral 3 (``PixtralProcessor``; Mistral 3 and Pixtral-12B's Llava): each ``[IMG]``
becomes ``rows`` lines of ``[IMG]`` x ``cols`` + ``[IMG_BREAK]``, the last break ``[IMG_END]``;
``rows x cols`` cells of ``patch_size * spatial_merge_size`` pixels cover the image fitted in
``size`` (sides floored, then rounded up to whole cells). Only ``[IMG]`` takes vision features.
Model inputs: ``pixel_values [images, 3, H, W]`` (zero-padded to the largest image) and
``image_sizes [images, 2]`` (real sizes). Turns: ``<s>[INST]...[/INST]reply</s>``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch.nn import functional

from energon_pack.encoding.families.base import ProcessorFamily

__all__ = ["PixtralFamily"]

_REPLY_AFTER = ("[/INST]", "[/TOOL_RESULTS]")
"""What an assistant reply follows in the Mistral turn format (a user turn, tool results)."""
_NOT_A_REPLY = (*_REPLY_AFTER, "[INST]", "[SYSTEM_PROMPT]", "[TOOL_RESULTS]", "[AVAILABLE_TOOLS]")
"""Turn markers that no reply holds: one before the end-of-turn token means no reply there."""
_OPENER = re.compile("|".join(map(re.escape, _REPLY_AFTER)))


def _setting(values: Any, key: str) -> Any:
    """``values[key]`` of a dict or a transformers ``SizeDict`` (None when unset)."""
    if isinstance(values, Mapping):
        return values.get(key)
    return getattr(values, key, None)


class PixtralFamily(ProcessorFamily):
    """Pixtral's row layout of ``[IMG]`` cells; ``pixel_values`` zero-padded to the largest
    image of a row, ``image_sizes`` giving each image's real size."""

    name: ClassVar[str] = "pixtral"
    processor_classes: ClassVar[tuple[str, ...]] = ("PixtralProcessor",)

    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        if self.image_setting("do_center_crop"):
            raise ValueError("PixtralFamily: do_center_crop=True is not supported")
        self.cell = int(processor.patch_size) * int(processor.spatial_merge_size)
        """Pixels per token edge: the processor passes ``patch_size * spatial_merge_size`` to
        its image processor as the patch size (the image processor's own is not used)."""
        self.do_resize = bool(self.image_setting("do_resize"))
        size = self.image_setting("size")
        longest = _setting(size, "longest_edge")
        if longest:
            self.max_size = (int(longest), int(longest))
        elif _setting(size, "height") and _setting(size, "width"):
            self.max_size = (int(_setting(size, "height")), int(_setting(size, "width")))
        else:
            raise ValueError(f"PixtralFamily: size {size!r} has no longest_edge or height/width")
        self.image_token = str(processor.image_token)
        self.break_token = str(processor.image_break_token)
        self.end_token = str(processor.image_end_token)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Token rows and columns of an image of ``(height, width)``: as the image processor's
        resize (fit in ``size`` with floored sides, then up to whole cells), counted as the
        processor does (``image_sizes // cell``)."""
        fitted_height, fitted_width = height, width
        if self.do_resize:
            max_height, max_width = self.max_size
            ratio = max(height / max_height, width / max_width)
            if ratio > 1:
                fitted_height = math.floor(height / ratio)
                fitted_width = math.floor(width / ratio)
            rows = (fitted_height - 1) // self.cell + 1
            cols = (fitted_width - 1) // self.cell + 1
        else:
            rows, cols = height // self.cell, width // self.cell
        if rows < 1 or cols < 1:
            raise ValueError(
                f"PixtralFamily: an image of {height}x{width} has no token rows or columns "
                f"(fitted to {fitted_height}x{fitted_width}, cells of {self.cell} pixels); "
                "the processor refuses it too"
            )
        return rows, cols

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """Per image: ``rows`` times (``[IMG]`` x ``cols`` + ``[IMG_BREAK]``), the last
        ``[IMG_BREAK]`` being ``[IMG_END]``."""
        out = []
        for height, width in sizes:
            rows, cols = self.grid(height, width)
            row = self.image_token * cols
            out.append((row + self.break_token) * (rows - 1) + row + self.end_token)
        return out

    def image_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """``rows * cols`` ``[IMG]`` tokens per image."""
        return [rows * cols for rows, cols in (self.grid(h, w) for h, w in sizes)]

    def settings(self) -> dict[str, Any]:
        """The base settings plus the processor's own geometry and image tokens."""
        values = super().settings()
        values["processor"] = {
            "patch_size": int(self.processor.patch_size),
            "spatial_merge_size": int(self.processor.spatial_merge_size),
            "image_token": self.image_token,
            "image_break_token": self.break_token,
            "image_end_token": self.end_token,
        }
        return values

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """Each reply after ``[/INST]`` (or ``[/TOOL_RESULTS]``) through the tokenizer's EOS
        (``</s>``); a generation prompt without a reply (another turn marker or the end of
        the text comes first) is no span."""
        eos = str(self.tokenizer.eos_token)
        spans = []
        for opener in _OPENER.finditer(text):
            begin = opener.end()
            stop = text.find(eos, begin)
            if stop < 0:
                break
            if not any(marker in text[begin:stop] for marker in _NOT_A_REPLY):
                spans.append((begin, stop + len(eos)))
        return spans

    def row_inputs(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``pixel_values`` zero-padded (bottom, right) to the largest height and width of the
        row and joined; ``image_sizes`` (each image's real size) and any other key joined in
        sample order."""
        others = [{k: v for k, v in s.items() if k != "pixel_values"} for s in samples]
        out = super().row_inputs(others)
        pixels = [s["pixel_values"] for s in samples if "pixel_values" in s]
        if pixels:
            height = max(int(p.shape[-2]) for p in pixels)
            width = max(int(p.shape[-1]) for p in pixels)
            out["pixel_values"] = torch.cat(
                [
                    functional.pad(p, (0, width - int(p.shape[-1]), 0, height - int(p.shape[-2])))
                    for p in pixels
                ]
            )
        return out
