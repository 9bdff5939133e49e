"""Kimi K2.5 (``Kimi_K25Processor``: DeepSeek-V3 text backbone, MoonViT vision tower).

The template writes ``<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\\n`` per
image; the processor repeats ``<|media_pad|>`` (the only vision token) once per merged patch of
the image shrunk (never enlarged) to at most ``max_patches`` patches and ``size["max_height"]``
a side, zero-padded to ``patch_size x merge_size`` multiples: ``rows x columns / merge_size**2``.
``pixel_values`` ``[patches, 3, patch_size, patch_size]``, ``image_grid_thw`` ``[images, 3]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from energon_pack.encoding.families.base import ProcessorFamily, delimited_spans

__all__ = ["KimiK25Family", "navit_size"]

_ASSISTANT = "<|im_assistant|>"
_MIDDLE = "<|im_middle|>"
_END = "<|im_end|>"
_EMPTY_THINK = "<think></think>"
"""The closed, empty think block the template writes after every finished assistant header
(and the non-thinking generation prompt pre-fills): prompt, not reply."""
_OPEN_THINK = "<think>"
"""The thinking generation prompt's pre-filled opener: the model writes what follows it."""


def navit_size(
    height: int,
    width: int,
    *,
    patch_size: int,
    merge_size: int,
    max_patches: int,
    max_side: int,
) -> tuple[int, int]:
    """The padded ``(height, width)`` in pixels the Kimi K2.5 image processor gives an image
    (transformers' ``navit_resize``): scaled down (never up) to at most ``max_patches`` patches
    and ``max_side`` patches a side, floored, then zero-padded to ``patch_size x merge_size``
    multiples."""
    patches_high = max(1.0, height // patch_size)
    patches_wide = max(1.0, width // patch_size)
    scale = min(
        1.0,
        math.sqrt(max_patches / (patches_high * patches_wide)),
        (max_side * patch_size) / height,
        (max_side * patch_size) / width,
    )
    new_height = min(max(1, int(height * scale)), max_side * patch_size)
    new_width = min(max(1, int(width * scale)), max_side * patch_size)
    factor = merge_size * patch_size
    return -(-new_height // factor) * factor, -(-new_width // factor) * factor


def _side(size: Any) -> int:
    """``size["max_height"]`` of a dict or a transformers ``SizeDict``."""
    value = size.get("max_height") if isinstance(size, Mapping) else size.max_height
    if value is None:
        raise ValueError(f"Kimi K2.5 image size needs max_height, got {size!r}")
    return int(value)


class KimiK25Family(ProcessorFamily):
    """Kimi K2.5: one ``<|media_pad|>`` run per image, media per image joined on patches
    (``pixel_values``) and images (``image_grid_thw``), as the base class joins them."""

    name: ClassVar[str] = "kimi_k25"
    processor_classes: ClassVar[tuple[str, ...]] = ("Kimi_K25Processor",)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The ``(rows, columns)`` patch grid (``image_grid_thw[1:]``) of an image."""
        patch_size = int(self.image_setting("patch_size"))
        if not self.image_setting("do_resize"):
            if height % patch_size or width % patch_size:
                raise ValueError(
                    f"without resizing, a {height}x{width} image is not a {patch_size}-pixel grid"
                )
            return height // patch_size, width // patch_size
        padded_height, padded_width = navit_size(
            height,
            width,
            patch_size=patch_size,
            merge_size=int(self.image_setting("merge_size")),
            max_patches=int(self.image_setting("max_patches")),
            max_side=_side(self.image_setting("size")),
        )
        return padded_height // patch_size, padded_width // patch_size

    def image_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Merged patches per image: the grid over ``merge_size**2`` (the processor divides by
        its image processor's own ``merge_size``)."""
        merge = int(self.processor.image_processor.merge_size) ** 2
        out = []
        for height, width in sizes:
            rows, columns = self.grid(height, width)
            out.append(rows * columns // merge)
        return out

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``<|media_pad|>`` repeated :meth:`image_tokens` times per image (the template's
        ``<|media_begin|>image<|media_content|>`` and ``<|media_end|>`` stay around it)."""
        return [self.image_placeholder * count for count in self.image_tokens(sizes)]

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """From after each ``<|im_assistant|>{name}<|im_middle|>`` header through its
        ``<|im_end|>``, without the template's pre-filled think opener: an empty
        ``<think></think>`` right after the header (finished turns, non-thinking prompt) is
        prompt, and of a ``<think>reasoning</think>`` only ``<think>`` is (the thinking
        prompt pre-fills it). A reply without its ``<|im_end|>`` is no span."""
        return delimited_spans(text, _ASSISTANT, _END, opening=_reply_start)


def _reply_start(text: str, at: int) -> int | None:
    """Where the reply of an ``<|im_assistant|>`` header ending before ``at`` begins: after
    the header's ``<|im_middle|>``, past a pre-filled think opener; None without one."""
    middle = text.find(_MIDDLE, at)
    if middle < 0:
        return None
    begin = middle + len(_MIDDLE)
    for opener in (_EMPTY_THINK, _OPEN_THINK):  # the empty block first: it starts as the opener
        if text.startswith(opener, begin):
            return begin + len(opener)
    return begin
