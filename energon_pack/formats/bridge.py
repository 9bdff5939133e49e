"""Megatron-Bridge's WebDataset sample layouts, read as its converters write them.

A sample holds its conversation in ``json`` (or ``conversation.json``): a JSON list of turns
(ShareGPT ``from``/``value`` or ``role``/``content``, content a string or typed parts such as
``{"type": "image"}``), or an object with ``conversations`` or ``messages`` (and optionally
``system`` and ``tools``, the function list). Its media are any of:

* ``jpgs``: a pickled list of images, each the bytes of an image file (the ChatML layouts, e.g.
  the Mantis converter ``prepare_mantis_energon.py``) or an ``[H, W, 3]`` array (the legacy
  Qwen-VL converter ``convert_to_qwenvl_wds.py``);
* ``videos`` / ``mp4s``: a pickled list of videos, each the bytes of a video file, a list of
  frames (``[H, W, 3]`` or ``[3, H, W]`` arrays) or one ``[T, H, W, 3]`` / ``[T, 3, H, W]`` array;
* single members without an index: ``jpg``, ``png``, ``image.png``, ``video.mp4``,
  ``audio.wav``, ``flac``, ... (the LLaVA-style ``jpg`` + ``json`` samples and the Energon
  tutorial's ``image.png`` + ``conversation.json``);
* none (a text-only sample: a ``json`` list and no media member).

Pickles are read with :func:`~energon_pack.formats.safe_pickle.load_arrays`, which never runs
code from the data. The ``<image>`` / ``<video>`` / ``<audio>`` placeholders (or media parts)
take the images, videos and audio in order: list items first, then single members by name.
Media files stay compressed bytes (probed from their headers, decoded once their pack is
chosen); arrays become
:class:`~energon_pack.media.Frames` (raw uint8 bytes) whose shapes are the probe.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

import numpy as np

from energon_pack.formats.conversation import (
    conversation_messages,
    conversation_tools,
    conversation_turns,
    message_media_kinds,
)
from energon_pack.formats.native import load_json
from energon_pack.formats.raw import RawSample
from energon_pack.formats.safe_pickle import load_arrays
from energon_pack.media.config import MediaConfig, MediaKind
from energon_pack.media.errors import MediaError
from energon_pack.media.probe import Frames, media_kind

__all__ = [
    "BRIDGE_MEMBERS",
    "CONVERSATION_MEMBERS",
    "is_bridge_sample",
    "parse_bridge_sample",
    "rgb_frames",
]

Kind = Literal["image", "video"]
"""What a pickled media list holds."""

BRIDGE_MEMBERS: dict[str, Kind] = {"jpgs": "image", "videos": "video", "mp4s": "video"}
"""Pickled media-list members and the kind of media each holds."""

CONVERSATION_MEMBERS: tuple[str, ...] = ("json", "conversation.json")
"""Members that hold the conversation, in the order they are looked for."""


def is_bridge_sample(sample: Mapping[str, Any]) -> bool:
    """Whether ``sample`` is in one of Bridge's layouts: a pickled media list, a
    ``conversation.json`` member, a media member without an index (``jpg``, ``image.png``), or
    a ``json`` that is a list of turns."""
    if BRIDGE_MEMBERS.keys() & sample.keys() or "conversation.json" in sample:
        return True
    if any(_single_media(name) is not None for name in sample):
        return True
    raw = sample.get("json")
    if isinstance(raw, (bytes, bytearray, str)):
        head = raw[:64].lstrip()
        return head[:1] in (b"[", "[")
    return isinstance(raw, list)


def parse_bridge_sample(
    key: str, sample: Mapping[str, Any], config: MediaConfig | None = None
) -> RawSample:
    """Parse one sample of a Bridge layout (see the module docstring) into a
    :class:`RawSample`."""
    member = next((m for m in CONVERSATION_MEMBERS if m in sample), "json")
    meta = load_json(key, sample.get(member), config, member)
    system: Any = None
    tools = None
    if isinstance(meta, dict):
        system = meta.get("system")
        tools = conversation_tools(key, meta.get("tools"))
        turns_value = meta.get("conversations", meta.get("messages"))
    else:
        turns_value = meta
    if system is not None and not isinstance(system, str):
        raise MediaError(key, member, "bad_sample", "'system' must be a string")
    turns = tuple(conversation_turns(key, turns_value, member))
    messages = tuple(conversation_messages(key, turns_value, member))
    found: dict[MediaKind, list[tuple[str, bytes | Frames]]] = {
        kind: [] for kind in get_args(MediaKind)
    }
    for name, list_kind in BRIDGE_MEMBERS.items():
        for index, item in enumerate(_list(sample, key, name)):
            where = f"{name}[{index}]"
            found[list_kind].append((where, _payload(item, key, where, list_kind)))
    for name in sorted(sample):
        kind_of = _single_media(name)
        if kind_of is not None:
            found[kind_of].append((name, _file(sample[name], key, name)))
    kinds = message_media_kinds(messages)
    if any(kinds.count(kind) != len(items) for kind, items in found.items()):
        counts = " and ".join(f"{kinds.count(kind)} <{kind}>" for kind in found)
        held = " and ".join(
            f"{len(items)} {kind}s {[n for n, _ in items]}" for kind, items in found.items()
        )
        raise MediaError(
            key,
            member,
            "placeholder_mismatch",
            f"{counts} placeholders but {held}; make them match",
        )
    pending = {kind: iter(items) for kind, items in found.items()}
    media: list[tuple[str, MediaKind, bytes | Frames]] = []
    for placeholder in kinds:
        kind = next(each for each in found if each == placeholder)
        name, payload = next(pending[kind])
        media.append((name, kind, payload))
    return RawSample(key, turns, system, tuple(media), messages, tools)


def _single_media(name: str) -> MediaKind | None:
    """The kind of a media member without an index (``jpg``, ``image.png``, ``wav``), else
    None."""
    if name.partition(".")[0].isdigit():
        return None
    return media_kind(name)


def _list(sample: Mapping[str, Any], key: str, member: str) -> list[Any]:
    data = sample.get(member)
    if data is None or len(data) == 0:
        return []
    return load_arrays(data, key, member, allow_bytes=True)


def _file(data: Any, key: str, member: str) -> bytes:
    if not isinstance(data, (bytes, bytearray)):
        raise MediaError(key, member, "bad_sample", f"member is {type(data).__name__}, not bytes")
    return bytes(data)


def _payload(item: Any, key: str, member: str, kind: Kind) -> bytes | Frames:
    """A list item: a file's bytes stay compressed; arrays become :class:`Frames`."""
    if isinstance(item, bytes):
        return item
    if kind == "video" and isinstance(item, list) and any(isinstance(f, bytes) for f in item):
        raise MediaError(
            key,
            member,
            "unsupported",
            "a video stored as a list of encoded frames is not read; store each video as a "
            "video file (a video.mp4 member, or its bytes in the list) or as [H, W, 3] arrays",
        )
    return rgb_frames(item, key, member, kind)


