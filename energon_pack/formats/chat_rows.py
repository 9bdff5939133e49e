"""Chat rows as TRL / transformers use them, and LLaVA-style JSON records with media paths.

A row is a mapping with the conversation under ``messages`` (role/content; content a string
or a list of ``{"type": "text" | "image" | "video" | "audio"}`` parts) or ``conversations``
(ShareGPT ``from``/``value`` with ``<image>`` / ``<video>`` / ``<audio>`` placeholders), and its
media in placeholder order under ``images`` / ``videos`` / ``audios`` (or ``image`` / ``video``
/ ``audio``: one item or a list), and optionally its function list under ``tools`` (for a chat
template's ``tools=``).

A media item is a ``PIL.Image`` (images), a list of frames (videos: PIL images or
``[H, W, 3]`` arrays), ``{"array": ..., "sampling_rate": ...}`` (audio decoded by a
``datasets`` ``Audio`` column; mono), the bytes of a file, a ``{"bytes": ..., "path": ...}``
dict (a ``datasets`` ``Image`` / ``Video`` / ``Audio`` column without decoding), or a path
relative to the media root. Paths are resolved by :class:`ChatDataset` and must stay inside
its ``media_root``: absolute paths, ``..`` and symlinks that lead out are a
:class:`~energon_pack.media.MediaError`.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from energon_pack.formats.bridge import rgb_frames
from energon_pack.formats.conversation import (
    conversation_messages,
    conversation_tools,
    conversation_turns,
    message_media_kinds,
)
from energon_pack.formats.raw import RawSample
from energon_pack.media.audio_decode import Waveform
from energon_pack.media.config import MediaKind
from energon_pack.media.errors import MediaError
from energon_pack.media.probe import Frames, image_frames

__all__ = [
    "MEDIA_FIELDS",
    "ChatDataset",
    "is_chat_row",
    "parse_chat_row",
    "read_media_paths",
    "resolve_inside",
]

MEDIA_FIELDS: dict[MediaKind, tuple[str, str]] = {
    "image": ("images", "image"),
    "video": ("videos", "video"),
    "audio": ("audios", "audio"),
}
"""Each medium's row fields: the list (``images``) and the single item (``image``)."""


def is_chat_row(sample: Mapping[str, Any]) -> bool:
    """Whether ``sample`` is a chat row (a conversation field, no WebDataset ``json`` member)."""
    return "json" not in sample and ("messages" in sample or "conversations" in sample)


def parse_chat_row(key: str, row: Mapping[str, Any]) -> RawSample:
    """Parse a chat row (see the module docstring); media paths must be resolved already."""
    field = "messages" if "messages" in row else "conversations"
    turns = tuple(conversation_turns(key, row[field], field))
    messages = tuple(conversation_messages(key, row[field], field))
    system = row.get("system")
    if system is not None and not isinstance(system, str):
        raise MediaError(key, "system", "bad_sample", "'system' must be a string")
    items = {each: _items(row, each) for each in MEDIA_FIELDS}
    kinds = message_media_kinds(messages)
    for each, (name, _) in MEDIA_FIELDS.items():
        if kinds.count(each) != len(items[each]):
            raise MediaError(
                key,
                field,
                "placeholder_mismatch",
                f"{kinds.count(each)} {each} placeholders or parts but {len(items[each])} items "
                f"in {name!r}; make them match one to one, in order",
            )
    pending = {each: iter(enumerate(items[each])) for each in MEDIA_FIELDS}
    media: list[tuple[str, MediaKind, bytes | Frames | Waveform]] = []
    for placeholder in kinds:
        kind = _KINDS[placeholder]
        index, item = next(pending[kind])
        member = f"{MEDIA_FIELDS[kind][0]}[{index}]"
        media.append((member, kind, _payload(item, kind, key, member)))
    tools = conversation_tools(key, row.get("tools"))
    return RawSample(key, turns, system, tuple(media), messages, tools)


_KINDS: dict[str, MediaKind] = {"image": "image", "video": "video", "audio": "audio"}


def _items(row: Mapping[str, Any], kind: MediaKind) -> list[Any]:
    plural, single = MEDIA_FIELDS[kind]
    value = row.get(plural, row.get(single))
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _payload(item: Any, kind: MediaKind, key: str, member: str) -> bytes | Frames | Waveform:
    if isinstance(item, MediaError):  # a path ChatDataset refused: fails with the sample
        raise item
    if isinstance(item, Mapping) and item.get("bytes") is not None:
        item = item["bytes"]
    if kind == "audio" and isinstance(item, Mapping) and item.get("array") is not None:
        return Waveform.from_array(item["array"], item.get("sampling_rate"), key=key, member=member)
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    if isinstance(item, Image.Image) and kind == "image":
        return image_frames(item)
    if kind == "video" and isinstance(item, (list, np.ndarray, torch.Tensor)):
        frames = [
            np.asarray(image_frames(f).array()[0]) if isinstance(f, Image.Image) else np.asarray(f)
            for f in item
        ]
        return rgb_frames(frames, key, member, "video")
    if isinstance(item, (str, os.PathLike, Mapping)):
        raise MediaError(
            key,
            member,
            "bad_sample",
            f"media path {_path_of(item)!r} is not resolved; read the rows through "
            "ChatDataset(rows, media_root=...) so paths are read inside that root",
        )
    raise MediaError(
        key, member, "bad_sample", f"unsupported {kind} item of type {type(item).__name__}"
    )


