"""A Qwen-style HF tokenizer and Qwen2-VL processor built locally (no downloads).

A small byte-level BPE vocabulary trained with ``tokenizers`` on a fixed text, Qwen2's
pre-tokenizer split pattern, the Qwen2-VL special tokens and a ChatML chat template that adds
Qwen's default system prompt and renders image/video content parts as vision blocks. The
assistant content and its ``<|im_end|>`` are wrapped in ``{% generation %}`` so transformers'
``return_assistant_tokens_mask`` gives the reference loss mask.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil, Qwen2VLProcessor

from energon_pack.encoding.chatml import SPECIAL_TOKENS
from energon_pack.media import MediaConfig

QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEFAULT_SYSTEM = "You are a helpful assistant."
CHAT_TEMPLATE = (
    "{% macro content(message) %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ content(message) }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ content(message) }}<|im_end|>{% endif %}{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = (
    "What is shown here? Describe the image in detail.\n\n\nThe quick brown fox jumps over the "
    "lazy dog.\n A user asks, the assistant answers; the system sets the rules. 12 345 6789\n"
    "  indented text\tand tabs, émigré façade naïve.\n"
)


def qwen_tokenizer(vocab_size: int = 700) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the Qwen2-VL special tokens and a ChatML template."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_CORPUS] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class _ImageOnlyProcessor(Qwen2VLProcessor):
    """Qwen2VLProcessor without a video processor (transformers' needs torchvision, which
    cannot run against the CPU torch here); everything else is transformers' own code."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def qwen_processor(tokenizer: PreTrainedTokenizerFast, media: MediaConfig) -> Qwen2VLProcessor:
    """Qwen2VLProcessor with the PIL image processor set up like ``media`` (no video
    processor: transformers' needs torchvision)."""
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=media.min_pixels,
        max_pixels=media.max_pixels,
        patch_size=media.patch_size,
        merge_size=media.merge_size,
        temporal_patch_size=media.temporal_patch_size,
    )
    return _ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer)


def reference_ids(
    processor: Qwen2VLProcessor,
    messages: list[dict[str, Any]],
    images: list[Any],
    video_grids: list[tuple[int, int, int]],
    merge_size: int,
) -> tuple[list[int], list[int], dict[str, Any]]:
    """transformers' ids and assistant mask: the chat template, then each image placeholder
    expanded by the processor (its image processor decides the grids) and each video
    placeholder by the processor's ``replace_video_token`` rule with the given grids."""
    text = processor.tokenizer.apply_chat_template(messages, tokenize=False)
    image_inputs: dict[str, Any] = {}
    image_repl: list[str] = []
    if images:
        image_inputs, image_repl = processor._process_images(images)
    video_repl = [
        processor.video_token * (int(torch.tensor(grid).prod()) // merge_size**2)
        for grid in video_grids
    ]
    expanded, _ = processor.get_text_with_replacements([text], image_repl, video_repl, [])
    ids = processor.tokenizer(expanded[0], add_special_tokens=False)["input_ids"]
    rendered = processor.tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    mask = _expand_mask(rendered, processor, ids)
    return list(ids), mask, image_inputs


def _expand_mask(rendered: Any, processor: Qwen2VLProcessor, expanded: list[int]) -> list[int]:
    """The template's assistant mask carried over to the placeholder-expanded ids."""
    pads = {
        processor.tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")
    }
    mask: list[int] = []
    position = 0
    short = rendered["input_ids"]
    for index, token in enumerate(short):
        flag = int(rendered["assistant_masks"][index])
        if token in pads:
            while position < len(expanded) and expanded[position] == token:
                mask.append(0)
                position += 1
            continue
        mask.append(flag)
        position += 1
    return mask
