"""Set-up shared by the concept, integration, family and format pages of the docs.

Everything here stands in for what a reader already has: image and video files, a Hugging Face
tokenizer saved in a folder, a way to stop a loader's worker processes when a page is done. The
files and the tokenizer are the test suite's own builders (``tests/support/helpers.py``,
``tests/support/hf_qwen.py``): nothing is downloaded, and the pages print the same values on
every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helpers
from helpers import image_bytes, video_bytes
from hf_qwen import qwen_tokenizer

__all__ = ["image_bytes", "save_qwen_style_tokenizer", "stop_workers", "video_bytes"]


def stop_workers(*loaders: Any) -> None:
    """Stop the worker processes of Energon savable loaders now (Energon keeps persistent
    workers until a loader is garbage-collected, and has no public call to stop them)."""
    for loader in loaders:
        helpers.stop_workers(loader)


def save_qwen_style_tokenizer(directory: str | Path, vocab_size: int = 600) -> Path:
    """Save a small byte-level BPE tokenizer with the Qwen2-VL special tokens and a ChatML chat
    template into ``directory``, so that ``AutoTokenizer.from_pretrained(directory)`` loads it
    as it would load a checkpoint's tokenizer."""
    path = Path(directory)
    qwen_tokenizer(vocab_size).save_pretrained(path)
    return path
