"""Tokenising an offline pack's input, one partition of its source at a time
(:func:`~energon_pack.sources.rows.open_source`: a JSONL or JSON-array file, a Parquet file, a
folder ``datasets`` saved, or a Megatron-Energon dataset). :class:`PartitionTokeniser` is a
pure function of a partition, so it runs in this process or on Ray Data's workers alike.

Offline packs are text only and stop at the first sample they cannot read: every error names
the sample (``<file>:<line>`` in a JSONL file, ``<file>[<index>]`` in other files and folders,
an Energon sample's ``__key__``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.offline.inputs import SAMPLE_FORMS, sample_tokens, train_newline_after
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row_layout import RowLayout
from energon_pack.sources.energon import read_energon_partition
from energon_pack.sources.files import FILE_FORMS
from energon_pack.sources.rows import read_partition

TOKEN_COLUMNS = ("number", "key", "ids", "mask")
"""What :class:`PartitionTokeniser` returns per sample: its number (the 1-based line of a JSONL
file, the position from 1 elsewhere; Energon's order across partitions), its key, its
``input_ids`` (int32) and ``loss_mask`` (uint8)."""

Tokens = tuple[int, str, npt.NDArray[np.int32], npt.NDArray[np.uint8]]


class PartitionTokeniser:
    """Each sample of a partition tokenised by ``encoder`` (pre-tokenised ids checked against
    ``vocab_size``; with ``newline``, the newline after each trained ``<|im_end|>`` trained
    too), as the :data:`TOKEN_COLUMNS`; a ValueError names the first sample it cannot read."""

    def __init__(
        self,
        encoder: SampleEncoder,
        vocab_size: int | None,
        newline: tuple[int, list[int]] | None,
    ) -> None:
        self.encoder, self.vocab_size, self.newline = encoder, vocab_size, newline

    def __call__(self, partition: str) -> dict[str, npt.NDArray[Any]]:
        part = json.loads(partition)
        rows = self._energon(part) if "energon" in part else self._records(part)
        listed = list(rows)
        numbers = np.asarray([row[0] for row in listed], dtype=np.int64)
        columns = [np.empty(len(listed), dtype=object) for _ in range(3)]
        for position, (_, key, ids, mask) in enumerate(listed):
            columns[0][position], columns[1][position], columns[2][position] = key, ids, mask
        return dict(zip(TOKEN_COLUMNS, (numbers, *columns), strict=True))

    def _records(self, part: dict[str, Any]) -> Iterator[Tokens]:
        name = Path(part.get("path") or part["saved"]).name
        for index, number, record in read_partition(part):
            key = f"{name}:{number}" if "bytes" in part else f"{name}[{index}]"
            if isinstance(record, ValueError):
                raise ValueError(f"sample {key}: {record}; {FILE_FORMS}")
            if not isinstance(record, dict):
                raise ValueError(
                    f"sample {key}: expected a JSON object (a sample: {SAMPLE_FORMS}), got "
                    f"{type(record).__name__}; {FILE_FORMS}"
                )
            ids, mask = sample_tokens(key, record, self.encoder, self.vocab_size, self.newline)
            yield number, key, ids.astype(np.int32), mask

    def _energon(self, part: dict[str, Any]) -> Iterator[Tokens]:
        # The layout is not used to read a sample (overlong samples are the driver's concern).
        layout = RowLayout(1)
        for number, key, outcome in read_energon_partition(part, self.encoder, layout):
            if not isinstance(outcome, EncodedSample):
                raise ValueError(outcome[1])
            if outcome.media:
                raise ValueError(
                    f"sample {key}: offline packing is text-only, but the sample has "
                    f"{len(outcome.media)} medium/media; plan it (energon-pack plan) or pack it "
                    "online (PackingTaskEncoder)"
                )
            ids = outcome.input_ids.numpy()
            mask = outcome.loss_mask.numpy().astype(np.uint8)
            if self.newline is not None:
                mask = train_newline_after(ids, mask, *self.newline)
            yield number, key, ids.astype(np.int32), mask
