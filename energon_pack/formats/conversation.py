"""Turns of the conversation forms other formats use, as ``(role, text with placeholders)``.

Accepted turn forms: ShareGPT ``{"from", "value"}`` and role/content ``{"role", "content"}``
where content is a string or a list of parts (``{"type": "text", "text"}``, ``{"type":
"image"}``, ``{"type": "video"}``, ``{"type": "audio"}``: transformers / TRL / OpenAI style).
Parts become the native form: text joined without separators, ``<image>`` / ``<video>`` /
``<audio>`` for media parts.

:func:`conversation_messages` gives the same turns as chat messages for a chat template
(transformers' form): roles ``human``/``gpt`` become ``user``/``assistant``; a string with
``<image>``/``<video>``/``<audio>`` placeholders becomes typed parts (each placeholder a media
part); typed content keeps its parts, and only its ``{"type": "image" | "video" | "audio"}``
parts are media (a literal ``<image>`` in a text part is text). ``tool_calls``,
``reasoning_content``, ``name`` and ``tool_call_id`` are passed through.
:func:`message_media_kinds` lists the media in order.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from energon_pack.media.config import MediaKind
from energon_pack.media.errors import MediaError

__all__ = [
    "MESSAGE_ROLES",
    "check_media_order",
    "check_placeholders",
    "conversation_messages",
    "conversation_tools",
    "conversation_turns",
    "message_media_kinds",
    "placeholder_kinds",
    "turn_text",
]

_PLACEHOLDER = re.compile(r"<(image|video|audio)>")
_MEDIA_PARTS = {
    "image": "<image>",
    "image_url": "<image>",
    "video": "<video>",
    "audio": "<audio>",
    "input_audio": "<audio>",
}
MESSAGE_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}
"""Turn roles a chat message may have, and the chat-template role each becomes."""
_PASSED_THROUGH = ("tool_calls", "reasoning_content", "name", "tool_call_id")


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
    kind = _part_type(part)
    if kind == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    if kind in _MEDIA_PARTS:
        return _MEDIA_PARTS[kind]
    raise MediaError(
        key,
        member,
        "bad_sample",
        f"turn {index} has a content part {_short(part)}; parts are {{'type': 'text', 'text': "
        "...}, {'type': 'image'}, {'type': 'video'} or {'type': 'audio'}",
    )


def _part_type(part: Any) -> str | None:
    """A content part's ``type`` if it is a string (a list or a dict there is a bad part, not
    a lookup that fails)."""
    kind = part.get("type") if isinstance(part, dict) else None
    return kind if isinstance(kind, str) else None


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def placeholder_kinds(turns: Sequence[tuple[str, str]]) -> list[str]:
    """``"image"`` / ``"video"`` / ``"audio"`` for each ``<image>`` / ``<video>`` / ``<audio>``
    of the turns, in order."""
    return [match.group(1) for _, text in turns for match in _PLACEHOLDER.finditer(text)]


def check_placeholders(
    key: str,
    turns: Sequence[tuple[str, str]],
    media: Sequence[tuple[str, MediaKind, object]],
) -> None:
    """The turns' ``<image>``/``<video>``/``<audio>`` placeholders take the ``(member, kind,
    payload)`` media one to one, in order; else a ``placeholder_mismatch`` naming both."""
    check_media_order(key, placeholder_kinds(turns), media)


def check_media_order(
    key: str,
    placeholders: Sequence[str],
    media: Sequence[tuple[str, MediaKind, object]],
) -> None:
    """The ``placeholders`` (``"image"`` / ``"video"`` / ``"audio"`` in order) take the
    ``(member, kind, payload)`` media one to one; else a ``placeholder_mismatch`` naming both."""
    kinds = [kind for _, kind, _ in media]
    if list(placeholders) != kinds:
        raise MediaError(
            key,
            "json",
            "placeholder_mismatch",
            f"{len(placeholders)} placeholders {list(placeholders)} but {len(media)} media "
            f"members {[name for name, _, _ in media]} of kinds {kinds}; make the "
            "<image>/<video>/<audio> placeholders match the media members in order",
        )


def conversation_messages(key: str, turns: Any, member: str = "json") -> list[dict[str, Any]]:
    """Every turn of a non-empty list as a chat message; see the module docstring."""
    if not isinstance(turns, list) or not turns:
        raise MediaError(key, member, "bad_sample", "the conversation must be a non-empty list")
    return [_message(key, index, turn, member) for index, turn in enumerate(turns)]


def _message(key: str, index: int, turn: Any, member: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise MediaError(key, member, "bad_sample", f"turn {index} must be an object")
    role = turn.get("from", turn.get("role"))
    if not isinstance(role, str) or role not in MESSAGE_ROLES:
        raise MediaError(
            key,
            member,
            "bad_sample",
            f"turn {index} has the unknown conversation role {role!r}; use one of "
            f"{sorted(MESSAGE_ROLES)}",
        )
    content = turn.get("value", turn.get("content"))
    if content is None and turn.get("tool_calls"):
        content = ""  # OpenAI's form of an assistant turn that only calls tools
    message: dict[str, Any] = {
        "role": MESSAGE_ROLES[role],
        "content": _content(key, index, content, member),
    }
    for name in _PASSED_THROUGH:
        if turn.get(name) is not None:
            message[name] = turn[name]
    return message


def _content(key: str, index: int, content: Any, member: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        if not _PLACEHOLDER.search(content):
            return content
        pieces = _PLACEHOLDER.split(content)  # text, kind, text, kind, ..., text
        return [
            {"type": piece} if number % 2 else {"type": "text", "text": piece}
            for number, piece in enumerate(pieces)
            if number % 2 or piece
        ]
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = _part_type(part)
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in _MEDIA_PARTS:
                parts.append({"type": _MEDIA_PARTS[kind][1:-1]})
            else:
                _part_text(key, index, part, member)  # raises the error naming the part
        return parts
    raise MediaError(
        key,
        member,
        "bad_sample",
        f"turn {index} needs 'value' (ShareGPT) or 'content' (a string or a list of parts)",
    )


def message_media_kinds(messages: Sequence[dict[str, Any]]) -> list[str]:
    """``"image"`` / ``"video"`` / ``"audio"`` for each media part of the messages, in order."""
    return [
        part["type"]
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part["type"] != "text"
    ]


def conversation_tools(
    key: str, value: Any, member: str = "tools"
) -> tuple[dict[str, Any], ...] | None:
    """A row's function list (``tools``: a list of JSON schemas, or that list as a JSON string)
    as the chat template's ``tools=``; None when the row has none."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise MediaError(
                key, member, "bad_sample", f"'tools' is not valid JSON: {error}"
            ) from None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise MediaError(
            key,
            member,
            "bad_sample",
            "'tools' must be a list of function schemas (objects), as transformers' tools=",
        )
    return tuple(value) if value else None
