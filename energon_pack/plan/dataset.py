"""Training from a plan: :class:`PlannedDataset`, a map-style dataset whose item ``i`` is pack
``i`` of a plan, built by :class:`~energon_pack.VLMPackingCollator` from its members.

Members are read by random access: a JSONL row through the plan's line index (``rows.npy``), a
JSON array's item, a Parquet row (its row group), a saved ``datasets`` row, an Energon sample
through Energon's sample index (prepared as the online loaders prepare it). Media are read and
decoded only for the pack asked for. The dataset's order is the plan's steps, each step's packs
by micro-batch and then rank, so that a sampler that deals consecutive indices over the ranks
(Megatron's) gives each rank the packs the plan assigned to it.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
import torch

from energon_pack.checks import check_choice
from energon_pack.collate.batch import CollatedBatch
from energon_pack.collate.collator import VLMPackingCollator
from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.encoding.family import Family
from energon_pack.encoding.fingerprint import settings_fingerprint
from energon_pack.formats.chat_rows import read_media_paths
from energon_pack.memory.monitor import NO_BUFFER, MonitorConfig, RSSMonitor
from energon_pack.offline.inputs import conversation_sample, pretokenised, tokenizer_vocab_size
from energon_pack.packing.mrope import MRopeConfig, PositionIds
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row_layout import RowLayout
from energon_pack.plan.build import encoder_identity
from energon_pack.plan.store import PLAN_FILE, ROWS_FILE, PackIndex, Plan, bad_array, load_array
from energon_pack.sources.energon import EnergonSamples, EnergonSource
from energon_pack.sources.files import name_os_errors
from energon_pack.sources.rows import (
    JsonSource,
    ParquetSource,
    SavedDatasetSource,
    Source,
    load_saved,
    open_source,
)

logger = logging.getLogger("energon_pack.plan")

PlanOutput = Literal["batch", "hf", "bridge"]
"""What :class:`PlannedDataset` gives per pack: a CollatedBatch, transformers' model inputs, or
Megatron-Bridge's batch dict."""
_SINGLE = "VLMPackingCollator got a micro-batch of 1 sample"
"""The collator's warning for a one-sample micro-batch (a pack of one sample is planned)."""


@dataclass(frozen=True)
class PlanOrder:
    """The packs of a plan in the dataset's order, and what a sampler needs of them.

    ``step``, ``rank`` and ``vision`` hold, per dataset index, the plan's step and rank of the
    pack and its vision tokens; indices run step by step, each step's packs by micro-batch then
    rank. ``data_parallel_size``, ``global_batch_size``, ``balance`` and ``seed`` are the
    plan's settings.
    """

    step: npt.NDArray[np.int64]
    rank: npt.NDArray[np.int64]
    vision: npt.NDArray[np.int64]
    data_parallel_size: int
    global_batch_size: int
    balance: bool
    seed: int

    def __len__(self) -> int:
        return len(self.step)

    def steps(self) -> list[list[int]]:
        """The dataset indices of each of the plan's steps, in order."""
        bounds = np.flatnonzero(np.diff(self.step)) + 1
        return [part.tolist() for part in np.split(np.arange(len(self.step)), bounds)]

    def steps_per_epoch(self, global_batch_size: int | None = None) -> int:
        """Optimizer steps of one epoch at ``global_batch_size`` packs per step (default: the
        plan's); the last may hold fewer."""
        per_step = global_batch_size or self.global_batch_size
        return math.ceil(len(self) / per_step)


