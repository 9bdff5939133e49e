"""A plan on disk: ``plan.parquet`` (one row per pack) and ``plan.json`` (what it was built
from and with, and its counts), read back as a :class:`Plan`.

``plan.parquet`` columns, one row per pack in step order: ``pack`` (its number), ``step``,
``rank``, ``micro`` (its place among the rank's packs of the step), and per member, in row
order: ``keys`` (as the source names them: the row index as a string, Energon's
``__key__``), ``lengths`` (tokens, unpadded),
``vision_tokens`` and ``media``.

``plan.json`` (written last, so only a complete plan has one): ``format_version``,
``energon_pack_version``, ``source`` (the file, its size and SHA-256, the media root; the
data files of a saved ``datasets`` folder; an Energon dataset's split part, shards and index
digest),
``spec`` (:meth:`PlanSpec.to_json`), ``encoder`` (the tokenizer's identity, the encoding and
the encoder's settings), ``counts`` (``rows``, ``samples`` planned, ``packs``, ``steps``,
``last_step_packs``, ``tokens``, ``fill``, ``straggler``, ``straggler_floor``, ``skipped``
by kind) and ``skipped`` (every row left out: ``key``, ``kind``, ``reason``). A line index
of a JSONL source, ``rows.npy`` (``[3, rows]``: start and end byte offset, 1-based line
number), lets a reader fetch any row without reading the file. ``index/`` holds the packs of
``plan.parquet`` as arrays a loader maps without pyarrow (:class:`PackIndex`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from energon_pack.encoding.fingerprint import settings_fingerprint
from energon_pack.offline.manifest import write_json
from energon_pack.sources.files import name_os_errors

PLAN_FILE = "plan.json"
PACKS_FILE = "plan.parquet"
ROWS_FILE = "rows.npy"
INDEX_DIR = "index"
FORMAT_VERSION = 2
"""Plan layout written; 2 added ``index/``."""
_COMPARED = ("format_version", "source", "spec", "encoder")


@dataclass(frozen=True)
class Plan:
    """A whole-dataset plan: where it lies, what ``plan.json`` says, and its packs."""

    out_dir: Path
    record: Mapping[str, Any]
    """The contents of ``plan.json``."""
    reused: bool = False
    """Whether an up-to-date plan already in ``out_dir`` was returned."""

    @classmethod
    def read(cls, out_dir: str | Path) -> Plan:
        """The plan in ``out_dir``; a ValueError names the directory when it holds none."""
        out_dir = Path(out_dir)
        record = read_record(out_dir)
        if record is None:
            raise ValueError(
                f"{out_dir} holds no plan ({PLAN_FILE} is missing: not a plan directory, or "
                "an interrupted build); run energon-pack plan again"
            )
        return cls(out_dir, record)

    @property
    def counts(self) -> Mapping[str, Any]:
        """Rows, samples, packs, steps, fill, straggler ratio, skipped by kind, ..."""
        counts: Mapping[str, Any] = self.record["counts"]
        return counts

    @property
    def packs(self) -> int:
        """Packs in the plan (each one row of micro-batch 1)."""
        return int(self.counts["packs"])

    @property
    def steps(self) -> int:
        """Optimizer steps of one epoch (the last may hold fewer packs)."""
        return int(self.counts["steps"])

    def table(self) -> Any:
        """``plan.parquet`` as a ``pyarrow.Table``."""
        import pyarrow.parquet as pq

        path = self.out_dir / PACKS_FILE
        with name_os_errors(path):
            return pq.read_table(path)

    def summary(self) -> str:
        """One line: samples, packs, steps, fill, straggler ratio and skipped rows."""
        counts = self.counts
        skipped = counts["skipped"]
        left_out = ", ".join(f"{n} {kind}" for kind, n in skipped.items() if n) or "none"
        straggler = counts["straggler"]
        balance = "n/a" if straggler is None else f"{straggler:.3f}"
        floor = counts["straggler_floor"]
        floor_text = "" if floor is None else f" (floor {floor:.3f})"
        return (
            f"{counts['samples']} samples -> {counts['packs']} packs in {counts['steps']} "
            f"steps, fill {counts['fill']:.4f}, straggler {balance}{floor_text} at "
            f"{self.record['spec']['data_parallel_size']} ranks; skipped: {left_out}"
        )


def read_record(out_dir: Path) -> dict[str, Any] | None:
    """``out_dir``'s ``plan.json`` (None when there is none); a ValueError when unreadable."""
    path = out_dir / PLAN_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}); rebuild the plan with --force"
        ) from None
    if not isinstance(record, dict) or not all(key in record for key in (*_COMPARED, "counts")):
        raise ValueError(f"{path} is not a plan record; rebuild the plan with --force")
    return record


