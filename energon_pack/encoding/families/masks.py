"""4-D attention masks for a packed row of a model whose images attend both ways, given to
the model per layer type as ``attention_mask={"full_attention": ..., "sliding_attention":
...}`` where restarting position ids alone do not make packing exact (Gemma 3 and Gemma 4:
transformers reads their image blocks at per-segment positions in a packed row)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["image_blocks", "segment_masks"]


def image_blocks(image: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """``[T]`` block index of each token: one block per run of ``image`` tokens within a
    segment, ``-1`` off images."""
    starts = image.clone()
    starts[1:] &= ~(image[:-1] & (segment[1:] == segment[:-1]))
    return torch.where(image, torch.cumsum(starts.long(), 0) - 1, -1)


def segment_masks(
    model: Any,
    segment_lengths: Sequence[int],
    image: torch.Tensor,
    *,
    full_attention_images: bool,
    family: str,
) -> dict[str, torch.Tensor]:
    """The per-layer-type masks ``[1, 1, T, T]`` of a row of segments of ``segment_lengths``:
    causal within each segment; the tokens of one image (a run of ``image``, ``[T]`` bool)
    attend to each other in the sliding-window layers, and in the full-attention layers too
    when ``full_attention_images``; the sliding layers see only ``sliding_window`` tokens back.
    Boolean (True attends) for ``sdpa``, additive for ``eager``.

    Raises:
        ValueError: the lengths are not a split of the row, or the model's attention takes no
            4-D mask (``family`` names the family in the message).
    """
    config = model.config.get_text_config()
    total = int(image.numel())
    if sum(segment_lengths) != total or any(n <= 0 for n in segment_lengths):
        raise ValueError(
            f"{family} packing: segment lengths {list(segment_lengths)} are not a split of "
            f"{total} tokens"
        )
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation not in ("sdpa", "eager"):
        raise ValueError(
            f"{family} packing: attention implementation {implementation!r} takes no 4-D mask; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    device = image.device
    lengths = torch.tensor(list(segment_lengths), device=device)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    index = torch.arange(total, device=device)
    query, key = index[:, None], index[None, :]
    causal = (key <= query) & (segment[:, None] == segment[None, :])
    block = image_blocks(image.reshape(-1).bool(), segment)
    same_image = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    full = causal | same_image if full_attention_images else causal
    window = getattr(config, "sliding_window", None)
    sliding = causal | same_image
    if window is not None:
        sliding &= key > query - int(window)
    masks = {"full_attention": full, "sliding_attention": sliding}
    layer_types = getattr(config, "layer_types", None) or list(masks)
    out = {}
    for layer_type in dict.fromkeys(layer_types):
        mask = masks[layer_type][None, None]
        if implementation == "eager":
            dtype = model.dtype
            zero = torch.zeros((), dtype=dtype, device=device)
            mask = torch.where(mask, zero, torch.finfo(dtype).min)
        out[layer_type] = mask
    return out
