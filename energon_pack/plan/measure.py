"""Measuring rows for a plan: each row's tokens, vision tokens and media, exactly as the
loaders count them (the same encoder, media probed from their headers, never decoded), or
why it cannot be packed.

:func:`measure_partition` is a pure function of a partition of the source and the settings, so
any worker on any machine can run it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.formats.chat_rows import read_media_paths
from energon_pack.media.errors import MediaError
from energon_pack.offline.inputs import conversation_sample, pretokenised, tokenizer_vocab_size
from energon_pack.packing.packed import EncodedSample
from energon_pack.plan.spec import PlanSpec
from energon_pack.sources.energon import read_energon_partition
from energon_pack.sources.engine import Engine, run_partitions
from energon_pack.sources.rows import SourceRow, read_partition

SKIP_KINDS = ("bad_row", "media_error", "overlong", "over_vision_cap")
"""Why a row is left out of a plan: it is no sample the loaders read (or is empty), its media
cannot be probed, it fits no row, or it alone is over a vision cap."""

COLUMNS = ("index", "length", "vision_tokens", "media", "key", "skip", "reason")
"""The columns :func:`measure_partition` returns: the row's number, its tokens, vision tokens
and media (0 for a skipped row), its key (as the source names it: the row index of a file,
Energon's ``__key__``), and for a skipped row its kind (one of :data:`SKIP_KINDS`, else ``""``)
and the message naming the row, the limit and the fix."""

NUMBERS = 4
"""The leading :data:`COLUMNS` that are int64 (the others are strings)."""

Outcome = tuple[int, int, int] | tuple[str, str]
"""A measured row: ``(tokens, vision tokens, media)``, or ``(skip kind, reason)``."""


def measure_partitions(
    partitions: list[str],
    encoder: SampleEncoder,
    spec: PlanSpec,
    media_root: Path | None,
    engine: Engine = "ray",
    address: str | None = None,
    progress: int | None = None,
    on_rows: Callable[[int], object] = lambda rows: None,
) -> dict[str, npt.NDArray[Any]]:
    """The :data:`COLUMNS` of every row of ``partitions``, in row order, measured on Ray Data
    (``engine="ray"``: a local Ray, or the cluster at ``address``) or in this process
    (``"local"``); ``progress``, the row count, shows a bar. ``on_rows`` is called with the
    row count of each partition as it comes back."""
    worked = {}
    measurer = PartitionMeasurer(encoder, spec, media_root)
    measured = run_partitions(partitions, measurer, engine, address, progress, "measuring")
    for number, columns in measured:
        worked[number] = columns
        on_rows(len(columns["index"]))
    if not worked:
        return _columns([])
    columns = {name: np.concatenate([worked[k][name] for k in sorted(worked)]) for name in COLUMNS}
    order = np.argsort(columns["index"], kind="stable")
    return {name: values[order] for name, values in columns.items()}


class PartitionMeasurer:
    """:func:`measure_partition` with its settings, as it travels to Ray's workers."""

    def __init__(self, encoder: SampleEncoder, spec: PlanSpec, media_root: Path | None) -> None:
        self.encoder, self.spec, self.media_root = encoder, spec, media_root

    def __call__(self, partition: str) -> dict[str, npt.NDArray[Any]]:
        return measure_partition(partition, self.encoder, self.spec, self.media_root)


def measure_partition(
    partition: str, encoder: SampleEncoder, spec: PlanSpec, media_root: Path | None
) -> dict[str, npt.NDArray[Any]]:
    """The :data:`COLUMNS` of each row of ``partition`` (a source's ``partitions()`` entry).
    A row that cannot be packed is returned with its kind and reason, never raised (the driver
    applies ``spec.overlong``)."""
    part = json.loads(partition)
    if "energon" in part:
        return _columns(
            _row(number, key, _encoded_counts(key, outcome), spec)
            for number, key, outcome in read_energon_partition(part, encoder, spec.layout)
        )
    return measure_records(read_partition(part), encoder, spec, media_root)


def measure_records(
    records: Iterable[SourceRow],
    encoder: SampleEncoder,
    spec: PlanSpec,
    media_root: Path | None,
) -> dict[str, npt.NDArray[Any]]:
    """:func:`measure_partition` over a source's rows (a record may be the ValueError of a
    line that is no JSON); each row's key is its index."""
    vocab = tokenizer_vocab_size(encoder.tokenizer)
    rows = []
    for index, _, record in records:
        key = str(index)
        rows.append(_row(index, key, _record_counts(key, record, encoder, media_root, vocab), spec))
    return _columns(rows)


def _columns(rows: Iterable[tuple[int, int, int, int, str, str, str]]) -> dict[str, Any]:
    listed = list(rows)
    columns = list(zip(*listed, strict=True)) if listed else [()] * len(COLUMNS)
    return {
        name: np.asarray(values, dtype=np.int64 if position < NUMBERS else object)
        for position, (name, values) in enumerate(zip(COLUMNS, columns, strict=True))
    }


def _row(
    number: int, key: str, outcome: Outcome, spec: PlanSpec
) -> tuple[int, int, int, int, str, str, str]:
    if isinstance(outcome[0], str):
        kind, reason = outcome
        return number, 0, 0, 0, key, str(kind), str(reason)
    length, vision, media = (int(value) for value in outcome)
    kind, reason = _refusal(key, length, vision, media, spec)
    return number, length, vision, media, key, kind, reason


def _record_counts(
    key: str, record: Any, encoder: SampleEncoder, media_root: Path | None, vocab: int | None
) -> Outcome:
    """Tokens, vision tokens and media of one record, as the loaders encode it."""
    try:
        if isinstance(record, ValueError):
            raise ValueError(f"row {key}: {record}")
        if not isinstance(record, Mapping):
            raise ValueError(f"row {key}: expected a JSON object, got {type(record).__name__}")
        if "input_ids" in record:
            ids, _ = pretokenised(key, dict(record), vocab)
            return len(ids), 0, 0
        sample = conversation_sample(key, read_media_paths(record, key, media_root))
        return _encoded_counts(key, encoder.encode_sample(key, sample))
    except MediaError as error:
        return "media_error", str(error)
    except ValueError as error:
        return "bad_row", str(error)


def _encoded_counts(key: str, encoded: EncodedSample | tuple[str, str]) -> Outcome:
    if isinstance(encoded, tuple):
        return encoded
    if encoded.length == 0:
        return "bad_row", f"row {key} is empty (0 tokens); drop it from the source"
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
