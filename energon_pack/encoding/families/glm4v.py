"""GLM-4.1V (``Glm4vProcessor``): template writes ``<|begin_of_image|><|image|><|end_of_image|>``
per image; the processor widens ``<|image|>`` to ``(h/14)*(w/14)/2**2`` pads, on the size smart-
resized to multiples of ``patch * merge = 28`` within the pixel budget (over 2 temporal copies).
Inputs: ``pixel_values [sum h*w/196, 1176]``, ``image_grid_thw [images, 3]``,
``mm_token_type_ids [1, L]`` (1 on image pads). A video (where the processor has its video
processor) renders ``<|begin_of_video|><|video|><|end_of_video|>``; ``<|video|>`` becomes, per
temporal patch of the frames its video processor samples, ``<|begin_of_image|>`` + ``<|image|>``
x ``(h/14)*(w/14)/2**2`` + ``<|end_of_image|>`` + the whole second of the patch's first frame,
the size smart-resized over all the frames (type 2 in ``mm_token_type_ids``). A video's patches
join ``pixel_values`` and ``image_grid_thw`` as one image per temporal patch, in text order, as
the model's own ``get_video_features`` flattens them (its forward takes no row holding image and
video pads together); ``video_grid_thw`` stays for the positions. Packed rows: ``[4, 1, T]``
positions, a text row restarting per segment over the model's own per-segment mRoPE rows
(``get_rope_index``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import (
    PackingRule,
    ProcessorFamily,
    SampledVideo,
    joined,
)
from energon_pack.media.config import MediaKind, smart_resize_video
from energon_pack.media.tokens import special_token_id

__all__ = ["Glm4vFamily"]

_ASSISTANT = "<|assistant|>\n"
"""The released GLM-4.1V template's generation prompt: a reply starts after it."""
_STOPS = ("<|user|>", "<|observation|>")
"""Tokens that end a reply and that the model generates (GLM's generation-config stop ids,
with the tokenizer's EOS): kept in the span."""
_HEADERS = ("<|system|>", "<|assistant|>")
"""Role headers that end a reply without being part of it."""