def rgb_frames(value: Any, key: str, member: str, kind: Literal["image", "video"]) -> Frames:
    """An image array (``[H, W, 3]`` / ``[3, H, W]``) or a video (a list of such frames, or a
    ``[T, ...]`` array) as :class:`Frames`; float pixels (0-255) are rounded to uint8."""
    if kind == "image":
        frames = [value]
    elif isinstance(value, list):
        frames = value
    else:
        frames = list(value) if isinstance(value, np.ndarray) and value.ndim == 4 else [None]
    if not frames or not all(isinstance(f, np.ndarray) and f.ndim == 3 for f in frames):
        raise MediaError(
            key,
            member,
            "bad_sample",
            f"expected {'an [H, W, 3] array' if kind == 'image' else 'a list of [H, W, 3] frames'}"
            f", got {_describe(value)}",
        )
    hwc = [_hwc(frame, key, member) for frame in frames]
    if len({f.shape for f in hwc}) != 1:
        raise MediaError(key, member, "bad_sample", "video frames differ in size")
    return Frames.from_array(np.stack(hwc))


def _hwc(frame: np.ndarray[Any, Any], key: str, member: str) -> np.ndarray[Any, Any]:
    if frame.shape[-1] != 3 and frame.shape[0] == 3:
        frame = frame.transpose(1, 2, 0)
    if frame.shape[-1] != 3:
        raise MediaError(key, member, "bad_sample", f"a frame of shape {frame.shape}, not RGB")
    if frame.dtype != np.uint8:
        frame = np.clip(np.rint(frame), 0, 255).astype(np.uint8)
    return frame


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape}"
    return type(value).__name__
