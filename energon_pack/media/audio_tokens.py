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


def whisper_frames(
    probe: AudioProbe,
    rate: int = WHISPER_RATE,
    window: int = WHISPER_WINDOW,
    hop: int = WHISPER_HOP,
) -> int:
    """Mel frames Whisper's feature extractor gives the probed audio (the ones in its attention
    mask): the decoded samples at ``rate``, cut to one ``window``, one frame per ``hop``
    samples begun (the extractor's ``sampling_rate``, ``n_samples`` and ``hop_length``)."""
    samples = min(played_frames(probe, rate), window)
    return -(-samples // hop)


def qwen2_audio_tokens(
    probe: AudioProbe,
    rate: int = WHISPER_RATE,
    window: int = WHISPER_WINDOW,
    hop: int = WHISPER_HOP,
) -> int:
    """``<|AUDIO|>`` tokens Qwen2-Audio's processor gives the probed audio (of its first
    window: the processor cuts the rest); the feature extractor's settings as in
    :func:`whisper_frames`."""
    frames = whisper_frames(probe, rate, window, hop)
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1
