"""Sample formats other than the native one, read into the same :class:`RawSample`.

* :mod:`~energon_pack.formats.bridge`: Megatron-Bridge's Qwen-VL WebDataset layout
  (``json`` + pickled ``jpgs`` / ``videos``), read by :func:`parse_any`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from energon_pack.formats.bridge import is_bridge_sample, parse_bridge_sample
from energon_pack.sample import RawSample, parse_sample

__all__ = ["parse_any"]


def parse_any(key: str, sample: Mapping[str, Any]) -> RawSample:
    """Parse a WebDataset sample of any supported layout: Bridge's when it has ``jpgs`` or
    ``videos`` members, else the native one (:func:`~energon_pack.sample.parse_sample`)."""
    if is_bridge_sample(sample):
        return parse_bridge_sample(key, sample)
    return parse_sample(key, sample)
