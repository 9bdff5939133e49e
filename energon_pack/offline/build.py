"""Building an offline pack: :func:`pack_offline` writes a packed directory from a source of
text samples (a JSONL file, a JSON array, a Parquet file, a saved ``datasets`` folder or a
Megatron-Energon dataset).

The packing itself is out of core: pass 1 tokenises the source's partitions (in this process,
or on Ray Data's workers) and appends each sequence's tokens to temporary files as its
partition comes back, while only the lengths and offsets stay in memory; pass 2 packs the
lengths (best or first fit decreasing) in the source's order, whatever order the partitions
came back in; pass 3 copies the sequences in pack order from the memory-mapped temporary files
into the final arrays, a bounded chunk at a time.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import importlib.metadata
import json
import logging
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from energon_pack.checks import check_choice
from energon_pack.encoding.chatml import ByteTokenizer, Tokenizer
from energon_pack.encoding.describe import encoding_record
from energon_pack.encoding.fingerprint import tokenizer_identity
from energon_pack.encoding.template import make_encoder
from energon_pack.offline.bridge import bridge_pad_id, write_bridge
from energon_pack.offline.inputs import im_end_newline, tokenizer_vocab_size
from energon_pack.offline.manifest import (
    FORMAT_VERSION,
    damaged_message,
    file_record,
    manifest_differences,
    metadata_record,
    read_manifest,
    read_metadata,
    reuse_problems,
    stale_message,
    tokenizer_content,
    write_json,
)
from energon_pack.offline.spec import (
    FORMATS,
    MANIFEST_FILE,
    OfflineFormat,
    OfflinePackResult,
    PackingSpec,
    PackMetadata,
    bridge_parquet_name,
    data_files,
    metadata_file,
)
from energon_pack.offline.tokenise import PartitionTokeniser
from energon_pack.packing.bins import OVERLONG_FIX, best_fit_decreasing, first_fit_decreasing
from energon_pack.packing.row_layout import RowLayout
from energon_pack.sources.energon import EnergonSource
from energon_pack.sources.engine import ENGINES, Engine, run_partitions
from energon_pack.sources.files import name_os_errors, sha256
from energon_pack.sources.rows import JsonSource, ParquetSource, Source, open_source

logger = logging.getLogger("energon_pack.offline")


_TMP_IDS = ".input_ids.tmp"
_TMP_MASK = ".loss_mask.tmp"
_COPY_CHUNK_TOKENS = 1 << 22
"""Most tokens gathered in memory at once while writing the arrays in pack order."""


def pack_offline(
    input_path: str | Path,
    out_dir: str | Path,
    spec: PackingSpec,
    tokenizer: Tokenizer | None = None,
    *,
    force: bool = False,
    format: OfflineFormat = "energon_pack",
    split: str = "train",
    engine: Engine = "local",
    ray_address: str | None = None,
    progress: bool = False,
) -> OfflinePackResult:
    """Tokenise and pack ``input_path`` into ``out_dir`` (see the module docstring): a JSONL
    file, one sample per line, a file holding one JSON array of samples (read whole), a
    ``.parquet`` file whose columns are the samples' fields, a folder ``datasets`` saved
    (``save_to_disk``; its ``split`` when it holds a ``DatasetDict``) or a Megatron-Energon
    dataset (its ``split`` part, read by Energon as the loaders read it); each sample is a
    prompt/answer pair, a pre-tokenised one, or any text conversation the collator reads
    (:mod:`energon_pack.offline`).

    ``engine="ray"`` tokenises on Ray Data (a local Ray with every core, or the cluster at
    ``ray_address``; the ``ray`` extra), ``"local"`` in this process; both write the same
    packs. ``progress`` shows a progress bar on stderr while the samples are tokenised.

    ``format="bridge"`` writes Megatron-Bridge's packed parquet instead of the ``.npy`` arrays
    (see :func:`bridge_parquet_name`); packs then fill ``packed_sequence_size`` with the tokens
    Bridge feeds, ``L - 1`` per sequence of ``L`` (the last token is only a label).

    ``tokenizer`` is HF-style (``encode``, ``convert_tokens_to_ids``; ``pad_token_id`` is used
    for padding when present) or None for :class:`~energon_pack.ByteTokenizer`; with an
    explicit tokenizer, pre-tokenised ids are checked against its ``vocab_size``. The encoder
    is :func:`~energon_pack.make_encoder`'s (``"auto"``: the chat template when the tokenizer
    has one, else ChatML, with a :class:`~energon_pack.PackingWarning`); the manifest's
    ``tokenizer`` records which (:func:`~energon_pack.encoding.describe.encoding_record`:
    ``encoding``, ``system_prompt``, the template's digest), as does the result. If ``out_dir``
    already holds a pack with the same manifest (spec, format, input sha256, tokenizer identity
    and content, template) whose files are still as built, it is reused; a different one, or
    files changed since (a cut parquet, an edited metadata file), is refused with a ValueError
    naming what differs. ``force`` always rebuilds in place (other files in
    ``out_dir`` are left alone). A failing read or write (full disk, read-only or missing
    folder, ...) raises the OSError with the path it concerns.
    """
    input_path, out_dir = Path(input_path), Path(out_dir)
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(map(repr, FORMATS))}, got {format!r}")
    check_choice("engine", engine, ENGINES)
    if not input_path.exists():
        raise ValueError(
            f"input {input_path} does not exist; pass a JSONL file of samples (or a JSON file "
            "holding one array of samples, a Parquet file, a saved datasets folder or an "
            "Energon dataset)"
        )
    source = open_source(input_path, split=split)
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out_dir))
    tok: Tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    encoder = make_encoder(tok)
    manifest = {
        "format_version": FORMAT_VERSION,
        "energon_pack_version": importlib.metadata.version("energon_pack"),
        "spec": spec.to_json(),
        "tokenizer": {**tokenizer_identity(tok), **encoding_record(encoder)},
        "tokenizer_content": tokenizer_content(tok),
        "input_sha256": source_digest(source),
        "format": format,
    }
    existing = None if force else read_manifest(out_dir)
    if existing is not None:
        differences = manifest_differences(existing, manifest)
        if differences:
            raise ValueError(stale_message(out_dir, differences))
        problems = reuse_problems(out_dir, existing)
        if problems:
            raise ValueError(damaged_message(out_dir, problems))
        logger.info("reusing the up-to-date pack in %s", out_dir)
        return _result(out_dir, existing, read_metadata(out_dir, existing), reused=True)
    if not force and out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(
            f"out dir {out_dir} is not empty and has no {MANIFEST_FILE} (an interrupted build "
            "or other files); pass force=True (--force) to build there, or choose an empty or "
            "new directory"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # incomplete until the manifest is back
    try:
        tokeniser = PartitionTokeniser(
            encoder,
            tokenizer_vocab_size(tok) if tokenizer is not None else None,
            im_end_newline(tok) if spec.train_newline_after_im_end else None,
        )
        shown = len(source) if progress else None
        partitions = source.partitions()
        worked = run_partitions(partitions, tokeniser, engine, ray_address, shown, "tokenising")
        pad_id = bridge_pad_id(tok) if format == "bridge" else 0
        counts, metadata = _build(source, worked, out_dir, spec, format=format, pad_id=pad_id)
    finally:
        for name in (_TMP_IDS, _TMP_MASK):
            (out_dir / name).unlink(missing_ok=True)
    manifest["stats"] = counts
    size = spec.packed_sequence_size
    manifest["arrays"] = {
        name: file_record(out_dir / name, npy=format == "energon_pack")
        for name in data_files(format, size)
    }
    metadata_path = out_dir / metadata_file(format, size)
    write_json(metadata_path, [dataclasses.asdict(metadata)])
    manifest["metadata"] = metadata_record(metadata_path, metadata)
    write_json(out_dir / MANIFEST_FILE, {**manifest, "input_path": str(input_path.resolve())})
    return _result(out_dir, manifest, metadata, reused=False)


# --------------------------------------------------------------------------------- building
def _build(
    source: Source,
    worked: Iterable[tuple[int, dict[str, npt.NDArray[Any]]]],
    out_dir: Path,
    spec: PackingSpec,
    *,
    format: OfflineFormat,
    pad_id: int,
) -> tuple[dict[str, int], PackMetadata]:
    """The three passes over the tokenised partitions; returns the counters and the
    metadata (``pad_id`` pads Bridge's sequences)."""
    size = spec.packed_sequence_size
    bridge = format == "bridge"
    # What fits a pack depends on the size and the multiple only (the slots come later).
    fits = RowLayout(size, spec.pad_seq_to_mult)
    # An Energon source's keys are kept to name the samples Energon could not load.
    spill = _Spill(fits, spec.overlong, bridge, [] if isinstance(source, EnergonSource) else None)
    # Pass 1: spill each partition's tokens to disk as it comes back; only numbers, offsets
    # and lengths stay in memory. Each file's close (its last write) names it on failure.
    ids_path, mask_path = out_dir / _TMP_IDS, out_dir / _TMP_MASK
    with (
        name_os_errors(ids_path),
        ids_path.open("wb") as ids_out,
        name_os_errors(mask_path),
        mask_path.open("wb") as mask_out,
    ):
        for _, columns in worked:
            spill.add(columns, ids_out, mask_out)
    if isinstance(source, EnergonSource) and spill.samples < len(source):
        _refuse_lost(source, set(spill.keys or ()))
    lengths, written = spill.lengths, spill.written
    if not lengths:
        raise ValueError(
            f"input {source.path} gave no sequences to pack ({spill.samples} samples read, "
            f"{spill.skipped} skipped as overlong); check the file, or the size and --overlong"
        )
    if spill.truncated:
        logger.warning("truncated %d sample(s) to packed_sequence_size=%d", spill.truncated, size)
    # The sequences in the source's order, whatever order their partitions came back in.
    number = np.concatenate(spill.numbers)
    by_number = np.argsort(number, kind="stable")
    src_lengths = np.asarray(lengths, dtype=np.int64)[by_number]
    src_starts = np.asarray(spill.starts, dtype=np.int64)[by_number]
    lines = number[by_number]
    if isinstance(source, EnergonSource):  # Energon's order, numbered from 1
        lines = np.arange(1, len(lines) + 1, dtype=np.int64)
    # Pass 2: pack the lengths (Bridge's: the tokens it feeds, L - 1).
    packed = [fits.bridge_span(int(n)) for n in src_lengths] if bridge else src_lengths.tolist()
    groups, split_packs = _pack(packed, spec)
    # Pass 3: write the arrays in pack order.
    order = np.fromiter((i for group in groups for i in group), dtype=np.int64, count=len(lengths))
    seq_lengths = src_lengths[order]
    seq_starts = np.concatenate(([0], np.cumsum(seq_lengths)[:-1]))
    pack_starts = np.cumsum([0, *(len(group) for group in groups)], dtype=np.int64)
    spilled = [
        np.memmap(out_dir / tmp, dtype=dtype, mode="r", shape=(written,))
        for tmp, dtype in ((_TMP_IDS, np.int32), (_TMP_MASK, np.uint8))
    ]
    if bridge:
        write_bridge(
            out_dir / bridge_parquet_name(size),
            fits,
            spilled,
            groups,
            src_starts,
            src_lengths,
            pad_id,
        )
        metadata = PackMetadata.compute(np.asarray(packed)[order], pack_starts, size)
    else:
        for tokens, name in zip(spilled, ("input_ids", "loss_mask"), strict=True):
            _gather(tokens, out_dir / f"{name}.npy", src_starts[order], seq_lengths)
        _save(out_dir / "seq_starts.npy", seq_starts)
        _save(out_dir / "seq_lengths.npy", seq_lengths.astype(np.int32))
        _save(out_dir / "seq_lines.npy", lines[order])
        _save(out_dir / "pack_starts.npy", pack_starts)
        metadata = PackMetadata.compute(seq_lengths, pack_starts, size)
    del spilled
    counts = {
        "samples": spill.samples,
        "sequences": len(lengths),
        "packs": len(groups),
        "tokens": written,
        "skipped": spill.skipped,
        "truncated": spill.truncated,
        "split_packs": split_packs,
    }
    logger.info("packed %d sequences into %d packs in %s", len(lengths), len(groups), out_dir)
    return counts, metadata


@dataclasses.dataclass
class _Spill:
    """Pass 1's account: each tokenised partition's sequences appended to the temporary files
    (an overlong one stopped, skipped or truncated as ``overlong`` says), with what stays in
    memory: each kept sequence's number in the source, offset and length, and every sample's
    key when ``keys`` is a list."""

    fits: RowLayout
    overlong: str
    bridge: bool
    keys: list[str] | None
    numbers: list[npt.NDArray[np.int64]] = dataclasses.field(default_factory=list)
    starts: list[int] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    written: int = 0
    samples: int = 0
    skipped: int = 0
    truncated: int = 0

    def add(
        self, columns: dict[str, npt.NDArray[Any]], ids_out: BinaryIO, mask_out: BinaryIO
    ) -> None:
        """Spill one partition's :data:`~energon_pack.offline.tokenise.TOKEN_COLUMNS`."""
        # Bridge feeds L - 1 tokens of a stored sequence of L: one more token is stored.
        keep = self.fits.capacity + 1 if self.bridge else self.fits.seq_length
        self.samples += len(columns["number"])
        kept = []
        for position, (key, ids, mask) in enumerate(
            zip(columns["key"], columns["ids"], columns["mask"], strict=True)
        ):
            if self.keys is not None:
                self.keys.append(key)
            if self.bridge and len(ids) < 2:
                raise ValueError(
                    f"sample {key} has {len(ids)} token; Megatron-Bridge trains on L - 1 tokens "
                    "of a sequence of L, so format='bridge' needs at least 2; drop the sample"
                )
            reason = self.fits.overlong(key, len(ids) - 1 if self.bridge else len(ids))
            if reason is not None:
                if self.overlong == "error":
                    fix = f"{OVERLONG_FIX} (or 'truncate' to cut them; --overlong)"
                    raise ValueError(f"{reason}; {fix}")
                if self.overlong == "skip":
                    self.skipped += 1
                    logger.warning("skipping: %s", reason)
                    continue
                self.truncated += 1
                ids, mask = ids[:keep], mask[:keep]
            _append(ids_out, ids, mask_out, mask)
            kept.append(position)
            self.starts.append(self.written)
            self.lengths.append(len(ids))
            self.written += len(ids)
        self.numbers.append(columns["number"][kept])


def source_digest(source: Source) -> str:
    """What the manifest's ``input_sha256`` holds: a file's SHA-256; for a folder (a saved
    ``datasets`` folder, an Energon dataset), the SHA-256 of its fingerprint without its path
    (its data files' sizes and digests, an Energon split part, shards and index digest)."""
    if isinstance(source, JsonSource):
        return source.sha256
    if isinstance(source, ParquetSource):
        return sha256(source.path)
    facts = {k: v for k, v in source.fingerprint().items() if k not in ("path", "media_root")}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def _refuse_lost(source: EnergonSource, seen: set[str]) -> None:
    """A ValueError naming the samples of ``source`` that Energon could not load."""
    lost = source.missing(seen)
    if lost:
        raise ValueError(
            f"Energon could not load {len(lost)} sample(s) of {source.path} (the first: "
            f"{lost[0]!r}; its error is in the log); fix or exclude them, nothing was written"
        )


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


def _result(
    out_dir: Path, manifest: Mapping[str, Any], metadata: PackMetadata, *, reused: bool
) -> OfflinePackResult:
    return OfflinePackResult(
        out_dir=out_dir,
        reused=reused,
        metadata=metadata,
        format=manifest.get("format", "energon_pack"),
        tokenizer=dict(manifest["tokenizer"]),
        **manifest["stats"],
    )
