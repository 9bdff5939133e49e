"""Why a packed row is not exact, in words a user can act on: the input that is wrong or
missing, the layer type that carries one segment into another, and the fix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from energon_pack.verify.inputs import Inputs, Segment
from energon_pack.verify.measure import Difference


@dataclass(frozen=True)
class Findings:
    """What the passes measured on one attention implementation."""

    attn_implementation: str
    inputs: Inputs
    segments: Sequence[Segment]
    layer_types: Sequence[str]
    mrope: bool
    block_mask: bool
    """The family packs with a 4-D block mask the model builds (images attend both ways)."""
    alone: Difference
    """Packed against each sample alone."""
    leak: Difference
    """The other segments when one changed."""
    leaked: bool


def layer_name(layer: int | None, layer_types: Sequence[str]) -> str | None:
    """``"3 (linear_attention)"``, or None."""
    if layer is None:
        return None
    kind = layer_types[layer] if layer < len(layer_types) else "decoder layer"
    return f"{layer} ({kind})"


def reason(found: Findings) -> str:
    """Why packed differs from alone (see the module docstring)."""
    if found.mrope and _text_positions_only(found.inputs):
        return (
            "1-D position_ids for an mRoPE model: the row's images and text rotate unlike the "
            "model's own positions for each sample; give position_ids [4, R, T] "
            "(VLMPackingCollator(position_ids='mrope'), or hf_model_inputs with the batch's "
            "mrope_position_ids)"
        )
    if found.leaked:
        return _leak_reason(found)
    if found.block_mask and not isinstance(found.inputs.get("attention_mask"), dict):
        return (
            "the family's image tokens attend both ways inside each image, which position_ids "
            "alone cannot say: pass the 4-D block masks VLMPackingCollator(..., output='hf', "
            "hf_model=model) builds as attention_mask"
        )
    where = layer_name(found.alone.layer, found.layer_types)
    if where is None:
        return (
            "packed differs from alone in the logits although no decoder layer does: the loss "
            "or the labels of the row differ (labels unshifted, -100 on each segment's first "
            "token)"
        )
    return (
        f"packed differs from alone from layer {where} although no segment sees another: "
        "the row's positions or per-sample inputs differ from those the model derives for one "
        "sample"
    )


def _leak_reason(found: Findings) -> str:
    layer = found.leak.layer
    kind = found.layer_types[layer] if layer is not None and layer < len(found.layer_types) else ""
    if kind == "linear_attention":
        return (
            f"linear-attention layers (first: layer {layer}) carry their state from one "
            "segment into the next: transformers' torch implementation of these layers takes "
            "no segment boundaries (cu_seq_lens reach only the optional fla / causal-conv1d "
            "kernels). Train these models one sample per row, unpacked"
        )
    mask = found.inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return (
            "the packed inputs carry a 2-D attention_mask: transformers then builds one causal "
            "mask over the whole row and ignores the segment boundaries in position_ids; drop "
            "attention_mask (the library's hf inputs leave it out)"
        )
    start = _missing_restart(found.inputs, found.segments)
    if start is not None:
        return (
            f"position_ids do not restart at token {start.start} (segment {start.key!r}): the "
            "model reads the row there as one sequence, so a boundary is missing (cu_seqlens "
            "or position_ids)"
        )
    where = layer_name(layer, found.layer_types) or "the embeddings"
    return (
        f"segments see each other from layer {where} with {found.attn_implementation}: this "
        "implementation ignores the packed boundaries; use one that takes them (eager, sdpa, "
        "flash_attention_2) or pass a 4-D block mask"
    )


def _text_positions(inputs: Inputs) -> torch.Tensor | None:
    positions = inputs.get("position_ids")
    if not isinstance(positions, torch.Tensor):
        return None
    return positions.reshape(-1, positions.shape[-1])[0] if positions.dim() == 3 else positions[0]


def _text_positions_only(inputs: Inputs) -> bool:
    positions = inputs.get("position_ids")
    return isinstance(positions, torch.Tensor) and positions.dim() == 2


def _missing_restart(inputs: Inputs, segments: Sequence[Segment]) -> Segment | None:
    positions = _text_positions(inputs)
    if positions is None:
        return None
    for segment in segments:
        if int(positions[segment.start]) != 0:
            return segment
    return None
