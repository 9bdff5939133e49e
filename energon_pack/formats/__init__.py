"""Sample formats, each read into the same :class:`~energon_pack.formats.raw.RawSample`.

* :mod:`~energon_pack.formats.native`: the native WebDataset layout (``json`` + media members);
* :mod:`~energon_pack.formats.bridge`: Megatron-Bridge's WebDataset layouts (``json`` or
  ``conversation.json`` + pickled ``jpgs`` / ``videos`` lists or single media members);
* :mod:`~energon_pack.formats.chat_rows`: TRL / transformers chat rows (``messages`` +
  ``images`` / ``videos``) and LLaVA JSON records, with :class:`ChatDataset` for a DataLoader.

:func:`parse_any` tells them apart, so every path (Energon, collator) reads all of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from energon_pack.formats.bridge import is_bridge_sample, parse_bridge_sample
from energon_pack.formats.chat_rows import ChatDataset, is_chat_row, parse_chat_row
from energon_pack.formats.native import parse_sample
from energon_pack.formats.raw import RawSample
from energon_pack.media.config import MediaConfig
from energon_pack.media.errors import media_errors

__all__ = ["ChatDataset", "parse_any"]


def parse_any(key: str, sample: Mapping[str, Any], config: MediaConfig | None = None) -> RawSample:
    """Parse a sample of any supported layout: a chat row (a ``messages`` / ``conversations``
    field, no ``json`` member), one of Bridge's
    (:func:`~energon_pack.formats.bridge.is_bridge_sample`), else the native one
    (:func:`~energon_pack.formats.native.parse_sample`). JSON is bounded by ``config``'s
    ``max_json_bytes`` / ``max_json_depth``; every failure is a ``MediaError``."""
    with media_errors(key, "json", "bad_sample"):
        if is_chat_row(sample):
            return parse_chat_row(key, sample)
        if is_bridge_sample(sample):
            return parse_bridge_sample(key, sample, config)
        return parse_sample(key, sample, config)
