"""Tiny local stand-ins for the Hugging Face model and processor a quick-start reader loads.

``tiny_qwen2_5_vl()`` gives the test suite's Qwen2.5-VL model two layers deep, built from its
config with random weights (fixed seed), and a Qwen2.5-VL processor holding the test suite's
small byte-level BPE tokenizer (``tests/support/hf_qwen.py``: Qwen2-VL's special tokens, a
ChatML chat template) and transformers' PIL image processor. The processor has no video processor:
transformers' needs torchvision, which this environment does not run.
``save_tokenizer(directory)`` saves that tokenizer where
``AutoTokenizer.from_pretrained(directory)`` (or ``--tokenizer DIR``) loads it. Nothing is
downloaded, so a page prints the same values on every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_trainers import TOKENIZER, model_for
from transformers import PreTrainedModel, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

__all__ = ["save_tokenizer", "tiny_qwen2_5_vl"]


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
    TOKENIZER.save_pretrained(target)
    return target


def tiny_qwen2_5_vl() -> tuple[PreTrainedModel, Qwen2_5_VLProcessor]:
    """The test suite's two-layer Qwen2.5-VL (``tests/train/test_trainers.py``: random weights,
    training mode) in float32, and a Qwen2.5-VL processor on the same tokenizer."""
    processor = ImageOnlyQwen2_5_VLProcessor(  # type: ignore[no-untyped-call]
        image_processor=Qwen2VLImageProcessorPil(), tokenizer=TOKENIZER
    )
    return model_for("qwen2_5_vl").float(), processor
