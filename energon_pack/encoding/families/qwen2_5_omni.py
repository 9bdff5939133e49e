"""Qwen2.5-Omni's thinker (``Qwen2_5OmniProcessor``): images, videos and audio.

The chat template renders ``<|vision_bos|><|IMAGE|><|vision_eos|>`` per image and
``<|audio_bos|><|AUDIO|><|audio_eos|>`` per audio. The processor widens ``<|IMAGE|>`` to
``(h/14)*(w/14)/2**2`` tokens on the size its Qwen2-VL image processor smart-resizes to, and
``<|AUDIO|>`` to one token per audio-encoder output frame
(:mod:`~energon_pack.encoding.families.whisper_audio`). Inputs: ``pixel_values``,
``image_grid_thw``, ``input_features``, ``feature_attention_mask``. A video (where the processor
has its Qwen2-VL video processor) renders ``<|vision_bos|><|VIDEO|><|vision_eos|>``; ``<|VIDEO|>``
widens to ``ceil(frames / temporal_patch_size) * (h/14)*(w/14)/2**2`` tokens for the frames the
video processor samples, on the size it smart-resizes each frame to (``pixel_values_videos``,
``video_grid_thw``, and ``video_second_per_grid``: ``temporal_patch_size`` over the call's
``fps``, 2 by default, as the processor writes it). Packed rows: ``[4, 1, T]`` positions, a text
row restarting per segment over the three mRoPE rows of the model's own ``get_rope_index`` for
each segment alone (its image and video grids, video timing and audio lengths).

With the processor's ``load_audio_from_video`` set, a video's own audio track (MP4/MOV) is read
with it: its tokens are counted from the track's header with the sample's other audio, and
``<|VIDEO|>`` widens to ``<|audio_bos|>`` + the video's and the track's tokens interleaved by
time + ``<|audio_eos|>``. A video token of temporal patch ``t`` sits at ``t *
video_second_per_grid * position_id_per_seconds``, the ``i``-th audio token at ``i``; both are
cut into chunks of ``position_id_per_seconds * seconds_per_chunk`` and the chunks alternate,
video first. The track's features follow the sample's audio in text order; the segment's rope
index runs with ``use_audio_in_video``. A video without a track keeps its plain layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import Measured, PackingRule, SampledVideo, jsonable
from energon_pack.encoding.families.whisper_audio import WhisperAudioFamily
from energon_pack.media.audio import AudioProbe
from energon_pack.media.config import smart_resize

__all__ = ["Qwen25OmniFamily"]


class Qwen25OmniFamily(WhisperAudioFamily):
    """Qwen2.5-Omni's thinker: Qwen2-VL images and Whisper audio, ``[4, 1, T]`` packed
    positions."""

    name: ClassVar[str] = "qwen2_5_omni"
    processor_classes: ClassVar[tuple[str, ...]] = ("Qwen2_5OmniProcessor",)
    packing: ClassVar[PackingRule] = "mrope"
    segment_keys: ClassVar[frozenset[str]] = frozenset(
        {"image_grid_thw", "feature_attention_mask", "video_grid_thw", "video_second_per_grid"}
    )
    image_processor_media: ClassVar[tuple[str, ...] | None] = ()
    takes_videos: ClassVar[bool] = True
    default_video_fps: ClassVar[float] = 2.0
    """The ``fps`` the processor times a video's grids by when its call is given none."""

    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        call = self._call_kwargs
        self.loads_video_audio = bool(call.get("load_audio_from_video"))
        self.position_id_per_seconds = float(call.get("position_id_per_seconds", 25))
        """Positions per second of a video's time (of an audio token: one each)."""
        self.seconds_per_chunk = float(call.get("seconds_per_chunk", 2.0))
        """Seconds of a chunk where a video's tokens and its track's alternate."""

    def media_expansions(self, measured: Sequence[Measured]) -> list[str]:
        """The base expansions; where a video holds an audio track, each audio's tokens
        counted with the sample's other audio (:meth:`audio_counts`) and the video's tokens
        interleaved with its track's (see the module docstring). A sample holding a video with
        and one without a track is a ValueError: the model's rope index reads a sample's
        videos all one way."""
        tracks = [m.audio is not None for m in measured if isinstance(m, SampledVideo)]
        if not any(tracks):
            return super().media_expansions(measured)
        if not all(tracks):
            raise ValueError(
                "a sample's videos must all have an audio track or none "
                "(load_audio_from_video reads them together)"
            )
        audios = [
            m if isinstance(m, AudioProbe) else m.audio
            for m in measured
            if not isinstance(m, tuple)
        ]
        counts = iter(self.audio_counts([a for a in audios if a is not None]))
        sizes = [m for m in measured if isinstance(m, tuple)]
        images = iter(self.expansions(sizes) if sizes else [])
        out = []
        for shape in measured:
            if isinstance(shape, tuple):
                out.append(next(images))
            elif isinstance(shape, AudioProbe):
                out.append(self.audio_placeholder * next(counts))
            else:
                out.append(self._with_track(shape, next(counts)))
        return out

    def _with_track(self, video: SampledVideo, audio_tokens: int) -> str:
        """A video's tokens and its track's ``audio_tokens`` in chunks of time, alternating
        (the processor's ``replace_video_with_audio_token``)."""
        grid_t, height, width = self._grid(video)
        seconds = self._second_per_grid()
        times = [t * seconds * self.position_id_per_seconds for t in range(grid_t)]
        per_chunk = int(self.position_id_per_seconds * self.seconds_per_chunk)
        video_chunks = _chunk_sizes([t for t in times for _ in range(height * width)], per_chunk)
        audio_chunks = _chunk_sizes(list(range(audio_tokens)), per_chunk)
        parts = [str(self.processor.audio_bos_token)]
        for index in range(max(len(video_chunks), len(audio_chunks))):
            if index < len(video_chunks):
                parts.append(str(self.video_placeholder) * video_chunks[index])
            if index < len(audio_chunks):
                parts.append(self.audio_placeholder * audio_chunks[index])
        parts.append(str(self.processor.audio_eos_token))
        return "".join(parts)

    def _second_per_grid(self) -> float:
        """Seconds of one temporal patch: ``temporal_patch_size`` over the call's ``fps``."""
        fps = self._video_kwargs.get("fps") or self.default_video_fps
        return int(self.video_setting("temporal_patch_size")) / fps

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        """``<|IMAGE|>`` repeated ``grid_h * grid_w / merge**2`` times per image."""
        patch = int(self.image_setting("patch_size"))
        merge = int(self.image_setting("merge_size"))
        size = self.image_setting("size")
        least, most = _setting(size, "shortest_edge"), _setting(size, "longest_edge")
        out = []
        for height, width in sizes:
            if self.image_setting("do_resize"):
                height, width = smart_resize(height, width, patch * merge, least, most)
            out.append(self.image_placeholder * ((height // patch) * (width // patch) // merge**2))
        return out

    def video_expansions(self, videos: Sequence[SampledVideo]) -> list[str]:
        """``<|VIDEO|>`` repeated ``grid_t * grid_h * grid_w / merge**2`` times per video: its
        kept frames in temporal patches (the last repeated to fill one), each frame resized as
        the video processor resizes it (its pixel cap shared over the frames with
        ``cap_pixels_per_frame``)."""
        token = str(self.video_placeholder)
        return [token * math.prod(self._grid(video)) for video in videos]

    def _grid(self, video: SampledVideo) -> tuple[int, int, int]:
        """``(temporal patches, rows, columns)`` of a video's merged tokens."""
        setting = self.video_setting
        patch, merge = int(setting("patch_size")), int(setting("merge_size"))
        temporal = int(setting("temporal_patch_size"))
        size = setting("size")
        least, most = _setting(size, "shortest_edge"), _setting(size, "longest_edge")
        frames = len(video.frames)
        height, width = video.header.height, video.header.width
        if setting("do_resize"):
            cap = most
            if setting("cap_pixels_per_frame"):
                total = int(int(setting("max_video_tokens")) * (patch * merge) ** 2 * 0.9)
                cap = max(min(most, total * temporal // frames), int(least * 1.05))
            height, width = smart_resize(height, width, patch * merge, least, cap)
        return math.ceil(frames / temporal), height // patch // merge, width // patch // merge

    def video_inputs(self, videos: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """The video processor's outputs and ``video_second_per_grid``, one per video:
        ``temporal_patch_size`` over the processor call's ``fps`` (its default 2, not the
        rate the frames were sampled at), as the processor computes it."""
        out = super().video_inputs(videos)
        out["video_second_per_grid"] = torch.tensor([self._second_per_grid()] * len(videos))
        return out

    def settings(self) -> dict[str, Any]:
        """The base settings (the image processor's) plus the feature extractor's and how a
        video's audio track is read."""
        out = super().settings()
        out["feature_extractor"] = jsonable(self.processor.feature_extractor.to_dict())
        if self.loads_video_audio:
            out["load_audio_from_video"] = {
                "position_id_per_seconds": self.position_id_per_seconds,
                "seconds_per_chunk": self.seconds_per_chunk,
            }
        return out

    def position_ids(
        self, model: Any, input_ids: torch.Tensor, media: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """One segment's ``[4, 1, L]`` positions: ``arange(L)`` (the text row, from which the
        thinker's text model builds the packed causal mask) over the three mRoPE rows of the
        model's own ``get_rope_index`` for this segment alone (its ids, its image and video
        grids, its videos' seconds per grid and its audios' mel lengths). Concatenated along
        the last dim, the segments' positions make a packed row's ``position_ids``; pass no
        attention mask. A segment whose videos hold their audio tracks (a video opening with
        ``<|audio_bos|>``) runs it with ``use_audio_in_video``."""
        ids = input_ids.reshape(1, -1)
        rope = getattr(model, "get_rope_index", None) or model.thinker.get_rope_index
        features = media.get("feature_attention_mask")
        opens = self.tokenizer.convert_tokens_to_ids(
            [self.processor.vision_bos_token, self.processor.audio_bos_token]
        )
        tracks = bool(((ids[0, :-1] == opens[0]) & (ids[0, 1:] == opens[1])).any())
        with torch.no_grad():
            positions, _ = rope(
                ids,
                image_grid_thw=media.get("image_grid_thw"),
                video_grid_thw=media.get("video_grid_thw"),
                attention_mask=torch.ones_like(ids),
                use_audio_in_video=tracks,
                audio_seqlens=None if features is None else features.sum(-1),
                second_per_grids=media.get("video_second_per_grid"),
            )
        text = torch.arange(ids.shape[1], device=positions.device, dtype=positions.dtype)
        return torch.cat([text.view(1, 1, -1), positions], dim=0)


def _chunk_sizes(times: Sequence[float], per_chunk: int) -> list[int]:
    """How many of ``times`` (ascending) each chunk takes, as the processor's
    ``get_chunked_index`` cuts them: a chunk closes at the first time at or past its end,
    and the next chunk's end is one ``per_chunk`` further (however far that time is)."""
    sizes, start, end = [], 0, per_chunk
    for index, time in enumerate(times):
        if time >= end:
            sizes.append(index - start)
            start, end = index, end + per_chunk
    sizes.append(len(times) - start)
    return sizes


def _setting(values: Any, key: str) -> int:
    """``values[key]`` of a dict or a transformers ``SizeDict``."""
    found: Any = values.get(key) if isinstance(values, Mapping) else getattr(values, key)
    return int(found)
