"""Megatron-Bridge's packed parquet (``training_<size>.idx.parquet``) written from offline packs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.chatml import Tokenizer
from energon_pack.packing.row_layout import (
    RowLayout,
    default_pad_token_id,
)
from energon_pack.sources.files import name_os_errors

_PARQUET_ROW_GROUP = 500
"""Packs per parquet row group (Bridge's own writer's default)."""


def bridge_pad_id(tokenizer: Tokenizer) -> int:
    """The id that pads sequences in Bridge's packs: the tokenizer's ``eos_token_id`` (what
    Bridge's collate pads with and strips as ``tokenizer.eos_id``), else its padding id."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and not isinstance(eos, bool):
        return eos
    return default_pad_token_id(tokenizer)


def write_bridge(
    path: Path,
    layout: RowLayout,
    sources: Sequence[npt.NDArray[Any]],
    groups: Sequence[Sequence[int]],
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
    pad_id: int,
) -> None:
    """Write the packs as Bridge's packed parquet (one row per pack, row groups of
    :data:`_PARQUET_ROW_GROUP`), holding one row group in memory at a time."""
    pa, pq = _pyarrow()
    ids_source, mask_source = sources
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int8())),
            ("seq_start_id", pa.list_(pa.int64())),
        ]
    )
    with name_os_errors(path), pq.ParquetWriter(str(path), schema) as writer:
        for first in range(0, len(groups), _PARQUET_ROW_GROUP):
            columns: dict[str, list[Any]] = {name: [] for name in schema.names}
            for group in groups[first : first + _PARQUET_ROW_GROUP]:
                spans = [(int(starts[i]), int(starts[i] + lengths[i])) for i in group]
                ids, mask, seq_starts = layout.bridge_row(
                    [ids_source[a:b] for a, b in spans],
                    [mask_source[a:b] for a, b in spans],
                    pad_id,
                )
                columns["input_ids"].append(ids)
                columns["loss_mask"].append(mask)
                columns["seq_start_id"].append(seq_starts)
            writer.write_table(pa.table(columns, schema=schema))


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            "format='bridge' writes parquet with pyarrow, which is not installed; "
            "pip install 'energon_pack[bridge]' (or pyarrow)"
        ) from None
    return pyarrow, pyarrow.parquet