def plan_order(plan: Plan) -> tuple[PlanOrder, PackKeys]:
    """The :class:`PlanOrder` of ``plan`` and the member keys of each pack in that order (read
    from the plan's ``index/``, mapped from disk)."""
    index = PackIndex.read(plan.out_dir)
    if index.packs.shape[1] != plan.packs:
        raise ValueError(
            f"plan {plan.out_dir}: its index holds {index.packs.shape[1]} packs but "
            f"{PLAN_FILE} counts {plan.packs}; plan it again with --force"
        )
    _, step, rank, micro, vision = (np.asarray(row) for row in index.packs)
    order = np.lexsort((rank, micro, step))
    spec = plan.record["spec"]
    planned = PlanOrder(
        step=step[order],
        rank=rank[order],
        vision=vision[order],
        data_parallel_size=int(spec["data_parallel_size"]),
        global_batch_size=int(spec["global_batch_size"]),
        balance=bool(spec["vision"].get("vision_balance", False)),
        seed=int(spec["seed"]),
    )
    return planned, PackKeys(index, order)


class PackKeys:
    """The member keys of each pack in the dataset's order: ``keys[i]`` is pack ``i``'s list,
    decoded from the plan's index on each read (no list per pack is held)."""

    def __init__(self, index: PackIndex, rows: npt.NDArray[np.int64]) -> None:
        self.index, self.rows = index, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, pack: int) -> list[str]:
        if not -len(self.rows) <= pack < len(self.rows):
            raise IndexError(f"pack {pack} is out of range for {len(self.rows)} packs")
        return self.index.members(int(self.rows[pack]))

    def __iter__(self) -> Iterator[list[str]]:
        return (self[pack] for pack in range(len(self.rows)))


