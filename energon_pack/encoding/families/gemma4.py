"""Gemma 4 (``Gemma4Processor`` with a Gemma 4 image processor; ``<|turn>role ... <turn|>`` turns).

Each image is resized, aspect ratio kept, to the largest ``(patch_size x pooling_kernel_size)``
multiple grid within ``max_soft_tokens x pooling_kernel_size**2`` patches. The ``<|image|>``
placeholder becomes ``<|image>`` + ``<|image|>`` x (patches / ``pooling_kernel_size**2``) +
``<image|>``; only ``<|image|>`` takes vision features. ``pixel_values`` is ``[images,
max_patches, 3 x patch_size**2]`` and ``image_position_ids`` ``[images, max_patches, 2]`` (padded
with -1); positions restart per segment, with per-segment 4-D masks (:meth:`attention_masks`).
A video (where the processor has its video processor) becomes, per frame its video processor
samples, ``mm:ss <|image>`` + ``<|video|>`` x soft tokens + ``<image|>``, joined by spaces, each
frame resized as an image is under the video processor's settings (``pixel_values_videos``,
``video_position_ids``, ``num_frames_per_video``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import (
    PackingRule,
    ProcessorFamily,
    SampledVideo,
    delimited_spans,
)
from energon_pack.encoding.families.masks import segment_masks

__all__ = ["Gemma4Family", "resized_size"]

_HEADER = "<|turn>model\n"
_END = "<turn|>"
_EMPTY_THOUGHT = "<|channel>thought\n<channel|>"
"""The closed, empty thought channel the released template pre-fills after the generation
prompt when thinking is off: part of the prompt, not of the reply."""


def resized_size(
    height: int, width: int, patch_size: int, max_patches: int, pooling_kernel_size: int
) -> tuple[int, int]:
    """The ``(height, width)`` the Gemma 4 image processor resizes an image to: the largest
    aspect-preserving size with sides a multiple of ``pooling_kernel_size x patch_size`` and at
    most ``max_patches`` patches; a side that rounds to zero becomes one multiple and the other
    ``floor(long / short)`` multiples, capped at ``max_patches / pooling_kernel_size**2``."""
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = pooling_kernel_size * patch_size
    out_height = math.floor(factor * height / side) * side
    out_width = math.floor(factor * width / side) * side
    if out_height == 0 and out_width == 0:
        raise ValueError(f"Gemma 4 resizes a {height}x{width} image to 0x0")
    longest = (max_patches // pooling_kernel_size**2) * side
    if out_height == 0:
        out_height = side
        out_width = min(math.floor(width / height) * side, longest)
    elif out_width == 0:
        out_width = side
        out_height = min(math.floor(height / width) * side, longest)
    if out_height * out_width > target_px:
        raise ValueError(
            f"Gemma 4 resizes a {height}x{width} image to {out_height}x{out_width}, over "
            f"{max_patches} patches of {patch_size}"
        )
    return out_height, out_width


class Gemma4Family(ProcessorFamily):
    """Gemma 4 through ``Gemma4Processor`` (see the module docstring).

    As the processor's own call on the rendered template, the text is tokenised with the
    tokenizer's special tokens (the released template writes ``<bos>`` too, so a row starts
    with two, as it does through the processor). Packed rows need the 4-D masks of
    :meth:`attention_masks` when the model's ``use_bidirectional_attention`` is ``"vision"``;
    they are exact for the default setting as well.
    """

    name: ClassVar[str] = "gemma4"
    processor_classes: ClassVar[tuple[str, ...]] = ("Gemma4Processor",)
    packing: ClassVar[PackingRule] = "block_mask"
    token_keys: ClassVar[frozenset[str]] = frozenset({"mm_token_type_ids"})
    image_processor_media: ClassVar[tuple[str, ...] | None] = ("num_soft_tokens_per_image",)
    """``pixel_values`` and ``image_position_ids``, as the processor's call makes them (without
    tokenising the text it writes for the images)."""
    takes_videos: ClassVar[bool] = True

    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        self.image_token = str(processor.image_token)
        self.boi_token = str(processor.boi_token)
        self.eoi_token = str(processor.eoi_token)

    def _image_settings(self) -> tuple[bool, int, int, int]:
        """(do_resize, patch_size, max_soft_tokens, pooling_kernel_size) as the processor's
        call passes them: its merged images kwargs over the image processor's attributes."""
        value = self.image_setting
        return (
            bool(value("do_resize")),
            int(value("patch_size")),
            int(value("max_soft_tokens")),
            int(value("pooling_kernel_size")),
        )

    def soft_tokens(self, height: int, width: int, *, video: bool = False) -> int:
        """``<|image|>`` tokens of one ``height`` x ``width`` image (``<|video|>`` tokens of
        one frame of a video): its patches after the resize, over ``pooling_kernel_size**2``,
        under the image (video) processor's settings."""
        if video:
            value = self.video_setting
            do_resize, patch = bool(value("do_resize")), int(value("patch_size"))
            max_soft, kernel = int(value("max_soft_tokens")), int(value("pooling_kernel_size"))
        else:
            do_resize, patch, max_soft, kernel = self._image_settings()
        if do_resize:
            height, width = resized_size(height, width, patch, max_soft * kernel**2, kernel)
        return (height // patch) * (width // patch) // kernel**2

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``<|image>`` + ``<|image|>`` x soft tokens + ``<image|>`` per image."""
        return [
            self.boi_token + self.image_token * self.soft_tokens(height, width) + self.eoi_token
            for height, width in sizes
        ]

    def image_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Soft tokens per image."""
        return [self.soft_tokens(height, width) for height, width in sizes]

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """Per kept frame ``mm:ss <|image>`` + ``<|video|>`` x soft tokens + ``<image|>``,
        joined by spaces (the frame's whole minutes and seconds from its index and the
        header's rate)."""
        token = str(self.video_placeholder)
        out = []
        for video in videos:
            count = self.soft_tokens(video.header.height, video.header.width, video=True)
            block = self.boi_token + token * count + self.eoi_token
            stamps = [f"{int(t // 60):02d}:{int(t % 60):02d}" for t in video.timestamps]
            out.append(" ".join(f"{stamp} {block}" for stamp in stamps))
        return out

    def video_inputs(self, videos: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """The video processor's outputs without ``num_soft_tokens_per_video``, which the
        processor does not return."""
        out = super().video_inputs(videos)
        out.pop("num_soft_tokens_per_video", None)
        return out

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """After each ``<|turn>model\\n`` (and a pre-filled empty thought channel right after
        it) through its ``<turn|>`` and the newline after it, as for Gemma 3 (what the Gemma
        training templates' generation markers enclose)."""
        spans = []
        for begin, end in delimited_spans(text, _HEADER, _END, trailing="\n"):
            if text.startswith(_EMPTY_THOUGHT, begin):
                begin += len(_EMPTY_THOUGHT)
            spans.append((begin, end))
        return spans

    def _modality_ids(self) -> tuple[list[int], list[int], list[int]]:
        """The image, video and audio token ids the processor marks in ``mm_token_type_ids``."""

        def ids(name: str) -> list[int]:
            return [int(i) for i in getattr(self.processor, name) if i is not None]

        return ids("image_token_ids"), ids("video_token_ids"), ids("audio_token_ids")

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``mm_token_type_ids`` ``[L]``: 1 on image, 2 on video, 3 on audio soft tokens."""
        types = torch.zeros_like(input_ids)
        for value, ids in enumerate(self._modality_ids(), start=1):
            types[torch.isin(input_ids, torch.tensor(ids, dtype=input_ids.dtype))] = value
        return {"mm_token_type_ids": types}

    def attention_masks(
        self, model: Any, segment_lengths: Sequence[int], input_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The 4-D masks (``[1, 1, T, T]``, one per layer type) a packed row of ``input_ids``
        (``[T]``, segments of ``segment_lengths``) needs to train as its segments alone, passed
        as the model's ``attention_mask``.

        transformers derives packed masks from restarting ``position_ids``, but with
        ``use_bidirectional_attention="vision"`` (the image tokens of one image attend to each
        other in sliding-window layers) it reads the image blocks at per-segment positions, so
        the blocks of every segment after the first are wrong. These masks are the model's own
        rule per segment (:func:`~energon_pack.encoding.families.masks.segment_masks`):
        full-attention layers causal; sliding layers causal or same image, and within
        ``sliding_window`` of the query.

        Raises:
            ValueError: the model attends bidirectionally everywhere
                (``use_bidirectional_attention="all"``), or see ``segment_masks``.
        """
        bidirectional = getattr(model.config.get_text_config(), "use_bidirectional_attention", None)
        if bidirectional == "all":
            raise ValueError("Gemma 4 packing: use_bidirectional_attention='all' is not causal")
        ids = input_ids.reshape(-1)
        image, video, _ = self._modality_ids()
        vision = torch.isin(ids, torch.tensor(image + video, dtype=ids.dtype, device=ids.device))
        if bidirectional != "vision":
            vision = torch.zeros_like(vision)
        return segment_masks(
            model, segment_lengths, vision, full_attention_images=False, family="Gemma 4"
        )
