"""What a processor-backed model family is: one object per transformers processor that knows
the family's token layout, model inputs and packing rule.

A :class:`ProcessorFamily` is built from a processor instance (its own settings, never class
defaults). It

* names the text the chat template renders for each image (:attr:`image_placeholder`) and the
  text the processor writes in its place (:meth:`expansions`), computed from each image's
  displayed ``(height, width)`` alone, so a sample is tokenised before any decode; for an audio
  family the same for each audio (:attr:`audio_placeholder`, :meth:`audio_expansions`, from the
  audio's header probe), and for a family that takes video for each video
  (:attr:`video_placeholder`, :meth:`video_frames` sampled as its video processor samples
  them, :meth:`video_expansions`);
* names the token ids that count as vision tokens (:attr:`vision_token_ids`);
* finds the assistant replies in a rendered conversation when the template has no generation
  markers (:meth:`assistant_spans`);
* materialises one sample's media through the processor itself (:meth:`media_inputs`,
  :meth:`audio_inputs`, :meth:`video_inputs`: exact by construction), derives the token-level
  model inputs from the ids (:meth:`token_inputs`) and joins the inputs of several samples
  into one packed row (:meth:`row_inputs`);
* says how a packed row trains exactly (:attr:`packing`), or why it is refused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from PIL import Image

from energon_pack.media.audio import AudioProbe
from energon_pack.media.config import MediaKind
from energon_pack.media.decode import VideoHeader
from energon_pack.media.tokens import special_token_id

__all__ = [
    "TEXT_KEYS",
    "AudioFamily",
    "Measured",
    "PackingRule",
    "ProcessorFamily",
    "SampledVideo",
    "Tokenizes",
    "delimited_spans",
    "joined",
    "jsonable",
]

PackingRule = Literal["position_ids", "mrope", "block_mask", "refused"]
"""How a packed row trains exactly: ``"position_ids"`` (positions restart per segment; the
model derives its per-segment mask from them), ``"mrope"`` (positions from the model's own
rope index, per segment: :meth:`ProcessorFamily.position_ids`), ``"block_mask"`` (4-D masks
per layer type: :meth:`ProcessorFamily.attention_masks`) or ``"refused"``
(:attr:`ProcessorFamily.refusal` says why)."""

Tokenizes = Literal["template", "request"]
"""How a family's ids are made: ``"template"`` (the processor's chat template rendered, each
medium's placeholder expanded, the text tokenised: :class:`~energon_pack.ProcessorEncoder`) or
``"request"`` (the tokenizer's backend encodes the conversation to ids itself, as
mistral-common does: :meth:`ProcessorFamily.request_ids`,
:class:`~energon_pack.encoding.request_encoder.RequestEncoder`)."""


@dataclass(frozen=True)
class SampledVideo:
    """A video's header and the source frames its family's video processor keeps."""

    header: VideoHeader
    frames: tuple[int, ...]
    audio: AudioProbe | None = None
    """Its audio track's probe, where the family reads the audio of videos
    (:attr:`ProcessorFamily.loads_video_audio`) and the video has one."""

    @property
    def timestamps(self) -> list[float]:
        """Seconds of each kept frame (its index over the header's rate), as transformers'
        ``VideoMetadata.timestamps``."""
        return [index / self.header.fps for index in self.frames]


Measured = tuple[int, int] | AudioProbe | SampledVideo
"""What a medium's header gave: an image's displayed ``(height, width)``, an audio's probe, a
video's header and kept frames."""

TEXT_KEYS = frozenset({"input_ids", "attention_mask"})
"""Processor outputs that come from the text, not the media."""


def delimited_spans(
    text: str,
    header: str,
    end: str,
    *,
    opening: Callable[[str, int], int | None] | None = None,
    trailing: str = "",
) -> list[tuple[int, int]]:
    """Character spans of the replies in ``text``: from after each ``header`` (or from
    ``opening(text, offset after the header)``, where the reply begins) through its ``end``,
    and through ``trailing`` where it follows the end directly; a reply without an end, or
    without an opening (``opening`` gives None), is no span (so a count check refuses it)."""
    spans = []
    start = text.find(header)
    while start >= 0:
        after = start + len(header)
        begin = after if opening is None else opening(text, after)
        if begin is None:
            break
        stop = text.find(end, begin)
        if stop < 0:
            break
        stop += len(end)
        if trailing and text.startswith(trailing, stop):
            stop += len(trailing)
        spans.append((begin, stop))
        start = text.find(header, stop)
    return spans


class ProcessorFamily(ABC):
    """A model family served through its transformers processor (see the module docstring).

    Subclasses set the class attributes and implement :meth:`expansions`; the defaults of the
    other methods suit a processor whose media outputs are per-image tensors joined along the
    first dimension.
    """

    name: ClassVar[str]
    """The family's name (``"pixtral"``, ``"glm4v"``, ...)."""
    processor_classes: ClassVar[tuple[str, ...]]
    """transformers processor class names of the family."""
    packing: ClassVar[PackingRule] = "position_ids"
    refusal: ClassVar[str | None] = None
    """Why packing is refused (``packing == "refused"``)."""
    add_special_tokens: ClassVar[bool] = True
    """Whether the processor's tokenizer call adds special tokens (a BOS) to the text."""
    takes_images: ClassVar[bool] = True
    """Whether the family's processor takes images (an audio-only family's does not)."""
    tokenizes: ClassVar[Tokenizes] = "template"
    """How the family's ids are made (see :data:`Tokenizes`)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        merge = getattr(processor, "_merge_kwargs", None)
        merged = merge(tokenizer_init_kwargs=self.tokenizer.init_kwargs) if merge else {}
        self._image_kwargs: dict[str, Any] = dict(merged.get("images_kwargs", {}))
        self._video_kwargs: dict[str, Any] = dict(merged.get("videos_kwargs", {}))
        self._audio_kwargs: dict[str, Any] = dict(merged.get("audio_kwargs", {}))
        self._call_kwargs: dict[str, Any] = {
            key: value for key, value in merged.items() if not isinstance(value, dict)
        }
        """The processor call's own settings (not of one medium's processor)."""

    def image_setting(self, key: str) -> Any:
        """An image setting as the processor's call passes it: the processor's merged image
        kwargs (its own defaults, which override the image processor's attributes), else the
        image processor's attribute (None without either)."""
        found = self._image_kwargs.get(key)
        return getattr(self.processor.image_processor, key, None) if found is None else found

    def video_setting(self, key: str) -> Any:
        """A video setting as the processor's call passes it (see :meth:`image_setting`)."""
        found = self._video_kwargs.get(key)
        return getattr(self.processor.video_processor, key, None) if found is None else found

    def image_processor_inputs(
        self, images: Sequence[np.ndarray[Any, Any]], *, drop: Sequence[str] = ()
    ) -> dict[str, torch.Tensor]:
        """The image processor's outputs for ``images`` with the processor's merged image
        kwargs (what the processor's call computes from them), without the keys in ``drop``
        (those the processor does not return)."""
        kwargs = {**self._image_kwargs, "return_tensors": "pt"}
        out = self.processor.image_processor([Image.fromarray(i) for i in images], **kwargs)
        return {k: v for k, v in out.items() if k not in drop}

    @property
    def image_placeholder(self) -> str:
        """The text the chat template renders for each image: ``processor.image_token``."""
        return str(self.processor.image_token)

    @property
    def vision_token_ids(self) -> frozenset[int]:
        """Ids that count as vision tokens (the image pads the model's vision features fill):
        the placeholder's id, which the processor repeats in its expansion."""
        return frozenset({special_token_id(self.tokenizer, self.image_placeholder)})

    @abstractmethod
    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """The text the processor writes in place of each image's placeholder, for the images
        of one sample with displayed sizes ``(height, width)``, in order."""

    def settings(self) -> dict[str, Any]:
        """The family's settings for a settings fingerprint (JSON-able): by default its name
        and the processor's image-processor settings."""
        image_processor = getattr(self.processor, "image_processor", None)
        values = image_processor.to_dict() if image_processor is not None else {}
        out = {"family": self.name, "image_processor": jsonable(values)}
        if self.video_placeholder is not None:
            video = self.processor.video_processor.to_dict()
            out["video_processor"] = jsonable({**video, "call": self._video_kwargs})
        return out

    def assistant_spans(self, text: str) -> list[tuple[int, int]] | None:
        """Character spans of the assistant replies in a rendered conversation, for templates
        without generation markers; None when the family has no rule of its own."""
        return None

    image_processor_media: ClassVar[tuple[str, ...] | None] = None
    """Set: :meth:`media_inputs` gives the image processor's outputs alone
    (:meth:`image_processor_inputs`) without these keys, which the processor does not return;
    None: the processor's own call."""

    def media_inputs(self, images: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """The processor's media outputs for the images of one sample (HWC uint8 RGB, EXIF
        transposed), from the processor's own call on the images (or from its image processor:
        :attr:`image_processor_media`)."""
        if not images:
            return {}
        if self.image_processor_media is not None:
            return self.image_processor_inputs(images, drop=self.image_processor_media)
        pil = [Image.fromarray(image) for image in images]
        out = self.processor(images=[pil], return_tensors="pt")
        return {k: v for k, v in out.items() if k not in TEXT_KEYS and k not in self.token_keys}

    token_keys: ClassVar[frozenset[str]] = frozenset()
    """Processor outputs derived from the ids (:meth:`token_inputs` gives them)."""

    def token_inputs(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Model inputs derived from a sample's ids (e.g. ``token_type_ids``), ``[L]`` each."""
        return {}

    def row_inputs(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The media inputs of several samples' :meth:`media_inputs`, joined for one packed row
        (each key concatenated along dim 0, in sample order)."""
        keys = [k for sample in samples for k in sample]
        return {
            key: joined([sample[key] for sample in samples if key in sample])
            for key in dict.fromkeys(keys)
        }

    segment_keys: ClassVar[frozenset[str]] = frozenset()
    """Media outputs :meth:`position_ids` reads per segment (kept per sample in a row)."""

    def position_ids(
        self, model: Any, input_ids: torch.Tensor, media: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """One segment's position ids (``packing == "mrope"``), from the model's own rope
        index on the segment's ids ``[L]`` and its :attr:`segment_keys` media."""
        raise NotImplementedError(f"the {self.name} family packs with {self.packing!r}")

    def attention_masks(
        self, model: Any, segment_lengths: Sequence[int], input_ids: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """The ``attention_mask`` dict (per layer type, ``[1, 1, T, T]``) of a packed row of
        ``input_ids`` ``[T]`` split into ``segment_lengths`` (``packing == "block_mask"``)."""
        raise NotImplementedError(f"the {self.name} family packs with {self.packing!r}")

    def request_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        audio_counts: Sequence[int],
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of a conversation as the tokenizer's backend encodes it, each audio's run
        ``audio_counts`` long, and the token spans of its assistant replies
        (``tokenizes == "request"``)."""
        raise NotImplementedError(f"the {self.name} family tokenizes a rendered template")

    @property
    def audio_placeholder(self) -> str | None:
        """The text the chat template renders for each audio; None: the family takes no
        audio."""
        return None

    @property
    def audio_token_ids(self) -> frozenset[int]:
        """Ids that count as audio tokens (those the audio encoder's features fill)."""
        return frozenset()

    @property
    def audio_rate(self) -> int:
        """The sample rate the processor's feature extractor takes."""
        return int(self.processor.feature_extractor.sampling_rate)

    def audio_expansions(self, probes: Sequence[AudioProbe]) -> list[str]:
        """The text the processor writes in place of each audio's placeholder, from the
        audio's probe (its rate and length) alone, in order."""
        raise NotImplementedError(f"the {self.name} family takes no audio")

    def audio_counts(self, probes: Sequence[AudioProbe]) -> list[int]:
        """The audio tokens of each audio, from its probe alone, in order; a ValueError for an
        audio the processor cannot take."""
        raise NotImplementedError(f"the {self.name} family counts audio in its expansions")

    def audio_inputs(self, waveforms: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """The processor's audio outputs for the audio of one sample (mono float32 at
        :attr:`audio_rate`), from the processor's own call."""
        raise NotImplementedError(f"the {self.name} family takes no audio")

    takes_videos: ClassVar[bool] = False
    """Whether the family serves videos (where its processor has a video processor)."""

    @property
    def video_placeholder(self) -> str | None:
        """The text the chat template renders for each video, ``processor.video_token``;
        None: the family takes no video (or its processor has no video processor)."""
        if not self.takes_videos or getattr(self.processor, "video_processor", None) is None:
            return None
        return str(self.processor.video_token)

    @property
    def video_token_ids(self) -> frozenset[int]:
        """Ids that count as video tokens (those the vision features of a video fill): the
        placeholder's id, which the processor repeats in its expansion."""
        token = self.video_placeholder
        if token is None:
            return frozenset()
        return frozenset({special_token_id(self.tokenizer, token)})

    def video_frames(self, header: VideoHeader) -> tuple[int, ...]:
        """The source frames the video processor keeps of a video: its own ``sample_frames``
        on the header's frame count and rate, with the settings its call passes it (the
        processor's video kwargs over the video processor's attributes), every frame where it
        does not sample. A ValueError where it cannot sample the video (too few frames)."""
        video_processor = self.processor.video_processor
        kwargs = {
            name: self.video_setting(name) for name in video_processor.valid_kwargs.__annotations__
        }
        if not kwargs.pop("do_sample_frames"):
            return tuple(range(header.frames))
        for name in ("input_data_format", "do_convert_rgb", "device", "video_metadata"):
            kwargs.pop(name, None)
        from transformers.video_utils import VideoMetadata

        metadata = VideoMetadata(
            total_num_frames=header.frames,
            fps=header.fps,
            width=header.width,
            height=header.height,
            duration=header.duration,
        )
        return tuple(int(i) for i in video_processor.sample_frames(metadata=metadata, **kwargs))

    loads_video_audio: bool = False
    """Whether a video's own audio track is read with it (the Omni processors'
    ``load_audio_from_video``): probed with its header, expanded among its frames' tokens
    (:meth:`media_expansions`) and decoded for the audio encoder after the video's frames."""

    def media_expansions(self, measured: Sequence[Measured]) -> list[str]:
        """The text the processor writes in place of each medium's placeholder, in the
        sample's order: :meth:`expansions` of the images, :meth:`audio_expansions` of the
        audio and :meth:`video_expansions` of the videos (each called once for the sample's
        media of its kind); a ValueError where the processor refuses a medium."""
        sizes = [shape for shape in measured if isinstance(shape, tuple)]
        probes = [shape for shape in measured if isinstance(shape, AudioProbe)]
        videos = [shape for shape in measured if isinstance(shape, SampledVideo)]
        images = iter(self.expansions(sizes) if sizes else [])
        audios = iter(self.audio_expansions(probes) if probes else [])
        clips = iter(self.video_expansions(videos) if videos else [])
        return [
            next(images if isinstance(s, tuple) else audios if isinstance(s, AudioProbe) else clips)
            for s in measured
        ]

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """The text the processor writes in place of each video's placeholder, from its header
        and the frames :meth:`video_frames` keeps of it, in order."""
        raise NotImplementedError(f"the {self.name} family takes no video")

    def video_inputs(self, videos: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """The video processor's outputs for the videos of one sample, each its kept frames
        (``[T, H, W, 3]`` uint8, sampled already), with the processor's video kwargs: one call
        per video (their frame counts may differ), joined on the first dimension."""
        kwargs = {**self._video_kwargs, "do_sample_frames": False, "return_tensors": "pt"}
        kwargs.pop("num_frames", None)
        kwargs.pop("fps", None)
        outs = [self.processor.video_processor(videos=[video], **kwargs) for video in videos]
        keys = [key for key, value in outs[0].items() if isinstance(value, torch.Tensor)]
        return {key: joined([out[key] for out in outs]) for key in keys}

    def sample_inputs(
        self, media: Sequence[tuple[MediaKind, np.ndarray[Any, Any]]]
    ) -> dict[str, torch.Tensor]:
        """The processor's outputs for one sample's decoded media, in the sample's order
        (images as :meth:`media_inputs` takes them, videos as :meth:`video_inputs`, audio as
        :meth:`audio_inputs`); a family whose model reads images and video frames from one
        tensor in text order overrides it."""
        by_kind: dict[MediaKind, list[np.ndarray[Any, Any]]] = {
            "image": [],
            "video": [],
            "audio": [],
        }
        for kind, array in media:
            by_kind[kind].append(array)
        out = self.media_inputs(by_kind["image"]) if by_kind["image"] else {}
        if by_kind["video"]:
            out.update(self.video_inputs(by_kind["video"]))
        if by_kind["audio"]:
            out.update(self.audio_inputs(by_kind["audio"]))
        return out

    def image_tokens(self, sizes: Sequence[tuple[int, int]]) -> list[int]:
        """Vision tokens of each image (the :attr:`vision_token_ids` in its expansion)."""
        vision = self.vision_token_ids
        return [
            sum(i in vision for i in self.tokenizer.encode(text, add_special_tokens=False))
            for text in self.expansions(sizes)
        ]


class AudioFamily(ProcessorFamily):
    """A processor family that takes audio, each audio's features filling runs of the
    processor's ``audio_token``."""

    @property
    def audio_placeholder(self) -> str:
        """``processor.audio_token``."""
        return str(self.processor.audio_token)

    @property
    def audio_token_ids(self) -> frozenset[int]:
        return frozenset({int(self.processor.audio_token_id)})


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)``, or the tensor itself where it is the only one (a video's
    pixels are large: no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


def jsonable(value: Any) -> Any:
    """``value`` as JSON-able data for a settings fingerprint (other objects by their repr)."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)
