"""Qwen2-Audio (``Qwen2AudioProcessor``: Whisper's feature extractor, Qwen2 text backbone).

The chat template renders ``Audio N: <|audio_bos|><|AUDIO|><|audio_eos|>`` for each audio part;
the processor widens the middle token to one ``<|AUDIO|>`` per audio-encoder output frame
(:mod:`~energon_pack.encoding.families.whisper_audio`). Audio only: no images. Packed rows train
exactly through position ids restarting per segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from energon_pack.encoding.families.base import jsonable
from energon_pack.encoding.families.whisper_audio import WhisperAudioFamily

__all__ = ["Qwen2AudioFamily"]


class Qwen2AudioFamily(WhisperAudioFamily):
    """Qwen2-Audio: audio only (no images), ``<|AUDIO|>`` runs from the audio's length."""

    name: ClassVar[str] = "qwen2_audio"
    processor_classes: ClassVar[tuple[str, ...]] = ("Qwen2AudioProcessor",)
    takes_images: ClassVar[bool] = False
    min_audio_tokens = 2
    """With one, the model takes a lone audio token for its legacy unexpanded form and merges
    the features differently."""

    @property
    def image_placeholder(self) -> str:
        raise NotImplementedError("the qwen2_audio family takes no images")

    @property
    def vision_token_ids(self) -> frozenset[int]:
        return frozenset()

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        raise ValueError("Qwen2-Audio takes no images")

    def settings(self) -> dict[str, Any]:
        """The family's name and the feature extractor's settings."""
        extractor = self.processor.feature_extractor
        return {"family": self.name, "feature_extractor": jsonable(extractor.to_dict())}
