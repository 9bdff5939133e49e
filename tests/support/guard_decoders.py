"""Decoders for the guard tests, imported by the decoder process: numpy and the standard
library only, like the library's own decoding modules (the helper maps ``energon_pack`` and
``energon_pack.media`` without running their ``__init__``)."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

from energon_pack.media.errors import medium_label


def filled_frames(
    value: int, shape: tuple[int, ...], crash: bool, alloc: Any
) -> tuple[np.ndarray[Any, Any], int]:
    """A decoder for the batch tests: ``shape`` bytes of ``value``, or a SIGSEGV."""
    if crash:
        ctypes.string_at(0)
    frames = alloc(shape)
    frames.fill(value)
    return frames, value


def slow_frames(value: int, delay: float, alloc: Any) -> tuple[np.ndarray[Any, Any], int]:
    """A decoder for the batch tests that takes ``delay`` seconds."""
    time.sleep(delay)
    frames = alloc((10,))
    frames.fill(value)
    return frames, value


def fresh_array(shape: tuple[int, ...], alloc: Any) -> tuple[np.ndarray[Any, Any], None]:
    """A decoder that ignores ``alloc``."""
    return np.zeros(shape, dtype=np.uint8), None


def labelled_frames(alloc: Any) -> tuple[np.ndarray[Any, Any], str]:
    """A decoder whose extra is the medium its log lines would name."""
    return alloc((1,)), medium_label()
