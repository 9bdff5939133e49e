"""The input of an offline pack: JSONL lines read as samples and tokenised (prompt/answer pairs,
conversations, pre-tokenised ids).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.chatml import SampleEncoder, Tokenizer
from energon_pack.offline.manifest import name_os_errors
from energon_pack.offline.spec import is_int

_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------- reading
def read_samples(
    path: Path,
    encoder: SampleEncoder,
    vocab_size: int | None,
    newline: tuple[int, list[int]] | None = None,
) -> Iterator[tuple[int, str, npt.NDArray[np.int64], npt.NDArray[np.uint8]]]:
    """``(line number, key, input_ids, loss_mask)`` of each sample of the JSONL file."""
    with name_os_errors(path), path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            key = f"{path.name}:{number}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
                raise ValueError(
                    f"sample {key}: invalid JSON ({error}); each line must be one JSON object"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"sample {key}: expected a JSON object, got {type(record).__name__}"
                )
            ids, mask = _tokens(key, record, encoder, vocab_size)
            if newline is not None and "input_ids" not in record:
                mask = _train_newline_after(ids, mask, *newline)
            yield number, key, ids, mask


def _tokens(
    key: str, record: dict[str, Any], encoder: SampleEncoder, vocab_size: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    if "input_ids" in record:
        return _pretokenised(key, record, vocab_size)
    if "input" in record and "output" in record:
        prompt, answer = record["input"], record["output"]
        if not isinstance(prompt, str) or not isinstance(answer, str):
            raise ValueError(f"sample {key}: 'input' and 'output' must be strings")
        conversation: dict[str, Any] = {
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
        }
        if "system" in record:
            conversation["system"] = record["system"]
    elif "conversations" in record:
        conversation = record
    else:
        raise ValueError(
            f"sample {key}: unknown record with keys {sorted(record)}; expected "
            "{'input', 'output'}, {'conversations'} or {'input_ids', 'loss_mask'}"
        )
    encoded = encoder.encode_sample(key, {"json": conversation})
    if encoded.media:
        raise ValueError(f"sample {key}: offline packing is text-only; remove <image>/<video>")
    return encoded.input_ids.numpy(), encoded.loss_mask.numpy().astype(np.uint8)


def im_end_newline(tokenizer: Tokenizer) -> tuple[int, list[int]]:
    """The id of ``<|im_end|>`` and the ids of the ``\\n`` the ChatML template puts after it."""
    return tokenizer.convert_tokens_to_ids("<|im_end|>"), list(tokenizer.encode("\n"))


def _train_newline_after(
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


def _pretokenised(
    key: str, record: dict[str, Any], vocab_size: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
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
def template_identity(encoder: SampleEncoder) -> dict[str, Any]:
    """The chat template's part of the tokenizer's identity: the encoding and the template's
    digest for the template encoder, nothing for ChatML (so earlier packs stay up to date)."""
    settings = encoder.settings()
    keys = ("encoding", "chat_template_sha256", "template_kwargs")
    return {key: settings[key] for key in keys if key in settings}


def tokenizer_vocab_size(tokenizer: Tokenizer) -> int | None:
    size = getattr(tokenizer, "vocab_size", None)
    return size if is_int(size) else None
