"""InternVL (``InternVLProcessor`` with a GotOcr2 image processor; ChatML turns).

Each image is tiled: the grid (columns x rows, ``min_patches``..``max_patches`` tiles) whose
aspect ratio is closest to the image's, plus one thumbnail tile when the grid has more than one.
The ``<IMG_CONTEXT>`` placeholder becomes ``<img>`` + ``<IMG_CONTEXT>`` x (``image_seq_length``
x tiles) + ``</img>``; only ``<IMG_CONTEXT>`` takes vision features. A ``<video>`` becomes one
line per frame its video processor keeps, ``Frame{i}: <img>`` + ``<IMG_CONTEXT>`` x
``image_seq_length`` + ``</img>``, joined by newlines. ``pixel_values`` is ``[tiles, 3, H, W]``
over all image tiles and video frames of a row, in text order; positions restart per segment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import (
    ProcessorFamily,
    SampledVideo,
    delimited_spans,
    joined,
)
from energon_pack.media.config import MediaKind

__all__ = ["InternVLFamily", "tile_grid"]

_HEADER = "<|im_start|>assistant\n"
_END = "<|im_end|>"


def tile_grid(
    height: int, width: int, tile: tuple[int, int], min_tiles: int, max_tiles: int
) -> tuple[int, int]:
    """The (columns, rows) grid GotOcr2 tiles a ``height`` x ``width`` image into: the grid of
    ``min_tiles``..``max_tiles`` tiles whose width/height ratio is closest to the image's
    (grids in order of tile count, columns first); on a tie the later grid wins while the image
    area exceeds half the grid's pixel area. ``(1, 1)`` when no grid fits."""
    grids = sorted(
        (
            (columns, rows)
            for columns in range(1, max_tiles + 1)
            for rows in range(1, max_tiles + 1)
            if min_tiles <= columns * rows <= max_tiles
        ),
        key=lambda grid: grid[0] * grid[1],
    )
    tile_height, tile_width = tile
    ratio = width / height
    area = width * height
    best_diff = float("inf")
    best = (1, 1)
    for columns, rows in grids:
        diff = abs(ratio - columns / rows)
        if diff < best_diff:
            best_diff = diff
            best = (columns, rows)
        elif diff == best_diff and area > 0.5 * tile_height * tile_width * columns * rows:
            best = (columns, rows)
    return best


class InternVLFamily(ProcessorFamily):
    """InternVL through ``InternVLProcessor`` (GotOcr2 tiling; see the module docstring)."""

    name: ClassVar[str] = "internvl"
    processor_classes: ClassVar[tuple[str, ...]] = ("InternVLProcessor",)
    takes_videos: ClassVar[bool] = True
    image_processor_media: ClassVar[tuple[str, ...] | None] = ("num_patches",)
    """``pixel_values`` of the images (all their tiles, in order), as the processor's call
    makes them (a call it refuses on images without text)."""

    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        image_processor = processor.image_processor
        if not hasattr(image_processor, "crop_image_to_patches"):
            raise ValueError(
                f"InternVL family: image processor {type(image_processor).__name__} does not "
                "tile as GotOcr2 does (crop_image_to_patches), so its token counts are unknown"
            )
        self.image_seq_length = int(processor.image_seq_length)
        self.start_token = str(processor.start_image_token)
        self.end_token = str(processor.end_image_token)
        self.context_token = str(processor.image_token)

    def _image_settings(self) -> tuple[bool, int, int, tuple[int, int]]:
        """(crop_to_patches, min_patches, max_patches, (tile height, tile width)) as the
        processor's call passes them: its merged images kwargs (the processor's own
        ``crop_to_patches=True`` default among them) over the image processor's attributes."""
        value = self.image_setting
        size = value("size")
        if isinstance(size, Mapping):
            tile = (int(size["height"]), int(size["width"]))
        else:
            tile = (int(size.height), int(size.width))
        return (
            bool(value("crop_to_patches")),
            int(value("min_patches")),
            int(value("max_patches")),
            tile,
        )

    def tiles(self, height: int, width: int) -> int:
        """Tiles (``pixel_values`` rows) of one ``height`` x ``width`` image."""
        return self._tile_counts([(height, width)])[0]

    def _tile_counts(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        crop, min_tiles, max_tiles, tile = self._image_settings()
        if not crop or max_tiles <= 1:
            return [1] * len(sizes)
        counts = []
        for height, width in sizes:
            columns, rows = tile_grid(height, width, tile, min_tiles, max_tiles)
            grid = columns * rows
            counts.append(grid + 1 if grid > 1 else 1)  # the thumbnail when tiled
        return counts

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``<img>`` + ``<IMG_CONTEXT>`` x (image_seq_length x tiles) + ``</img>`` per image."""
        return [
            self.start_token + self.context_token * tokens + self.end_token
            for tokens in self.image_tokens(sizes)
        ]

    def image_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """``image_seq_length`` x tiles per image."""
        return [self.image_seq_length * tiles for tiles in self._tile_counts(sizes)]

    @property
    def video_token_ids(self) -> frozenset[int]:
        """A video's frames fill ``<IMG_CONTEXT>`` tokens, as images do."""
        return self.vision_token_ids if self.video_placeholder is not None else frozenset()

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """One ``Frame{i}: <img>...</img>`` line per kept frame, joined by newlines."""
        block = self.start_token + self.context_token * self.image_seq_length + self.end_token
        return [
            "\n".join(f"Frame{i + 1}: {block}" for i in range(len(video.frames)))
            for video in videos
        ]

    def sample_inputs(
        self, media: Sequence[tuple[MediaKind, np.ndarray[Any, Any]]]
    ) -> dict[str, torch.Tensor]:
        """``pixel_values``: each image's tiles and each video's frames in the sample's order,
        as the processor joins them (the model fills the ``<IMG_CONTEXT>`` tokens in order)."""
        images = [array for kind, array in media if kind == "image"]
        tiles: list[torch.Tensor] = []
        if images:
            out = self.image_processor_inputs(images)
            counts = [int(n) for n in out["num_patches"]]
            tiles = list(torch.split(out["pixel_values"], counts))
        blocks, image = [], iter(tiles)
        for kind, array in media:
            if kind == "image":
                blocks.append(next(image))
            else:
                blocks.append(self.video_inputs([array])["pixel_values_videos"].flatten(0, 1))
        return {"pixel_values": joined(blocks)} if blocks else {}

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """ChatML: after each ``<|im_start|>assistant\\n`` through its ``<|im_end|>``."""
        return delimited_spans(text, _HEADER, _END)
