"""Model directories for the verify page, as checkpoints ship them without weights: the test
suite's builders (``tests/support/model_dirs.py``: transformers' config defaults, Qwen's real
tokenizer built offline, the processor files). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

from model_dirs import model_dir

__all__ = ["checkpoint_dir"]


def checkpoint_dir(directory: str | Path, model: str) -> Path:
    """``directory`` holding ``model``'s checkpoint files (``qwen2_vl``, ``qwen3_5``, ...)."""
    return model_dir(Path(directory), model)
