"""Gemma 3n (``Gemma3nProcessor``): images through a MobileNet tower and audio through a
conformer encoder into a Gemma text model with causal attention only.

The chat template renders ``<image_soft_token>`` and ``<audio_soft_token>`` for the media; the
processor writes ``\\n\\n<start_of_image>`` + ``<image_soft_token>`` x ``image_seq_length`` +
``<end_of_image>\\n\\n`` for each image, whatever its size, and ``\\n\\n<start_of_audio>`` +
``<audio_soft_token>`` x ``audio_seq_length`` + ``<end_of_audio>\\n\\n`` for each audio, whatever
its length (the feature extractor cuts audio past its ``max_length``, 30 s at 16 kHz, and the
model pads the encoder's output to the fixed count). Model inputs: ``pixel_values [images, 3,
H, W]``, ``input_features [audios, frames, mels]`` with ``input_features_mask``, and
``token_type_ids [L]`` (1 on image soft tokens, 3 on audio soft tokens).

No layer attends bidirectionally, so a packed row trains exactly through position ids
restarting per segment.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from functools import cached_property
from typing import Any, ClassVar

import torch

from energon_pack.encoding.families.base import PackingRule, delimited_spans, jsonable
from energon_pack.encoding.families.frame_audio import FrameAudioFamily
from energon_pack.encoding.families.gemma3 import Gemma3Family
from energon_pack.media.audio import AudioProbe
from energon_pack.media.audio_decode import played_frames

__all__ = ["Gemma3nFamily"]

logger = logging.getLogger("energon_pack.encoding")

IMAGE_TYPE, AUDIO_TYPE = 1, 3
"""``token_type_ids`` of the image and the audio soft tokens, as the processor writes them."""


class Gemma3nFamily(FrameAudioFamily):
    """Gemma 3n: fixed soft-token runs per image and per audio (see the module docstring)."""

    name: ClassVar[str] = "gemma3n"
    processor_classes: ClassVar[tuple[str, ...]] = ("Gemma3nProcessor",)
    packing: ClassVar[PackingRule] = "position_ids"
    token_keys: ClassVar[frozenset[str]] = frozenset({"token_type_ids"})
    passes_audio_kwargs: ClassVar[bool] = True

    @property
    def vision_token_ids(self) -> frozenset[int]:
        """The image soft token's id (``processor.image_token_id``)."""
        return frozenset({int(self.processor.image_token_id)})

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """The processor's ``full_image_sequence`` for every image."""
        return [str(self.processor.full_image_sequence)] * len(sizes)

    def audio_expansions(self, probes: Sequence[AudioProbe]) -> list[str]:
        """The processor's ``full_audio_sequence`` for every audio; an audio past the feature
        extractor's window is logged (the extractor cuts it, as in the processor)."""
        window = self.audio_window
        for probe in probes:
            if window is not None and played_frames(probe, self.audio_rate) > window:
                logger.warning(
                    "gemma3n: an audio of %.1f s is past the feature extractor's window of "
                    "%.1f s (max_length=%d at %d Hz); its end is cut, as the processor cuts it",
                    probe.seconds,
                    window / self.audio_rate,
                    window,
                    self.audio_rate,
                )
        return [str(self.processor.full_audio_sequence)] * len(probes)

    @cached_property
    def audio_window(self) -> int | None:
        """Samples the feature extractor keeps of an audio (``max_length`` of the processor's
        audio kwargs, else of the extractor's call), None where it keeps all; read once."""
        found = self._audio_kwargs.get("max_length")
        if found is None:
            call = inspect.signature(self.processor.feature_extractor.__call__).parameters
            default = call["max_length"].default if "max_length" in call else None
            found = None if default is inspect.Parameter.empty else default
        truncate = self._audio_kwargs.get("truncation", True)
        return int(found) if found and truncate else None

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``token_type_ids``: 1 on the image soft tokens, 3 on the audio soft tokens."""
        types = torch.zeros_like(input_ids)
        types[input_ids == int(self.processor.image_token_id)] = IMAGE_TYPE
        types[input_ids == int(self.processor.audio_token_id)] = AUDIO_TYPE
        return {"token_type_ids": types}

    def settings(self) -> dict[str, Any]:
        """The base settings plus the feature extractor's (with the processor's audio kwargs)
        and both soft-token counts."""
        out = super().settings()
        extractor = self.processor.feature_extractor.to_dict()
        out["feature_extractor"] = jsonable({**extractor, "call": self._audio_kwargs})
        out["image_seq_length"] = int(self.processor.image_seq_length)
        out["audio_seq_length"] = int(self.processor.audio_seq_length)
        return out

    def assistant_spans(self, text: str) -> list[tuple[int, int]]:
        """The Gemma turn format's replies, as :meth:`Gemma3Family.assistant_spans`."""
        return delimited_spans(text, Gemma3Family.HEADER, Gemma3Family.END, trailing="\n")
