"""Qwen3-Omni's thinker (``Qwen3OmniMoeProcessor``): images, videos and audio, as Qwen2.5-Omni's
(:mod:`~energon_pack.encoding.families.qwen2_5_omni`) but for its audio (and a video's grids
timed by an ``fps`` of 1 where the call gives none).

The processor pads the audio of one call only to its longest, ``P`` samples (no 30-second
window, nothing cut). Whisper's feature extractor then gives an audio of ``n`` samples
``ceil(n / hop)`` mel frames, at most ``floor(P / hop)`` (it drops the frame begun past a
partial last hop), so an audio's frames depend on the longest audio of its sample. For ``L``
frames and ``n_window`` (50 as released) the model reads ``((f - 1) // 2 + 1 - 1) // 2 + 1 +
(L // (2 * n_window)) * 13`` ``<|AUDIO|>`` tokens with ``f = ((L % (2 * n_window)) - 1) // 2 +
1``: 13 per full chunk of ``2 * n_window`` frames, the rest through the encoder's three stride-2
steps. A packed row pads the audio features to its most frames.

With ``load_audio_from_video``, a video's tokens and its audio track's merge one by one in time
order (not in chunks): a video token of temporal patch ``t`` at ``t * video_second_per_grid *
position_id_per_seconds`` (13 by default) goes before the first audio token whose index is
not below that time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from energon_pack.encoding.families.base import SampledVideo
from energon_pack.encoding.families.qwen2_5_omni import Qwen25OmniFamily
from energon_pack.media.audio import AudioProbe
from energon_pack.media.audio_decode import played_frames

__all__ = ["Qwen3OmniFamily"]

CHUNK_TOKENS = 13
"""Audio tokens of one full chunk of ``2 * n_window`` mel frames."""


class Qwen3OmniFamily(Qwen25OmniFamily):
    """Qwen3-Omni-MoE's thinker: Qwen2.5-Omni's layout with chunked audio tokens."""

    name: ClassVar[str] = "qwen3_omni_moe"
    processor_classes: ClassVar[tuple[str, ...]] = ("Qwen3OmniMoeProcessor",)
    default_video_fps: ClassVar[float] = 1.0

    def _with_track(self, video: SampledVideo, audio_tokens: int) -> str:
        """A video's tokens and its track's ``audio_tokens`` merged in time order (the
        processor's ``replace_video_with_audio_token``): before the tokens of a temporal patch
        at time ``T``, the audio tokens of index below ``T`` not yet written."""
        grid_t, height, width = self._grid(video)
        seconds = self._second_per_grid()
        parts, written = [str(self.processor.audio_bos_token)], 0
        for patch in range(grid_t):
            time = patch * seconds * self.position_id_per_seconds
            due = min(audio_tokens, math.ceil(time)) - written
            parts.append(self.audio_placeholder * max(due, 0))
            written += max(due, 0)
            parts.append(str(self.video_placeholder) * (height * width))
        parts.append(self.audio_placeholder * (audio_tokens - written))
        parts.append(str(self.processor.audio_eos_token))
        return "".join(parts)

    def audio_tokens(self, probe: AudioProbe) -> int:
        """``<|AUDIO|>`` tokens of an audio alone in its sample."""
        return self.audio_counts([probe])[0]

    def audio_counts(self, probes: Sequence[AudioProbe]) -> list[int]:
        """``<|AUDIO|>`` tokens per audio as the processor counts the sample's audio together
        (its videos' audio tracks among them); an audio shorter than half the extractor's
        STFT window, which it cannot pad by reflection, is a ValueError."""
        extractor = self.processor.feature_extractor
        hop, least = int(extractor.hop_length), int(extractor.n_fft) // 2 + 1
        lengths = [played_frames(probe, self.audio_rate) for probe in probes]
        short = [p.seconds for p, n in zip(probes, lengths, strict=True) if n < least]
        if short:
            raise ValueError(
                f"audio of {short} s is shorter than the feature extractor's STFT takes "
                f"({least} samples at {self.audio_rate} Hz at least)"
            )
        cap = max(lengths) // hop
        chunk = 2 * int(self.processor.n_window)
        counts = []
        for length in lengths:
            frames = min(-(-length // hop), cap)
            rest = (frames % chunk - 1) // 2 + 1
            counts.append(((rest - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * CHUNK_TOKENS)
        return counts
