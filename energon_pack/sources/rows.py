"""The rows a plan measures: a JSONL file (one record per non-blank line), a JSON file holding
one array of records, a Parquet file (one record per row, its columns as the record's fields)
or a folder ``datasets`` saved, each row named by its 0-based index; or a Megatron-Energon
dataset (:mod:`~energon_pack.sources.energon`). :func:`open_source` opens any of them.

A JSONL file is indexed once (:func:`line_index`: where each record starts and ends) and cut
into byte ranges that workers read on their own, so the driver never holds the rows; a Parquet
file is cut by row groups, which workers read on their own too; a JSON array is read whole (as
:func:`~energon_pack.sources.files.read_records` reads it) and its records travel with their
partitions.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.sources.energon import ENERGON_MARKER, EnergonSource, is_energon_dataset
from energon_pack.sources.files import name_os_errors, read_records, sha256

ROWS_PER_PARTITION = 2048
"""Records one measuring task reads: small enough to spread a short file over every worker,
large enough that scheduling costs little next to the tokenising."""


def open_source(
    path: str | Path, media_root: str | Path | None = None, split: str = "train"
) -> Source:
    """The source at ``path``: an Energon dataset (a folder with ``.nv-meta``; its ``split``
    part), a folder ``datasets`` saved (its ``split`` when it holds a ``DatasetDict``), a
    ``.parquet`` file, else a JSON/JSONL file. The rows' media paths are read inside
    ``media_root``, by default the folder that holds ``path``. Paths are made absolute: the
    workers that read the partitions run in other folders (and machines)."""
    path = Path(path).resolve()
    root = path.parent if media_root is None else Path(media_root).resolve()
    if path.is_dir():
        if is_energon_dataset(path):
            return EnergonSource.open(path, split)
        if (path / _SAVED_STATE).is_file() or (path / _SAVED_SPLITS).is_file():
            return SavedDatasetSource.open(path, root, split)
        raise ValueError(
            f"source {path} is a folder but neither an Energon dataset (no {ENERGON_MARKER}) "
            f"nor a folder that datasets' save_to_disk wrote (no {_SAVED_STATE} or "
            f"{_SAVED_SPLITS}); pass one of those, or a JSONL, JSON or Parquet file"
        )
    if path.suffix == ".parquet":
        return ParquetSource.open(path, root)
    return JsonSource.open(path, root)


def line_index(path: Path) -> tuple[npt.NDArray[np.int64], str]:
    """``[3, N]`` int64: the start and end byte offset and the 1-based line number of each
    non-blank line of ``path``, and the file's SHA-256 (taken in the same read)."""
    starts: list[int] = []
    ends: list[int] = []
    numbers: list[int] = []
    offset = 0
    digest = hashlib.sha256()
    with name_os_errors(path), path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            digest.update(raw)
            if raw.strip():
                starts.append(offset)
                ends.append(offset + len(raw))
                numbers.append(number)
            offset += len(raw)
    index = np.asarray([starts, ends, numbers], dtype=np.int64).reshape(3, len(starts))
    return index, digest.hexdigest()


