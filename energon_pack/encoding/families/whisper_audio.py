"""What the Qwen audio families share: Whisper's feature extractor in the processor, one
``<|AUDIO|>`` per audio-encoder output frame, and ChatML turns.

The processor pads each audio to the extractor's window (``padding="max_length"``: 30 s at
16 kHz for the released checkpoints) and writes ``(((L - 1) // 2 + 1) - 2) // 2 + 1`` audio
tokens for ``L`` mel frames of the audio's first window
(:func:`~energon_pack.media.audio_tokens.qwen2_audio_tokens`, from the header alone). The model
inputs are ``input_features`` ``[audios, mels, frames]`` and ``feature_attention_mask``
``[audios, frames]``, joined along the first dimension for a packed row (zero-padded to the
row's most frames where the processor pads each call only to its longest audio). The released
templates have no generation markers: a reply runs from after ``<|im_start|>assistant\\n``
through ``<|im_end|>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn import functional

from energon_pack.encoding.families.base import TEXT_KEYS, AudioFamily, delimited_spans
from energon_pack.media.audio import AudioProbe
from energon_pack.media.audio_tokens import qwen2_audio_tokens

__all__ = ["WhisperAudioFamily"]


class WhisperAudioFamily(AudioFamily):
    """A processor family whose audio goes through Whisper's feature extractor (see the module
    docstring); :attr:`min_audio_tokens` is the fewest audio tokens the model takes."""

    min_audio_tokens: int = 1

    def audio_tokens(self, probe: AudioProbe) -> int:
        """Audio tokens of one audio, from the feature extractor's own settings."""
        extractor = self.processor.feature_extractor
        return qwen2_audio_tokens(
            probe, self.audio_rate, int(extractor.n_samples), int(extractor.hop_length)
        )

    def audio_expansions(self, probes: Sequence[AudioProbe]) -> list[str]:
        """The audio token repeated :meth:`audio_counts` times per audio."""
        return [self.audio_placeholder * count for count in self.audio_counts(probes)]

    def audio_counts(self, probes: Sequence[AudioProbe]) -> list[int]:
        """:meth:`audio_tokens` of each of a sample's audios; an audio that gives fewer than
        :attr:`min_audio_tokens` is a ValueError (too short for the encoder)."""
        counts = [self.audio_tokens(probe) for probe in probes]
        least = self.min_audio_tokens
        short = [p.seconds for p, n in zip(probes, counts, strict=True) if n < least]
        if short:
            frames = 4 * least - 1  # mel frames that give `least` tokens
            hop = int(self.processor.feature_extractor.hop_length)
            raise ValueError(
                f"audio of {short} s gives fewer than {least} audio tokens "
                f"({(frames - 1) * hop + 1} samples at {self.audio_rate} Hz at least)"
            )
        return counts

    def audio_inputs(self, waveforms: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """``input_features`` and ``feature_attention_mask`` from the processor's own call (its
        text one placeholder per audio, dropped)."""
        if not waveforms:
            return {}
        out = self.processor(
            text=self.audio_placeholder * len(waveforms),
            audio=[np.asarray(w, dtype=np.float32) for w in waveforms],
            sampling_rate=self.audio_rate,
            return_tensors="pt",
        )
        return {k: v for k, v in out.items() if k not in TEXT_KEYS and k.startswith(_AUDIO_KEYS)}

    def row_inputs(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The samples' media joined for one packed row, the audio features and their mask
        zero-padded on the frame dimension to the row's most frames (the model reads only the
        frames the mask marks)."""
        frames = [
            int(s["feature_attention_mask"].shape[-1]) for s in samples if _AUDIO_KEYS[1] in s
        ]
        if not frames:
            return super().row_inputs(samples)
        most = max(frames)
        padded = [
            {
                key: functional.pad(value, (0, most - value.shape[-1]))
                if key in _AUDIO_KEYS
                else value
                for key, value in sample.items()
            }
            for sample in samples
        ]
        return super().row_inputs(padded)

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """From after each ``<|im_start|>assistant\\n`` through its ``<|im_end|>``."""
        return delimited_spans(text, "<|im_start|>assistant\n", "<|im_end|>")


_AUDIO_KEYS = ("input_features", "feature_attention_mask")
"""The processor outputs that come from the audio."""
