"""The rows a plan measures: a JSONL file (one record per non-blank line) or a JSON file
holding one array of records, each named by its 0-based row index.

A JSONL file is indexed once (:func:`line_index`: where each record starts and ends) and cut
into byte ranges that workers read on their own, so the driver never holds the rows; a JSON
array is read whole (as :func:`~energon_pack.offline.inputs.read_records` reads it) and its
records travel with their partitions.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.offline.inputs import read_records
from energon_pack.offline.manifest import name_os_errors, sha256

ROWS_PER_PARTITION = 2048
"""Records one measuring task reads: small enough to spread a short file over every worker,
large enough that scheduling costs little next to the tokenising."""


def line_index(path: Path) -> npt.NDArray[np.int64]:
    """``[2, N]`` int64: the start and end byte offset of each non-blank line of ``path``."""
    starts: list[int] = []
    ends: list[int] = []
    offset = 0
    with name_os_errors(path), path.open("rb") as lines:
        for raw in lines:
            if raw.strip():
                starts.append(offset)
                ends.append(offset + len(raw))
            offset += len(raw)
    return np.asarray([starts, ends], dtype=np.int64).reshape(2, len(starts))


@dataclass(frozen=True)
class JsonSource:
    """A JSONL or JSON-array file of rows, and the folder its media paths are read under.

    Build it with :meth:`open`; ``index`` holds the JSONL line offsets (None for an array,
    whose ``records`` are held instead).
    """

    path: Path
    media_root: Path | None
    index: npt.NDArray[np.int64] | None
    records: list[Any] | None

    @classmethod
    def open(cls, path: str | Path, media_root: str | Path | None = None) -> JsonSource:
        """Index ``path`` (a ValueError names it when it is no file or no JSON array)."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(
                f"source {path} is not a file; pass a JSONL file of rows (or a JSON file "
                "holding one array of rows)"
            )
        root = None if media_root is None else Path(media_root)
        with name_os_errors(path), path.open("rb") as data:
            array = data.read(4096).lstrip().startswith(b"[")
        if array:
            records = [record for _, _, record in read_records(path)]
            return cls(path, root, None, records)
        return cls(path, root, line_index(path), None)

    def __len__(self) -> int:
        if self.records is not None:
            return len(self.records)
        assert self.index is not None
        return int(self.index.shape[1])

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the rows: the file's resolved path, size and SHA-256, and the media
        root."""
        return {
            "path": str(self.path.resolve()),
            "bytes": self.path.stat().st_size,
            "sha256": sha256(self.path),
            "media_root": None if self.media_root is None else str(self.media_root.resolve()),
        }

    def partitions(self, rows: int = ROWS_PER_PARTITION) -> list[str]:
        """The source cut into runs of ``rows`` records, each a JSON text that
        :func:`read_partition` reads back."""
        out = []
        for first in range(0, len(self), rows):
            last = min(first + rows, len(self))
            part: dict[str, Any] = {"path": str(self.path), "first": first}
            if self.records is not None:
                part["records"] = self.records[first:last]
            else:
                assert self.index is not None
                part["bytes"] = [int(self.index[0, first]), int(self.index[1, last - 1])]
            out.append(json.dumps(part))
        return out


def read_partition(partition: str) -> Iterator[tuple[int, Any]]:
    """``(row index, record)`` of each record of a partition of :meth:`JsonSource.partitions`;
    a line that is not valid JSON gives its ValueError as the record."""
    part = json.loads(partition)
    first = part["first"]
    if "records" in part:
        yield from enumerate(part["records"], first)
        return
    start, stop = part["bytes"]
    path = Path(part["path"])
    with name_os_errors(path), path.open("rb") as data:
        data.seek(start)
        chunk = data.read(stop - start)
    lines = (line for line in chunk.split(b"\n") if line.strip())
    for index, raw in enumerate(lines, first):
        try:
            yield index, json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            yield index, ValueError(f"row {index}: invalid JSON ({error})")
