"""Small Energon datasets written into a test's folder."""

from __future__ import annotations

import io
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