@dataclass(frozen=True)
class JsonSource:
    """A JSONL or JSON-array file of rows, and the folder its media paths are read under.

    Build it with :meth:`open`; ``index`` holds the JSONL line offsets and numbers
    (:func:`line_index`; None for an array, whose ``records`` are held instead), ``sha256`` the
    file's digest.
    """

    path: Path
    media_root: Path | None
    index: npt.NDArray[np.int64] | None
    records: list[Any] | None
    sha256: str

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
            return cls(path, root, None, records, sha256(path))
        index, digest = line_index(path)
        return cls(path, root, index, None, digest)

    def __len__(self) -> int:
        if self.records is not None:
            return len(self.records)
        assert self.index is not None
        return int(self.index.shape[1])

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the rows (:func:`file_fingerprint`)."""
        return file_fingerprint(self.path, self.media_root, self.sha256)

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
                part["line"] = int(self.index[2, first])
            out.append(json.dumps(part))
        return out


@dataclass(frozen=True)
class ParquetSource:
    """A Parquet file of rows (its columns are each record's fields: ``messages``,
    ``images``, ...), and the folder its media paths are read under; ``row_groups`` holds the
    row count of each row group. Build it with :meth:`open`."""

    path: Path
    media_root: Path | None
    row_groups: tuple[int, ...]

    @classmethod
    def open(cls, path: str | Path, media_root: str | Path | None = None) -> ParquetSource:
        """Read the file's footer (a ValueError names it when it is no Parquet file)."""
        import pyarrow.parquet as pq

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"source {path} is not a file; pass a Parquet file of rows")
        try:
            metadata = pq.ParquetFile(path).metadata
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"source {path} is not a readable Parquet file ({error})") from None
        counts = tuple(metadata.row_group(k).num_rows for k in range(metadata.num_row_groups))
        return cls(path, None if media_root is None else Path(media_root), counts)

    def __len__(self) -> int:
        return sum(self.row_groups)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the rows (:func:`file_fingerprint`)."""
        return file_fingerprint(self.path, self.media_root, sha256(self.path))

    def partitions(self, rows: int = ROWS_PER_PARTITION) -> list[str]:
        """One partition per row group (``rows`` is not used: a row group is read whole)."""
        starts = [sum(self.row_groups[:k]) for k in range(len(self.row_groups))]
        return [
            json.dumps({"path": str(self.path), "first": first, "row_group": k})
            for k, first in enumerate(starts)
            if self.row_groups[k]
        ]


_SAVED_STATE = "state.json"
_SAVED_SPLITS = "dataset_dict.json"


@dataclass(frozen=True)
class SavedDatasetSource:
    """A ``datasets.Dataset`` saved with ``save_to_disk`` (Arrow files; for a ``DatasetDict``,
    one split's folder), read with ``datasets.load_from_disk`` as raw Arrow rows (an ``Image``
    column stays ``{"bytes", "path"}``, decoded by the loaders only); ``files`` holds its data
    files. Build it with :meth:`open`."""

    path: Path
    media_root: Path | None
    rows: int
    files: tuple[str, ...]

    @classmethod
    def open(
        cls, path: str | Path, media_root: str | Path | None = None, split: str = "train"
    ) -> SavedDatasetSource:
        """Open the folder (a ValueError names it, or the split it lacks)."""
        path = Path(path)
        if (path / _SAVED_SPLITS).is_file():
            splits = _json_file(path / _SAVED_SPLITS).get("splits", [])
            if split not in splits:
                raise ValueError(
                    f"source {path} holds the splits {splits}, not {split!r}; pass --split "
                    "with one of them"
                )
            path = path / split
        state = _json_file(path / _SAVED_STATE)
        files = tuple(str(entry["filename"]) for entry in state.get("_data_files", []))
        dataset = load_saved(path)
        root = None if media_root is None else Path(media_root)
        return cls(path, root, len(dataset), files)

    def __len__(self) -> int:
        return self.rows

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the rows: the folder, each data file's name, size and SHA-256, and
        the media root."""
        return {
            "path": str(self.path.resolve()),
            "files": [
                [name, (self.path / name).stat().st_size, sha256(self.path / name)]
                for name in self.files
            ],
            "media_root": None if self.media_root is None else str(self.media_root.resolve()),
        }

    def partitions(self, rows: int = ROWS_PER_PARTITION) -> list[str]:
        """The rows cut into runs of ``rows``."""
        return [
            json.dumps(
                {"saved": str(self.path), "first": first, "stop": min(first + rows, self.rows)}
            )
            for first in range(0, self.rows, rows)
        ]


def _json_file(path: Path) -> dict[str, Any]:
    try:
        with name_os_errors(path):
            value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); save the dataset again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} is not a datasets description; save the dataset again")
    return value


def load_saved(path: Path) -> Any:
    """``datasets.load_from_disk(path)`` as raw Arrow rows (a ValueError when it fails)."""
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError:
        raise ValueError(
            f"source {path} is a saved datasets folder; install datasets to read it"
        ) from None
    try:
        return datasets.load_from_disk(str(path)).with_format("arrow")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"source {path}: datasets cannot load it ({error})") from None


Source = JsonSource | ParquetSource | SavedDatasetSource | EnergonSource


def file_fingerprint(path: Path, media_root: Path | None, digest: str) -> dict[str, Any]:
    """What identifies a source file's rows: its resolved path, size and SHA-256 (``digest``),
    and the media root."""
    return {
        "path": str(path.resolve()),
        "bytes": path.stat().st_size,
        "sha256": digest,
        "media_root": None if media_root is None else str(media_root.resolve()),
    }


SourceRow = tuple[int, int, Any]
"""A row of a source: its 0-based index, its number as a person finds it (the 1-based line of
a JSONL file, else the index + 1) and its record."""


def read_partition(part: dict[str, Any]) -> Iterator[SourceRow]:
    """Each :data:`SourceRow` of a source's partition (a ``partitions()`` entry, parsed); a
    JSONL line that is not valid JSON gives a ValueError saying so as the record."""
    first = part["first"]
    if "saved" in part:
        table = load_saved(Path(part["saved"]))[first : part["stop"]]
        yield from _numbered(table.to_pylist(), first)
        return
    if "row_group" in part:
        import pyarrow.parquet as pq

        path = Path(part["path"])
        with name_os_errors(path):
            table = pq.ParquetFile(path).read_row_group(part["row_group"])
        yield from _numbered(table.to_pylist(), first)
        return
    if "records" in part:
        yield from _numbered(part["records"], first)
        return
    start, stop = part["bytes"]
    path = Path(part["path"])
    with name_os_errors(path), path.open("rb") as data:
        data.seek(start)
        chunk = data.read(stop - start)
    index = first
    for line, raw in enumerate(chunk.split(b"\n"), part["line"]):
        if not raw.strip():
            continue
        try:
            yield index, line, json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            yield index, line, ValueError(f"invalid JSON ({error})")
        index += 1


def _numbered(records: list[Any], first: int) -> Iterator[SourceRow]:
    for index, record in enumerate(records, first):
        yield index, index + 1, record
