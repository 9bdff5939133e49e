"""Measuring rows for a plan: each row's tokens, vision tokens and media, exactly as the
loaders count them (the same encoder, media probed from their headers, never decoded), or
why it cannot be packed.

:func:`measure_partition` is a pure function of a partition of the source and the settings, so
any worker on any machine can run it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.formats.chat_rows import read_media_paths
from energon_pack.media.errors import MediaError
from energon_pack.offline.inputs import conversation_sample, pretokenised, tokenizer_vocab_size
from energon_pack.plan.source import read_partition
from energon_pack.plan.spec import PlanSpec

SKIP_KINDS = ("bad_row", "media_error", "overlong", "over_vision_cap")
"""Why a row is left out of a plan: it is no sample the loaders read (or is empty), its media
cannot be probed, it fits no row, or it alone is over a vision cap."""

COLUMNS = ("index", "length", "vision_tokens", "media", "skip", "reason")
"""The columns :func:`measure_partition` returns: the row index, its tokens, vision tokens and
media (0 for a skipped row), and for a skipped row its kind (one of :data:`SKIP_KINDS`, else
``""``) and the message naming the row, the limit and the fix."""


def measure_partition(
    partition: str, encoder: SampleEncoder, spec: PlanSpec, media_root: Path | None
) -> dict[str, npt.NDArray[Any]]:
    """The :data:`COLUMNS` of each row of ``partition`` (a
    :meth:`~energon_pack.plan.source.JsonSource.partitions` entry). A row that cannot be
    packed is returned with its kind and reason, never raised (the driver applies
    ``spec.overlong``)."""
    return measure_records(read_partition(partition), encoder, spec, media_root)


def measure_records(
    records: Iterable[tuple[int, Any]],
    encoder: SampleEncoder,
    spec: PlanSpec,
    media_root: Path | None,
) -> dict[str, npt.NDArray[Any]]:
    """:func:`measure_partition` over ``(row index, record)`` pairs (a record may be the
    ValueError of a line that is no JSON)."""
    rows: list[tuple[int, int, int, int, str, str]] = []
    vocab = tokenizer_vocab_size(encoder.tokenizer)
    for index, record in records:
        try:
            length, vision, media = _counts(str(index), record, encoder, media_root, vocab)
        except MediaError as error:
            rows.append((index, 0, 0, 0, "media_error", str(error)))
            continue
        except ValueError as error:
            rows.append((index, 0, 0, 0, "bad_row", str(error)))
            continue
        kind, reason = _refusal(str(index), length, vision, media, spec)
        rows.append((index, length, vision, media, kind, reason))
    columns = list(zip(*rows, strict=True)) if rows else [()] * len(COLUMNS)
    return {
        name: np.asarray(values, dtype=np.int64 if position < 4 else object)
        for position, (name, values) in enumerate(zip(COLUMNS, columns, strict=True))
    }


def _counts(
    key: str, record: Any, encoder: SampleEncoder, media_root: Path | None, vocab: int | None
) -> tuple[int, int, int]:
    """Tokens, vision tokens and media of one record, as the loaders encode it."""
    if isinstance(record, ValueError):
        raise record
    if not isinstance(record, Mapping):
        raise ValueError(f"row {key}: expected a JSON object, got {type(record).__name__}")
    if "input_ids" in record:
        ids, _ = pretokenised(key, dict(record), vocab)
        return len(ids), 0, 0
    sample = conversation_sample(key, read_media_paths(record, key, media_root))
    encoded = encoder.encode_sample(key, sample)
    if encoded.length == 0:
        raise ValueError(f"row {key} is empty (0 tokens); drop it from the source")
    return encoded.length, encoded.vision_tokens, len(encoded.media)


def _refusal(key: str, length: int, vision: int, media: int, spec: PlanSpec) -> tuple[str, str]:
    """``(kind, message)`` when the row cannot go into any pack, else ``("", "")``."""
    reason = spec.layout.overlong(key, length)
    if reason is not None:
        return "overlong", reason
    excess = spec.vision.excess(key, vision, media)
    if excess is not None:
        return "over_vision_cap", excess[1]
    return "", ""
