"""Small Energon datasets written into a test's folder."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

CRUDE = "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
"""The ``dataset.yaml`` of a ``CrudeWebdataset``."""


def write_dataset(
    root: Path, samples: list[tuple[str, dict[str, bytes]]], description: str = CRUDE
) -> Path:
    """A one-shard prepared Energon dataset of ``samples`` (in that order), described by
    ``description`` (the ``dataset.yaml`` text; default a ``CrudeWebdataset``)."""
    from megatron.energon.flavors.webdataset import BaseWebdatasetFactory

    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(root / "shard-000000.tar", "w") as tar:
        for key, members in samples:
            for name, data in members.items():
                info = tarfile.TarInfo(f"{key}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    BaseWebdatasetFactory.prepare_dataset(
        root,
        ["shard-000000.tar"],
        split_parts_ratio=[("train", 1.0), ("val", 0.0), ("test", 0.0)],
        shuffle_seed=None,
        workers=1,
    )
    (root / ".nv-meta" / "dataset.yaml").write_text(description)
    return root


def image_audio_samples(*, audio: bool) -> list[tuple[str, dict[str, bytes]]]:
    """18 native chat samples: every third text-only, the others (with ``audio``) an image, an
    audio of 1-2 s, or both in either order, else one or two images; PNG images seeded by the
    sample's index, WAV or FLAC sweeps at 16 kHz."""
    from audio_files import encode_audio
    from family_kit import png_bytes, test_images

    out = []
    for index in range(18):
        members: dict[str, bytes] = {}
        text = f"What is it? {index}"
        names = []
        if index % 3:
            kinds = [["image"], ["audio"], ["image", "audio"], ["audio", "image"]][index % 4]
            if not audio:
                kinds = ["image"] * (1 + index % 2)
            for position, kind in enumerate(kinds):
                if kind == "image":
                    member = f"{position}.png"
                    members[member] = png_bytes(test_images(index, [(40 + index, 70)])[0])
                    text = "<image>" + text
                else:
                    fmt = "wav" if index % 2 else "flac"
                    seconds = 1.0 + index % 5 / 5
                    member = f"{position}.{fmt}"
                    members[member] = encode_audio(fmt, 16000, 1, int(16000 * seconds), sweep=True)
                    text = "<audio>" + text
                names.append(member)
        turns = [
            {"from": "human", "value": text},
            {"from": "gpt", "value": f"The quick brown fox {index}."},
        ]
        media = names[::-1]  # each placeholder went before the text: the last medium first
        members["json"] = json.dumps({"conversations": turns, "media": media}).encode()
        out.append((f"s{index:03d}", members))
    return out
