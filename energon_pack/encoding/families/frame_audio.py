"""What the families whose audio features are frame-major share: the processor's feature
extractor gives ``input_features`` ``[audios, frames, mels]`` and ``input_features_mask``
``[audios, frames]`` (true on the audio's own frames), each call padded to its longest audio.

A packed row joins its samples' audio along the first dimension, each zero-padded on the frame
dimension to the row's most frames with the mask false there: the encoders of these families
read only the frames the mask marks (measured equal to a lone call, where padding *waveforms*
to a longer call's length would shift an audio's own frames).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch.nn import functional

from energon_pack.encoding.families.base import AudioFamily

__all__ = ["FrameAudioFamily"]

_AUDIO_KEYS = ("input_features", "input_features_mask")
"""The processor outputs that come from the audio."""


class FrameAudioFamily(AudioFamily):
    """A processor family with frame-major audio features (see the module docstring)."""

    passes_audio_kwargs: ClassVar[bool] = False
    """Whether the processor's call hands the feature extractor its merged audio settings
    (those set on the processor apply), rather than the sample rate alone."""

    def audio_inputs(self, waveforms: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """``input_features`` and ``input_features_mask`` from the processor's feature
        extractor on the sample's audio (padded to its longest), with the settings the
        processor's call hands it."""
        if not waveforms:
            return {}
        settings = dict(self._audio_kwargs) if self.passes_audio_kwargs else {}
        settings.update(sampling_rate=self.audio_rate, return_tensors="pt")
        features = self.processor.feature_extractor(
            [np.asarray(w, dtype=np.float32) for w in waveforms], **settings
        )
        out = {"input_features": features["input_features"]}
        mask = features.get("input_features_mask", features.get("attention_mask"))
        if mask is not None:
            out["input_features_mask"] = mask
        return out

    def row_inputs(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The samples' media joined for one packed row, the audio features and their mask
        zero-padded on the frame dimension to the row's most frames."""
        frames = [int(s["input_features"].shape[1]) for s in samples if "input_features" in s]
        if not frames:
            return super().row_inputs(samples)
        most = max(frames)
        padded = [
            {
                key: _padded_frames(value, most) if key in _AUDIO_KEYS else value
                for key, value in sample.items()
            }
            for sample in samples
        ]
        return super().row_inputs(padded)


def _padded_frames(values: torch.Tensor, frames: int) -> torch.Tensor:
    """``values`` (``[audios, frames, ...]``) zero-padded (false) on dim 1 to ``frames``."""
    missing = frames - values.shape[1]
    pad = [0, 0] * (values.dim() - 2) + [0, missing]
    return functional.pad(values, pad)