def differences(built: Mapping[str, Any], asked: Mapping[str, Any]) -> list[str]:
    """Every setting (dotted name) where the plan ``built`` differs from the request."""
    old = settings_fingerprint({name: built.get(name) for name in _COMPARED})
    new = settings_fingerprint({name: asked.get(name) for name in _COMPARED})
    return [
        f"{name}={old.get(name)!r} but the request has {new.get(name)!r}"
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    ]


def write_packs(
    path: Path,
    groups: list[list[int]],
    columns: Mapping[str, Any],
    step: Any,
    rank: Any,
    micro: Any,
) -> None:
    """``plan.parquet``: the packs in step order (then rank, then micro-batch)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    order = np.lexsort((np.asarray(micro), np.asarray(rank), np.asarray(step)))
    members = [groups[p] for p in order.tolist()]
    flat = np.fromiter((i for group in members for i in group), dtype=np.int64)
    offsets = np.zeros(len(members) + 1, dtype=np.int32)
    np.cumsum([len(group) for group in members], out=offsets[1:])

    def per_member(values: Any, kind: Any) -> Any:
        return pa.ListArray.from_arrays(offsets, pa.array(values[flat], kind))

    table = pa.table(
        {
            "pack": pa.array(order, pa.int64()),
            "step": pa.array(np.asarray(step)[order], pa.int64()),
            "rank": pa.array(np.asarray(rank)[order], pa.int32()),
            "micro": pa.array(np.asarray(micro)[order], pa.int32()),
            "keys": per_member(columns["key"].astype(str), pa.string()),
            "lengths": per_member(columns["length"], pa.int64()),
            "vision_tokens": per_member(columns["vision_tokens"], pa.int64()),
            "media": per_member(columns["media"], pa.int64()),
        }
    )
    with name_os_errors(path):
        pq.write_table(table, path)
    vision = np.add.reduceat(columns["vision_tokens"][flat], offsets[:-1]) if len(flat) else flat
    keys = [str(key).encode() for key in columns["key"][flat]]
    arrays: dict[str, npt.NDArray[np.int64] | npt.NDArray[np.uint8]] = {
        "packs": np.stack(
            [order, *(np.asarray(v)[order] for v in (step, rank, micro)), vision]
        ).astype(np.int64),
        "member_starts": offsets.astype(np.int64),
        "keys": np.frombuffer(b"".join(keys), dtype=np.uint8),
        "key_starts": np.cumsum([0, *map(len, keys)], dtype=np.int64),
    }
    index = path.parent / INDEX_DIR
    index.mkdir(exist_ok=True)
    for name, values in arrays.items():
        with name_os_errors(index / f"{name}.npy"):
            np.save(index / f"{name}.npy", values)


@dataclass(frozen=True)
class PackIndex:
    """The packs of a plan (``index/`` of its directory), in ``plan.parquet``'s order, mapped
    from disk: ``packs`` is ``[5, P]`` (pack number, step, rank, micro-batch, vision tokens);
    pack ``p``'s members are ``member_starts[p]:member_starts[p + 1]``, member ``m``'s key the
    UTF-8 bytes ``keys[key_starts[m]:key_starts[m + 1]]``. Nothing in it is a Python object per
    pack or key, so forked loader workers share it without copying."""

    packs: npt.NDArray[np.int64]
    member_starts: npt.NDArray[np.int64]
    keys: npt.NDArray[np.uint8]
    key_starts: npt.NDArray[np.int64]

    @classmethod
    def read(cls, out_dir: Path) -> PackIndex:
        """The index of the plan in ``out_dir``; a ValueError names the directory when it has
        none, and the file when an array is not what the plan wrote (its shape, type, or
        offsets that do not run in order over the next array)."""
        index = out_dir / INDEX_DIR
        if not (index / "packs.npy").is_file():
            raise ValueError(
                f"plan {out_dir} has no {INDEX_DIR}/ (a plan written before format 2, or an "
                "interrupted build); plan it again with --force"
            )
        packs = load_array(out_dir, f"{INDEX_DIR}/packs.npy", np.int64, 2)
        member_starts = load_array(out_dir, f"{INDEX_DIR}/member_starts.npy", np.int64, 1)
        keys = load_array(out_dir, f"{INDEX_DIR}/keys.npy", np.uint8, 1)
        key_starts = load_array(out_dir, f"{INDEX_DIR}/key_starts.npy", np.int64, 1)
        if packs.shape[0] != 5 or (packs[1:] < 0).any():
            bad_array(out_dir, f"{INDEX_DIR}/packs.npy", "not 5 rows of numbers >= 0")
        members = len(key_starts) - 1
        _check_offsets(out_dir, "member_starts", member_starts, packs.shape[1], members)
        _check_offsets(out_dir, "key_starts", key_starts, None, len(keys))
        return cls(packs, member_starts, keys, key_starts)

    def members(self, pack: int) -> list[str]:
        """The keys of the members of pack row ``pack`` (``plan.parquet``'s order)."""
        first, last = int(self.member_starts[pack]), int(self.member_starts[pack + 1])
        starts = (self.key_starts[first : last + 1] - self.key_starts[first]).tolist()
        blob = bytes(self.keys[int(self.key_starts[first]) : int(self.key_starts[last])])
        try:
            return [blob[a:b].decode() for a, b in itertools.pairwise(starts)]
        except UnicodeDecodeError as error:
            raise ValueError(
                f"pack {pack}: its member keys in {INDEX_DIR}/keys.npy are not UTF-8 ({error}); "
                "the plan is damaged: plan it again with --force"
            ) from None


def load_array(out_dir: Path, name: str, dtype: type[np.generic], ndim: int) -> Any:
    """The ``.npy`` array ``name`` of the plan in ``out_dir``, mapped from disk; a ValueError
    names it when it is no array of ``dtype`` with ``ndim`` dimensions (a cut or damaged
    file)."""
    path = out_dir / name
    with name_os_errors(path):
        try:
            array = np.load(path, mmap_mode="r")
        except OSError:
            raise
        except Exception as error:  # numpy's header parser raises many types for a bad header
            bad_array(out_dir, name, f"not an array numpy reads ({type(error).__name__}: {error})")
    if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != ndim:
        bad_array(out_dir, name, f"not a {ndim}-d {np.dtype(dtype).name} array")
    return array


def _check_offsets(out_dir: Path, name: str, starts: Any, count: int | None, end: int) -> None:
    """``starts`` must run from 0 to ``end`` without going back, with ``count + 1`` entries."""
    if (
        len(starts) == 0
        or (count is not None and len(starts) != count + 1)
        or starts[0] != 0
        or starts[-1] != end
        or (np.diff(starts) < 0).any()
    ):
        bad_array(out_dir, f"{INDEX_DIR}/{name}.npy", f"not offsets running from 0 to {end}")


def bad_array(out_dir: Path, name: str, what: str) -> NoReturn:
    """The ValueError of a plan file ``name`` in ``out_dir`` that is ``what``."""
    raise ValueError(
        f"plan {out_dir}: {name} is {what}; the plan is damaged or cut: plan it again with --force"
    )


def write_rows(path: Path, index: Any) -> None:
    with name_os_errors(path):
        np.save(path, index)


def write_record(out_dir: Path, record: Mapping[str, Any]) -> None:
    write_json(out_dir / PLAN_FILE, record)
