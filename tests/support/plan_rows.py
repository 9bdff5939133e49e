"""The shipped demo dataset's rows as a JSONL file of chat rows whose media are files under a
media root (the input of the plan tests and benchmarks)."""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

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
