"""Set-up shared by the concept, integration, family and format pages of the docs.

Everything here stands in for what a reader already has: image and video files, a Hugging Face
tokenizer saved in a folder, a way to stop a loader's worker processes when a page is done.
Nothing is downloaded; everything is built from fixed inputs, so the pages print the same
values on every run.
"""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
from PIL import Image
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

__all__ = [
    "CHAT_TEMPLATE",
    "image_bytes",
    "save_qwen_style_tokenizer",
    "stop_workers",
    "video_bytes",
]


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    """An image file of ``width`` x ``height`` random pixels, encoded as ``fmt``."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def video_bytes(width: int = 96, height: int = 64, frames: int = 8, fps: int = 4) -> bytes:
    """A small H.264 MP4 of ``frames`` grey frames at ``fps``."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        for index in range(frames):
            array = np.full((height, width, 3), index * 20 % 256, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def stop_workers(*loaders: Any) -> None:
    """Stop the worker processes of Energon savable loaders now.

    A loader that was iterated keeps its worker processes (Energon uses persistent workers)
    until it is garbage-collected. Neither Energon nor torch has a public call for stopping
    them, so this makes the call torch's iterator makes when it is finalised.
    """
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()


# --- a Qwen-style Hugging Face tokenizer, built locally ------------------------------------

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""The Qwen2-VL special tokens the encoders use."""

_SPLIT = (
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
    "<|im_start|>{{ message['role'] }}\n{{ content(message) }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A ChatML template as Qwen2-VL's renders conversations: a default system prompt, image and
video parts as vision blocks, no generation markers."""

_CORPUS = (
    "What is shown here? Describe the image in detail.\n\n\nThe quick brown fox jumps over the "
    "lazy dog.\n A user asks, the assistant answers; the system sets the rules. 12 345 6789\n"
    "  A cat sits on a mat. What happens in the video? Nothing much.\n"
)


def save_qwen_style_tokenizer(directory: str | Path, vocab_size: int = 600) -> Path:
    """Save a small byte-level BPE tokenizer with the Qwen2-VL special tokens and a ChatML chat
    template into ``directory``, so that ``AutoTokenizer.from_pretrained(directory)`` loads it
    as it would load a checkpoint's tokenizer."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
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
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    path = Path(directory)
    tokenizer.save_pretrained(path)
    return path
