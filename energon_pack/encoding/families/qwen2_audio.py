"""Qwen2-Audio (``Qwen2AudioProcessor``: Whisper's feature extractor, Qwen2 text backbone).

The chat template renders ``Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>`` for each audio part;
the processor writes ``<|AUDIO|>`` once per audio-encoder output frame in place of the middle
token: ``(((L - 1) // 2 + 1) - 2) // 2 + 1`` for ``L`` mel frames of the audio's first window
(:func:`~energon_pack.media.audio_tokens.qwen2_audio_tokens`, from the header alone). The model
inputs are the feature extractor's ``input_features`` ``[audios, mels, frames]`` (every audio
padded to the window) and ``feature_attention_mask`` ``[audios, frames]``, joined along the
first dimension for a packed row. The released template has no generation markers: a reply runs
from after ``<|im_start|>assistant\\n`` through ``<|im_end|>``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import (
    TEXT_KEYS,
    ProcessorFamily,
    delimited_spans,
    jsonable,
)
from energon_pack.media.audio import AudioProbe
from energon_pack.media.audio_tokens import qwen2_audio_tokens

__all__ = ["Qwen2AudioFamily"]

MIN_AUDIO_TOKENS = 2
"""Fewest ``<|AUDIO|>`` tokens an audio may give: with one, the model takes a lone audio token
for its legacy unexpanded form and merges the features differently."""


class Qwen2AudioFamily(ProcessorFamily):
    """Qwen2-Audio: audio only (no images), ``<|AUDIO|>`` runs from the audio's length."""

    name: ClassVar[str] = "qwen2_audio"
    processor_classes: ClassVar[tuple[str, ...]] = ("Qwen2AudioProcessor",)
    takes_images: ClassVar[bool] = False

    @property
    def image_placeholder(self) -> str:
        raise NotImplementedError("the qwen2_audio family takes no images")

    @property
    def vision_token_ids(self) -> frozenset[int]:
        return frozenset()

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        raise ValueError("Qwen2-Audio takes no images")

    @property
    def audio_placeholder(self) -> str:
        """``processor.audio_token`` (``<|AUDIO|>``)."""
        return str(self.processor.audio_token)

    @property
    def audio_token_ids(self) -> frozenset[int]:
        return frozenset({int(self.processor.audio_token_id)})

    def audio_tokens(self, probe: AudioProbe) -> int:
        """``<|AUDIO|>`` tokens of one audio, from the feature extractor's own settings."""
        extractor = self.processor.feature_extractor
        return qwen2_audio_tokens(
            probe, self.audio_rate, int(extractor.n_samples), int(extractor.hop_length)
        )

    def audio_expansions(self, probes: Sequence[AudioProbe]) -> list[str]:
        """``<|AUDIO|>`` repeated :meth:`audio_tokens` times per audio; an audio that gives
        fewer than :data:`MIN_AUDIO_TOKENS` is a ValueError (too short for the encoder)."""
        counts = [self.audio_tokens(probe) for probe in probes]
        short = [p.seconds for p, n in zip(probes, counts, strict=True) if n < MIN_AUDIO_TOKENS]
        if short:
            raise ValueError(
                f"audio of {short} s gives fewer than {MIN_AUDIO_TOKENS} audio tokens "
                f"({6 * int(self.processor.feature_extractor.hop_length) + 1} samples at "
                f"{self.audio_rate} Hz at least)"
            )
        return [self.audio_placeholder * count for count in counts]

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
        return {k: v for k, v in out.items() if k not in TEXT_KEYS}

    def settings(self) -> dict[str, Any]:
        """The family's name and the feature extractor's settings."""
        extractor = self.processor.feature_extractor
        return {"family": self.name, "feature_extractor": jsonable(extractor.to_dict())}

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """From after each ``<|im_start|>assistant\\n`` through its ``<|im_end|>``."""
        return delimited_spans(text, "<|im_start|>assistant\n", "<|im_end|>")
