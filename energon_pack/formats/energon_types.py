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

:class:`MediaKeepingDecoder` decodes only ``json`` / ``txt``-like members (which ``field_map``
needs); images, videos and pickles stay bytes, so media are probed and decoded lazily as usual
and nothing is unpickled by webdataset.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
import webdataset
from megatron.energon import CaptioningSample, SampleDecoder, VQASample

from energon_pack.media.config import MediaConfig
from energon_pack.media.errors import MediaError

__all__ = ["MediaKeepingDecoder", "typed_sample_row"]

_TEXT = frozenset({"txt", "text", "caption", "question", "answer"})
_JSON = frozenset({"json", "jsn"})


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


class MediaKeepingDecoder(SampleDecoder):  # type: ignore[misc]
    """Energon sample decoder that parses JSON and text members and leaves all others raw.

    A JSON member over ``max_json_bytes`` is not parsed (``PackingTaskEncoder`` passes its
    ``MediaConfig.max_json_bytes``)."""

    def __init__(self, max_json_bytes: int = MediaConfig.max_json_bytes) -> None:
        self._config = {"energon_pack": "json+text only", "max_json_bytes": max_json_bytes}
        handler = functools.partial(_decode_text_and_json, max_json_bytes)
        self._decoder = webdataset.autodecode.Decoder([handler], pre=[], post=[])


def typed_sample_row(sample: Any) -> dict[str, Any] | None:
    """The chat row of an Energon ``VQASample`` / ``CaptioningSample`` (see the module table),
    or None for other samples. Raises :class:`~energon_pack.media.MediaError` for a sample
    type that has no conversation form."""
    key = str(getattr(sample, "__key__", "?"))
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
