"""Settings fingerprints: flat, JSON-able records of the settings a result depends on.

A saved state carries the fingerprint of the settings it was made with. Restoring compares it
with the current fingerprint setting by setting and refuses any difference by name, so a
changed setting is never half-accepted (and never fails later with a misleading error).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from energon_pack.encoding.chatml import ByteTokenizer, Tokenizer
from energon_pack.encoding.family import ModelFamily

_UNSET = "<unset>"
_SAVED_CLASS_NAMES: dict[type, str] = {ByteTokenizer: "energon_pack.encode.ByteTokenizer"}
"""The class names that saved states and offline manifests carry for this package's own
tokenizers: the module they had when those files were first written, so files written before
a class moved keep matching."""


def tokenizer_identity(tokenizer: Tokenizer) -> dict[str, Any]:
    """What identifies a tokenizer: its class, vocabulary size, name or path and pad token id."""
    cls = type(tokenizer)
    name = getattr(tokenizer, "name_or_path", None)
    pad = getattr(tokenizer, "pad_token_id", None)
    size = getattr(tokenizer, "vocab_size", None)
    return {
        "class": _SAVED_CLASS_NAMES.get(cls, f"{cls.__module__}.{cls.__qualname__}"),
        "vocab_size": size if _is_int(size) else None,
        "name_or_path": name if isinstance(name, str) else None,
        "pad_token_id": pad if _is_int(pad) else 0,
    }


def family_identity(family: ModelFamily) -> dict[str, Any]:
    """What identifies a model family preset's rules: name, rope rule, ``tokens_per_second``
    (its media settings are recorded with the media)."""
    return {
        "name": family.name,
        "rope": family.rope,
        "tokens_per_second": family.tokens_per_second,
    }


def settings_fingerprint(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` flattened to dotted names (``media.max_pixels``), values as JSON gives them
    back. Dataclasses and mappings are flattened; other values must be JSON-able."""
    flat: dict[str, Any] = {}

    def add(name: str, value: Any) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                add(f"{name}.{key}" if name else str(key), item)
        else:
            flat[name] = value

    add("", settings)
    fingerprint: dict[str, Any] = json.loads(json.dumps(flat))
    return fingerprint


def check_fingerprint(saved: object, current: Mapping[str, Any], *, what: str) -> None:
    """Raise ValueError naming every setting whose saved and current values differ."""
    if not isinstance(saved, Mapping):
        raise ValueError(
            f"{what} carries no settings fingerprint (settings={saved!r:.200} must be a dict), "
            "so it cannot be checked against the current settings; it was not saved by this "
            "version of energon_pack, or was edited. Start a fresh run, or restore with the "
            "version that saved it."
        )
    differences = [
        f"{name}: saved {saved.get(name, _UNSET)!r}, now {current.get(name, _UNSET)!r}"
        for name in sorted(set(saved) | set(current))
        if saved.get(name, _UNSET) != current.get(name, _UNSET)
    ]
    if differences:
        raise ValueError(
            f"cannot restore {what}: it was saved with other settings ({'; '.join(differences)}). "
            "An exact resume needs the settings the checkpoint was saved with: restore with "
            "those, or start a fresh run (without restoring) to use the new ones."
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
