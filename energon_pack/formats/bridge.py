"""Megatron-Bridge's Qwen-VL WebDataset layout (its ``convert_to_qwenvl_wds.py`` output).

One sample has three members:

* ``json``: the conversation, a JSON list of turns (ShareGPT ``from``/``value`` or
  ``role``/``content``), or an object with ``conversations`` or ``messages`` (and optionally
  ``system`` and ``tools``);
* ``jpgs``: a pickled list of images, each an ``[H, W, 3]`` array (already resized);
* ``videos``: a pickled list of videos, each a list of frames (``[H, W, 3]`` or ``[3, H, W]``)
  or one ``[T, H, W, 3]`` / ``[T, 3, H, W]`` array.

Pickles are read with :func:`~energon_pack.formats.safe_pickle.load_arrays`, which never runs
code from the data. The ``<image>`` / ``<video>`` placeholders take the images and videos in
order. Pixels become :class:`~energon_pack.media.Frames` (raw uint8 bytes): probing reads their
shapes, and they are patchified only once a sample's pack is chosen.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

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
from energon_pack.media.config import MediaConfig
from energon_pack.media.errors import MediaError
from energon_pack.media.probe import Frames

__all__ = ["BRIDGE_MEMBERS", "is_bridge_sample", "parse_bridge_sample", "rgb_frames"]

BRIDGE_MEMBERS: frozenset[str] = frozenset({"jpgs", "videos"})
"""Members that mark a sample as Bridge's layout."""


def is_bridge_sample(sample: Mapping[str, Any]) -> bool:
    """Whether ``sample`` has Bridge's ``jpgs`` / ``videos`` members (its converter always
    writes both, empty lists included)."""
    return bool(BRIDGE_MEMBERS & sample.keys())


def parse_bridge_sample(
    key: str, sample: Mapping[str, Any], config: MediaConfig | None = None
) -> RawSample:
    """Parse one Bridge Qwen-VL sample (see the module docstring) into a :class:`RawSample`."""
    meta = load_json(key, sample.get("json"), config)
    system: Any = None
    tools = None
    if isinstance(meta, dict):
        system = meta.get("system")
        tools = conversation_tools(key, meta.get("tools"))
        turns_value = meta.get("conversations", meta.get("messages"))
    else:
        turns_value = meta
    if system is not None and not isinstance(system, str):
        raise MediaError(key, "json", "bad_sample", "'system' must be a string")
    turns = tuple(conversation_turns(key, turns_value))
    messages = tuple(conversation_messages(key, turns_value))
    images = [
        rgb_frames(a, key, f"jpgs[{i}]", "image") for i, a in enumerate(_list(sample, key, "jpgs"))
    ]
    videos = [
        rgb_frames(v, key, f"videos[{i}]", "video")
        for i, v in enumerate(_list(sample, key, "videos"))
    ]
    kinds = message_media_kinds(messages)
    if kinds.count("image") != len(images) or kinds.count("video") != len(videos):
        raise MediaError(
            key,
            "json",
            "placeholder_mismatch",
            f"{kinds.count('image')} <image> and {kinds.count('video')} <video> placeholders but "
            f"{len(images)} images in 'jpgs' and {len(videos)} videos in 'videos'; make them match",
        )
    pending = {"image": iter(enumerate(images)), "video": iter(enumerate(videos))}
    media: list[tuple[str, Literal["image", "video"], Frames]] = []
    for kind in kinds:
        index, frames = next(pending[kind])
        name = f"jpgs[{index}]" if kind == "image" else f"videos[{index}]"
        media.append((name, "image" if kind == "image" else "video", frames))
    return RawSample(key, turns, system, tuple(media), messages, tools)


def _list(sample: Mapping[str, Any], key: str, member: str) -> list[Any]:
    data = sample.get(member)
    return [] if data is None or len(data) == 0 else load_arrays(data, key, member)


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
