"""Reading source files: a failed read or write named by its path (:func:`name_os_errors`), a
file's SHA-256, and the records of a JSON or JSONL file (:func:`read_records`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FILE_FORMS = (
    "a JSONL file holds one sample object per line; a JSON file holds one array of sample objects"
)
"""The files of samples a source may be, as errors name them."""


@contextlib.contextmanager
def name_os_errors(path: str | Path) -> Iterator[None]:
    """Give an OSError raised inside that names no file (a failed write: ENOSPC, EFBIG, ...)
    the name ``path``."""
    try:
        yield
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from error


def sha256(path: Path) -> str:
    """The SHA-256 of the file ``path`` (hex), read a MiB at a time."""
    digest = hashlib.sha256()
    with name_os_errors(path), path.open("rb") as data:
        while block := data.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def read_records(path: Path) -> Iterator[tuple[int, str, Any]]:
    """``(number, key, record)`` of each JSON value of the file: a JSON array's items when the
    file starts with ``[`` (read whole), else one per non-blank line (streamed)."""
    with name_os_errors(path), path.open("rb") as lines:
        head = lines.read(4096).lstrip()
        lines.seek(0)
        if head.startswith(b"["):
            yield from _array_items(path, lines.read())
            return
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            key = f"{path.name}:{number}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
                raise ValueError(f"sample {key}: invalid JSON ({error}); {FILE_FORMS}") from None
            yield number, key, record


def _array_items(path: Path, data: bytes) -> Iterator[tuple[int, str, Any]]:
    """The items of the JSON array ``data`` (the whole file ``path``)."""
    try:
        items = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(
            f"{path}: starts with '[' but is not one valid JSON array ({error}); {FILE_FORMS}"
        ) from None
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected one JSON array of samples; {FILE_FORMS}")
    for index, item in enumerate(items):
        yield index + 1, f"{path.name}[{index}]", item
