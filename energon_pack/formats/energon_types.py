"""Energon's standard sample types as conversations, and a decoder that keeps media compressed.

A dataset's own ``dataset.yaml`` names its sample type (``__class__``); Energon then builds those
samples from the members with its ``field_map`` and hands them to the task encoder, where
:func:`typed_sample_row` turns them into a chat row (see :mod:`~energon_pack.formats.chat_rows`):

===========================  =============================================================
``VQAWebdataset``            user: ``<image>\\n`` + ``context``; assistant: the answer with
                             the largest ``answer_weights`` entry (the first answer without
                             weights; a string answer as is)
``CaptioningWebdataset``     user: ``<image>``; assistant: ``caption``
===========================  =============================================================

``SimilarityInterleavedWebdataset`` has no question/answer structure (images matched to text
by similarity, nothing to train on as a reply), so its samples are refused by name.

Megatron-Bridge's ``ChatMLWebdataset`` (its ``ChatMLSample``: ``conversation``, ``imgs``,
``videos`` mapped from members by ``field_map``) installs its own decoder, which decodes every
image into a tensor as the sample is read. :func:`keep_media_compressed` gives such datasets a
:class:`MediaKeepingDecoder` that keeps each media member as a :class:`NamedMember` instead, and
:func:`typed_sample_row` turns the sample back into its members, read by
:mod:`~energon_pack.formats.bridge` like the same shard prepared as ``CrudeWebdataset``.

:class:`MediaKeepingDecoder` decodes only ``json`` / ``txt``-like members (which ``field_map``
needs); images, videos and pickles stay bytes, so media are probed and decoded lazily as usual
and nothing is unpickled by webdataset.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import webdataset
from megatron.energon import CaptioningSample, SampleDecoder, VQASample

from energon_pack.media.config import MediaConfig
from energon_pack.media.errors import MediaError

__all__ = ["MediaKeepingDecoder", "NamedMember", "keep_media_compressed", "typed_sample_row"]

_TEXT = frozenset({"txt", "text", "caption", "question", "answer"})
_JSON = frozenset({"json", "jsn"})


@dataclass(frozen=True)
class NamedMember:
    """A WebDataset member kept compressed, with its name (``jpgs``, ``image.png``, ...)."""

    name: str
    data: bytes


def _decode_text_and_json(max_json_bytes: int, key: str, data: bytes) -> Any:
    """JSON / text members parsed; a malformed, too deeply nested or too large (over
    ``max_json_bytes``, not parsed) one stays bytes, so the encoder reports it as the sample's
    ``bad_sample`` (counted and logged) instead of Energon dropping it uncounted."""
    extension = key.rsplit(".", 1)[-1].lower()
    try:
        if extension in _JSON:
            return data if len(data) > max_json_bytes else json.loads(data)
        if extension in _TEXT:
            return data.decode("utf-8")
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return data
    return None  # webdataset: not handled, the member stays bytes


def _keep_named(max_json_bytes: int, key: str, data: bytes) -> Any:
    """As :func:`_decode_text_and_json`, other members as :class:`NamedMember` (webdataset
    passes the member name with a leading dot)."""
    decoded = _decode_text_and_json(max_json_bytes, key, data)
    return NamedMember(key.removeprefix("."), data) if decoded is None else decoded


class MediaKeepingDecoder(SampleDecoder):  # type: ignore[misc]
    """Energon sample decoder that parses JSON and text members and leaves all others raw
    (as :class:`NamedMember` with ``keep_names``, for samples whose ``field_map`` renames them).

    A JSON member over ``max_json_bytes`` is not parsed (``PackingTaskEncoder`` passes its
    ``MediaConfig.max_json_bytes``)."""

    def __init__(
        self, max_json_bytes: int = MediaConfig.max_json_bytes, *, keep_names: bool = False
    ) -> None:
        self._config = {
            "energon_pack": "json+text only",
            "max_json_bytes": max_json_bytes,
            "keep_names": keep_names,
        }
        handler = functools.partial(
            _keep_named if keep_names else _decode_text_and_json, max_json_bytes
        )
        self._decoder = webdataset.autodecode.Decoder([handler], pre=[], post=[])


def is_chatml_type(sample_type: object) -> bool:
    """Whether ``sample_type`` is Megatron-Bridge's ``ChatMLSample`` (or a subclass), told by
    class name so that Bridge need not be importable."""
    mro = getattr(sample_type, "__mro__", ())
    return any(cls.__name__ == "ChatMLSample" for cls in mro)


def keep_media_compressed(datasets: Sequence[Any], max_json_bytes: int) -> None:
    """Give every loaded dataset (Energon's ``LoadedDataset``) that yields Bridge's
    ``ChatMLSample`` a :class:`MediaKeepingDecoder` in place of its own, so that its images
    stay compressed until a pack is chosen."""
    for loaded in datasets:
        factory = loaded.dataset
        sample_type = getattr(factory, "__sample_type__", None)
        if hasattr(factory, "_decoder") and is_chatml_type(sample_type):
            factory._decoder = MediaKeepingDecoder(max_json_bytes, keep_names=True)


def typed_sample_row(sample: Any) -> dict[str, Any] | None:
    """The chat row of an Energon ``VQASample`` / ``CaptioningSample`` (see the module table),
    the members of a Bridge ``ChatMLSample``, or None for other samples. Raises
    :class:`~energon_pack.media.MediaError` for a sample type that has no conversation form."""
    key = str(getattr(sample, "__key__", "?"))
    if is_chatml_type(type(sample)):
        return _chatml_members(key, sample)
    if isinstance(sample, VQASample):
        turns = [
            {"from": "human", "value": f"<image>\n{sample.context}"},
            {"from": "gpt", "value": _answer(key, sample.answers, sample.answer_weights)},
        ]
        return {"conversations": turns, "images": [_image(key, sample.image)]}
    if isinstance(sample, CaptioningSample):
        turns = [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": sample.caption}]
        return {"conversations": turns, "images": [_image(key, sample.image)]}
    if type(sample).__name__ in ("SimilarityInterleavedSample", "InterleavedSample"):
        raise MediaError(
            key,
            "*",
            "unsupported",
            f"{type(sample).__name__} has no question/answer turns to train on; convert it to "
            "conversations (e.g. the native sample format) first",
        )
    return None


def _chatml_members(key: str, sample: Any) -> dict[str, Any]:
    """A ``ChatMLSample`` as the members it was mapped from: ``json`` (the conversation) and
    each media field under its member's own name."""
    for field in ("audio", "tools"):
        if getattr(sample, field, None) is not None:
            raise MediaError(
                key,
                field,
                "unsupported",
                f"ChatMLSample.{field} is not read by PackingTaskEncoder (images, videos and "
                f"text only); map no {field} member in the dataset's field_map",
            )
    conversation = sample.conversation
    if isinstance(conversation, NamedMember):  # a member the decoder does not parse
        conversation = conversation.data
    members: dict[str, Any] = {"json": conversation}
    for field in ("imgs", "videos"):
        value = getattr(sample, field, None)
        if value is None:
            continue
        if not isinstance(value, NamedMember):
            raise MediaError(
                key,
                field,
                "unsupported",
                f"ChatMLSample.{field} arrived decoded ({type(value).__name__}); build the "
                "dataset with get_train_dataset / get_val_dataset(task_encoder="
                "PackingTaskEncoder(...)) so that its media stay compressed",
            )
        members[value.name] = value.data
    return members


def _answer(key: str, answers: Any, weights: Any) -> str:
    if isinstance(answers, str):
        return answers
    if not isinstance(answers, (list, tuple)) or not answers:
        raise MediaError(key, "answers", "bad_sample", f"no answer to train on: {answers!r}")
    if weights is not None and len(weights) == len(answers):
        scores = torch.as_tensor(weights, dtype=torch.float64)
        return str(answers[int(torch.argmax(scores))])
    return str(answers[0])


def _image(key: str, image: Any) -> Any:
    if isinstance(image, (bytes, bytearray)) or not isinstance(image, torch.Tensor):
        return image
    raise MediaError(
        key,
        "image",
        "unsupported",
        "the image arrived decoded as a tensor; use the task encoder's own decoder "
        "(MediaKeepingDecoder) so images stay compressed until a pack is chosen",
    )
