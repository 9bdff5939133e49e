"""Idefics3 and SmolVLM: an image is resized (longest edge ``size``), grown to multiples of
``max_image_size`` and cut into rows x cols tiles plus a global view; each tile is
``<fake_token_around_image><row_r_col_c>`` + ``<image>`` x ``image_seq_len``, each row ends in
``\\n``, then ``\\n<fake_token_around_image><global-img>`` + ``<image>`` x ``image_seq_len`` +
``<fake_token_around_image>`` (an unsplit image is the global part alone, without the newlines).
Media: ``pixel_values`` ``[1, tiles, 3, M, M]`` and ``pixel_attention_mask`` ``[1, tiles, M, M]``.

A SmolVLM video (where the processor has its video processor) becomes an intro naming its frame
count in words and its whole duration, then per frame its video processor samples ``\nFrame
from mm:ss:`` and the global view of one image; its frames join the sample's tiles in text
order.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import ProcessorFamily, SampledVideo
from energon_pack.media.config import MediaKind

__all__ = ["Idefics3Family"]

_MAX_IMAGE_SIZE = 4096
"""transformers' absolute limit on the resized longest edge (``MAX_IMAGE_SIZE`` of the image
processor's module, read from there when it has one)."""


def _setting(values: Any, key: str) -> Any:
    """``values[key]`` of a dict or a transformers ``SizeDict`` (None when unset)."""
    if isinstance(values, Mapping):
        return values.get(key)
    return getattr(values, key, None)


