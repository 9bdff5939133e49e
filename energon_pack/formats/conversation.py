"""Turns of the conversation forms other formats use, as ``(role, text with placeholders)``.

Accepted turn forms: ShareGPT ``{"from", "value"}`` and role/content ``{"role", "content"}``
where content is a string or a list of parts (``{"type": "text", "text"}``, ``{"type":
"image"}``, ``{"type": "video"}``: transformers / TRL / OpenAI style). Parts become the
native form: text joined without separators, ``<image>`` / ``<video>`` for media parts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from energon_pack.media.errors import MediaError

__all__ = ["check_placeholders", "conversation_turns", "placeholder_kinds", "turn_text"]

_PLACEHOLDER = re.compile(r"<(image|video)>")
_MEDIA_PARTS = {"image": "<image>", "image_url": "<image>", "video": "<video>"}


def conversation_turns(key: str, turns: Any, member: str = "json") -> list[tuple[str, str]]:
    """Every turn of a non-empty list as ``(role, text)``; see the module docstring."""
    if not isinstance(turns, list) or not turns:
        raise MediaError(key, member, "bad_sample", "the conversation must be a non-empty list")
    return [turn_text(key, index, turn, member) for index, turn in enumerate(turns)]


def turn_text(key: str, index: int, turn: Any, member: str = "json") -> tuple[str, str]:
    """``(role, text)`` of one turn; content parts are joined, media parts become placeholders."""
    if isinstance(turn, dict):
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if isinstance(role, str) and isinstance(content, str):
            return role, content
        if isinstance(role, str) and isinstance(content, list):
            return role, "".join(_part_text(key, index, part, member) for part in content)
    raise MediaError(
        key,
        member,
        "bad_sample",
        f"turn {index} needs 'from'/'value' (ShareGPT) or 'role'/'content' (a string or a list "
        "of parts)",
    )


def _part_text(key: str, index: int, part: Any, member: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind in _MEDIA_PARTS:
        return _MEDIA_PARTS[kind]
    raise MediaError(
        key,
        member,
        "bad_sample",
        f"turn {index} has a content part {_short(part)}; parts are {{'type': 'text', 'text': "
        "...}, {'type': 'image'} or {'type': 'video'}",
    )


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def placeholder_kinds(turns: Sequence[tuple[str, str]]) -> list[str]:
    """``"image"`` / ``"video"`` for each ``<image>`` / ``<video>`` of the turns, in order."""
    return [match.group(1) for _, text in turns for match in _PLACEHOLDER.finditer(text)]


def check_placeholders(
    key: str,
    turns: Sequence[tuple[str, str]],
    media: Sequence[tuple[str, Literal["image", "video"], object]],
) -> None:
    """The turns' ``<image>``/``<video>`` placeholders take the ``(member, kind, payload)``
    media one to one, in order; else a ``placeholder_mismatch`` naming both."""
    placeholders = placeholder_kinds(turns)
    kinds = [kind for _, kind, _ in media]
    if placeholders != kinds:
        raise MediaError(
            key,
            "json",
            "placeholder_mismatch",
            f"{len(placeholders)} placeholders {placeholders} but {len(media)} media members "
            f"{[name for name, _, _ in media]} of kinds {kinds}; make the <image>/<video> "
            "placeholders match the media members in order",
        )
