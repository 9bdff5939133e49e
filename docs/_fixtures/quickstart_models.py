"""Tiny local stand-ins for the Hugging Face model and processor a quick-start reader loads.

``tiny_qwen2_5_vl()`` gives a Qwen2.5-VL model two layers deep, built from its config with
random weights (fixed seed), and a Qwen2.5-VL processor holding a small byte-level BPE
tokenizer with Qwen2-VL's special tokens and a ChatML chat template, and transformers' PIL
image processor. The processor has no video processor: transformers' needs torchvision, which
this environment does not run. ``save_tokenizer(directory)`` saves that tokenizer where
``AutoTokenizer.from_pretrained(directory)`` (or ``--tokenizer DIR``) loads it. Nothing is
downloaded, so a page prints the same values on every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
)

__all__ = ["save_tokenizer", "tiny_qwen2_5_vl"]

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen2-VL's special tokens, in Qwen's order (ids right after the learned vocabulary)."""

_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "What is it? A square. What colour is this square? Blue. Describe the image in detail.\n"
    "The quick brown fox jumps over the lazy dog. A user asks, the assistant answers.\n"
)


def _tokenizer() -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_CORPUS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tokenizer.chat_template = _TEMPLATE
    return tokenizer


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
