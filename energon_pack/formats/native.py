"""The on-disk sample format: a WebDataset sample with a ``json`` member and media members.

``json`` holds ``{"conversations": [...], "system": optional str, "media": optional list of
member names in placeholder order, "tools": optional function list}``. Turns are ShareGPT/LLaVA
style (``{"from": "human", "value": "<image>\\n..."}``) or role/content style (``{"role":
"user", "content": ...}``). Media members are named ``<index>.<jpg|jpeg|png|webp|mp4>``; without
a ``media`` list they are taken in index order. The ``<image>``/``<video>`` placeholders of all
turns, in order, must match the media members one to one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from energon_pack.formats.conversation import (
    check_media_order,
    conversation_messages,
    conversation_tools,
    message_media_kinds,
)
from energon_pack.formats.raw import RawSample
from energon_pack.media.config import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, MediaConfig
from energon_pack.media.errors import MediaError, media_errors
from energon_pack.media.probe import media_kind

__all__ = ["load_json", "parse_sample"]


def parse_sample(
    key: str, sample: Mapping[str, Any], config: MediaConfig | None = None
) -> RawSample:
    """Validate and parse a raw sample (member name -> bytes; ``json`` may be decoded already).

    Raises :class:`~energon_pack.media.MediaError` (a ValueError) naming the key and member for
    missing, malformed, too large (``config.max_json_bytes``) or too deeply nested
    (``config.max_json_depth``) JSON, unknown media extensions, missing members, and
    placeholder/media count mismatches.
    """
    with media_errors(key, "json", "bad_sample"):
        return _parse(key, sample, config or MediaConfig())


def _parse(key: str, sample: Mapping[str, Any], config: MediaConfig) -> RawSample:
    meta = _json(key, sample.get("json"), config)
    turns = tuple(_turn(key, index, turn) for index, turn in enumerate(meta["conversations"]))
    system = meta.get("system")
    if system is not None and not isinstance(system, str):
        raise MediaError(key, "json", "bad_sample", "'system' must be a string")
    names = _media_names(key, sample, meta.get("media"))
    media = []
    for name in names:
        kind = media_kind(name)
        if kind is None:
            known = sorted(IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
            raise MediaError(
                key, name, "unsupported", f"unknown media extension; use one of {known}"
            )
        if name not in sample:
            raise MediaError(key, name, "bad_sample", "member listed in 'media' is missing")
        data = sample[name]
        if not isinstance(data, (bytes, bytearray)):
            raise MediaError(key, name, "bad_sample", f"member is {type(data).__name__}, not bytes")
        media.append((name, kind, bytes(data)))
    messages = tuple(conversation_messages(key, meta["conversations"]))
    check_media_order(key, message_media_kinds(messages), media)
    tools = conversation_tools(key, meta.get("tools"))
    return RawSample(key, turns, system, tuple(media), messages, tools)


def load_json(key: str, raw: Any, config: MediaConfig | None = None, member: str = "json") -> Any:
    """``raw`` parsed if it is JSON bytes/str, else as given, within ``config``'s
    ``max_json_bytes`` and ``max_json_depth``; anything else is a :class:`MediaError`."""
    cfg = config or MediaConfig()
    if raw is None:
        raise MediaError(key, member, "bad_sample", f"sample has no {member!r} member")
    too_deep = (
        f"the JSON nests deeper than max_json_depth={cfg.max_json_depth}; flatten it or "
        "raise MediaConfig.max_json_depth"
    )
    if isinstance(raw, (bytes, bytearray, str)):
        if len(raw) > cfg.max_json_bytes:
            raise MediaError(
                key,
                member,
                "bad_sample",
                f"the JSON member has {len(raw)} bytes, above max_json_bytes="
                f"{cfg.max_json_bytes}; shrink it or raise MediaConfig.max_json_bytes",
            )
        try:
            meta = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise MediaError(key, member, "bad_sample", f"invalid JSON: {exc}") from exc
        except RecursionError:
            raise MediaError(key, member, "bad_sample", too_deep) from None
    else:
        meta = raw
    if _depth_exceeds(meta, cfg.max_json_depth):
        raise MediaError(key, member, "bad_sample", too_deep)
    return meta


def _json(key: str, raw: Any, config: MediaConfig) -> dict[str, Any]:
    meta = load_json(key, raw, config)
    if not isinstance(meta, dict):
        raise MediaError(key, "json", "bad_sample", "the JSON member must be an object")
    conversations = meta.get("conversations")
    if not isinstance(conversations, list) or not conversations:
        raise MediaError(
            key, "json", "bad_sample", "the JSON needs a non-empty 'conversations' list of turns"
        )
    return meta


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/dicts deeper than ``limit`` (iterative, no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in item)
    return False


def _turn(key: str, index: int, turn: Any) -> tuple[str, str]:
    if isinstance(turn, dict):
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if isinstance(role, str) and isinstance(content, str):
            return role, content
    raise MediaError(
        key,
        "json",
        "bad_sample",
        f"turn {index} needs string 'from'/'value' (ShareGPT) or 'role'/'content' fields",
    )


def _media_names(key: str, sample: Mapping[str, Any], order: Any) -> list[str]:
    if order is None:
        indexed = []
        for name in sample:
            head, _, ext = name.partition(".")
            if head.isdigit() and ext:
                indexed.append((int(head), name))
        return [name for _, name in sorted(indexed)]
    if isinstance(order, list) and all(isinstance(name, str) for name in order):
        return list(order)
    raise MediaError(key, "json", "bad_sample", "'media' must be a list of member names")
