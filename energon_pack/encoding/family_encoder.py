"""What the encoders of a processor family share: the family, its media token ids, each
medium measured from its header (an image's displayed size, an audio's probe, a video's kept
frames), the family's refusals as ``unsupported`` media errors, and the encoded media items.

:class:`FamilyEncoder` is the base of :class:`~energon_pack.ProcessorEncoder` (a rendered chat
template) and :class:`~energon_pack.encoding.request_encoder.RequestEncoder` (a tokenizer
backend that encodes the conversation itself).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from typing_extensions import Unpack

from energon_pack.encoding.chatml import SampleEncoder, TurnOptions
from energon_pack.encoding.families.base import Measured, ProcessorFamily, SampledVideo
from energon_pack.encoding.rendering import with_system
from energon_pack.formats.raw import RawSample
from energon_pack.media import MediaError, MediaItem
from energon_pack.media.audio import AudioProbe, probe_video_audio
from energon_pack.media.audio_decode import Waveform, audio_probe
from energon_pack.media.config import MediaKind
from energon_pack.media.displayed import displayed_image_size, displayed_video_header
from energon_pack.media.probe import Frames

__all__ = ["FamilyEncoder", "media_item"]

T = TypeVar("T")


class FamilyEncoder(SampleEncoder):
    """The base of a processor family's encoders (see the module docstring).

    Args:
        family: the family (:func:`~energon_pack.model_family` of a processor).
        media: limits for reading media (pixel bomb guard, media per sample, decoder
            isolation); resizing is the processor's.
        system_prompt, loss_on: see :class:`~energon_pack.SampleEncoder`.
    """

    def __init__(self, family: ProcessorFamily, **options: Unpack[TurnOptions]) -> None:
        super().__init__(family.tokenizer, **options)
        self.family = family
        media_ids = family.audio_token_ids | family.video_token_ids
        if family.takes_images:
            media_ids |= family.vision_token_ids
        self.media_ids_tensor = torch.tensor(sorted(media_ids), dtype=torch.long)
        """The family's image, video and audio token ids."""

    def _family_takes(
        self, raw: RawSample, measured: Sequence[Measured], counted: Callable[[], T]
    ) -> T:
        """``counted()`` (the family's token layout of the sample's media); a medium its
        processor refuses (an aspect ratio over its limit, a side that resizes to nothing,
        audio too short for the encoder, a video it cannot stack: a ValueError there) is
        ``unsupported``."""
        try:
            return counted()
        except ValueError as error:
            members = [member for member, _, _ in raw.media]
            raise MediaError(
                raw.key,
                ",".join(members),
                "unsupported",
                f"the {self.family.name} processor cannot take the sample's media "
                f"{[_shown(shape) for shape in measured]}: {error}; drop or resize it",
            ) from None

    def _measure(
        self, key: str, member: str, kind: MediaKind, data: bytes | Frames | Waveform
    ) -> Measured:
        """An image's displayed ``(height, width)``, an audio's probe or a video's header and
        kept frames, from the header."""
        takes_audio = self.family.audio_placeholder is not None
        takes_video = self.family.video_placeholder is not None
        if kind == "audio" and takes_audio and not isinstance(data, Frames):
            return audio_probe(data, key, member)
        if kind == "image" and self.family.takes_images and isinstance(data, bytes):
            return displayed_image_size(data, self.media, key=key, member=member)
        if kind == "video" and takes_video and isinstance(data, bytes):
            header = displayed_video_header(data, self.media, key=key, member=member)
            audio = probe_video_audio(data, key, member) if self.family.loads_video_audio else None
            try:
                return SampledVideo(header, self.family.video_frames(header), audio)
            except (ValueError, TypeError) as error:  # TypeError: a setting it needs is unset
                raise MediaError(
                    key,
                    member,
                    "unsupported",
                    f"the {self.family.name} video processor cannot sample {header.frames} "
                    f"frames at {header.fps:g} fps: {type(error).__name__}: {error}; check its "
                    "sampling settings (num_frames, fps)",
                ) from None
        takes = [
            name
            for name, taken in (
                ("encoded images", self.family.takes_images),
                ("encoded videos", takes_video),
                ("audio", takes_audio),
            )
            if taken
        ]
        raise MediaError(
            key,
            member,
            "unsupported",
            f"family {self.family.name!r} takes {' and '.join(takes)} only (decoded frames are "
            "supported for the Qwen families; videos where the processor has a video "
            "processor); drop the medium or use a model that takes it",
        )

    def _messages(self, raw: RawSample) -> list[dict[str, Any]]:
        """The sample's messages, its system prompt first, each content a list of parts."""
        messages = with_system(super()._messages(raw), raw.system, self.system_prompt)
        return [_typed(message) for message in messages]


def media_item(
    member: str, data: bytes | Frames | Waveform, shape: Measured, tokens: int, audio: int
) -> MediaItem:
    """The encoded medium: an image with its displayed size, an audio, or a video with its
    size, kept frames and the ``audio`` tokens of its own audio track."""
    if isinstance(shape, AudioProbe):
        return MediaItem(member, "audio", data, (1, 1, tokens), tokens)
    if isinstance(shape, SampledVideo):
        size = (shape.header.height, shape.header.width)
        grid = (len(shape.frames), *size)
        track = audio if shape.audio is not None else 0
        return MediaItem(
            member,
            "video",
            data,
            grid,
            tokens,
            size=size,
            frame_indices=shape.frames,
            audio_tokens=track,
        )
    return MediaItem(member, "image", data, (1, *shape), tokens, size=shape)


def _shown(shape: Measured) -> object:
    """A measured medium in a message: ``(height, width)``, seconds, or frames kept."""
    if isinstance(shape, AudioProbe):
        return f"{shape.seconds:g} s"
    if isinstance(shape, SampledVideo):
        sound = "" if shape.audio is None else f" and {shape.audio.seconds:g} s of audio"
        return f"{len(shape.frames)} frames{sound}"
    return shape


def _typed(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with string content as one text part: processors' chat templates read
    content as a list of typed parts (some only so)."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content}]}
    return message
