"""Tiny local stand-ins for the processors and models a reader of the model-families page
loads from the Hub: the test suite's own builders (``tests/encoding/test_family_*.py``), a
small BPE tokenizer with each family's special tokens and turn format, the family's real
transformers processor class, and a two-layer model built from the family's config with random
weights. Nothing is downloaded."""

from __future__ import annotations

import json
from typing import Any

import test_family_gemma3
import test_family_idefics3
import test_family_qwen2_audio
from family_kit import png_bytes
from family_kit import test_images as seeded_images
from transformers import PreTrainedModel

__all__ = ["gemma3", "qwen2_audio", "sample", "smolvlm"]


def smolvlm() -> tuple[Any, PreTrainedModel]:
    """A SmolVLM processor (28 px tiles) and its tiny float64 model."""
    processor = test_family_idefics3.small("smolvlm")
    return processor, test_family_idefics3.tiny_model("smolvlm", processor).double()


def gemma3() -> tuple[Any, PreTrainedModel]:
    """A Gemma 3 processor (32 px images, 4 soft tokens) and its tiny float64 model."""
    processor = test_family_gemma3.make_processor()
    return processor, test_family_gemma3.tiny_model().double()


def qwen2_audio() -> tuple[Any, PreTrainedModel]:
    """A Qwen2-Audio processor (16 mel bins, 2-second windows) and its tiny float64 model."""
    processor = test_family_qwen2_audio.processor(2)
    return processor, test_family_qwen2_audio.tiny_model(processor)


def sample(key: str, question: str, answer: str, *sizes: tuple[int, int]) -> dict[str, Any]:
    """A native sample: PNG images of ``sizes`` (height, width) before ``question``."""
    members = {f"{i}.png": png_bytes(image) for i, image in enumerate(seeded_images(0, sizes))}
    turns = [
        {"from": "human", "value": "<image>" * len(sizes) + question},
        {"from": "gpt", "value": answer},
    ]
    body = json.dumps({"conversations": turns, "media": list(members)})
    return {"__key__": key, "json": body.encode(), **members}
