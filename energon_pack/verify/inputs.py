"""The model inputs a verification compares: the packed row as the library builds it for the
model's attention implementation, and each sample alone as the model takes one sample without
packing (no positions: the model derives its own; an all-ones attention mask, as a processor
returns it).

Both go through the same collator, so the media tensors and the family's token inputs are the
processor's; only the packing differs. Token ids are renumbered for the cut vocabulary after
collation (:class:`~energon_pack.verify.tiny.Vocabulary`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from energon_pack.collate import CollatedBatch, VLMPackingCollator
from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.families.materialise import model_side_inputs
from energon_pack.packing.packed import EncodedSample
from energon_pack.train.hf import HFTarget
from energon_pack.verify.tiny import Vocabulary, tokenizer_numbering

Inputs = dict[str, Any]
Adapt = Callable[[Inputs], Inputs]
"""What a trainer does to the packed inputs before the forward (e.g. adds an
``attention_mask``); verification then checks the inputs the model really gets."""

_PACKING_ONLY = ("position_ids", "attention_mask")
"""Packed-row inputs a sample alone goes without: the model derives them itself."""
_SEGMENT_AWARE_STAND_IN = {True: "qwen3_vl", False: None}
"""Model type whose input layout a linear-attention model is given (by whether it rotates with
mRoPE), so that its packed row is built and its leak measured instead of refused."""


@dataclass(frozen=True)
class Segment:
    """One packed sample: its key and where its tokens lie in the row."""

    key: str
    start: int
    length: int


@dataclass(frozen=True)
class Packing:
    """How the samples are collated and renumbered for the cut model."""

    collator: VLMPackingCollator
    family: Any
    vocabulary: Vocabulary

    def packed(
        self, model: Any, samples: Sequence[EncodedSample]
    ) -> tuple[Inputs, tuple[Segment, ...]]:
        """The packed row of ``samples`` (one row) for ``model``, and its segments."""
        batch = self._collated(samples)
        if len(batch.cu_seqlens) != 1:
            raise ValueError("the samples did not fit one row; lower --samples")
        lengths = torch.diff(batch.cu_seqlens[0]).tolist()
        starts = batch.cu_seqlens_padded[0][:-1].tolist()
        segments = tuple(
            Segment(key, int(start), int(length))
            for key, start, length in zip(batch.keys[0], starts, lengths, strict=True)
        )
        return self._model_inputs(model, batch), segments

    def alone(self, model: Any, sample: EncodedSample) -> Inputs:
        """``sample`` by itself, as the model takes one sample unpacked from its processor:
        no positions (the model derives them) and an all-ones ``attention_mask`` (without
        one, transformers looks for packed sequences in the positions the model derives,
        and an Omni thinker's, which repeat over an image, read as several)."""
        with warnings.catch_warnings():  # one sample alone is the point here
            warnings.filterwarnings("ignore", "VLMPackingCollator got a micro-batch of 1")
            inputs = self._model_inputs(model, self._collated([sample]))
        for name in _PACKING_ONLY:
            inputs.pop(name, None)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" not in inputs and _takes(model, "mm_token_type_ids"):
            inputs["mm_token_type_ids"] = _media_token_types(model, inputs["input_ids"])
        return inputs

    def _collated(self, samples: Sequence[EncodedSample]) -> CollatedBatch:
        batch = self.collator.collate(list(samples))
        if batch.skipped_keys:
            raise ValueError(f"the collator skipped {list(batch.skipped_keys)}")
        return batch

    def _model_inputs(self, model: Any, batch: CollatedBatch) -> Inputs:
        """The model's inputs for ``batch``. The family's model-side inputs (masks, rope
        positions) are derived from the tokenizer's ids, which the family knows, with the
        model's config numbering its special ids as the tokenizer does (its rope index
        compares them); only then are the ids renumbered for the cut model."""
        target = HFTarget.of(model)
        if target.segment_blind:
            target = HFTarget(_SEGMENT_AWARE_STAND_IN[target.mrope], target.attn_implementation)
        inputs = batch.model_inputs(target)
        renumber = self.vocabulary.to_model
        if isinstance(self.family, ProcessorFamily) and batch.family_inputs is not None:
            with tokenizer_numbering(model.config, self.vocabulary):
                inputs.update(
                    model_side_inputs(
                        self.family,
                        model,
                        batch.input_ids,
                        batch.cu_seqlens_padded,
                        batch.family_inputs,
                    )
                )
        return {**inputs, **{name: renumber(inputs[name]) for name in ("input_ids", "labels")}}


def _takes(model: Any, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _media_token_types(model: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """1 on image tokens, 2 on video tokens (what Qwen-VL processors return)."""
    config = model.config
    types = torch.zeros_like(input_ids)
    for kind, name in ((1, "image_token_id"), (2, "video_token_id")):
        token = getattr(config, name, None)
        if isinstance(token, int):
            types[input_ids == token] = kind
    return types
