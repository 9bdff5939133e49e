"""The model inputs of a processor family's packed rows: each sample's images, videos and audio
decoded (in the guarded helper process) and run through the family's processor, joined in
row-then-segment order, and the token-level inputs laid out like the rows' tokens."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from energon_pack.encoding.families import ProcessorFamily
from energon_pack.media import MediaConfig, MediaError
from energon_pack.media.audio_decode import audio_samples
from energon_pack.media.config import MediaKind
from energon_pack.media.displayed import displayed_images, displayed_videos
from energon_pack.media.probe import Frames
from energon_pack.packing.packed import EncodedSample, PackedSample, SkippedSample

__all__ = [
    "Decoded",
    "FamilyInputs",
    "decoded",
    "family_inputs",
    "model_built_inputs",
    "model_side_inputs",
    "sample_media",
]

Decoded = tuple[MediaKind, np.ndarray[Any, Any]]
"""A decoded medium and its kind (a video's audio track comes as ``"audio"``)."""


@dataclass(frozen=True)
class FamilyInputs:
    """A batch's inputs from a processor family: the processor's media outputs of all rows
    (joined by :meth:`ProcessorFamily.row_inputs`) and the token-level ones, ``[R, T]``."""

    media: dict[str, torch.Tensor]
    tokens: dict[str, torch.Tensor]
    segments: tuple[tuple[dict[str, torch.Tensor], ...], ...] = ()
    """Per row, per segment: the media outputs the family's position rule reads
    (:attr:`ProcessorFamily.segment_keys`)."""
    model_rule: str | None = None
    """The family's packing rule when its rows also need inputs built by the model
    (``"block_mask"``, ``"mrope"``: :func:`model_side_inputs`), else None."""

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every input by name."""
        return {**self.media, **self.tokens}


def family_inputs(
    family: ProcessorFamily,
    packs: Sequence[PackedSample],
    rows: Sequence[Sequence[tuple[int, EncodedSample]]],
    media: MediaConfig,
) -> FamilyInputs:
    """The family inputs of ``packs``, whose samples are ``rows`` (each sample with its
    position in the micro-batch, which a :class:`SkippedSample` names when its media fail)."""
    flat = [(position, sample) for row in rows for position, sample in row]
    arrays = iter(decoded(flat, media, family.audio_rate if _has_audio(flat) else None))
    by_position = {
        position: _processed(
            family, sample, position, [next(arrays) for _ in _decoded_kinds(sample)]
        )
        for position, sample in flat
    }
    outputs = [[by_position[position] for position, _ in row] for row in rows]
    per_sample = [out for row in outputs for out in row if out]
    segments = tuple(
        tuple({k: v for k, v in out.items() if k in family.segment_keys} for out in row)
        for row in outputs
    )
    width = int(packs[0].row.input_ids.shape[0]) if packs else 0
    tokens: dict[str, torch.Tensor] = {
        key: torch.zeros(len(packs), width, dtype=torch.long) for key in family.token_keys
    }
    for index, (pack, row) in enumerate(zip(packs, rows, strict=True)):
        offsets = pack.row.cu_seqlens_padded.tolist()
        for (_, sample), start in zip(row, offsets, strict=False):
            for key, values in family.token_inputs(sample.input_ids).items():
                tokens[key][index, start : start + values.numel()] = values
    rule = family.packing if family.packing in ("block_mask", "mrope") else None
    media_inputs = family.row_inputs(per_sample) if per_sample else {}
    return FamilyInputs(media_inputs, tokens, segments, rule)


def model_side_inputs(
    family: ProcessorFamily,
    model: Any,
    input_ids: torch.Tensor,
    cu_seqlens_padded: Sequence[torch.Tensor],
    inputs: FamilyInputs,
) -> dict[str, Any]:
    """The inputs of a packed batch that need the model (``input_ids [R, T]``, each row's
    physical boundaries): with ``packing == "block_mask"`` the ``attention_mask`` dict of the
    rows' 4-D masks, with ``"mrope"`` the rows' position ids (each segment's from the model's
    rope index); nothing for ``"position_ids"``."""
    if family.packing not in ("block_mask", "mrope"):
        return {}
    rows = []
    for index, bounds in enumerate(cu_seqlens_padded):
        edges = torch.unique_consecutive(bounds.long()).tolist()  # static slots are empty
        ids = input_ids[index]
        if family.packing == "block_mask":
            lengths = [b - a for a, b in itertools.pairwise(edges)]
            rows.append(family.attention_masks(model, lengths, ids))
            continue
        media = inputs.segments[index] if inputs.segments else ()
        parts = [
            family.position_ids(model, ids[a:b], media[i] if i < len(media) else {})
            for i, (a, b) in enumerate(itertools.pairwise(edges))
        ]
        rows.append({"position_ids": torch.cat(parts, dim=-1)})
    if family.packing == "mrope":
        return {"position_ids": torch.cat([row["position_ids"] for row in rows], dim=-2)}
    return {"attention_mask": {key: torch.cat([row[key] for row in rows]) for key in rows[0]}}


def model_built_inputs(
    family: ProcessorFamily | None,
    model: Any,
    input_ids: torch.Tensor,
    cu_seqlens_padded: Sequence[torch.Tensor],
    inputs: FamilyInputs,
) -> dict[str, Any]:
    """:func:`model_side_inputs` of a batch whose family's rows need inputs built by the model
    (``inputs.model_rule``), after checking that the batch's ``family`` and the ``model``
    itself (a module, not its config) are given; nothing for another family. A ValueError
    names what is missing."""
    if inputs.model_rule is None:
        return {}
    if family is None or not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"this batch's family packs with {inputs.model_rule!r} inputs that its model "
            "builds (4-D masks or per-segment positions): pass the model and the family, "
            "batch.hf_model_inputs(model, family=task_encoder.family)"
        )
    return model_side_inputs(family, model, input_ids, cu_seqlens_padded, inputs)


def sample_media(
    family: ProcessorFamily, sample: EncodedSample, media: MediaConfig, position: int = 0
) -> dict[str, torch.Tensor]:
    """The processor's media outputs for ``sample``'s images, videos and audio alone (see
    :func:`decoded`)."""
    samples = [(position, sample)]
    rate = family.audio_rate if _has_audio(samples) else None
    return _processed(family, sample, position, decoded(samples, media, rate))


def decoded(
    samples: Sequence[tuple[int, EncodedSample]], media: MediaConfig, audio_rate: int | None = None
) -> list[Decoded]:
    """The media of ``samples`` (each with its position in the micro-batch), in order, each
    with its kind: an image's upright pixels (HWC uint8), a video's kept frames (THWC uint8)
    followed by its audio track where the video's expansion holds one (``audio_tokens``), an
    audio's mono float32 samples at ``audio_rate``. Raises :class:`SkippedSample` at the
    position of a sample whose medium cannot be decoded or decodes to another size than its
    header gave (its tokens would no longer match)."""
    images, videos = [], []
    for position, sample in samples:
        for item in sample.media:
            if item.kind == "audio":
                continue
            if not isinstance(item.data, bytes) or item.size is None:
                error = MediaError(sample.key, item.member, "unsupported", "not a probed image")
                raise SkippedSample(position, error)
            if item.kind == "video" and item.frame_indices is not None:
                job = (sample.key, item.member, item.data, item.frame_indices, item.size, position)
                videos.append(job)
            else:
                images.append((sample.key, item.member, item.data, item.size, position))
    try:
        pixels = iter(displayed_images(images, media))
        clips = iter(displayed_videos(videos, media))
    except MediaError as error:
        raise SkippedSample(error.position or 0, error) from error
    out: list[Decoded] = []
    for position, sample in samples:
        for item in sample.media:
            if item.kind != "audio":
                out.append((item.kind, next(clips if item.kind == "video" else pixels)))
                if not item.audio_tokens:
                    continue
            if audio_rate is None or isinstance(item.data, Frames):
                unprobed = MediaError(sample.key, item.member, "unsupported", "not a probed audio")
                raise SkippedSample(position, unprobed)
            try:
                out.append(
                    (
                        "audio",
                        audio_samples(
                            item.data, audio_rate, key=sample.key, member=item.member, config=media
                        ),
                    )
                )
            except MediaError as error:
                raise SkippedSample(position, error) from error
    return out


def _decoded_kinds(sample: EncodedSample) -> list[MediaKind]:
    """The kinds :func:`decoded` gives for ``sample``, in order."""
    kinds: list[MediaKind] = []
    for item in sample.media:
        kinds.append(item.kind)
        if item.audio_tokens:
            kinds.append("audio")
    return kinds


def _has_audio(samples: Sequence[tuple[int, EncodedSample]]) -> bool:
    return any(sample.audio_tokens for _, sample in samples)


def _processed(
    family: ProcessorFamily,
    sample: EncodedSample,
    position: int,
    arrays: list[Decoded],
) -> dict[str, torch.Tensor]:
    """The family's media outputs for one sample's decoded images, videos and audio."""
    if not arrays:
        return {}
    try:
        return family.sample_inputs(arrays)
    except (ValueError, RuntimeError, OSError) as error:
        failure = MediaError(
            sample.key,
            sample.media[0].member,
            "corrupt",
            f"the {family.name} processor failed on the sample's media: {error}",
        )
        raise SkippedSample(position, failure) from error
