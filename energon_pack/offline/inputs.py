"""The samples of an offline pack, each read and tokenised (:func:`sample_tokens`):
prompt/answer pairs, pre-tokenised ids, or any conversation layout
:func:`~energon_pack.formats.parse_any` reads (what the collator reads: ``messages`` or
``conversations`` rows, WebDataset ``json`` members), text only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.chatml import SampleEncoder, Tokenizer
from energon_pack.formats import parse_any
from energon_pack.media.tokens import special_token_id
from energon_pack.offline.spec import is_int

_INT32_MAX = 2**31 - 1

SAMPLE_FORMS = (
    "{'input', 'output'}, {'messages'} or {'conversations'} (a chat row, as the collator "
    "reads it), {'json'} (a WebDataset sample's conversation) or {'input_ids', 'loss_mask'}"
)
"""The sample objects an offline input holds, as errors name them."""
_CONVERSATION_FIELDS = ("messages", "conversations", "json", "conversation.json")
_MEDIA_FIELDS = ("images", "videos", "audios", "image", "video", "audio", "jpgs", "mp4s")


# ---------------------------------------------------------------------------------- reading
def sample_tokens(
    key: str,
    record: dict[str, Any],
    encoder: SampleEncoder,
    vocab_size: int | None,
    newline: tuple[int, list[int]] | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    """The ``input_ids`` and ``loss_mask`` of one sample (``key`` names it in errors): a
    pre-tokenised record checked against ``vocab_size``, else the conversation tokenised by
    ``encoder``, with the newline after each trained ``<|im_end|>`` trained too when
    ``newline`` is given (:func:`im_end_newline`)."""
    ids, mask = _tokens(key, record, encoder, vocab_size)
    if newline is not None and "input_ids" not in record:
        mask = train_newline_after(ids, mask, *newline)
    return ids, mask


def _tokens(
    key: str, record: dict[str, Any], encoder: SampleEncoder, vocab_size: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    if "input_ids" in record:
        return pretokenised(key, record, vocab_size)
    sample = conversation_sample(key, record)
    media = [field for field in _MEDIA_FIELDS if record.get(field)]
    if media:
        raise ValueError(
            f"sample {key}: offline packing is text-only, but the sample has media {media}; "
            "remove them, or pack media online (PackingTaskEncoder, VLMPackingCollator)"
        )
    raw = parse_any(key, sample, encoder.media)
    if raw.media:
        raise ValueError(
            f"sample {key}: offline packing is text-only; remove its media and <image>/<video>"
        )
    encoded = encoder.encode(raw)
    return encoded.input_ids.numpy(), encoded.loss_mask.numpy().astype(np.uint8)


def conversation_sample(key: str, record: dict[str, Any]) -> dict[str, Any]:
    """The conversation sample the collator reads for ``record``: a prompt/answer pair as a
    user and an assistant turn, a chat row or WebDataset conversation as it is; a ValueError
    naming the sample forms otherwise (pre-tokenised records are read by
    :func:`pretokenised`)."""
    if "input" in record and "output" in record:
        prompt, answer = record["input"], record["output"]
        if not isinstance(prompt, str) or not isinstance(answer, str):
            raise ValueError(f"sample {key}: 'input' and 'output' must be strings")
        sample: dict[str, Any] = {
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
        }
        if "system" in record:
            sample["system"] = record["system"]
        return sample
    if any(field in record for field in _CONVERSATION_FIELDS):
        return record
    raise ValueError(
        f"sample {key}: unknown record with keys {sorted(record)}; expected {SAMPLE_FORMS}"
    )


def im_end_newline(tokenizer: Tokenizer) -> tuple[int, list[int]]:
    """The id of ``<|im_end|>`` and the ids of the ``\\n`` the ChatML template puts after it."""
    return special_token_id(tokenizer, "<|im_end|>"), list(tokenizer.encode("\n"))


def train_newline_after(
    ids: npt.NDArray[np.int64], mask: npt.NDArray[np.uint8], im_end: int, newline: list[int]
) -> npt.NDArray[np.uint8]:
    """``mask`` with the ``newline`` tokens that follow each trained ``im_end`` trained too."""
    out: npt.NDArray[np.uint8] = mask.copy()
    width = len(newline)
    for t in np.flatnonzero((ids == im_end) & (mask == 1)):
        follow = ids[t + 1 : t + 1 + width]
        if len(follow) == width and follow.tolist() == newline:
            out[t + 1 : t + 1 + width] = 1
    return out


def pretokenised(
    key: str, record: dict[str, Any], vocab_size: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    """The ``input_ids`` and ``loss_mask`` of a pre-tokenised record, checked (aligned, 0/1
    mask, ids inside ``vocab_size`` or int32); a ValueError naming the sample otherwise."""
    raw_ids, raw_mask = record["input_ids"], record.get("loss_mask")
    if not isinstance(raw_ids, list) or not isinstance(raw_mask, list):
        raise ValueError(
            f"sample {key}: pre-tokenised samples need lists 'input_ids' and 'loss_mask' "
            "(1 = target token)"
        )
    if not raw_ids or len(raw_ids) != len(raw_mask):
        raise ValueError(
            f"sample {key}: input_ids has {len(raw_ids)} tokens and loss_mask {len(raw_mask)}; "
            "they must be non-empty and aligned"
        )
    try:
        ids, mask = np.asarray(raw_ids), np.asarray(raw_mask)
    except (ValueError, OverflowError):
        ids = mask = np.asarray([None])  # ragged or huge values: rejected below
    if (
        ids.ndim != 1
        or ids.dtype.kind not in "iu"
        or mask.ndim != 1
        or mask.dtype.kind not in "iub"
        or not ((mask == 0) | (mask == 1)).all()
    ):
        raise ValueError(
            f"sample {key}: input_ids must be a list of ints and loss_mask of 0/1 values; "
            "fix the record"
        )
    limit = vocab_size if vocab_size is not None else _INT32_MAX + 1
    if ids.min() < 0 or ids.max() >= limit:
        bad = int(ids[(ids < 0) | (ids >= limit)][0])
        raise ValueError(
            f"sample {key}: token id {bad} is outside [0, {limit}) "
            f"({'the tokenizer vocab_size' if vocab_size is not None else 'int32'}); "
            "pass the tokenizer that made these ids"
        )
    return ids.astype(np.int64), mask.astype(np.uint8)


# --------------------------------------------------------------------------------- manifest
def tokenizer_vocab_size(tokenizer: Tokenizer) -> int | None:
    size = getattr(tokenizer, "vocab_size", None)
    return size if is_int(size) else None