def _path_of(item: Any) -> Any:
    return item.get("path") if isinstance(item, Mapping) else item


def resolve_inside(root: Path, relative: str | os.PathLike[str], key: str, member: str) -> Path:
    """``root / relative`` if it is a file inside ``root`` (symlinks resolved), else a
    :class:`~energon_pack.media.MediaError`: absolute paths, ``..`` parts, links out, missing."""
    text = os.fspath(relative)
    path = Path(text)
    if not text or path.is_absolute() or path.drive or ".." in path.parts:
        raise MediaError(
            key,
            member,
            "bad_sample",
            f"media path {_shown(text)} must be relative to the media root {str(root)!r} "
            "without '..'",
        )
    try:
        base = root.resolve()
        target = (base / path).resolve()
        inside = target.is_relative_to(base)
        found = inside and target.is_file()
    except (OSError, ValueError, RuntimeError) as error:  # NUL byte, name too long, link loop
        raise _path_error(text, root, key, member, error) from None
    if not inside:
        raise MediaError(
            key,
            member,
            "bad_sample",
            f"media path {_shown(text)} leads out of the media root {str(base)!r} (a symlink)",
        )
    if not found:
        raise MediaError(
            key, member, "bad_sample", f"media file {_shown(text)} not found under {str(base)!r}"
        )
    return target


_SHOWN_CHARS = 120
"""Most characters of a media path an error message quotes."""


def _shown(text: str) -> str:
    """``text`` quoted for a message, cut to :data:`_SHOWN_CHARS` (with its length)."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


def _path_error(text: str, root: Path, key: str, member: str, error: BaseException) -> MediaError:
    """The :class:`MediaError` of a media path that cannot be resolved or read."""
    if isinstance(error, OSError):
        reason = errno.errorcode.get(error.errno or 0, type(error).__name__)
        reason = f"{error.strerror or error} ({reason})"
    elif isinstance(error, RuntimeError):
        reason = "a symlink loop"
    else:
        reason = str(error)
    return MediaError(
        key,
        member,
        "bad_sample",
        f"media path {_shown(text)} cannot be read under the media root {str(root)!r}: "
        f"{reason}; fix or drop the path in this row",
    )


class ChatDataset(torch.utils.data.Dataset[tuple[str, dict[str, Any]]]):
    """Map-style dataset of chat rows for :class:`~energon_pack.collate.VLMPackingCollator`.

    ``rows`` is a list of row dicts, a ``datasets.Dataset``, or the path of a JSON list (LLaVA
    style: ``{"id", "image": "rel/path.jpg", "conversations": [...]}``) or a JSONL file. Each
    item is ``(key, row)``: the key is the row's ``id`` (else its index), and media paths are
    read (as bytes, in the worker) from inside ``media_root``; a refused path fails the sample
    when it is encoded (so the collator's ``on_media_error`` applies). Decoding and
    patchifying wait for the collator, as for WebDataset samples.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]] | str | os.PathLike[str],
        media_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.rows: Sequence[Mapping[str, Any]] = (
            _load_rows(rows) if isinstance(rows, (str, os.PathLike)) else rows
        )
        self.media_root = None if media_root is None else Path(media_root)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[str, dict[str, Any]]:
        row = self.rows[index]
        key = str(row.get("id", index))
        return key, read_media_paths(row, key, self.media_root)


def read_media_paths(row: Mapping[str, Any], key: str, media_root: Path | None) -> dict[str, Any]:
    """A copy of the chat ``row`` whose media paths are read as bytes from inside
    ``media_root``; a path that cannot be read is left as its
    :class:`~energon_pack.media.MediaError`, raised when the sample is encoded (so each
    loader's ``on_media_error`` applies)."""
    out = dict(row)
    for plural, single in MEDIA_FIELDS.values():
        for name in (plural, single):
            if out.get(name) is not None:
                out[name] = _read_paths(out[name], key, name, media_root)
    return out


def _read_paths(value: Any, key: str, name: str, media_root: Path | None) -> Any:
    if isinstance(value, (list, tuple)):
        return [_read_path(item, key, f"{name}[{i}]", media_root) for i, item in enumerate(value)]
    return _read_path(value, key, name, media_root)


def _read_path(item: Any, key: str, member: str, media_root: Path | None) -> Any:
    path = item
    if isinstance(item, Mapping):
        if item.get("bytes") is not None or item.get("array") is not None:
            return item  # the data is in the row (a decoded Audio item names its source too)
        path = item.get("path")
    if not isinstance(path, (str, os.PathLike)):
        return item
    if media_root is None:
        return MediaError(
            key, member, "bad_sample", f"media path {os.fspath(path)!r} needs media_root="
        )
    try:
        target = resolve_inside(media_root, path, key, member)
        return target.read_bytes()
    except MediaError as error:  # raised when the sample is encoded, so policies apply
        return error
    except (OSError, ValueError, RuntimeError) as error:  # e.g. no permission, a folder
        return _path_error(os.fspath(path), media_root, key, member, error)


def _load_rows(path: str | os.PathLike[str]) -> list[Mapping[str, Any]]:
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{os.fspath(path)!r} must hold a JSON list of objects or JSON lines")
    return rows