class PlannedDataset(torch.utils.data.Dataset[Any]):
    """The packs of the plan in ``plan_dir`` as a map-style dataset: ``len()`` is the number
    of packs, item ``i`` the packed row of pack ``i`` (with ``output="batch"`` a
    :class:`~energon_pack.CollatedBatch` of one row, its ``keys`` the members; with
    ``output="hf"`` the transformers model inputs, with ``output="bridge"`` the dict
    Megatron-Bridge's VLM step reads), equal to what
    :class:`~energon_pack.VLMPackingCollator` builds from the same samples in the same order.

    ``encoder`` / ``family`` / ``position_ids`` / ``hf_model`` are the collator's; the
    encoder must be the one the plan was measured with (tokenizer, template, family, media
    settings), else a ValueError names what differs. The row layout is the plan's. The source
    must be the one planned (``check_source``: its fingerprint, the file's SHA-256 included, is
    compared once here). ``media_root`` defaults to the plan's.

    Members are read by random access (JSON, JSONL, Parquet and saved ``datasets`` rows, or an
    Energon dataset's samples through its sample index). A member whose media fail is skipped
    (logged, in the row's ``skipped_keys``) and the row is built from the others; so is a
    member that cannot be read.

    ``monitor``: an :class:`~energon_pack.RSSMonitor` in each process that reads packs (each
    loader worker), reporting and warning as the online loaders' do (its report's bin fill is
    the plan's).
    """

    packed_rows: ClassVar[bool] = True
    """Each item is a packed micro-batch already (``check_trainer`` reads it)."""

    def __init__(
        self,
        plan_dir: str | Path,
        encoder: SampleEncoder | None = None,
        *,
        family: Family | str | Any = None,
        position_ids: PositionIds | MRopeConfig = "1d",
        output: PlanOutput = "batch",
        hf_model: Any = None,
        media_root: str | Path | None = None,
        check_source: bool = True,
        monitor: MonitorConfig | None = None,
    ) -> None:
        check_choice("output", output, ("batch", "hf", "bridge"))
        self.output = output
        self.monitor = monitor
        self._watch: _Watch | None = None
        self.plan = Plan.read(plan_dir)
        record = self.plan.record
        with _plan_errors(self.plan.out_dir):
            layout = RowLayout(**record["spec"]["layout"])
        # the caller's settings: their own errors, not the plan's
        self.collator = VLMPackingCollator(
            layout=layout,
            encoder=encoder,
            family=family,
            position_ids=position_ids,
            output="batch" if output == "bridge" else output,
            hf_model=hf_model,
            on_media_error="skip",
        )
        with _plan_errors(self.plan.out_dir):
            changed = _differences(record["encoder"], encoder_identity(self.collator.encoder))
            if changed:
                raise ValueError(
                    f"plan {self.plan.out_dir} was measured with another encoder: "
                    f"{'; '.join(changed)}; pass the tokenizer, template and family it was planned "
                    "with, or plan again with this one"
                )
            planned = record["source"]
            root = media_root if media_root is not None else planned.get("media_root")
            self.source = _open_planned(planned, root)
            if check_source:
                moved = _differences(
                    {k: v for k, v in planned.items() if k != "media_root"},
                    {k: v for k, v in self.source.fingerprint().items() if k != "media_root"},
                )
                if moved:
                    raise ValueError(
                        f"plan {self.plan.out_dir}: its source changed since it was planned "
                        f"({'; '.join(moved)}); plan it again (energon-pack plan --force)"
                    )
            self.order, self.keys = plan_order(self.plan)
            self._reader: EnergonSamples | _RowReader
            if isinstance(self.source, EnergonSource):
                encoder = self.collator.encoder
                self._reader = EnergonSamples(self.source.path, self.source.split_part, encoder)
            else:
                rows = _RowReader(self.source, self.plan.out_dir / ROWS_FILE)
                rows.check()
                self._reader = rows
            self._vocab = tokenizer_vocab_size(self.collator.encoder.tokenizer)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> Any:
        members = self.keys[index]
        items: list[Any] = []
        unread: list[str] = []
        for key in members:
            try:
                items.append(self._member(key))
            except ValueError as error:
                logger.warning("skipping member %s of pack %d: %s", key, index, error)
                unread.append(key)
        if not items:
            raise ValueError(
                f"pack {index}: none of its members {members} could be read (see the "
                "log); check the source"
            )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE)
            row = self.collator(items)
        if unread and isinstance(row, CollatedBatch):
            row = replace(row, skipped_keys=(*row.skipped_keys, *unread))
        if self.monitor is not None:
            self._observe(len(items))
        if self.output == "bridge" and isinstance(row, CollatedBatch):
            return row.to_bridge_batch(self.collator.encoder.media)
        return row

    def _observe(self, samples: int) -> None:
        """Count a pack of ``samples`` for this process's monitor (made on its first pack, in
        each worker: a forked worker does not go on with its parent's)."""
        assert self.monitor is not None
        if self._watch is None or self._watch.pid != os.getpid():
            self._watch = _Watch(self.monitor)
        watch = self._watch
        watch.samples += samples
        watch.packs += 1
        fill = float(self.plan.counts["fill"])
        watch.monitor.observe(
            lambda: NO_BUFFER, samples=watch.samples, packs=watch.packs, bin_fill=fill
        )

    def steps_per_epoch(self, global_batch_size: int | None = None) -> int:
        """Optimizer steps of one epoch (:meth:`PlanOrder.steps_per_epoch`)."""
        return self.order.steps_per_epoch(global_batch_size)

    @staticmethod
    def collate_fn(items: Sequence[Any]) -> Any:
        """A DataLoader's ``collate_fn`` for micro-batches of one pack: the pack itself (a
        longer micro-batch stays a list of packs)."""
        return items[0] if len(items) == 1 else list(items)

    def _member(self, key: str) -> Any:
        if isinstance(self._reader, EnergonSamples):
            prepared = self._reader.prepare(key)
            if isinstance(prepared, tuple):
                raise ValueError(prepared[1])
            return prepared
        record = self._reader.record(int(key))
        if not isinstance(record, Mapping):
            raise ValueError(f"row {key}: expected a JSON object, got {type(record).__name__}")
        if "input_ids" in record:
            ids, mask = pretokenised(key, dict(record), self._vocab)
            return EncodedSample(key, torch.from_numpy(ids), torch.from_numpy(mask).long())
        media_root = self.source.media_root
        return key, conversation_sample(key, read_media_paths(record, key, media_root))


