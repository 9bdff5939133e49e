"""Offline packing of text SFT data: tokenise once, pack once, train with micro-batch 1.

:func:`pack_offline` turns a JSONL file into a packed dataset directory and
:class:`PackedDataset` reads it back as :class:`~energon_pack.layout.PackedRow` objects.

Input, one JSON object per line (blank lines are ignored; formats may be mixed):

* ``{"input": str, "output": str}`` (optional ``"system"``): a prompt/answer pair, encoded as a
  user turn and an assistant turn by :func:`~energon_pack.make_encoder`'s encoder for the
  tokenizer (its chat template when it has one, else ChatML); the loss covers the answer only;
* ``{"conversations": [...]}`` (optional ``"system"``, ``"tools"``): a text conversation, same
  encoder;
* ``{"input_ids": [...], "loss_mask": [...]}``: pre-tokenised, used as is.

Samples are named ``<file name>:<line number>`` in errors and logs.

Packed directory (all arrays are ``.npy`` files, read memory-mapped):

* ``input_ids.npy`` int32 ``[tokens]``: every packed sequence's tokens, concatenated in pack
  order, without padding; ``loss_mask.npy`` uint8 ``[tokens]`` aligned with it (1 = target);
* ``seq_starts.npy`` int64 ``[S]`` and ``seq_lengths.npy`` int32 ``[S]``: where each sequence
  lies in those arrays; ``seq_lines.npy`` int64 ``[S]``: its input line number;
* ``pack_starts.npy`` int64 ``[P + 1]``: pack ``p`` holds sequences
  ``pack_starts[p]:pack_starts[p + 1]`` (in input order within the pack);
* ``metadata.json``: a list with one dict of :class:`PackMetadata` keys, as Megatron-Bridge
  writes its packing metadata;
* ``manifest.json`` (written last, so only a complete directory has one): format version,
  package version, the :class:`PackingSpec`, the tokenizer identity, the input's sha256, the
  build statistics and, per array file, its size in bytes, shape, dtype, CRC-32 and the CRC-32
  of a sample of blocks (format 2). A directory is reused only when its manifest matches the
  request. :class:`PackedDataset` checks every array's size, shape, dtype and block sample on
  open (the full CRC-32 with ``verify=True``); format 1 directories open unchecked.

With ``format="bridge"`` the directory holds Megatron-Bridge's packed parquet instead of the
arrays: ``training_<size>.idx.parquet`` (one row per pack: ``input_ids``, the label-aligned
``loss_mask`` int8, ``seq_start_id``; each sequence padded with the tokenizer's eos so that the
``L - 1`` tokens Bridge feeds of it are a multiple of ``pad_seq_to_mult``), Bridge's
``<size>_metadata.jsonl`` (counted in those fed tokens) and the manifest (recording the
parquet's size and CRC-32). Packs then hold at most ``packed_sequence_size`` fed tokens.

The packing itself is out of core: pass 1 streams the input and appends each sequence's tokens
to temporary files while only the lengths stay in memory; pass 2 packs the lengths (best or
first fit decreasing); pass 3 copies the sequences in pack order from the memory-mapped
temporary files into the final arrays, a bounded chunk at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import random
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data

from energon_pack.binpack import OVERLONG_FIX, best_fit_decreasing, first_fit_decreasing
from energon_pack.encode import ByteTokenizer, SampleEncoder, Tokenizer
from energon_pack.fingerprint import tokenizer_identity
from energon_pack.layout import PackedRow, build_packed_row
from energon_pack.row_layout import (
    OverlongPolicy,
    RowLayout,
    default_pad_token_id,
    fixed_width_problem,
    multiple_problem,
)
from energon_pack.template_encoder import make_encoder
from energon_pack.topology import pad_seq_to_mult

logger = logging.getLogger("energon_pack.offline")

Algorithm = Literal["bfd", "ffd"]
OfflineFormat = Literal["energon_pack", "bridge"]
"""What :func:`pack_offline` writes: this package's ``.npy`` arrays (read by
:class:`PackedDataset`) or Megatron-Bridge's packed parquet (read by its
``GPTSFTPackedParquetDataset`` through ``PackedSequenceSpecs``)."""
FORMATS: tuple[OfflineFormat, ...] = ("energon_pack", "bridge")

FORMAT_VERSION = 2
"""Manifest layout written; format 1 (no ``arrays`` entry) is still read, unchecked."""
_READABLE_FORMATS = (1, FORMAT_VERSION)
MANIFEST_FILE = "manifest.json"
METADATA_FILE = "metadata.json"
ARRAY_FILES = (
    "input_ids.npy",
    "loss_mask.npy",
    "seq_starts.npy",
    "seq_lengths.npy",
    "seq_lines.npy",
    "pack_starts.npy",
)
_TMP_IDS = ".input_ids.tmp"
_TMP_MASK = ".loss_mask.tmp"
_COPY_CHUNK_TOKENS = 1 << 22
"""Most tokens gathered in memory at once while writing the arrays in pack order."""
_INT32_MAX = 2**31 - 1
_STATS = ("samples", "sequences", "packs", "tokens", "skipped", "truncated", "split_packs")
_ARRAY_FACTS = ("bytes", "shape", "dtype", "crc32", "sample_crc32")
_SAMPLE_BLOCKS = 16
_SAMPLE_BLOCK_BYTES = 1 << 16
"""The block sample checked on every open: 16 blocks of 64 KiB spread over the file."""
_READ_BYTES = 1 << 20
_PARQUET_ROW_GROUP = 500
"""Packs per parquet row group (Bridge's own writer's default)."""
_FILE_FACTS = ("bytes", "crc32", "sample_crc32")
_unchecked_warned: set[Path] = set()


@dataclass(frozen=True)
class PackingSpec:
    """What an offline pack is built with; :func:`pack_offline` and :class:`PackedDataset`
    check it against the directory's manifest.

    Args:
        packed_sequence_size: tokens per pack (the training ``seq_length``).
        pad_seq_to_mult: each sequence is padded to a multiple of this (see
            :func:`~energon_pack.topology.pad_seq_to_mult`); packing counts the padded lengths.
        pad_cu_seqlens: static ``cu_seqlens`` shapes for CUDA graphs (needs
            ``pad_to_max_length``); the slot count is ``max_segments`` or the metadata's
            ``max_samples_per_bin``.
        pad_to_max_length: every row is exactly ``packed_sequence_size`` tokens wide.
        algorithm: ``"bfd"`` (best fit decreasing) or ``"ffd"`` (first fit decreasing).
        overlong: a sequence whose padded length exceeds ``packed_sequence_size``:
            ``"error"`` raises, ``"skip"`` counts, logs and leaves it out, ``"truncate"`` keeps
            its first ``packed_sequence_size`` tokens and counts it.
        seed: the pack order is shuffled with ``random.Random(seed)`` so that it does not
            follow the packer's longest-first order (no global RNG is touched).
        max_segments: most sequences per pack (packs above it are split); with
            ``pad_cu_seqlens`` also the fixed number of ``cu_seqlens`` slots.
        train_newline_after_im_end: also train the ``\n`` that follows each trained
            ``<|im_end|>`` (Megatron-Bridge's chat preprocessing does; the default follows the
            chat templates' assistant masks, which end at ``<|im_end|>``). Encoded
            conversations only; pre-tokenised masks are used as they are.
    """

    packed_sequence_size: int
    pad_seq_to_mult: int = 1
    pad_cu_seqlens: bool = False
    pad_to_max_length: bool = False
    algorithm: Algorithm = "bfd"
    overlong: OverlongPolicy = "error"
    seed: int = 0
    max_segments: int | None = None
    train_newline_after_im_end: bool = False

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("invalid PackingSpec: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        out: list[str] = []
        for name in ("packed_sequence_size", "pad_seq_to_mult"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                out.append(f"{name} must be a positive int, got {value!r}")
        if self.max_segments is not None and (
            not _is_int(self.max_segments) or self.max_segments < 1
        ):
            out.append(
                f"max_segments must be a positive int or None (no limit), got {self.max_segments!r}"
            )
        if not _is_int(self.seed):
            out.append(f"seed must be an int, got {self.seed!r}")
        for name in ("pad_cu_seqlens", "pad_to_max_length", "train_newline_after_im_end"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.algorithm not in ("bfd", "ffd"):
            out.append(f"algorithm must be 'bfd' or 'ffd', got {self.algorithm!r}")
        if self.overlong not in ("error", "skip", "truncate"):
            out.append(f"overlong must be 'error', 'skip' or 'truncate', got {self.overlong!r}")
        if out:
            return out
        problems = (
            multiple_problem(
                "packed_sequence_size",
                self.packed_sequence_size,
                "pad_seq_to_mult",
                self.pad_seq_to_mult,
            ),
            fixed_width_problem(self.pad_cu_seqlens, self.pad_to_max_length),
        )
        return [problem for problem in problems if problem]

    def row_layout(self, pad_token_id: int = 0, slots: int | None = None) -> RowLayout:
        """The :class:`~energon_pack.row_layout.RowLayout` of the packs (Megatron-Bridge's
        ``PackedSequenceSpecs`` names mapped to the row settings); ``slots`` is the
        ``cu_seqlens`` slot count with ``pad_cu_seqlens`` (default ``max_segments``)."""
        return RowLayout(
            self.packed_sequence_size,
            self.pad_seq_to_mult,
            self.pad_to_max_length,
            self.pad_cu_seqlens,
            slots if slots is not None else self.max_segments,
            pad_token_id,
        )

    @classmethod
    def for_topology(
        cls,
        packed_sequence_size: int,
        *,
        tp: int = 1,
        cp: int = 1,
        sp: bool = False,
        eval_cp: int | None = None,
        **settings: Any,
    ) -> PackingSpec:
        """A spec whose ``pad_seq_to_mult`` follows the parallel topology; other fields as
        keyword arguments."""
        mult = pad_seq_to_mult(tp, cp, sp, eval_cp)
        return cls(packed_sequence_size, pad_seq_to_mult=mult, **settings)

    def to_json(self) -> dict[str, Any]:
        """The fields as a JSON-able dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PackingSpec:
        """Inverse of :meth:`to_json`."""
        return cls(**data)


@dataclass(frozen=True)
class PackMetadata:
    """The packing metadata Megatron-Bridge writes beside a packed dataset.

    ``dataset_max_seqlen``: longest packed sequence (real tokens, after truncation);
    ``max_samples_per_bin``: most sequences in one pack; ``packing_factor``: sequences per pack,
    rounded to 2 decimals; ``packing_efficiency``: real tokens over ``packs * pack_size`` in
    percent, rounded to 2 decimals; ``pack_size``: ``packed_sequence_size``;
    ``min_packed_seqlen``: real tokens of the emptiest pack.
    """

    dataset_max_seqlen: int
    max_samples_per_bin: int
    packing_factor: float
    packing_efficiency: float
    pack_size: int
    min_packed_seqlen: int

    @classmethod
    def compute(
        cls,
        seq_lengths: npt.NDArray[np.integer[Any]],
        pack_starts: npt.NDArray[np.integer[Any]],
        pack_size: int,
    ) -> PackMetadata:
        """From the per-sequence lengths in pack order and the ``[P + 1]`` pack boundaries."""
        packs = len(pack_starts) - 1
        if packs < 1 or len(seq_lengths) == 0:
            raise ValueError("packing metadata needs at least one pack")
        totals = np.add.reduceat(seq_lengths.astype(np.int64), pack_starts[:-1])
        return cls(
            dataset_max_seqlen=int(seq_lengths.max()),
            max_samples_per_bin=int(np.diff(pack_starts).max()),
            packing_factor=round(len(seq_lengths) / packs, 2),
            packing_efficiency=round(100.0 * float(totals.sum()) / (packs * pack_size), 2),
            pack_size=pack_size,
            min_packed_seqlen=int(totals.min()),
        )


@dataclass(frozen=True)
class OfflinePackResult:
    """What :func:`pack_offline` did (``reused``: an up-to-date directory was found, no work)."""

    out_dir: Path
    reused: bool
    metadata: PackMetadata
    samples: int
    """Input samples read."""
    sequences: int
    """Sequences packed (samples minus skipped)."""
    packs: int
    tokens: int
    """Real tokens packed."""
    skipped: int
    """Overlong samples left out (``overlong="skip"``)."""
    truncated: int
    """Overlong samples cut to ``packed_sequence_size`` (``overlong="truncate"``)."""
    split_packs: int
    """Extra packs made by splitting packs above ``max_segments``."""
    format: OfflineFormat = "energon_pack"
    """What was written (see :data:`OfflineFormat`)."""

    @property
    def files(self) -> list[Path]:
        """The packed data and metadata files, as a trainer is pointed at them."""
        size = self.metadata.pack_size
        return [
            self.out_dir / name
            for name in (*_data_files(self.format, size), _metadata_file(self.format, size))
        ]

    def stats_json(self) -> dict[str, int]:
        """The counters, as stored in the manifest."""
        return {name: getattr(self, name) for name in _STATS}


def pack_offline(
    input_path: str | Path,
    out_dir: str | Path,
    spec: PackingSpec,
    tokenizer: Tokenizer | None = None,
    *,
    force: bool = False,
    format: OfflineFormat = "energon_pack",
) -> OfflinePackResult:
    """Tokenise and pack the JSONL ``input_path`` into ``out_dir`` (see the module docstring).

    ``format="bridge"`` writes Megatron-Bridge's packed parquet instead of the ``.npy`` arrays
    (see :func:`bridge_parquet_name`); packs then fill ``packed_sequence_size`` with the tokens
    Bridge feeds, ``L - 1`` per sequence of ``L`` (the last token is only a label).

    ``tokenizer`` is HF-style (``encode``, ``convert_tokens_to_ids``; ``pad_token_id`` is used
    for padding when present) or None for :class:`~energon_pack.encode.ByteTokenizer`; with an
    explicit tokenizer, pre-tokenised ids are checked against its ``vocab_size``. If ``out_dir``
    already holds a pack with the same manifest it is reused; a different one is refused with a
    ValueError naming what differs. ``force`` always rebuilds in place (other files in
    ``out_dir`` are left alone). A failing read or write (full disk, read-only or missing
    folder, ...) raises the OSError with the path it concerns.
    """
    input_path, out_dir = Path(input_path), Path(out_dir)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")
    if not input_path.is_file():
        raise ValueError(f"input {input_path} is not a file; pass a JSONL file of samples")
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out_dir))
    tok: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    encoder = make_encoder(tok)
    manifest = {
        "format_version": FORMAT_VERSION,
        "energon_pack_version": importlib.metadata.version("energon_pack"),
        "spec": spec.to_json(),
        "tokenizer": {**tokenizer_identity(tok), **_template_identity(encoder)},
        "input_sha256": _sha256(input_path),
        "format": format,
    }
    existing = None if force else _read_manifest(out_dir)
    if existing is not None:
        differences = _manifest_differences(existing, manifest)
        if differences:
            raise ValueError(_stale_message(out_dir, differences))
        logger.info("reusing the up-to-date pack in %s", out_dir)
        return _result(out_dir, existing, _read_metadata(out_dir, existing), reused=True)
    if not force and out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(
            f"out dir {out_dir} is not empty and has no {MANIFEST_FILE} (an interrupted build "
            "or other files); pass force=True (--force) to build there, or choose an empty or "
            "new directory"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # incomplete until the manifest is back
    try:
        counts, metadata = _build(
            input_path, out_dir, spec, encoder, explicit=tokenizer is not None, format=format
        )
    finally:
        for name in (_TMP_IDS, _TMP_MASK):
            (out_dir / name).unlink(missing_ok=True)
    manifest["stats"] = counts
    size = spec.packed_sequence_size
    manifest["arrays"] = {
        name: _file_record(out_dir / name, npy=format == "energon_pack")
        for name in _data_files(format, size)
    }
    _write_json(out_dir / _metadata_file(format, size), [dataclasses.asdict(metadata)])
    _write_json(out_dir / MANIFEST_FILE, {**manifest, "input_path": str(input_path.resolve())})
    return _result(out_dir, manifest, metadata, reused=False)


class PackedDataset(torch.utils.data.Dataset[PackedRow]):
    """Map-style dataset over a directory written by :func:`pack_offline`: item ``p`` is pack
    ``p`` as a :class:`~energon_pack.layout.PackedRow`, laid out with the manifest's spec.

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
        manifest = _read_manifest(self.out_dir)
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
                _stale_message(self.out_dir, _spec_differences(self.spec, spec), reader=True)
            )
        slots = None
        if self.spec.pad_cu_seqlens:
            slots = self.spec.max_segments or self._max_samples_per_bin()
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
            facts = _array_facts(path)
            if records is None:
                continue
            record = records[name]
            checks = [(key, facts[key]) for key in ("bytes", "shape", "dtype")]
            checks.append(("sample_crc32", _crc32(path, sample=True)))
            if verify:
                checks.append(("crc32", _crc32(path, sample=False)))
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

    def _max_samples_per_bin(self) -> int:
        path = self.out_dir / METADATA_FILE
        if not path.is_file():
            raise ValueError(
                f"pad_cu_seqlens=True needs {path} for max_samples_per_bin (the number of "
                "cu_seqlens slots); re-run energon-pack offline --force to write it, or build "
                "with max_segments (--max-segments) to fix the slot count in the spec"
            )
        return _read_metadata(self.out_dir, {}).max_samples_per_bin


# --------------------------------------------------------------------------------- building
def _build(
    input_path: Path,
    out_dir: Path,
    spec: PackingSpec,
    encoder: SampleEncoder,
    *,
    explicit: bool,
    format: OfflineFormat,
) -> tuple[dict[str, int], PackMetadata]:
    """The three passes; returns the counters and the metadata."""
    size = spec.packed_sequence_size
    bridge = format == "bridge"
    # What fits a pack depends on the size and the multiple only (the slots come later).
    fits = RowLayout(size, spec.pad_seq_to_mult)
    # Bridge feeds L - 1 tokens of a stored sequence of L: one more token is stored.
    keep = fits.capacity + 1 if bridge else size
    tokenizer = encoder.tokenizer
    vocab_size = _vocab_size(tokenizer) if explicit else None
    newline = _im_end_newline(tokenizer) if spec.train_newline_after_im_end else None
    lengths: list[int] = []
    lines: list[int] = []
    samples = skipped = truncated = 0
    # Pass 1: tokenise and spill tokens to disk; only lengths and line numbers stay in memory.
    # Each file's close (its last write) names it on failure.
    ids_path, mask_path = out_dir / _TMP_IDS, out_dir / _TMP_MASK
    with (
        name_os_errors(ids_path),
        ids_path.open("wb") as ids_out,
        name_os_errors(mask_path),
        mask_path.open("wb") as mask_out,
    ):
        for line, key, ids, mask in _samples(input_path, encoder, vocab_size, newline):
            samples += 1
            if bridge and len(ids) < 2:
                raise ValueError(
                    f"sample {key} has {len(ids)} token; Megatron-Bridge trains on L - 1 tokens "
                    "of a sequence of L, so format='bridge' needs at least 2; drop the sample"
                )
            reason = fits.overlong(key, len(ids) - 1 if bridge else len(ids))
            if reason is not None:
                if spec.overlong == "error":
                    fix = f"{OVERLONG_FIX} (or 'truncate' to cut them; --overlong)"
                    raise ValueError(f"{reason}; {fix}")
                if spec.overlong == "skip":
                    skipped += 1
                    logger.warning("skipping: %s", reason)
                    continue
                truncated += 1
                ids, mask = ids[:keep], mask[:keep]
            _append(ids_out, ids, mask_out, mask)
            lengths.append(len(ids))
            lines.append(line)
    if not lengths:
        raise ValueError(
            f"input {input_path} gave no sequences to pack ({samples} samples read, {skipped} "
            "skipped as overlong); check the file, or the size and --overlong"
        )
    if truncated:
        logger.warning("truncated %d sample(s) to packed_sequence_size=%d", truncated, size)
    # Pass 2: pack the lengths (Bridge's: the tokens it feeds, L - 1).
    packed = [fits.bridge_span(n) for n in lengths] if bridge else lengths
    groups, split_packs = _pack(packed, spec)
    # Pass 3: write the arrays in pack order.
    order = np.fromiter((i for group in groups for i in group), dtype=np.int64, count=len(lengths))
    src_lengths = np.asarray(lengths, dtype=np.int64)
    src_starts = np.concatenate(([0], np.cumsum(src_lengths)[:-1]))
    seq_lengths = src_lengths[order]
    seq_starts = np.concatenate(([0], np.cumsum(seq_lengths)[:-1]))
    pack_starts = np.cumsum([0, *(len(group) for group in groups)], dtype=np.int64)
    tokens = int(src_lengths.sum())
    sources = [
        np.memmap(out_dir / tmp, dtype=dtype, mode="r", shape=(tokens,))
        for tmp, dtype in ((_TMP_IDS, np.int32), (_TMP_MASK, np.uint8))
    ]
    if bridge:
        pad_id = bridge_pad_id(tokenizer)
        _write_bridge(
            out_dir / bridge_parquet_name(size),
            fits,
            sources,
            groups,
            src_starts,
            src_lengths,
            pad_id,
        )
        metadata = PackMetadata.compute(np.asarray(packed)[order], pack_starts, size)
    else:
        for source, name in zip(sources, ("input_ids", "loss_mask"), strict=True):
            _gather(source, out_dir / f"{name}.npy", src_starts[order], seq_lengths)
        _save(out_dir / "seq_starts.npy", seq_starts)
        _save(out_dir / "seq_lengths.npy", seq_lengths.astype(np.int32))
        _save(out_dir / "seq_lines.npy", np.asarray(lines, dtype=np.int64)[order])
        _save(out_dir / "pack_starts.npy", pack_starts)
        metadata = PackMetadata.compute(seq_lengths, pack_starts, size)
    del sources
    counts = {
        "samples": samples,
        "sequences": len(lengths),
        "packs": len(groups),
        "tokens": tokens,
        "skipped": skipped,
        "truncated": truncated,
        "split_packs": split_packs,
    }
    logger.info("packed %d sequences into %d packs in %s", len(lengths), len(groups), out_dir)
    return counts, metadata


def _pack(lengths: Sequence[int], spec: PackingSpec) -> tuple[list[list[int]], int]:
    """Groups of sequence indices (input order inside each) in shuffled pack order, and the
    number of extra packs made by the ``max_segments`` split."""
    pack = best_fit_decreasing if spec.algorithm == "bfd" else first_fit_decreasing
    groups = pack(lengths, spec.packed_sequence_size, align=spec.pad_seq_to_mult)
    limit = spec.max_segments
    split: list[list[int]] = []
    for group in groups:
        if limit is None or len(group) <= limit:
            split.append(sorted(group))
        else:
            split += [sorted(group[i : i + limit]) for i in range(0, len(group), limit)]
    random.Random(spec.seed).shuffle(split)
    return split, len(split) - len(groups)


def bridge_parquet_name(packed_sequence_size: int) -> str:
    """The packed parquet file of ``format="bridge"``: Bridge's own name for a training split,
    ``training_<packed_sequence_size>.idx.parquet``."""
    return f"training_{packed_sequence_size}.idx.parquet"


def bridge_pad_id(tokenizer: Tokenizer) -> int:
    """The id that pads sequences in Bridge's packs: the tokenizer's ``eos_token_id`` (what
    Bridge's collate pads with and strips as ``tokenizer.eos_id``), else its padding id."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int) and not isinstance(eos, bool):
        return eos
    return default_pad_token_id(tokenizer)


def _write_bridge(
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


def _gather(
    source: npt.NDArray[Any],
    path: Path,
    starts: npt.NDArray[np.int64],
    lengths: npt.NDArray[np.int64],
) -> None:
    """Write ``source[starts[i] : starts[i] + lengths[i]]`` for all ``i``, concatenated, to the
    ``.npy`` file ``path``, holding at most about :data:`_COPY_CHUNK_TOKENS` tokens at once.

    Written sequentially, not through a memory map: a full disk is an OSError, not a SIGBUS."""
    header = {"descr": np.lib.format.dtype_to_descr(source.dtype), "fortran_order": False}
    ends = np.cumsum(lengths)
    first = 0
    with name_os_errors(path), path.open("wb") as out:
        np.lib.format.write_array_header_1_0(out, {**header, "shape": source.shape})
        while first < len(lengths):
            offset = int(ends[first] - lengths[first])
            # Sequences up to the chunk's end, and always at least one.
            last = max(first + 1, int(np.searchsorted(ends, offset + _COPY_CHUNK_TOKENS, "right")))
            chunk_lengths = lengths[first:last]
            total = int(chunk_lengths.sum())
            shift = np.repeat(
                starts[first:last] - (ends[first:last] - chunk_lengths), chunk_lengths
            )
            out.write(source[shift + np.arange(offset, offset + total)].tobytes())
            first = last


def _append(
    ids_out: BinaryIO, ids: npt.NDArray[Any], mask_out: BinaryIO, mask: npt.NDArray[Any]
) -> None:
    with name_os_errors(ids_out.name):
        ids_out.write(ids.astype(np.int32).tobytes())
    with name_os_errors(mask_out.name):
        mask_out.write(mask.astype(np.uint8).tobytes())


def _save(path: Path, array: npt.NDArray[Any]) -> None:
    with name_os_errors(path):
        np.save(path, array)


# ---------------------------------------------------------------------------------- reading
def _samples(
    path: Path,
    encoder: SampleEncoder,
    vocab_size: int | None,
    newline: tuple[int, list[int]] | None = None,
) -> Iterator[tuple[int, str, npt.NDArray[np.int64], npt.NDArray[np.uint8]]]:
    """``(line number, key, input_ids, loss_mask)`` of each sample of the JSONL file."""
    with name_os_errors(path), path.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            key = f"{path.name}:{number}"
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
                raise ValueError(
                    f"sample {key}: invalid JSON ({error}); each line must be one JSON object"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"sample {key}: expected a JSON object, got {type(record).__name__}"
                )
            ids, mask = _tokens(key, record, encoder, vocab_size)
            if newline is not None and "input_ids" not in record:
                mask = _train_newline_after(ids, mask, *newline)
            yield number, key, ids, mask


def _tokens(
    key: str, record: dict[str, Any], encoder: SampleEncoder, vocab_size: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    if "input_ids" in record:
        return _pretokenised(key, record, vocab_size)
    if "input" in record and "output" in record:
        prompt, answer = record["input"], record["output"]
        if not isinstance(prompt, str) or not isinstance(answer, str):
            raise ValueError(f"sample {key}: 'input' and 'output' must be strings")
        conversation: dict[str, Any] = {
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
        }
        if "system" in record:
            conversation["system"] = record["system"]
    elif "conversations" in record:
        conversation = record
    else:
        raise ValueError(
            f"sample {key}: unknown record with keys {sorted(record)}; expected "
            "{'input', 'output'}, {'conversations'} or {'input_ids', 'loss_mask'}"
        )
    encoded = encoder.encode_sample(key, {"json": conversation})
    if encoded.media:
        raise ValueError(f"sample {key}: offline packing is text-only; remove <image>/<video>")
    return encoded.input_ids.numpy(), encoded.loss_mask.numpy().astype(np.uint8)


def _im_end_newline(tokenizer: Tokenizer) -> tuple[int, list[int]]:
    """The id of ``<|im_end|>`` and the ids of the ``\n`` the ChatML template puts after it."""
    return tokenizer.convert_tokens_to_ids("<|im_end|>"), list(tokenizer.encode("\n"))


def _train_newline_after(
    ids: npt.NDArray[np.int64], mask: npt.NDArray[np.uint8], im_end: int, newline: list[int]
) -> npt.NDArray[np.uint8]:
    """``mask`` with the ``newline`` tokens that follow each trained ``im_end`` trained too."""
    out: npt.NDArray[np.uint8] = mask.copy()
    width = len(newline)
    for t in np.flatnonzero((ids == im_end) & (mask == 1)):
        follow = ids[t + 1 : t + 1 + width]
        if len(follow) == width and follow.tolist() == newline:
            out[t + 1 : t + 1 + width] = 1
    return out


def _pretokenised(
    key: str, record: dict[str, Any], vocab_size: int | None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8]]:
    raw_ids, raw_mask = record["input_ids"], record.get("loss_mask")
    if not isinstance(raw_ids, list) or not isinstance(raw_mask, list):
        raise ValueError(
            f"sample {key}: pre-tokenised samples need lists 'input_ids' and 'loss_mask' "
            "(1 = target token)"
        )
    if not raw_ids or len(raw_ids) != len(raw_mask):
        raise ValueError(
            f"sample {key}: input_ids has {len(raw_ids)} tokens and loss_mask {len(raw_mask)}; "
            "they must be non-empty and aligned"
        )
    try:
        ids, mask = np.asarray(raw_ids), np.asarray(raw_mask)
    except (ValueError, OverflowError):
        ids = mask = np.asarray([None])  # ragged or huge values: rejected below
    if (
        ids.ndim != 1
        or ids.dtype.kind not in "iu"
        or mask.ndim != 1
        or mask.dtype.kind not in "iub"
        or not ((mask == 0) | (mask == 1)).all()
    ):
        raise ValueError(
            f"sample {key}: input_ids must be a list of ints and loss_mask of 0/1 values; "
            "fix the record"
        )
    limit = vocab_size if vocab_size is not None else _INT32_MAX + 1
    if ids.min() < 0 or ids.max() >= limit:
        bad = int(ids[(ids < 0) | (ids >= limit)][0])
        raise ValueError(
            f"sample {key}: token id {bad} is outside [0, {limit}) "
            f"({'the tokenizer vocab_size' if vocab_size is not None else 'int32'}); "
            "pass the tokenizer that made these ids"
        )
    return ids.astype(np.int64), mask.astype(np.uint8)


# --------------------------------------------------------------------------------- manifest
def _template_identity(encoder: SampleEncoder) -> dict[str, Any]:
    """The chat template's part of the tokenizer's identity: the encoding and the template's
    digest for the template encoder, nothing for ChatML (so earlier packs stay up to date)."""
    settings = encoder.settings()
    keys = ("encoding", "chat_template_sha256", "template_kwargs")
    return {key: settings[key] for key in keys if key in settings}


def _vocab_size(tokenizer: Tokenizer) -> int | None:
    size = getattr(tokenizer, "vocab_size", None)
    return size if _is_int(size) else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with name_os_errors(path), path.open("rb") as data:
        while block := data.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The manifest of ``out_dir`` (None: there is none), checked to hold every key read."""
    path = out_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    fix = "rebuild with --force or point to a new directory"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path} ({error}); {fix}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in _READABLE_FORMATS:
        raise ValueError(
            f"{path} is not an energon_pack offline manifest of format "
            f"{' or '.join(map(str, _READABLE_FORMATS))} (format_version={version!r}); {fix}"
        )
    problem = _manifest_problem(manifest)
    if problem:
        raise ValueError(f"{path} is malformed: {problem}; {fix}")
    return dict(manifest)


def _data_files(format: OfflineFormat, packed_sequence_size: int) -> tuple[str, ...]:
    """The files a pack of ``format`` holds its packs in."""
    if format == "bridge":
        return (bridge_parquet_name(packed_sequence_size),)
    return ARRAY_FILES


def _metadata_file(format: OfflineFormat, packed_sequence_size: int) -> str:
    """The packing metadata file: Bridge's ``<size>_metadata.jsonl`` (a JSON list, as Bridge
    writes it) for ``format="bridge"``, else :data:`METADATA_FILE`."""
    return f"{packed_sequence_size}_metadata.jsonl" if format == "bridge" else METADATA_FILE


def _file_record(path: Path, *, npy: bool) -> dict[str, Any]:
    """What the manifest records of a data file (``.npy`` files: also shape and dtype)."""
    facts = _array_facts(path) if npy else {"bytes": path.stat().st_size}
    return {
        **facts,
        "crc32": _crc32(path, sample=False),
        "sample_crc32": _crc32(path, sample=True),
    }


def _manifest_problem(manifest: Mapping[str, Any]) -> str | None:
    """What a manifest of a readable format lacks, or None."""
    keys: list[str] = ["spec", "tokenizer", "stats"]
    keys += ["arrays"] if manifest["format_version"] >= 2 else []
    missing = [key for key in keys if not isinstance(manifest.get(key), dict)]
    if missing:
        return f"it has no {', '.join(missing)} (JSON object{'s' if len(missing) > 1 else ''})"
    try:
        PackingSpec.from_json(manifest["spec"])
    except (TypeError, ValueError) as error:
        return f"its spec is not a PackingSpec ({error})"
    if not _is_int(manifest["tokenizer"].get("pad_token_id")):
        return "it has no int tokenizer.pad_token_id"
    if sorted(manifest["stats"]) != sorted(_STATS) or not all(
        _is_int(value) for value in manifest["stats"].values()
    ):
        return f"its stats are not the int counters {', '.join(_STATS)}"
    format = manifest.get("format", "energon_pack")
    if format not in FORMATS:
        return f"its format {format!r} is none of {', '.join(FORMATS)}"
    facts = _ARRAY_FACTS if format == "energon_pack" else _FILE_FACTS
    size = manifest["spec"]["packed_sequence_size"]
    for name in _data_files(format, size) if "arrays" in keys else ():
        record = manifest["arrays"].get(name)
        if not isinstance(record, dict) or sorted(record) != sorted(facts):
            return f"it has no arrays.{name} record with {', '.join(facts)}"
    return None


def _array_facts(path: Path) -> dict[str, Any]:
    """Size, shape and dtype of the ``.npy`` file ``path``; ValueError naming it when its size
    is not what its header describes (truncated) or it is no ``.npy`` array."""
    with path.open("rb") as data:
        try:
            version = np.lib.format.read_magic(data)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(data)
        except ValueError as error:
            raise ValueError(
                f"{path} is not a .npy array file ({error}); rebuild the pack with "
                "energon-pack offline --force"
            ) from None
        expected = data.tell() + math.prod(shape) * dtype.itemsize
        size = os.fstat(data.fileno()).st_size
    if size != expected:
        raise ValueError(
            f"{path} has {size} bytes but its header describes {expected} ({dtype} {shape}): the "
            "file is truncated or damaged; rebuild the pack with energon-pack offline --force"
        )
    return {"bytes": size, "shape": list(shape), "dtype": dtype.str}


def _crc32(path: Path, *, sample: bool) -> int:
    """CRC-32 of the file, or of :data:`_SAMPLE_BLOCKS` blocks spread over it (first and last
    included; the whole file when it is smaller than the sample)."""
    value = 0
    with path.open("rb") as data:
        size = os.fstat(data.fileno()).st_size
        spans = [(0, size)]
        if sample and size > _SAMPLE_BLOCKS * _SAMPLE_BLOCK_BYTES:
            step = (size - _SAMPLE_BLOCK_BYTES) // (_SAMPLE_BLOCKS - 1)
            spans = [(i * step, _SAMPLE_BLOCK_BYTES) for i in range(_SAMPLE_BLOCKS - 1)]
            spans.append((size - _SAMPLE_BLOCK_BYTES, _SAMPLE_BLOCK_BYTES))
        for offset, length in spans:
            data.seek(offset)
            while length > 0 and (block := data.read(min(length, _READ_BYTES))):
                value = zlib.crc32(block, value)
                length -= len(block)
    return value


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


def _read_metadata(out_dir: Path, manifest: Mapping[str, Any]) -> PackMetadata:
    """The packing metadata of the pack ``manifest`` describes (``{}``: an energon_pack one)."""
    format = manifest.get("format", "energon_pack")
    size = manifest["spec"]["packed_sequence_size"] if manifest else 0
    path = out_dir / _metadata_file(format, size)
    try:
        data = json.loads(path.read_text())
        entry = data[0] if isinstance(data, list) else data
        return PackMetadata(**{f.name: entry[f.name] for f in dataclasses.fields(PackMetadata)})
    except (OSError, json.JSONDecodeError, LookupError, TypeError) as error:
        raise ValueError(
            f"cannot read the packing metadata {path} ({error!r}); re-run energon-pack offline "
            "--force to rewrite it"
        ) from None


def _manifest_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out = _spec_differences(PackingSpec.from_json(old["spec"]), PackingSpec.from_json(new["spec"]))
    if old.get("format", "energon_pack") != new["format"]:
        out.append(
            f"format={old.get('format', 'energon_pack')!r} but the request has {new['format']!r}"
        )
    for name in ("format_version", "input_sha256", "tokenizer", "energon_pack_version"):
        if old.get(name) != new[name]:
            out.append(f"{name}={old.get(name)!r} but the request has {new[name]!r}")
    return out


def _spec_differences(built: PackingSpec, asked: PackingSpec) -> list[str]:
    return [
        f"{f.name}={getattr(built, f.name)!r} but the spec asks {getattr(asked, f.name)!r}"
        for f in dataclasses.fields(PackingSpec)
        if getattr(built, f.name) != getattr(asked, f.name)
    ]


def _stale_message(out_dir: Path, differences: list[str], *, reader: bool = False) -> str:
    fix = (
        "rebuild it with energon-pack offline --force, or read it without a spec"
        if reader
        else "rebuild with --force (force=True) or point to a new directory"
    )
    return f"pack dir {out_dir} was built with {'; '.join(differences)}; {fix}"


def _result(
    out_dir: Path, manifest: Mapping[str, Any], metadata: PackMetadata, *, reused: bool
) -> OfflinePackResult:
    return OfflinePackResult(
        out_dir=out_dir,
        reused=reused,
        metadata=metadata,
        format=manifest.get("format", "energon_pack"),
        **manifest["stats"],
    )


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with name_os_errors(tmp):
        tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