class Idefics3Family(ProcessorFamily):
    """Idefics3 / SmolVLM processors (both write the same image layout).

    ``Idefics3Processor`` adds ``<fake_token_around_image>``, ``<image>`` and
    ``<end_of_utterance>`` to its tokenizer when built; ``SmolVLMProcessor`` reads its token
    strings from tokenizer attributes. Either way the ids come from ``processor.tokenizer``.
    """

    name: ClassVar[str] = "idefics3"
    processor_classes: ClassVar[tuple[str, ...]] = ("Idefics3Processor", "SmolVLMProcessor")
    takes_videos: ClassVar[bool] = True
    """SmolVLM's processor has a video processor; Idefics3's has none."""

    @property
    def _global_token(self) -> str:
        processor = self.processor
        token = getattr(processor, "global_image_token", None)  # SmolVLM
        if token is None:
            token = processor.global_image_tag  # Idefics3
        return str(token)

    def settings(self) -> dict[str, Any]:
        """The base settings plus ``image_seq_len`` (a processor attribute, not the image
        processor's, that sets the tokens of each tile)."""
        out = super().settings()
        out["image_seq_len"] = int(self.processor.image_seq_len)
        return out

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        """The size after the image processor's first resize (``size``)."""
        image_processor = self.processor.image_processor
        if not image_processor.do_resize:
            return height, width
        size = image_processor.size
        longest = _setting(size, "longest_edge")
        if not longest:
            fixed_height, fixed_width = _setting(size, "height"), _setting(size, "width")
            if not (fixed_height and fixed_width):
                raise ValueError(f"size must have longest_edge or height and width: {size!r}")
            return int(fixed_height), int(fixed_width)
        # rescale the longest edge to `longest` (up or down), the other edge rounded up to even
        aspect = width / height
        if width >= height:
            width = int(longest)
            height = int(width / aspect)
            height += height % 2
        else:
            height = int(longest)
            width = int(height * aspect)
            width += width % 2
        height, width = max(height, 1), max(width, 1)
        # then scale below the absolute limit
        limit = getattr(sys.modules.get(type(image_processor).__module__), "MAX_IMAGE_SIZE", None)
        limit = int(limit) if isinstance(limit, int) else _MAX_IMAGE_SIZE
        aspect = width / height
        if width >= height and width > limit:
            width = limit
            height = int(width / aspect)
        elif height > width and height > limit:
            height = limit
            width = int(height * aspect)
        return max(height, 1), max(width, 1)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles of an image of displayed size ``(height, width)``; (0, 0) when
        it is not split (the global view alone)."""
        image_processor = self.processor.image_processor
        height, width = self._resized(height, width)
        if not image_processor.do_image_splitting:
            return 0, 0
        tile = int(image_processor.max_image_size["longest_edge"])
        # resize_for_vision_encoder: both edges up to multiples of the tile; the short edge is
        # taken from the grown long edge and the aspect ratio (not from the short edge itself)
        aspect = width / height
        if width >= height:
            width = math.ceil(width / tile) * tile
            height = math.ceil(int(width / aspect) / tile) * tile
        else:
            height = math.ceil(height / tile) * tile
            width = math.ceil(int(height * aspect) / tile) * tile
        if height > tile or width > tile:
            return (height - tile) // tile + 1, (width - tile) // tile + 1
        return 0, 0

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """The processor's ``replace_image_token`` text for each image."""
        fake = str(self.processor.fake_image_token)
        image = self.image_placeholder * int(self.processor.image_seq_len)
        global_view = f"{fake}{self._global_token}{image}{fake}"
        out = []
        for height, width in sizes:
            rows, cols = self.grid(height, width)
            if rows == 0 and cols == 0:
                out.append(global_view)
                continue
            text = "".join(
                "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image}" for c in range(cols)) + "\n"
                for r in range(rows)
            )
            out.append(f"{text}\n{global_view}")
        return out

    @property
    def video_token_ids(self) -> frozenset[int]:
        """A video's frames fill ``<image>`` tokens, as images do."""
        return self.vision_token_ids if self.video_placeholder is not None else frozenset()

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """Per video: ``You are provided the following series of {count in words} frames from
        a {H:MM:SS} [H:MM:SS] video.\n``, per kept frame ``\nFrame from mm:ss:`` and the
        global view of one image, then ``\n\n``. A ValueError without ``num2words``, which
        spells the count."""
        try:
            from num2words import num2words
        except ImportError:
            raise ValueError(
                "SmolVLM spells a video's frame count in words: pip install num2words"
            ) from None
        fake = str(self.processor.fake_image_token)
        image = self.image_placeholder * int(self.processor.image_seq_len)
        view = f"{fake}{self._global_token}{image}{fake}"
        out = []
        for video in videos:
            duration = timedelta(seconds=int(video.header.duration))
            text = (
                f"You are provided the following series of {num2words(len(video.frames))} "
                f"frames from a {duration} [H:MM:SS] video.\n"
            )
            for seconds in video.timestamps:
                text += f"\nFrame from {int(seconds // 60):02d}:{int(seconds % 60):02d}:{view}"
            out.append(text + "\n\n")
        return out

    def sample_inputs(
        self, media: Sequence[tuple[MediaKind, np.ndarray[Any, Any]]]
    ) -> dict[str, torch.Tensor]:
        """As the base class for images alone; with a video, each image's tiles and each
        video's frames in text order, joined as :meth:`row_inputs` joins samples."""
        if all(kind != "video" for kind, _ in media):
            return super().sample_inputs(media)
        parts = [
            self.video_inputs([array]) if kind == "video" else self.media_inputs([array])
            for kind, array in media
        ]
        return self.row_inputs(parts)

    def assistant_spans(self, text: str) -> list[tuple[int, int]] | None:
        """Each ``Assistant:`` turn (one that opens the text, after an optional special token,
        or follows ``<end_of_utterance>\\n``): from after ``Assistant:`` (what the model writes
        after the generation prompt, the reply's leading space included) through
        ``<end_of_utterance>``."""
        end = str(self.processor.end_of_utterance_token)
        header = "Assistant:"
        specials = {str(t) for t in self.tokenizer.all_special_tokens}
        starts = [0] + [i + len(end) + 1 for i in _finds(text, end + "\n")]
        spans = []
        for i, start in enumerate(starts):
            if i == 0:
                start = text.find(header)
                if start < 0 or (start > 0 and text[:start] not in specials):
                    continue
            elif not text.startswith(header, start):
                continue
            begin = start + len(header)
            stop = text.find(end, begin)
            if stop < 0:
                break
            spans.append((begin, stop + len(end)))
        return spans

    def row_inputs(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The samples' tiles side by side in one batch row (``[1, sum tiles, 3, H, W]``), each
        padded with zeros to the largest tile (``pixel_attention_mask`` 0 there), as the
        processor pads a batch. The model drops all-zero padding tiles."""
        media = [s for s in samples if "pixel_values" in s]
        if not media:
            return {}
        height = max(int(s["pixel_values"].shape[-2]) for s in media)
        width = max(int(s["pixel_values"].shape[-1]) for s in media)
        pixels, masks = [], []
        for sample in media:
            values = sample["pixel_values"]
            pad = (0, width - values.shape[-1], 0, height - values.shape[-2])
            pixels.append(torch.nn.functional.pad(values, pad))
            mask = sample.get("pixel_attention_mask")
            if mask is None:
                mask = torch.ones(values.shape[:2] + values.shape[-2:], dtype=torch.int64)
            masks.append(torch.nn.functional.pad(mask, pad))
        return {
            "pixel_values": torch.cat(pixels, dim=1),
            "pixel_attention_mask": torch.cat(masks, 1),
        }


def _finds(text: str, needle: str) -> list[int]:
    """Start indices of the non-overlapping occurrences of ``needle`` in ``text``."""
    out = []
    at = text.find(needle)
    while at >= 0:
        out.append(at)
        at = text.find(needle, at + len(needle))
    return out
