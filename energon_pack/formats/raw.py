"""The parsed sample every format's parser gives (native, Bridge, chat rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from energon_pack.media.audio_decode import Waveform
from energon_pack.media.config import MediaKind
from energon_pack.media.probe import Frames

__all__ = ["RawSample"]


@dataclass(frozen=True)
class RawSample:
    """A parsed sample: turns as ``(role, content)``, media as ``(member, kind, payload)`` in
    placeholder order; the payload is a compressed file's bytes, decoded
    :class:`~energon_pack.media.Frames` (images, videos) or a decoded
    :class:`~energon_pack.media.audio_decode.Waveform` (audio). ``messages`` are the turns
    as chat messages for a chat template (see
    :func:`~energon_pack.formats.conversation.conversation_messages`; empty when a sample was
    built from ``turns`` only) and ``tools`` its function list."""

    key: str
    turns: tuple[tuple[str, str], ...]
    system: str | None
    media: tuple[tuple[str, MediaKind, bytes | Frames | Waveform], ...]
    messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
