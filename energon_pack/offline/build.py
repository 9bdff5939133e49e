"""Building an offline pack: :func:`pack_offline` writes a packed directory from a JSONL file
(or a file holding one JSON array of samples).

The packing itself is out of core: pass 1 streams the input and appends each sequence's tokens
to temporary files while only the lengths stay in memory; pass 2 packs the lengths (best or
first fit decreasing); pass 3 copies the sequences in pack order from the memory-mapped
temporary files into the final arrays, a bounded chunk at a time.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.metadata
import logging
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.chatml import ByteTokenizer, SampleEncoder, Tokenizer
from energon_pack.encoding.describe import encoding_record
from energon_pack.encoding.fingerprint import tokenizer_identity
from energon_pack.encoding.template import make_encoder
from energon_pack.offline.bridge import bridge_pad_id, write_bridge
from energon_pack.offline.inputs import im_end_newline, read_samples, tokenizer_vocab_size
from energon_pack.offline.manifest import (
    FORMAT_VERSION,
    damaged_message,
    file_record,
    manifest_differences,
    metadata_record,
    name_os_errors,
    read_manifest,
    read_metadata,
    reuse_problems,
    sha256,
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
from energon_pack.packing.bins import OVERLONG_FIX, best_fit_decreasing, first_fit_decreasing
from energon_pack.packing.row_layout import (
    RowLayout,
)

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
) -> OfflinePackResult:
    """Tokenise and pack ``input_path`` into ``out_dir`` (see the module docstring): a JSONL
    file, one sample per line, or a file holding one JSON array of samples (read whole); each
    sample is a prompt/answer pair, a pre-tokenised one, or any text conversation the collator
    reads (:mod:`energon_pack.offline`).

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
    if not input_path.is_file():
        raise ValueError(
            f"input {input_path} is not a file; pass a JSONL file of samples (or a JSON file "
            "holding one array of samples)"
        )
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
        "input_sha256": sha256(input_path),
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
        counts, metadata = _build(
            input_path, out_dir, spec, encoder, explicit=tokenizer is not None, format=format
        )
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
    vocab_size = tokenizer_vocab_size(tokenizer) if explicit else None
    newline = im_end_newline(tokenizer) if spec.train_newline_after_im_end else None
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
        for line, key, ids, mask in read_samples(input_path, encoder, vocab_size, newline):
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
        write_bridge(
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
