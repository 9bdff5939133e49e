"""What an offline pack is asked for and what it reports: :class:`PackingSpec`,
:class:`PackMetadata`, :class:`OfflinePackResult`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from energon_pack.packing.row_layout import (
    OverlongPolicy,
    RowLayout,
    fixed_width_problem,
    multiple_problem,
)
from energon_pack.packing.topology import pad_seq_to_mult

Algorithm = Literal["bfd", "ffd"]
OfflineFormat = Literal["energon_pack", "bridge"]
"""What :func:`pack_offline` writes: this package's ``.npy`` arrays (read by
:class:`PackedDataset`) or Megatron-Bridge's packed parquet (read by its
``GPTSFTPackedParquetDataset`` through ``PackedSequenceSpecs``)."""
FORMATS: tuple[OfflineFormat, ...] = ("energon_pack", "bridge")


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


STATS = ("samples", "sequences", "packs", "tokens", "skipped", "truncated", "split_packs")


@dataclass(frozen=True)
class PackingSpec:
    """What an offline pack is built with; :func:`pack_offline` and :class:`PackedDataset`
    check it against the directory's manifest.

    Args:
        packed_sequence_size: tokens per pack (the training ``seq_length``).
        pad_seq_to_mult: each sequence is padded to a multiple of this (see
            :func:`~energon_pack.pad_seq_to_mult`); packing counts the padded lengths.
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
        train_newline_after_im_end: also train the ``\\n`` that follows each trained
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
            if not is_int(value) or value < 1:
                out.append(f"{name} must be a positive int, got {value!r}")
        if self.max_segments is not None and (
            not is_int(self.max_segments) or self.max_segments < 1
        ):
            out.append(
                f"max_segments must be a positive int or None (no limit), got {self.max_segments!r}"
            )
        if not is_int(self.seed):
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
        """The :class:`~energon_pack.RowLayout` of the packs (Megatron-Bridge's
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
    tokenizer: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The manifest's record of the tokenizer: its identity and which encoder counted the
    tokens (``encoding``: ``"template"`` or ``"chatml"``, ``system_prompt``, the template's
    ``chat_template_sha256``; :func:`~energon_pack.encoding.describe.encoding_record`)."""

    @property
    def files(self) -> list[Path]:
        """The packed data and metadata files, as a trainer is pointed at them."""
        size = self.metadata.pack_size
        return [
            self.out_dir / name
            for name in (*data_files(self.format, size), metadata_file(self.format, size))
        ]

    def stats_json(self) -> dict[str, int]:
        """The counters, as stored in the manifest."""
        return {name: getattr(self, name) for name in STATS}


def bridge_parquet_name(packed_sequence_size: int) -> str:
    """The packed parquet file of ``format="bridge"``: Bridge's own name for a training split,
    ``training_<packed_sequence_size>.idx.parquet``."""
    return f"training_{packed_sequence_size}.idx.parquet"


def data_files(format: OfflineFormat, packed_sequence_size: int) -> tuple[str, ...]:
    """The files a pack of ``format`` holds its packs in."""
    if format == "bridge":
        return (bridge_parquet_name(packed_sequence_size),)
    return ARRAY_FILES


def metadata_file(format: OfflineFormat, packed_sequence_size: int) -> str:
    """The packing metadata file: Bridge's ``<size>_metadata.jsonl`` (a JSON list, as Bridge
    writes it) for ``format="bridge"``, else :data:`METADATA_FILE`."""
    return f"{packed_sequence_size}_metadata.jsonl" if format == "bridge" else METADATA_FILE


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
