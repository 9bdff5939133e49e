"""The shipped demo dataset's rows as a JSONL file of chat rows whose media are files under a
media root (the input of the plan tests and benchmarks)."""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@dataclass(frozen=True)
class ChatRows:
    path: Path
    media_root: Path


def write_chat_rows(root: Path) -> ChatRows:
    """``fixtures/vlm_demo``'s samples as chat rows (ShareGPT conversations, the media as
    paths under ``root/media``), one per line of ``root/rows.jsonl``, in shard order."""
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    rows = []
    for shard in sorted((FIXTURES / "vlm_demo").glob("*.tar")):
        samples: dict[str, dict[str, bytes]] = {}
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                handle = tar.extractfile(member)
                assert handle is not None
                key, _, extension = member.name.partition(".")
                samples.setdefault(key, {})[extension] = handle.read()
        for key, parts in samples.items():
            row = json.loads(parts.pop("json"))
            for extension, data in sorted(parts.items()):
                (media / f"{key}.{extension}").write_bytes(data)
                field = "videos" if extension.endswith("mp4") else "images"
                row.setdefault(field, []).append(f"{key}.{extension}")
            rows.append(row)
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return ChatRows(path, media)


def sharegpt_rows(rows: ChatRows) -> tuple[list[int], list[dict[str, Any]]]:
    """The ShareGPT rows of ``rows`` (their indices, and the rows) in one schema, as a Parquet
    file or a saved ``datasets`` folder holds them: images as a ``datasets`` ``Image`` column
    stores them (bytes for odd rows, a path under the media root for even ones), ``videos``
    and ``system`` present in every row. (A column is the union of the rows' fields, so rows
    of other forms would gain null fields the loaders refuse.)"""
    lines = rows.path.read_text().splitlines()
    kept = [
        i
        for i, line in enumerate(lines)
        if all("from" in turn for turn in json.loads(line).get("conversations", [{}]))
    ]
    out = []
    for number, i in enumerate(kept):
        row = json.loads(lines[i])
        row["images"] = [
            {"bytes": (rows.media_root / name).read_bytes(), "path": None}
            if number % 2
            else {"bytes": None, "path": name}
            for name in row.get("images", [])
        ]
        row.setdefault("videos", [])
        row.setdefault("system", None)
        out.append(row)
    return kept, out
