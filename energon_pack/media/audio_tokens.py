"""Audio tokens of a sample, from its header alone, as the processors count them.

Qwen2-Audio's processor runs Whisper's feature extractor at 16 kHz with 30-second windows
(480,000 samples, kept as they are or cut), one mel frame per 160 samples, and gives the
language model ``(((L - 1) // 2 + 1) - 2) // 2 + 1`` ``<|AUDIO|>`` tokens for ``L`` frames of
audio (its encoder's stride-2 convolution, then a stride-2 pooling). No torch here.
"""

from __future__ import annotations

from energon_pack.media.audio import AudioProbe
from energon_pack.media.audio_decode import played_frames

__all__ = ["WHISPER_HOP", "WHISPER_RATE", "WHISPER_WINDOW", "qwen2_audio_tokens", "whisper_frames"]

WHISPER_RATE = 16_000
"""The sample rate Whisper's feature extractor takes."""
WHISPER_HOP = 160
"""Samples per mel frame."""
WHISPER_WINDOW = 480_000
"""Samples of one window (30 s); the processors cut longer audio to it."""


def whisper_frames(probe: AudioProbe) -> int:
    """Mel frames Whisper's feature extractor gives the probed audio (its attention mask's
    length): the decoded samples at 16 kHz, cut to one window, one frame per 160 begun."""
    samples = min(played_frames(probe, WHISPER_RATE), WHISPER_WINDOW)
    return -(-samples // WHISPER_HOP)


def qwen2_audio_tokens(probe: AudioProbe) -> int:
    """``<|AUDIO|>`` tokens Qwen2-Audio's processor gives the probed audio (of its first 30 s:
    the processor cuts the rest)."""
    frames = whisper_frames(probe)
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1