@contextlib.contextmanager
def _plan_errors(out_dir: Path) -> Iterator[None]:
    """Name the plan in an error opening it; a record field of another type or missing is a
    ValueError naming ``plan.json``."""
    try:
        yield
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"plan {out_dir}: {PLAN_FILE} is not a plan record this version reads "
            f"({type(error).__name__}: {error}); plan it again with --force"
        ) from None
    except ValueError as error:
        if str(out_dir) in str(error):
            raise
        raise ValueError(f"plan {out_dir}: {error}") from None


class _Watch:
    """One process's RSS monitor of a :class:`PlannedDataset` and its counts so far."""

    def __init__(self, config: MonitorConfig) -> None:
        info = torch.utils.data.get_worker_info()
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        self.monitor = RSSMonitor(config, rank=rank, worker=0 if info is None else info.id)
        self.pid = os.getpid()
        self.samples = self.packs = 0


def _open_planned(planned: Mapping[str, Any], media_root: str | Path | None) -> Source:
    """The planned source, opened again (an Energon dataset at its split part)."""
    if "energon_split_part" in planned:
        return EnergonSource.open(planned["path"], planned["energon_split_part"])
    return open_source(planned["path"], media_root)


def _differences(built: Mapping[str, Any], asked: Mapping[str, Any]) -> list[str]:
    old, new = settings_fingerprint(dict(built)), settings_fingerprint(dict(asked))
    return [
        f"{name}={old.get(name)!r} but now {new.get(name)!r}"
        for name in sorted(set(old) | set(new))
        if old.get(name) != new.get(name)
    ]


class _RowReader:
    """Rows of a source by index, opened lazily (so the dataset pickles to workers)."""

    def __init__(self, source: Source, rows_file: Path) -> None:
        self.source, self.rows_file = source, rows_file
        self._index: npt.NDArray[np.int64] | None = None
        self._table: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source, "rows_file": self.rows_file}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.source, self.rows_file = state["source"], state["rows_file"]
        self._index, self._table = None, None

    def check(self) -> None:
        """A ValueError naming ``rows.npy`` when it is not the line index of the source."""
        source = self.source
        if not isinstance(source, JsonSource) or source.index is None:
            return
        out_dir, name = self.rows_file.parent, self.rows_file.name
        if not np.array_equal(load_array(out_dir, name, np.int64, 2), source.index):
            bad_array(out_dir, name, f"not the line index of {source.path}")

    def record(self, index: int) -> Any:
        """Row ``index`` of the source (a ValueError when there is none, or it is not valid
        JSON)."""
        source = self.source
        if not 0 <= index < len(source):
            raise ValueError(f"row {index} is not in {source.path} ({len(source)} rows)")
        if isinstance(source, JsonSource):
            if source.records is not None:
                return source.records[index]
            return self._line(source.path, index)
        if isinstance(source, ParquetSource):
            return self._parquet_row(source, index)
        if isinstance(source, SavedDatasetSource):
            if self._table is None:
                self._table = load_saved(source.path)
            return self._table[index : index + 1].to_pylist()[0]
        raise ValueError(f"source {source.path} cannot be read by row")

    def _line(self, path: Path, index: int) -> Any:
        if self._index is None:
            with name_os_errors(self.rows_file):
                self._index = np.load(self.rows_file, mmap_mode="r")
        start, stop = int(self._index[0, index]), int(self._index[1, index])
        with name_os_errors(path), path.open("rb") as data:
            data.seek(start)
            raw = data.read(stop - start)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            raise ValueError(f"row {index}: invalid JSON ({error})") from None

    def _parquet_row(self, source: ParquetSource, index: int) -> Any:
        import pyarrow.parquet as pq

        starts = np.cumsum([0, *source.row_groups]).tolist()
        group = bisect.bisect_right(starts, index) - 1
        with name_os_errors(source.path):
            table = pq.ParquetFile(source.path).read_row_group(group)
        return table.slice(index - starts[group], 1).to_pylist()[0]