class Glm4vFamily(ProcessorFamily):
    """GLM-4V family: Qwen2-VL-like smart resize with ``[4, 1, T]`` packed mRoPE positions."""

    name: ClassVar[str] = "glm4v"
    processor_classes: ClassVar[tuple[str, ...]] = ("Glm4vProcessor",)
    packing: ClassVar[PackingRule] = "mrope"
    segment_keys: ClassVar[frozenset[str]] = frozenset({"image_grid_thw", "video_grid_thw"})
    token_keys: ClassVar[frozenset[str]] = frozenset({"mm_token_type_ids"})
    takes_videos: ClassVar[bool] = True

    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        self._begin_of_image = special_token_id(self.tokenizer, "<|begin_of_image|>")

    @property
    def video_token_ids(self) -> frozenset[int]:
        """A video's frames fill ``<|image|>`` pads, as images do."""
        return self.vision_token_ids if self.video_placeholder is not None else frozenset()

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """Per temporal patch of the kept frames: ``<|begin_of_image|>`` + ``<|image|>`` x
        ``grid_h * grid_w / merge**2`` + ``<|end_of_image|>`` + ``int(seconds)`` of the patch's
        first frame (the last time repeated where the patches outnumber the times)."""
        setting = self.video_setting
        patch, merge = int(setting("patch_size")), int(setting("merge_size"))
        temporal = int(setting("temporal_patch_size"))
        size = setting("size")
        if isinstance(size, Mapping):
            least, most = int(size["shortest_edge"]), int(size["longest_edge"])
        else:
            least, most = int(size.shortest_edge), int(size.longest_edge)
        out = []
        for video in videos:
            frames = len(video.frames)
            height, width = video.header.height, video.header.width
            if setting("do_resize"):
                height, width = smart_resize_video(
                    frames,
                    height,
                    width,
                    temporal_factor=temporal,
                    factor=patch * merge,
                    min_pixels=least,
                    max_pixels=most,
                )
            tokens = (height // patch) * (width // patch) // merge**2
            patches = math.ceil(frames / temporal)
            times = video.timestamps[::2][:patches] or [0.0]
            times += [times[-1]] * (patches - len(times))
            frame = f"<|begin_of_image|>{self.image_placeholder * tokens}<|end_of_image|>"
            out.append("".join(f"{frame}{int(seconds)}" for seconds in times))
        return out

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``<|image|>`` repeated ``grid_h * grid_w / merge**2`` times per image."""
        image_processor = self.processor.image_processor
        patch = int(image_processor.patch_size)
        merge = int(image_processor.merge_size)
        out = []
        for height, width in sizes:
            resized_h, resized_w = self._resized(height, width)
            tokens = (resized_h // patch) * (resized_w // patch) // merge**2
            out.append(self.image_placeholder * tokens)
        return out

    def _resized(self, height: int, width: int) -> tuple[int, int]:
        """The size the image processor resizes ``(height, width)`` to (its smart resize:
        multiples of ``patch * merge``, ``temporal * h * w`` within the size's
        ``[shortest_edge, longest_edge]`` pixel budget; the rule of
        :func:`~energon_pack.media.config.smart_resize_video` for one temporal patch)."""
        image_processor = self.processor.image_processor
        if not image_processor.do_resize:
            return height, width
        factor = int(image_processor.patch_size) * int(image_processor.merge_size)
        frames = int(image_processor.temporal_patch_size)
        size = image_processor.size
        if isinstance(size, Mapping):
            min_pixels, max_pixels = size["shortest_edge"], size["longest_edge"]
        else:
            min_pixels, max_pixels = size.shortest_edge, size.longest_edge
        return smart_resize_video(
            frames,
            height,
            width,
            temporal_factor=frames,
            factor=factor,
            min_pixels=min_pixels,
            max_pixels=max_pixels,
        )

    def sample_inputs(
        self, media: Sequence[tuple[MediaKind, np.ndarray[Any, Any]]]
    ) -> dict[str, torch.Tensor]:
        """The processor's outputs with each video given as images, one per temporal patch,
        in text order (``pixel_values``, ``image_grid_thw``), as the model's own
        ``get_video_features`` flattens a video's grid: its forward cannot take a row's image
        and video pads together (it counts both kinds as images). ``video_grid_thw`` stays
        for the positions."""
        images = [array for kind, array in media if kind == "image"]
        found = self.media_inputs(images) if images else {}
        image = iter(
            zip(
                torch.split(found["pixel_values"], found["image_grid_thw"].prod(-1).tolist()),
                found["image_grid_thw"],
                strict=True,
            )
            if images
            else ()
        )
        pixels, grids, videos = [], [], []
        for kind, array in media:
            if kind == "image":
                patches, grid = next(image)
                pixels.append(patches)
                grids.append(grid[None])
                continue
            out = self.video_inputs([array])
            video = out["video_grid_thw"]
            slices = int(video[0, 0])
            pixels.append(out["pixel_values_videos"])
            grids.append(torch.cat([video.new_ones(slices, 1), video[:, 1:].repeat(slices, 1)], 1))
            videos.append(video)
        if not pixels:
            return {}
        out = {"pixel_values": joined(pixels), "image_grid_thw": joined(grids)}
        if videos:
            out["video_grid_thw"] = joined(videos)
        return out

    def assistant_spans(self, text: str) -> list[tuple[int, int]] | None:
        """Replies of GLM's turn format ``[gMASK]<sop><|system|>\\n...<|user|>\\n...
        <|assistant|>\\nreply``: each starts after ``<|assistant|>\\n`` (GLM-4.1V's generation
        prompt) and runs through the first stop token the model generates after it
        (``<|user|>``, ``<|observation|>`` or the tokenizer's EOS, kept), or up to a
        ``<|system|>`` / ``<|assistant|>`` header, or to the end of the text: the released
        template writes no end marker after the last reply. An empty reply at the end (a
        generation prompt) is no span; an ``<|assistant|>`` turn with metadata after the
        header is no span either."""
        eos = self.tokenizer.eos_token
        stops = tuple(dict.fromkeys((*_STOPS, *([eos] if isinstance(eos, str) else []))))
        spans = []
        start = text.find(_ASSISTANT)
        while start >= 0:
            begin = start + len(_ASSISTANT)
            first, stop = len(text), len(text)
            for token in (*stops, *_HEADERS):
                found = text.find(token, begin)
                if 0 <= found < first:
                    first = found
                    stop = found + len(token) if token in stops else found
            spans.append((begin, stop))
            start = text.find(_ASSISTANT, stop)
        return [(b, e) for b, e in spans if e > b]

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``mm_token_type_ids [L]`` as the processor derives it: 1 on image pads, 2 on pads
        between ``<|begin_of_video|>`` and ``<|end_of_video|>``, 0 elsewhere."""
        ids = input_ids.reshape(-1)
        starts = torch.cumsum(ids == int(self.processor.video_start_id), dim=0)
        ends = torch.cumsum(ids == int(self.processor.video_end_id), dim=0)
        in_video = starts > ends
        pads = ids == int(self.processor.image_token_id)
        types = torch.zeros_like(ids, dtype=torch.long)
        types[pads & ~in_video] = 1
        types[pads & in_video] = 2
        return {"mm_token_type_ids": types}

    def position_ids(
        self, model: Any, input_ids: torch.Tensor, media: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """One segment's ``[4, 1, L]`` positions: ``arange(L)`` (the text row, from which
        transformers' ``Glm4vTextModel`` builds the packed causal mask) over the three mRoPE
        rows of the model's own ``get_rope_index`` for this segment alone (its ids, its
        ``mm_token_type_ids`` and its ``image_grid_thw``). Concatenated along the last dim, the
        segments' positions make a packed row's ``position_ids``; pass no attention mask."""
        ids = input_ids.reshape(1, -1)
        rope = getattr(model, "get_rope_index", None)
        if rope is None:
            rope = model.model.get_rope_index
        types = self.token_inputs(input_ids)["mm_token_type_ids"].reshape(1, -1)
        images = media.get("image_grid_thw")
        if images is not None and media.get("video_grid_thw") is not None:
            # the images only: a video's patches are among them (see sample_inputs), one per
            # <|begin_of_image|> block, whose pads are type 2
            begins = torch.nonzero(ids[0] == self._begin_of_image).flatten()
            images = images[types[0, begins + 1].cpu() == 1]
        with torch.no_grad():
            positions, _ = rope(
                ids,
                mm_token_type_ids=types.to(ids.device),
                image_grid_thw=images if images is None or len(images) else None,
                video_grid_thw=media.get("video_grid_thw"),
            )
        text = torch.arange(ids.shape[1], device=positions.device, dtype=positions.dtype)
        return torch.cat([text.view(1, 1, -1), positions], dim=0)
