"""Reading an offline pack back: :class:`PackedDataset`, whose item ``p`` is the ``PackedRow`` of
pack ``p``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data

from energon_pack.offline.manifest import (
    array_facts,
    crc32,
    metadata_problem,
    read_manifest,
    read_metadata,
    spec_differences,
    stale_message,
)
from energon_pack.offline.spec import (
    ARRAY_FILES,
    MANIFEST_FILE,
    METADATA_FILE,
    PackingSpec,
    bridge_parquet_name,
)
from energon_pack.packing.row import PackedRow, build_packed_row

logger = logging.getLogger("energon_pack.offline")


_unchecked_warned: set[Path] = set()


class PackedDataset(torch.utils.data.Dataset[PackedRow]):
    """Map-style dataset over a directory written by :func:`pack_offline`: item ``p`` is pack
    ``p`` as a :class:`~energon_pack.PackedRow`, laid out with the manifest's spec.

    If ``spec`` is given it must equal the manifest's (a stale directory raises ValueError).
    Every array's size, shape and dtype and a sample of its blocks are checked against the
    manifest on open, so a truncated or swapped file is a ValueError naming it; ``verify=True``
    also checks each file's full CRC-32 (it reads the whole pack, about 3x the time of reading
    it once from the page cache). A format 1 directory (no such records) opens unchecked.
    The arrays are memory-mapped lazily, so the dataset pickles cheaply into loader workers.
    """

    def __init__(
        self, out_dir: str | Path, spec: PackingSpec | None = None, *, verify: bool = False
    ) -> None:
        self.out_dir = Path(out_dir)
        manifest = read_manifest(self.out_dir)
        if manifest is None:
            raise ValueError(
                f"{self.out_dir} holds no {MANIFEST_FILE}: it is not a complete offline pack; "
                "build it with energon-pack offline (or pack_offline)"
            )
        if manifest.get("format", "energon_pack") != "energon_pack":
            size = manifest["spec"]["packed_sequence_size"]
            raise ValueError(
                f"{self.out_dir} holds Megatron-Bridge packs (format {manifest['format']!r}): "
                f"train on them with Bridge's PackedSequenceSpecs(packed_train_data_path="
                f"'{self.out_dir / bridge_parquet_name(size)}'), or rebuild with "
                "format='energon_pack' (--format energon_pack) to read them here"
            )
        self.spec = PackingSpec.from_json(manifest["spec"])
        if spec is not None and spec != self.spec:
            raise ValueError(
                stale_message(self.out_dir, spec_differences(self.spec, spec), reader=True)
            )
        slots = None
        if self.spec.pad_cu_seqlens:
            slots = self.spec.max_segments or self._max_samples_per_bin(manifest.get("metadata"))
        self.layout = self.spec.row_layout(int(manifest["tokenizer"]["pad_token_id"]), slots)
        """How each pack is laid out as a row."""
        self._arrays: dict[str, npt.NDArray[Any]] | None = None
        self._check_files(manifest.get("arrays"), verify=verify)
        self._check_arrays()

    def __len__(self) -> int:
        return int(self._array("pack_starts").shape[0]) - 1

    def __getitem__(self, index: int) -> PackedRow:
        packs = len(self)
        if not -packs <= index < packs:
            raise IndexError(f"pack index {index} out of range for {packs} packs")
        index %= packs
        pack_starts = self._array("pack_starts")
        first, last = int(pack_starts[index]), int(pack_starts[index + 1])
        starts, lengths = self._array("seq_starts"), self._array("seq_lengths")
        ids, mask, lines = (
            self._array("input_ids"),
            self._array("loss_mask"),
            self._array("seq_lines"),
        )
        sequences = []
        for s in range(first, last):
            start, stop = int(starts[s]), int(starts[s]) + int(lengths[s])
            sequences.append(
                {
                    "input_ids": torch.from_numpy(np.array(ids[start:stop], dtype=np.int64)),
                    "loss_mask": torch.from_numpy(np.array(mask[start:stop], dtype=np.float32)),
                    "key": f"line {int(lines[s])}",
                }
            )
        return build_packed_row(sequences, self.layout)

    def source_lines(self, index: int) -> list[int]:
        """Input line numbers of the sequences in pack ``index``, in row order."""
        pack_starts = self._array("pack_starts")
        lines = self._array("seq_lines")[int(pack_starts[index]) : int(pack_starts[index + 1])]
        return [int(line) for line in lines]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def _array(self, name: str) -> npt.NDArray[Any]:
        if self._arrays is None:
            self._arrays = {
                file[: -len(".npy")]: np.load(self.out_dir / file, mmap_mode="r")
                for file in ARRAY_FILES
            }
        return self._arrays[name]

    def _check_files(self, records: Mapping[str, Any] | None, *, verify: bool) -> None:
        """Each array file against its header and the manifest's record of it."""
        missing = [f for f in ARRAY_FILES if not (self.out_dir / f).is_file()]
        if missing:
            raise ValueError(
                f"{self.out_dir} lacks {', '.join(missing)}; the pack is incomplete, rebuild it "
                "with energon-pack offline --force"
            )
        if records is None and self.out_dir.resolve() not in _unchecked_warned:
            _unchecked_warned.add(self.out_dir.resolve())
            logger.warning(
                "%s was written by an older energon_pack (manifest format 1, no array sizes or "
                "checksums): its arrays are not checked; rebuild it with energon-pack offline "
                "--force to have them checked",
                self.out_dir,
            )
        for name in ARRAY_FILES:
            path = self.out_dir / name
            facts = array_facts(path)
            if records is None:
                continue
            record = records[name]
            checks = [(key, facts[key]) for key in ("bytes", "shape", "dtype")]
            checks.append(("sample_crc32", crc32(path, sample=True)))
            if verify:
                checks.append(("crc32", crc32(path, sample=False)))
            for key, value in checks:
                if value != record[key]:
                    raise ValueError(
                        f"{path} does not match {self.out_dir / MANIFEST_FILE}: {key} is "
                        f"{value!r}, the manifest records {record[key]!r}; the file was replaced, "
                        "truncated or damaged after the build: rebuild the pack with "
                        "energon-pack offline --force"
                    )

    def _check_arrays(self) -> None:
        pack_starts, lengths = self._array("pack_starts"), self._array("seq_lengths")
        tokens = int(lengths.astype(np.int64).sum())
        if int(pack_starts[-1]) != len(lengths) or tokens != len(self._array("input_ids")):
            raise ValueError(
                f"{self.out_dir}: the arrays do not agree ({int(pack_starts[-1])} sequences in "
                f"pack_starts.npy, {len(lengths)} in seq_lengths.npy, {tokens} tokens listed, "
                f"{len(self._array('input_ids'))} in input_ids.npy); rebuild it with "
                "energon-pack offline --force"
            )

    def _max_samples_per_bin(self, record: Mapping[str, Any] | None) -> int:
        path = self.out_dir / METADATA_FILE
        if not path.is_file():
            raise ValueError(
                f"pad_cu_seqlens=True needs {path} for max_samples_per_bin (the number of "
                "cu_seqlens slots); re-run energon-pack offline --force to write it, or build "
                "with max_segments (--max-segments) to fix the slot count in the spec"
            )
        problem = None if record is None else metadata_problem(path, record)
        if problem is not None:  # the slot count would not be the one the packs were built for
            raise ValueError(
                f"{self.out_dir}: {problem}; re-run energon-pack offline --force to rewrite it"
            )
        return read_metadata(self.out_dir, {}).max_samples_per_bin
