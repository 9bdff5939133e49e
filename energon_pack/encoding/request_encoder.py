"""Encoding for a processor family whose tokenizer encodes a conversation to ids itself (no chat
template: mistral-common's ``MistralCommonBackend``, Voxtral's tokenizer).

:class:`RequestEncoder` measures each audio from its header, has the family encode the
conversation as its tokenizer's backend does with each audio's token run as long as the header
gives (:meth:`~energon_pack.encoding.families.ProcessorFamily.request_ids`), and marks the
assistant replies the backend placed as the loss targets. Nothing is decoded: the audio
features come from the processor's feature extractor when the sample's pack is chosen.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from typing_extensions import Unpack

from energon_pack.encoding.chatml import TurnOptions
from energon_pack.encoding.families.base import ProcessorFamily
from energon_pack.encoding.family_encoder import FamilyEncoder, media_item
from energon_pack.formats.raw import RawSample
from energon_pack.media import MediaError
from energon_pack.media.audio import AudioProbe
from energon_pack.packing.packed import EncodedSample

__all__ = ["RequestEncoder"]


class RequestEncoder(FamilyEncoder):
    """Encodes conversations for a family whose tokenizer encodes requests itself (see the
    module docstring).

    Args:
        family: the family (``family.tokenizes == "request"``).
        media, system_prompt, loss_on: see :class:`~energon_pack.SampleEncoder`.
    """

    def __init__(self, family: ProcessorFamily, **options: Unpack[TurnOptions]) -> None:
        if family.tokenizes != "request":
            raise ValueError(
                f"family {family.name!r} renders a chat template; encode it with "
                "make_encoder(family=processor) (a ProcessorEncoder)"
            )
        super().__init__(family, **options)

    def settings(self) -> dict[str, Any]:
        """The family's settings (its tokenizer's among them) and the loss rule."""
        return {
            "encoding": "request",
            **self.family.settings(),
            "system_prompt": self.system_prompt,
            "loss_on": self.loss_on,
        }

    def encode(self, raw: RawSample) -> EncodedSample:
        """Encode a parsed sample, reading only its audio's headers (see the module docstring).

        Raises :class:`~energon_pack.media.MediaError`: ``unsupported`` for a medium the
        family does not take or an audio it cannot count, ``bad_sample`` for a conversation
        the tokenizer's backend refuses.
        """
        messages = self._messages(raw)
        measured = [self._measure(raw.key, member, kind, data) for member, kind, data in raw.media]
        probes = [probe for probe in measured if isinstance(probe, AudioProbe)]
        counts = self._family_takes(raw, measured, lambda: self.family.audio_counts(probes))
        try:
            found, replies = self.family.request_ids(messages, raw.tools, counts)
        except ValueError as error:
            raise MediaError(
                raw.key,
                "json",
                "bad_sample",
                f"the {self.family.name} tokenizer cannot encode the conversation: {error}; "
                "fix the conversation's roles or drop the sample",
            ) from None
        ids = np.asarray(found, dtype=np.int64)
        mask = np.zeros(len(ids), dtype=bool)
        if self.loss_on == "all":
            mask[:] = True
        for begin, end in replies:
            mask[begin:end] = True
        mask &= ~np.isin(ids, self.media_ids_tensor.numpy())
        media = tuple(
            media_item(member, data, probe, count, count)
            for (member, _, data), probe, count in zip(raw.media, probes, counts, strict=True)
        )
        return EncodedSample(
            key=raw.key,
            input_ids=torch.from_numpy(ids),
            loss_mask=torch.from_numpy(mask.astype(np.int64)),
            media=media,
        )
