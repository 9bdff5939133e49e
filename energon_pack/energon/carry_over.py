"""Energon wrapper that packs samples online with :class:`~energon_pack.OnlineBinPacker`.

It stands where Energon's ``PackingDataset`` would, with three differences: samples the packer
does not place yet stay in the buffer for later packs (nothing is dropped), samples are
materialised (decoded) only once their pack is chosen, and every skipped sample is counted.

Saved state (per worker), all listed in ``_savable_fields``:

* ``_buffer``: restore keys of every buffered sample (held by the packer or in a chosen pack
  that has not been yielded yet), and ``_buffer_seqs``, their stream sequence numbers;
* ``_packer``: the packer's JSON state (held candidates by sequence number, counters);
* ``_pending``: chosen packs (sequence numbers) not yet yielded;
* ``_next_seq``, the packing sample index and ``_counters``;
* ``_source_done``: this pass's source ran dry (Energon then resets it to its next epoch), so a
  restore of a state saved during the flush or after the last pack finishes the epoch from
  ``_pending`` without reading the source again (states saved before the field restore as
  False);
* ``settings``: the fingerprint of every setting the packs depend on (see ``fingerprint``),
  with the global worker count (``world_size x num_workers``) and ``global_worker``, the global
  index of the worker that saved it (see :mod:`~energon_pack.energon.workers`): the state
  belongs to that global worker and resumes on any topology with the same global count.
  Restoring under other settings raises ValueError naming each difference, before anything is
  restored; restoring never changes the state it reads, so one state can be restored twice.

Accounting: every skipped sample is counted once under its reason in ``_counters["skipped"]``
and reaches the trainer in the ``packing_stats`` of the next pack this worker emits. Samples
skipped after a worker's last pack (at the end of a ``repeat=False`` epoch) are reported by one
more pack built from no samples (``pack([])``: a padding row with an all-zero loss mask), so
the final figures always arrive.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from megatron.energon.edataclass import edataclass
from megatron.energon.flavors.base_dataset import Sample, SavableDataset, set_sample_restore_key
from megatron.energon.savable import Savable
from megatron.energon.state import FlexState
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers.base import BaseWrapperDataset, SampleIndex, get_sample_restore_key
from megatron.energon.wrappers.buffer import SavableSampleBuffer

from energon_pack.encoding.fingerprint import check_fingerprint, settings_fingerprint
from energon_pack.energon.packing_stats import PackClock, PackingStats
from energon_pack.energon.state_check import (
    STATE_FIX,
    StateCheck,
    before_global_workers,
    dataset_identity,
    warned,
)
from energon_pack.energon.workers import (
    Topology,
    current_global_worker,
    saved_index,
    topology_refusal,
)
from energon_pack.memory.monitor import BufferSnapshot, RSSMonitor
from energon_pack.packing.bins import Bin, Overlong, aligned_length
from energon_pack.packing.buffer import BufferConfig
from energon_pack.packing.online import OnlineBinPacker
from energon_pack.packing.packed import SkippedSample, pack_dropping_failures
from energon_pack.packing.packer_state import GROWTH_SETTINGS

logger = logging.getLogger("energon_pack.energon")


T_sample = TypeVar("T_sample")
T_pack = TypeVar("T_pack")


@edataclass
class RejectedSample(Sample):
    """Stands in the stream for a sample that could not be encoded; counted, never packed."""

    reason: str
    message: str


class _SavablePacker(Savable):
    """The packer as an Energon savable field."""

    def __init__(self, make: Callable[[], OnlineBinPacker]) -> None:
        self._make = make
        self.packer = make()

    def save_state(self) -> FlexState:
        return FlexState(self.packer.state_dict())

    def restore_state(self, state: FlexState | None) -> None:
        self.packer = self._make()
        if state is not None:
            self.packer.load_state_dict(dict(state))


@dataclass(frozen=True)
class SampleSize:
    """What one buffered sample weighs: its tokens and the memory it holds."""

    length: int
    """Token length (the packer's item size)."""
    nbytes: int
    """Bytes the buffered sample holds (for ``max_bytes`` and the stats)."""
    decoded_nbytes: int
    """The part of ``nbytes`` that is decoded media (for the memory monitor)."""
    vision_tokens: int = 0
    """Encoder tokens among ``length``: image, video and audio (for the packer's budget)."""
    media: int = 0
    """Images, videos and audios (for the packer's vision budget)."""
    audio_tokens: int = 0
    """The audio part of ``vision_tokens`` (reported in the stats)."""


_AUDIO_COUNTERS = {"audio_tokens": 0, "audio_tokens_max": 0}
"""The audio counters in ``_counters`` (a state saved before them restores with these)."""


FREE_ON_RESTORE = frozenset({"overlong"})
"""Fingerprint settings a state may be restored under another value of: what happens to a sample
that fits no row does not change the packs of the samples that fit. (A state saved by a buffer
bounded by its count alone restores as one: see the packer's ``GROWTH_SETTINGS``.)"""


class CarryOverPackingDataset(BaseWrapperDataset[T_sample, T_pack], Generic[T_sample, T_pack]):
    """Packs a stream of encoded samples into packs with a bounded, carry-over buffer.

    Args:
        dataset: the pre-encoded samples (each with ``__key__`` and ``__restore_key__``).
        make_packer: builds a fresh :class:`OnlineBinPacker` (settings fixed per run).
        size: what a sample weighs in the buffer (:class:`SampleSize`).
        pack: builds the packed sample from the chosen samples, in stream order, decoding
            their media. It may raise :class:`~energon_pack.packing.packed.SkippedSample` for a
            sample that cannot be decoded (naming its position in the list, since keys may repeat in
            a blend of datasets): that sample is counted and skipped and the pack is built
            from the others (:func:`~energon_pack.packing.packed.pack_dropping_failures`). Must be
            stateless (it runs again on restore).
        overlong: a sample longer than the packer's capacity raises ValueError (``"error"``)
            or is counted and skipped (``"skip"``); one alone over a vision cap follows the
            packer's ``VisionBudget.over_cap`` (by default this).
        buffer: the buffer settings; the wrapper reads ``max_consecutive_skips`` (stop with an
            error after this many samples were skipped, when encoded or when decoded, without a
            pack being emitted in between, 0: never, since that means the data or the settings
            are broken; ``pack([])`` must give an empty pack, see the module docstring) and
            ``monitor`` (each worker runs an :class:`~energon_pack.memory.RSSMonitor`).
        settings: what else the packs depend on (the task encoder's settings, nested mappings
            or dataclasses of JSON-able values), checked on restore with the packer settings,
            ``overlong``, the global worker count and the worker's global index.
    """

    _savable_fields = (
        "_buffer",
        "_buffer_seqs",
        "_packer",
        "_pending",
        "_next_seq",
        "_pack_index",
        "_counters",
        "_source_done",
    )

    def __init__(
        self,
        dataset: SavableDataset[T_sample],
        *,
        make_packer: Callable[[], OnlineBinPacker],
        size: Callable[[T_sample], SampleSize],
        pack: Callable[[list[T_sample]], T_pack],
        overlong: Overlong = "error",
        buffer: BufferConfig | None = None,
        settings: Mapping[str, Any] | None = None,
        worker_config: WorkerConfig,
    ) -> None:
        super().__init__(dataset, worker_config=worker_config)
        self._make_packer = make_packer
        self._size = size
        buffer = buffer or BufferConfig()
        self.monitor_config = buffer.monitor
        self._pack = pack
        self.overlong: Overlong = overlong
        self.max_consecutive_skips = buffer.max_consecutive_skips
        self._clock = PackClock()  # not state: each pass (and each restore) starts it again
        self.reset_state_own()
        self.fingerprint = settings_fingerprint(
            {
                **(settings or {}),
                "packer": self.packer.settings(),
                "overlong": overlong,
                "global_workers": Topology.of(worker_config).global_workers,
                **dataset_identity(dataset),
            }
        )
        """Flat settings fingerprint saved with the state (with ``global_worker``, the global
        index of the worker that saved it) and compared on restore."""

    def reset_state_own(self) -> None:
        self._buffer: SavableSampleBuffer[T_sample] = SavableSampleBuffer(
            self.dataset, worker_config=self.worker_config
        )
        self._buffer_seqs: list[int] = []
        self._packer = _SavablePacker(self._make_packer)
        self._pending: list[list[int]] = []
        self._next_seq = 0
        self._pack_index = SampleIndex(self.worker_config, src=self)
        self._counters: dict[str, Any] = {
            "samples": 0,
            "packs": 0,
            "skipped": {},
            "in_a_row": 0,
            "in_a_row_kinds": {},
            **_AUDIO_COUNTERS,
        }
        self._source_done = False
        """This pass's source ran dry: only the packs in ``_pending`` (and the flush) are left."""
        self._restored = False

    def save_state(self) -> FlexState:
        state = super().save_state()
        state["settings"] = {
            **self.fingerprint,
            "global_worker": current_global_worker(self.worker_config),
        }
        return state

    def restore_state(self, state: FlexState) -> None:
        """Restore a copy of ``state`` (left unchanged) once it is valid and its settings match
        these (:meth:`check_state`)."""
        global_worker = current_global_worker(self.worker_config)
        self.check_state(state, what="the packing state", global_worker=global_worker)
        state = copy.deepcopy(state)
        state.setdefault("_source_done", False)  # saved before the field existed
        super().restore_state(state)
        for name, value in _AUDIO_COUNTERS.items():  # saved before audio was counted
            self._counters.setdefault(name, value)
        self._restored = True

    def check_state(self, state: object, *, what: str, global_worker: int) -> None:
        """Raise ValueError naming the field if ``state`` (this wrapper's saved state) cannot
        resume it exactly as global worker ``global_worker``: other settings, another dataset,
        another global worker, or a field that is malformed or inconsistent with the others.
        Reads no data and changes nothing."""
        if not isinstance(state, Mapping):
            raise ValueError(f"{what} must be a dict, got {type(state).__name__}; {STATE_FIX}")
        self.check_settings(state.get("settings"), what=what, global_worker=global_worker)
        StateCheck(self, state, what).run()

    def check_settings(self, saved: object, *, what: str, global_worker: int) -> None:
        """Raise ValueError naming each setting ``saved`` (a state's fingerprint) differs in,
        the global worker count and ``global_worker`` (the global index it is restored into)
        first.

        A state saved before the fingerprint held the dataset's identity is accepted with the
        identity unchecked (logged once). One saved before it held the global worker (with
        ``num_workers``, ``world_size`` and ``rank`` instead) restores only where it was saved:
        same topology, same rank."""
        current: dict[str, Any] = {**self.fingerprint, "global_worker": global_worker}
        if isinstance(saved, Mapping):
            free = set(FREE_ON_RESTORE)
            if not any(f"packer.{name}" in saved for name in GROWTH_SETTINGS):
                free |= {f"packer.{name}" for name in GROWTH_SETTINGS}  # it restores as saved
            saved = {k: v for k, v in saved.items() if k not in free}
            current = {k: v for k, v in current.items() if k not in free}
        if isinstance(saved, Mapping) and before_global_workers(saved):
            current = self._placement_before_global_workers(saved, current, what)
        elif isinstance(saved, Mapping):
            self._check_global_worker(saved, global_worker, what)
        if isinstance(saved, Mapping) and not any(name.startswith("dataset.") for name in saved):
            current = {k: v for k, v in current.items() if not k.startswith("dataset.")}
            if not warned["no_identity"]:
                warned["no_identity"] = True
                logger.warning(
                    "%s was saved by an earlier energon_pack without the dataset's identity "
                    "(shard names and sample counts): it is restored without checking that "
                    "this is the dataset it was saved over",
                    what,
                )
        check_fingerprint(saved, current, what=what)

    def _check_global_worker(self, saved: Mapping[str, Any], global_worker: int, what: str) -> None:
        """The global worker count and identity in ``saved``, checked with a clear message
        (values that are not ints are left to the fingerprint comparison)."""
        topology = Topology.of(self.worker_config)
        saved_global = saved_index(saved, "global_workers")
        if saved_global and saved_global != topology.global_workers:
            raise ValueError(topology_refusal(None, saved_global, topology))
        saved_worker = saved_index(saved, "global_worker")
        if saved_worker is not None and saved_worker != global_worker:
            per_rank = max(topology.num_workers, 1)
            raise ValueError(
                f"cannot restore {what}: global_worker: saved {saved_worker}, now "
                f"{global_worker}. It belongs to global worker {saved_worker} of "
                f"{topology.global_workers} and would resume global worker {global_worker} "
                f"(rank {global_worker // per_rank}, worker {global_worker % per_rank} at "
                f"{topology}). Restore on each rank the state that rank saved, or the rank's "
                "own file written by `energon checkpoint redist`, or start a fresh run"
            )

    def _placement_before_global_workers(
        self, saved: Mapping[str, Any], current: dict[str, Any], what: str
    ) -> dict[str, Any]:
        """The current fingerprint to compare a state saved before the global worker was
        recorded with: refused unless this loader has its topology and rank."""
        config = self.worker_config
        here = {
            "world_size": config.world_size,
            "num_workers": config.num_workers,
            "rank": config.rank,
        }
        if any(saved[name] != value for name, value in here.items()):
            then = ", ".join(f"{name}={saved[name]!r}" for name in here)
            now = ", ".join(f"{name}={value!r}" for name, value in here.items())
            raise ValueError(
                f"cannot restore {what}: it was saved by an earlier energon_pack with {then}, "
                "before packing states recorded their global worker, so it resumes only at "
                f"that rank and topology, not at {now}: restore it there, or start a fresh "
                "run (states saved by this version resume on any topology with the same "
                "world_size x num_workers)"
            )
        kept = {k: v for k, v in current.items() if k not in ("global_workers", "global_worker")}
        return {**kept, **here}

    def len_worker(self, worker_idx: int | None = None) -> int:
        # Packs per worker depend on the packing; like Energon, report source samples.
        return int(self.dataset.len_worker(worker_idx))

    @property
    def packer(self) -> OnlineBinPacker:
        return self._packer.packer

    def __iter__(self) -> Iterator[T_pack]:
        restored = self._restored
        if not restored:  # a new pass over the data, not a resume
            self._source_done = False
        self._restored = False
        self._clock = clock = PackClock()
        self._buffer.worker_start()
        if restored:
            self._check_restored_lengths()
        monitor = None
        if self.monitor_config is not None:
            worker = self.worker_config.rank_worker_id()
            monitor = RSSMonitor(self.monitor_config, self.worker_config.rank, worker)
        yield from self._drain()
        # Energon resets a source that ran dry to the start of its next epoch, so a state saved
        # after that (during the flush, or after the last pack) must not read the source again.
        for sample in () if self._source_done else self.dataset:
            if isinstance(sample, RejectedSample):
                self._skip(sample.__key__, sample.reason, sample.message)
                continue
            size = self._size(sample)
            if self._refused(sample, size):
                continue
            seq = self._next_seq
            self._next_seq += 1
            self._buffer.append(sample)
            self._buffer_seqs.append(seq)
            start = time.perf_counter()
            bins = self.packer.push(
                seq,
                size.length,
                nbytes=size.nbytes,
                vision_tokens=size.vision_tokens,
                media=size.media,
            )
            clock.took(start, samples=1)
            self._pending += [self._seqs(b) for b in bins]
            if monitor is not None:
                counters = self._counters
                monitor.observe(
                    self._snapshot,
                    samples=counters["samples"],
                    packs=counters["packs"],
                    bin_fill=self.packer.stats.bin_fill,
                )
            yield from self._drain()
        self._source_done = True
        start = time.perf_counter()
        flushed = self.packer.flush()
        clock.took(start, samples=0)
        self._pending += [self._seqs(b) for b in flushed]
        yield from self._drain()
        if self._counters["in_a_row"]:  # skips after the last pack: report them now
            with self._pack_index.ctx() as pack_index:
                empty = self._pack([])
            yield self._emit(empty, [], pack_index)

    def _check_restored_lengths(self) -> None:
        """Once the buffered samples are read back: each held candidate's saved length must be
        its sample's, and each pending pack must fit a row (ValueError by field otherwise)."""
        packer = self.packer
        position = {seq: index for index, seq in enumerate(self._buffer_seqs)}
        sizes = {seq: self._size(self._buffer[index]) for seq, index in position.items()}
        for index, held in enumerate(packer.held_sizes()):
            seq = int(held.key)
            saved = {"length": held.length}
            if packer.budget.active:  # the vision figures decide packs only with a budget
                saved.update(vision_tokens=held.vision_tokens, media=held.media)
            for name, value in saved.items():
                if getattr(sizes[seq], name) != value:
                    sample = _key(self._buffer[position[seq]])
                    raise ValueError(
                        f"cannot resume the packing state: _packer.held[{index}].{name}="
                        f"{value}, but its buffered sample {sample!r} has "
                        f"{getattr(sizes[seq], name)}; {STATE_FIX}"
                    )
        for index, seqs in enumerate(self._pending):
            lengths = [sizes[seq].length for seq in seqs]
            if not packer.fits(lengths):
                used = sum(aligned_length(length, packer.align) for length in lengths)
                raise ValueError(
                    f"cannot resume the packing state: _pending[{index}]={seqs} needs {used} "
                    f"tokens, above seq_length={packer.capacity}; {STATE_FIX}"
                )

    def _refused(self, sample: T_sample, size: SampleSize) -> bool:
        """Whether the sample cannot fit a pack (its tokens, or alone over a vision cap);
        raises or skips it per ``overlong`` (per the budget's ``over_cap`` for a cap)."""
        packer, key = self.packer, _key(sample)
        refusal = packer.refusal(key, size.length, size.vision_tokens, size.media)
        if refusal is None:
            return False
        if refusal.policy(self.overlong, packer.budget) == "error":
            raise ValueError(f"{refusal.message}; {refusal.fix}")
        self._skip(key, refusal.reason, refusal.message)
        return True

    def _snapshot(self) -> BufferSnapshot:
        measured = [(_key(s), self._size(s)) for s in self._buffer.buffer]
        sizes = [(key, size.nbytes) for key, size in measured]
        return BufferSnapshot(
            count=len(sizes),
            capacity=self.packer.max_held,
            bytes=sum(nbytes for _, nbytes in sizes),
            decoded_bytes=sum(size.decoded_nbytes for _, size in measured),
            biggest=tuple(sorted(sizes, key=lambda item: -item[1])[:3]),
            max_bytes=self.packer.max_bytes,
        )

    def _seqs(self, chosen: Bin) -> list[int]:
        return [int(key) for key in chosen.keys]

    def _drain(self) -> Iterator[T_pack]:
        """Yield the chosen packs in order; the state stays consistent at every yield."""
        while self._pending:
            seqs = self._pending[0]
            positions = [self._buffer_seqs.index(seq) for seq in seqs]
            chosen = [self._buffer[p] for p in positions]
            for position in sorted(positions, reverse=True):
                del self._buffer[position]
                del self._buffer_seqs[position]
            del self._pending[0]
            packed = self._pack_chosen(chosen)
            if packed is not None:
                yield packed

    def _pack_chosen(self, chosen: list[T_sample]) -> T_pack | None:
        """The pack of ``chosen``; a sample whose media fail is skipped and the rest packed."""

        def pack(samples: list[T_sample]) -> tuple[T_pack, int]:
            with self._pack_index.ctx() as pack_index:
                return self._pack(samples), pack_index

        def dropped(sample: T_sample, failure: SkippedSample) -> None:
            self._skip(failure.key, failure.reason, str(failure))

        result = pack_dropping_failures(chosen, pack, dropped)
        if result is None:
            return None
        (packed, pack_index), packed_samples = result
        counters = self._counters
        counters["samples"] += len(packed_samples)
        audio = sum(self._size(sample).audio_tokens for sample in packed_samples)
        counters["audio_tokens"] += audio
        counters["audio_tokens_max"] = max(counters["audio_tokens_max"], audio)
        return self._emit(packed, packed_samples, pack_index)

    def _emit(self, packed: T_pack, chosen: list[T_sample], pack_index: int) -> T_pack:
        """``packed`` with its restore key and this worker's stats; resets the skip run."""
        counters = self._counters
        counters["packs"] += 1
        counters["in_a_row"] = 0
        counters["in_a_row_kinds"] = {}
        keys = [get_sample_restore_key(sample) for sample in chosen]
        packed = set_sample_restore_key(packed, pack_index, *keys, src=self)
        if hasattr(packed, "packing_stats"):
            packed.packing_stats = self.stats()
        return packed

    def _skip(self, key: str, reason: str, message: str) -> None:
        """Count one skipped sample under ``reason`` and log it."""
        counters = self._counters
        counters["skipped"][reason] = counters["skipped"].get(reason, 0) + 1
        counters["in_a_row"] += 1
        kinds = counters["in_a_row_kinds"]
        kinds[reason] = kinds.get(reason, 0) + 1
        logger.warning("skipping sample %r (%s): %s", key, reason, message)
        if self.max_consecutive_skips and counters["in_a_row"] >= self.max_consecutive_skips:
            seen = ", ".join(f"{kind} x{n}" for kind, n in Counter(kinds).most_common())
            raise RuntimeError(
                f"{counters['in_a_row']} samples in a row were skipped without a pack emitted "
                f"(kinds: {seen}; last: {key!r}, {reason}: {message}); the "
                "dataset or the packing settings are likely wrong. See the log for each key, "
                "fix the data or settings, or raise BufferConfig(max_consecutive_skips=...)."
            )

    def stats(self) -> PackingStats:
        """Figures of this worker so far."""
        packer_stats = self.packer.stats
        return PackingStats(
            rank=self.worker_config.rank,
            worker=self.worker_config.rank_worker_id(),
            packs=self._counters["packs"],
            samples=self._counters["samples"],
            skipped=dict(self._counters["skipped"]),
            bin_fill=packer_stats.bin_fill,
            token_efficiency=packer_stats.token_efficiency,
            buffer_count=len(self._buffer_seqs),
            buffer_bytes=self.packer.held_bytes,
            mean_wait=packer_stats.mean_wait,
            max_wait=packer_stats.max_wait,
            left_buffer_full=packer_stats.emitted_by["buffer"],
            left_capped=self.packer.capped_underfilled,
            vision_tokens_mean=packer_stats.vision_tokens_mean,
            vision_tokens_max=packer_stats.vision_tokens_max,
            media_mean=packer_stats.media_mean,
            media_max=packer_stats.media_max,
            audio_tokens_mean=self._counters["audio_tokens"] / max(self._counters["packs"], 1),
            audio_tokens_max=self._counters["audio_tokens_max"],
            pack_us_per_sample=self._clock.us_per_sample(),
        )

    def restore_sample(self, restore_key: tuple[Any, ...]) -> T_pack:
        """Rebuild one pack from its restore key (re-reads its samples, decodes them again)."""
        name, pack_index, *entries = restore_key
        if name != type(self).__name__:
            raise ValueError(f"restore key {restore_key!r} was not made by {type(self).__name__}")
        samples = [self.dataset.restore_sample(inner) for inner in entries]
        with self._pack_index.ctx(pack_index):
            packed = self._pack(samples)
        restored: T_pack = set_sample_restore_key(packed, pack_index, *entries, src=self)
        return restored

    def config(self) -> dict[str, Any]:
        return {
            "type": type(self).__qualname__,
            "packer": self.packer.settings(),
            "max_consecutive_skips": self.max_consecutive_skips,
            "size": self._function_config(self._size),
            "pack": self._function_config(self._pack),
            "worker_config": self.worker_config.config(),
            "dataset": self.dataset.config(),
        }

    def __str__(self) -> str:
        return f"CarryOverPackingDataset(packer={self.packer.settings()})"


def _key(sample: Any) -> str:
    return str(getattr(sample, "__key__", "?"))
