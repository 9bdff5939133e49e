"""Tiny local stand-ins for the Hugging Face model and processor a quick-start reader loads.

``tiny_qwen2_5_vl()`` gives a Qwen2.5-VL model two layers deep, built from its config with
random weights (fixed seed), and a Qwen2.5-VL processor holding the test suite's small
byte-level BPE tokenizer (``tests/hf_qwen.py``: Qwen2-VL's special tokens, a ChatML chat
template) and transformers' PIL image processor. The processor has no video processor:
transformers' needs torchvision, which this environment does not run.
``save_tokenizer(directory)`` saves that tokenizer where
``AutoTokenizer.from_pretrained(directory)`` (or ``--tokenizer DIR``) loads it. Nothing is
downloaded, so a page prints the same values on every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hf_qwen import qwen_tokenizer
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
)

__all__ = ["save_tokenizer", "tiny_qwen2_5_vl"]


def _tokenizer() -> PreTrainedTokenizerFast:
    return qwen_tokenizer(500)


def _text_config(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 8192,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """transformers' Qwen2.5-VL processor without its video processor (which needs torchvision);
    everything else is transformers' own code. Saving writes the tokenizer and the image
    processor."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[no-untyped-call]

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)
        return []


def save_tokenizer(directory: str | Path) -> Path:
    """The stand-in tokenizer, saved where ``AutoTokenizer.from_pretrained(directory)`` loads it."""
    target = Path(directory)
    _tokenizer().save_pretrained(target)
    return target


def tiny_qwen2_5_vl() -> tuple[Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor]:
    """A two-layer Qwen2.5-VL (random float32 weights, training mode) and its processor."""
    tokenizer = _tokenizer()

    def ids(token: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(token))  # type: ignore[arg-type]

    text = _text_config(tokenizer)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
    }
    vision = {
        "depth": 1,
        "hidden_size": 32,
        "out_hidden_size": 32,
        "intermediate_size": 32,
        "num_heads": 2,
        "spatial_merge_size": 2,
        "tokens_per_second": 2,
        "window_size": 56,
        "fullatt_block_indexes": [0],
    }
    config = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
    )
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).train()
    processor = ImageOnlyQwen2_5_VLProcessor(  # type: ignore[no-untyped-call]
        image_processor=Qwen2VLImageProcessorPil(), tokenizer=tokenizer
    )
    return model, processor
