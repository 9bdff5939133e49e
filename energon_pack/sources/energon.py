"""A Megatron-Energon dataset as the source of a plan: its samples read by Energon itself (its
``.nv-meta`` description, sample type, ``field_map`` and shard readers) and measured by the
very task encoder the loaders run (:class:`~energon_pack.PackingTaskEncoder`'s cooker, decoder
and ``preencode_sample``), each named by its ``__key__``.

A partition is one rank of Energon's own split of the dataset over ``ranks`` readers
(``get_val_dataset`` with ``WorkerConfig(rank, world_size=ranks)``): every sample of the split
is read by exactly one partition, in Energon's order. A sample Energon itself could not load is
not lost from the count: :meth:`EnergonSource.missing` names it from the index.
"""

from __future__ import annotations

import json
import math
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row_layout import RowLayout
from energon_pack.sources.files import sha256

ENERGON_MARKER = ".nv-meta"
"""The folder that makes a directory an Energon dataset."""
_RANK_SPAN = 1 << 32
"""Row numbers of partition ``r`` start at ``r * _RANK_SPAN`` (renumbered once collected)."""


@dataclass(frozen=True)
class EnergonSource:
    """A prepared Energon dataset (a folder with ``.nv-meta``), one split part of it.

    ``shards`` holds each shard of the split with its sample count; ``excluded`` the samples
    the split excludes. Build it with :meth:`open`.
    """

    path: Path
    split_part: str
    shards: tuple[tuple[str, int], ...]
    excluded: frozenset[str]
    rows_per_partition: int

    media_root = None
    """Media live in the shards (the plan's media root does not apply)."""

    @classmethod
    def open(cls, path: str | Path, split_part: str = "train", rows: int = 2048) -> EnergonSource:
        """Read the dataset's description (a ValueError names the folder or split part)."""
        from megatron.energon.epathlib import EPath
        from megatron.energon.flavors.webdataset.empty_dataset_error import EmptyDatasetError
        from megatron.energon.flavors.webdataset.metadata import WebdatasetMeta

        path = Path(path).resolve()
        try:
            meta = WebdatasetMeta.from_config(path=EPath(path), split_part=split_part)
        except EmptyDatasetError:
            raise ValueError(
                f"Energon dataset {path}: split part {split_part!r} holds no shards; pass "
                "--split with a part that does (see .nv-meta/split.yaml)"
            ) from None
        except AssertionError:
            raise ValueError(
                f"Energon dataset {path} has no split part {split_part!r}; pass --split with "
                "one of the parts in .nv-meta/split.yaml"
            ) from None
        except (OSError, ValueError, KeyError) as error:
            raise ValueError(
                f"{path} is not a prepared Energon dataset ({error}); run energon prepare on it"
            ) from None
        shards = tuple((Path(str(shard.path)).name, int(shard.count)) for shard in meta.shards)
        return cls(path, split_part, shards, frozenset(meta.sample_excludes), rows)

    def __len__(self) -> int:
        """Samples in the split (before its excludes)."""
        return sum(count for _, count in self.shards)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the samples: the folder, the split part, each shard's name, size
        and sample count, and the SHA-256 of the sample index (``.nv-meta/index.sqlite``)."""
        return {
            "path": str(self.path),
            "energon_split_part": self.split_part,
            "shards": [
                [name, count, (self.path / name).stat().st_size] for name, count in self.shards
            ],
            "index_sha256": sha256(self.path / ENERGON_MARKER / "index.sqlite"),
            "media_root": None,
        }

    def partitions(self) -> list[str]:
        """Energon's split of the samples over one reader per ``rows_per_partition`` samples."""
        ranks = max(1, math.ceil(len(self) / self.rows_per_partition))
        return [
            json.dumps(
                {
                    "energon": str(self.path),
                    "split_part": self.split_part,
                    "rank": rank,
                    "ranks": ranks,
                    "first": rank * _RANK_SPAN,
                }
            )
            for rank in range(ranks)
        ]

    def complete(self, columns: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        """The measured ``columns`` (in partition order) numbered 0, 1, ..., with every sample
        of the split that Energon could not load appended as a ``bad_row``."""
        lost = self.missing(set(columns["key"].tolist())) if len(columns["key"]) < len(self) else []
        count = len(columns["index"]) + len(lost)
        reason = "Energon could not load sample {!r} (its error is in the log); fix or exclude it"
        added = {
            "length": [0] * len(lost),
            "vision_tokens": [0] * len(lost),
            "media": [0] * len(lost),
            "key": lost,
            "skip": ["bad_row"] * len(lost),
            "reason": [reason.format(key) for key in lost],
        }
        out = {"index": np.arange(count, dtype=np.int64)}
        for name, values in added.items():
            out[name] = np.concatenate([columns[name], np.asarray(values, columns[name].dtype)])
        return out

    def missing(self, keys: set[str]) -> list[str]:
        """The keys of the split's samples (its excludes left out) that are not in ``keys``,
        in index order: samples Energon could not load."""
        from megatron.energon.epathlib import EPath
        from megatron.energon.flavors.webdataset.indexing import SqliteIndexReader
        from megatron.energon.flavors.webdataset.metadata import get_info_shard_files

        names = get_info_shard_files(EPath(self.path))
        wanted = {name for name, _ in self.shards}
        reader = SqliteIndexReader(EPath(self.path / ENERGON_MARKER / "index.sqlite"))
        try:
            return [
                key
                for key, _, shard in reader.list_all_samples()
                if names[shard] in wanted
                and key not in keys
                and f"{names[shard]}/{key}" not in self.excluded
            ]
        finally:
            reader.close()


def is_energon_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder holding Energon's ``.nv-meta``."""
    return (path / ENERGON_MARKER).is_dir()


def read_energon_partition(
    partition: dict[str, Any], encoder: SampleEncoder, layout: RowLayout
) -> Iterator[tuple[int, str, EncodedSample | tuple[str, str]]]:
    """``(row number, key, outcome)`` of each sample of an Energon partition, as
    :class:`~energon_pack.PackingTaskEncoder` prepares it for its buffer: the outcome is an
    :class:`~energon_pack.packing.packed.EncodedSample`, or ``(kind, reason)`` for a sample it
    rejects (``"media_error"``: its media; ``"bad_row"``: no sample it reads)."""
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    measuring = _measuring_task_encoder(encoder, layout)
    config = WorkerConfig(rank=partition["rank"], world_size=partition["ranks"], num_workers=0)
    dataset = get_val_dataset(
        partition["energon"],
        split_part=partition["split_part"],
        worker_config=config,
        batch_size=None,
        task_encoder=measuring,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'pin_memory' argument is set as true")
        samples = iter(get_loader(dataset))
    for number, (key, outcome) in enumerate(samples, partition["first"]):
        # Energon hands tuples on as lists
        yield number, key, outcome if isinstance(outcome, EncodedSample) else tuple(outcome)


def _measuring_task_encoder(encoder: SampleEncoder, layout: RowLayout) -> Any:
    """An Energon task encoder that reads samples as PackingTaskEncoder does (its cookers and
    decoder) and gives ``(key, outcome)`` for each (see :func:`read_energon_partition`)."""
    from megatron.energon import DefaultTaskEncoder

    from energon_pack.energon.task_encoder import PackingTaskEncoder

    packing = PackingTaskEncoder(encoder=encoder, layout=layout)

    class MeasuringTaskEncoder(DefaultTaskEncoder):  # type: ignore[misc]
        cookers = PackingTaskEncoder.cookers

        def __init__(self) -> None:
            super().__init__()
            self.decoder = packing.decoder

        def encode_sample(self, sample: Any) -> tuple[str, Any]:
            return str(sample.__key__), _prepared(packing, sample)

    return MeasuringTaskEncoder()


def _prepared(packing: Any, sample: Any) -> EncodedSample | tuple[str, str]:
    """``sample`` (a cooked or typed Energon sample) as ``packing`` (a PackingTaskEncoder)
    prepares it for its buffer: an EncodedSample, or ``(kind, reason)`` when it is refused."""
    from energon_pack.energon.carry_over import RejectedSample

    try:
        prepared = packing.preencode_sample(sample)
    except ValueError as error:  # a sample type or row the encoder does not read
        return "bad_row", str(error)
    if isinstance(prepared, RejectedSample):
        return "media_error", str(prepared.message)
    encoded: EncodedSample = prepared.encoded
    return encoded


class EnergonSamples:
    """The samples of a prepared Energon dataset's ``split_part`` by ``__key__``: read through
    Energon's sample index and shard readers, loaded by the dataset's own description (sample
    type, ``field_map``) and prepared as :class:`~energon_pack.PackingTaskEncoder` prepares
    them (its decoder and cookers), by ``encoder``. Opened lazily, so it pickles to workers."""

    def __init__(self, path: Path, split_part: str, encoder: SampleEncoder) -> None:
        self.path, self.split_part, self.encoder = path, split_part, encoder
        self._opened: tuple[Any, Any, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "split_part": self.split_part, "encoder": self.encoder}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.split_part, self.encoder = (
            state["path"],
            state["split_part"],
            state["encoder"],
        )
        self._opened = None

    def prepare(self, key: str) -> EncodedSample | tuple[str, str]:
        """Sample ``key`` as the loaders prepare it, or ``(kind, reason)`` when refused (a
        ValueError when the index has no such sample)."""
        from megatron.energon.flavors.crude import CrudeSample

        packing, factory, reader = self._open()
        try:
            raw = reader[key]
        except (AssertionError, KeyError):
            raise ValueError(
                f"Energon dataset {self.path} has no sample {key!r} in its index; plan it again"
            ) from None
        sample = factory.load_sample(raw)
        if isinstance(sample, CrudeSample):
            subflavors = sample.get("__subflavors__") or {}
            cooker = next((c for c in packing.cookers if c.is_match(subflavors)), None)
            if cooker is None:
                return "bad_row", f"sample {key!r}: no cooker of PackingTaskEncoder takes it"
            sample = packing.cook_crude_sample(sample, cooker, {})
        return _prepared(packing, sample)

    def _open(self) -> tuple[Any, Any, Any]:
        if self._opened is None:
            from megatron.energon import WorkerConfig
            from megatron.energon.dataset_config import get_dataset_from_config
            from megatron.energon.epathlib import EPath
            from megatron.energon.flavors.webdataset.itar_reader import SqliteITarEntryReader

            from energon_pack.energon.task_encoder import PackingTaskEncoder

            packing = PackingTaskEncoder(encoder=self.encoder, layout=RowLayout(1))
            factory = get_dataset_from_config(
                self.path,
                split_part=self.split_part,
                training=False,
                worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                decoder=packing.decoder,
            )
            reader = SqliteITarEntryReader(base_path=EPath(self.path))
            # closed when this object goes, or at exit while logging still works
            weakref.finalize(self, reader.close)
            self._opened = packing, factory, reader
        return self._opened
