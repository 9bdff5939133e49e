"""Unpacked references: one sample alone through a transformers model, as a user runs it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from helpers import SMALL_MEDIA
from transformers import PreTrainedModel

from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row import IGNORE_INDEX


def alone_inputs(model: PreTrainedModel, sample: EncodedSample) -> dict[str, Any]:
    """``model(**inputs)`` keyword arguments of ``sample`` by itself: unshifted labels (``-100``
    off the loss mask and on the first token), its media, no position ids (the model computes
    them; Qwen-VL from ``mm_token_type_ids``)."""
    ids = sample.input_ids
    labels = torch.where(sample.loss_mask != 0, ids, IGNORE_INDEX)
    labels[0] = IGNORE_INDEX
    inputs: dict[str, Any] = {"input_ids": ids[None], "labels": labels[None], "use_cache": False}
    if model.config.model_type != "qwen2":
        config = model.config
        token_types = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id)
        inputs["mm_token_type_ids"] = token_types.long()[None]
        vision = sample.materialize(SMALL_MEDIA).vision
        inputs.update(vision.tensors() if vision is not None else {})
        if model.config.model_type == "qwen2_vl":
            inputs.pop("second_per_grid_ts", None)
    return inputs


def token_losses(model: PreTrainedModel, sample: EncodedSample) -> torch.Tensor:
    """The per-target-token losses of ``sample`` run alone (float64 model: float64 losses)."""
    inputs = alone_inputs(model, sample)
    labels = inputs.pop("labels")[0, 1:]
    logits = model(**inputs).logits[0, :-1]
    keep = labels != IGNORE_INDEX
    return F.cross_entropy(logits[keep], labels[keep], reduction="none")
