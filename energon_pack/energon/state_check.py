"""Checks of a saved :class:`~energon_pack.energon.carry_over.CarryOverPackingDataset` state before
anything is restored: every field's type and range, the buffered restore keys against the
dataset's layout, and the dataset's identity (shards and sample counts, without its path).
Each problem is a ValueError naming the field.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn, Protocol

from megatron.energon.flavors.base_dataset import SavableDataset
from megatron.energon.flavors.webdataset.sample_loader import WebdatasetSampleLoaderDataset
from megatron.energon.wrappers.base import BaseWrapperDataset
from megatron.energon.wrappers.buffer import SavableSampleBuffer
from megatron.energon.wrappers.map_dataset import MapDataset
from megatron.energon.wrappers.shuffle_buffer_dataset import ShuffleBufferDataset

from energon_pack.checks import shown
from energon_pack.packing.online import OnlineBinPacker

STATE_FIX = (
    "the checkpoint is corrupt or was edited: restore an untouched one, or start a fresh run"
)
_INT_MAX = 2**63 - 1


def before_global_workers(saved: Mapping[str, Any]) -> bool:
    """Whether the fingerprint ``saved`` is from before states recorded their global worker
    (it names ``num_workers``, ``world_size`` and ``rank`` instead)."""
    return "global_workers" not in saved and all(
        name in saved for name in ("num_workers", "world_size", "rank")
    )


warned = {"no_identity": False}
"""Warnings given once per process."""


def dataset_identity(dataset: SavableDataset[Any]) -> dict[str, Any]:
    """What identifies the data under ``dataset`` without its path: the number of shards and
    samples of its WebDataset sources and a digest of each shard's name and sample count (from
    the dataset's prepared index). Empty for sources that are not prepared WebDatasets."""
    shards = [
        [info.name, info.count]
        for leaf in _webdataset_leaves(dataset)
        for reader in leaf.join_readers
        for info in getattr(reader, "shard_infos", ())
    ]
    if not shards:
        return {}
    digest = hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16]
    return {
        "dataset": {
            "shards": len(shards),
            "samples": sum(count for _, count in shards),
            "digest": digest,
        }
    }


def _webdataset_leaves(node: Any) -> Iterator[WebdatasetSampleLoaderDataset]:
    if isinstance(node, WebdatasetSampleLoaderDataset):
        yield node
    elif isinstance(node, BaseWrapperDataset):
        for inner in node.datasets:
            yield from _webdataset_leaves(inner)


def _restore_key_problem(node: Any, key: tuple[Any, ...], sizes: dict[int, int]) -> str | None:
    """What is wrong with the restore ``key`` of a sample of ``node`` (None: nothing found);
    ``sizes`` caches the number of samples of each WebDataset source by ``id``.

    Follows the key through the Energon datasets whose layout is known: ``MapDataset`` adds
    its name and sample index (and the item index of a generator), a wrapper of several
    datasets its name and the dataset index, the WebDataset reader ``("Webdataset", index)``;
    other wrappers pass it on unchanged. Below an unknown dataset the rest goes unchecked."""
    while True:
        name = type(node).__name__
        if isinstance(node, WebdatasetSampleLoaderDataset):
            if id(node) not in sizes:
                sizes[id(node)] = min((len(reader) for reader in node.join_readers), default=0)
            total = sizes[id(node)]
            if len(key) != 2 or key[0] != "Webdataset":
                return f"must end with ('Webdataset', index), not {key!r}"
            if not _is_int(key[1]) or not 0 <= key[1] < total:
                return f"has sample index {key[1]!r}, not an int in [0, {total})"
            return None
        if not isinstance(node, BaseWrapperDataset):
            return None
        if isinstance(node, MapDataset):
            width = 3 if inspect.isgeneratorfunction(node.map_fn) else 2
            head, key = key[:width], key[width:]
            if len(head) != width or head[0] != name:
                return f"must start with {name!r} and {width - 1} index(es), not {head!r}"
            if not all(_is_int(index) and 0 <= index <= _INT_MAX for index in head[1:]):
                return f"has {name} indexes {head[1:]!r}, not ints >= 0"
            node = node.dataset
        elif isinstance(node, ShuffleBufferDataset):
            node = node.dataset
        elif type(node).restore_sample is not BaseWrapperDataset.restore_sample:
            return None  # its own key layout: not checked
        elif len(node.datasets) == 1:
            node = node.datasets[0]
        else:
            if len(key) < 2 or key[0] != name:
                return f"must start with {name!r} and a dataset index, not {key[:2]!r}"
            count = len(node.datasets)
            if not _is_int(key[1]) or not 0 <= key[1] < count:
                return f"has {name} dataset index {key[1]!r}, not an int in [0, {count})"
            node, key = node.datasets[key[1]], key[2:]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class CheckedWrapper(Protocol):
    """What a state check reads of the packing wrapper whose state it checks."""

    @property
    def _savable_fields(self) -> Sequence[str]: ...

    @property
    def dataset(self) -> SavableDataset[Any]: ...

    @property
    def _make_packer(self) -> Callable[[], OnlineBinPacker]: ...


class StateCheck:
    """Checks the fields of a saved :class:`CarryOverPackingDataset` state (see ``check_state``)."""

    def __init__(self, wrapper: CheckedWrapper, state: Mapping[str, Any], what: str):
        self.wrapper = wrapper
        self.state = state
        self.what = what
        self.sizes: dict[int, int] = {}

    def fail(self, name: str, value: object, rule: str) -> NoReturn:
        raise ValueError(f"cannot restore {self.what}: {name}={shown(value)} {rule}; {STATE_FIX}")

    def int_field(self, name: str, value: object, low: int = 0) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _INT_MAX:
            self.fail(name, value, f"must be an int in [{low}, {_INT_MAX}]")
        return value

    def run(self) -> None:
        state = self.state
        wrapper = self.wrapper
        expected = {"__class__", "datasets", "settings", *wrapper._savable_fields}
        missing = sorted(expected - set(state) - {"_source_done"})  # _source_done: added later
        unknown = sorted(set(state) - expected, key=str)
        if missing or unknown:
            self.fail(
                "keys",
                sorted(state, key=str),
                f"must be {sorted(expected)}: missing {missing}, unknown {unknown}",
            )
        if state["__class__"] != type(wrapper).__name__:
            self.fail("__class__", state["__class__"], f"must be {type(wrapper).__name__!r}")
        keys = self.restore_keys(state["_buffer"])
        seqs = self.buffer_seqs(state["_buffer_seqs"], len(keys))
        held = self.packer_keys(state["_packer"])
        pending = self.pending(state["_pending"], set(seqs))
        self.consistent(seqs, held, pending)
        next_seq = self.int_field("_next_seq", state["_next_seq"])
        if seqs and next_seq <= seqs[-1]:
            self.fail("_next_seq", next_seq, f"must be above every buffered seq (up to {seqs[-1]})")
        self.int_field("_pack_index", state["_pack_index"])
        self.counters(state["_counters"])
        done = state.get("_source_done", False)
        if not isinstance(done, bool):
            self.fail("_source_done", done, "must be a bool")
        if done and held:
            self.fail(
                "_source_done",
                done,
                f"cannot be True while the packer holds {held} "
                "(the source runs dry only after the packer was flushed)",
            )
        if not isinstance(state["datasets"], list):
            self.fail(
                "datasets", state["datasets"], "must be the list of the inner datasets' states"
            )

    def restore_keys(self, buffer: object) -> list[tuple[Any, ...]]:
        if not isinstance(buffer, Mapping) or set(buffer) != {"__class__", "_restore_keys"}:
            self.fail(
                "_buffer",
                buffer,
                "must be a SavableSampleBuffer state "
                "{'__class__': 'SavableSampleBuffer', '_restore_keys': [...]}",
            )
        if buffer["__class__"] != SavableSampleBuffer.__name__:
            self.fail("_buffer.__class__", buffer["__class__"], "must be 'SavableSampleBuffer'")
        keys = buffer["_restore_keys"]
        if not isinstance(keys, list):
            self.fail("_buffer._restore_keys", keys, "must be a list of restore keys")
        seen: dict[tuple[Any, ...], int] = {}
        for index, key in enumerate(keys):
            name = f"_buffer._restore_keys[{index}]"
            if not isinstance(key, (tuple, list)) or not key:
                self.fail(name, key, "must be a non-empty tuple (a sample's restore key)")
            key = tuple(key)
            try:
                first = seen.setdefault(key, index)
            except TypeError:
                self.fail(name, key, "must hold only str, int and tuple items")
            if first != index:
                self.fail(
                    name,
                    key,
                    f"must be unique: it is also _buffer._restore_keys[{first}] "
                    "(that sample would be delivered twice)",
                )
            problem = _restore_key_problem(self.wrapper.dataset, key, self.sizes)
            if problem is not None:
                self.fail(name, key, problem)
        return list(seen)

    def buffer_seqs(self, value: object, count: int) -> list[int]:
        if not isinstance(value, list):
            self.fail("_buffer_seqs", value, "must be a list of ints")
        seqs = [self.int_field(f"_buffer_seqs[{i}]", seq) for i, seq in enumerate(value)]
        if len(seqs) != count:
            self.fail(
                "_buffer_seqs",
                value,
                f"must hold one seq per buffered restore key ({count}), not {len(seqs)}",
            )
        for index in range(1, len(seqs)):
            if seqs[index] <= seqs[index - 1]:
                self.fail(
                    f"_buffer_seqs[{index}]",
                    seqs[index],
                    f"must be above "
                    f"_buffer_seqs[{index - 1}]={seqs[index - 1]} (unique, stream order)",
                )
        return seqs

    def packer_keys(self, value: object) -> list[int]:
        if not isinstance(value, Mapping):
            self.fail("_packer", value, "must be the packer's state dict")
        packer = self.wrapper._make_packer()
        try:
            packer.load_state_dict(dict(value))
        except ValueError as error:
            raise ValueError(f"cannot restore {self.what}: _packer: {error}") from None
        for index, key in enumerate(packer.held_keys):
            if not _is_int(key):
                self.fail(f"_packer.held[{index}].key", key, "must be an int (a buffered seq)")
        return [int(key) for key in packer.held_keys]

    def pending(self, value: object, buffered: set[int]) -> set[int]:
        if not isinstance(value, list):
            self.fail("_pending", value, "must be a list of packs (lists of seqs)")
        out: set[int] = set()
        for index, pack in enumerate(value):
            name = f"_pending[{index}]"
            if not isinstance(pack, list) or not pack:
                self.fail(name, pack, "must be a non-empty list of seqs")
            for position, seq in enumerate(pack):
                seq = self.int_field(f"{name}[{position}]", seq)
                if seq not in buffered:
                    self.fail(f"{name}[{position}]", seq, "must be a buffered seq (_buffer_seqs)")
                if seq in out:
                    self.fail(
                        f"{name}[{position}]", seq, "must be pending once (it is listed twice)"
                    )
                out.add(seq)
        return out

    def consistent(self, seqs: list[int], held: list[int], pending: set[int]) -> None:
        buffered = set(seqs)
        for index, key in enumerate(held):
            if key not in buffered:
                self.fail(
                    f"_packer.held[{index}].key", key, "must be a buffered seq (_buffer_seqs)"
                )
            if key in pending:
                self.fail(f"_packer.held[{index}].key", key, "must not also be pending (_pending)")
        lost = sorted(buffered - set(held) - pending)
        if lost:
            self.fail(
                "_buffer_seqs",
                seqs,
                f"must each be held by the packer or pending; {lost} "
                "are neither (those samples would never be delivered)",
            )

    def counters(self, value: object) -> None:
        names = {"samples", "packs", "skipped", "in_a_row", "in_a_row_kinds"}
        audio = {"audio_tokens", "audio_tokens_max"}  # absent from states saved before them
        if not isinstance(value, Mapping) or set(value) not in (names, names | audio):
            self.fail(
                "_counters",
                value,
                f"must be a dict with the keys {sorted(names)} (and {sorted(audio)})",
            )
        for name in ("samples", "packs", "in_a_row", *sorted(audio & set(value))):
            self.int_field(f"_counters.{name}", value[name])
        if audio <= set(value) and value["audio_tokens_max"] > value["audio_tokens"]:
            self.fail(
                "_counters.audio_tokens_max",
                value["audio_tokens_max"],
                f"must be at most _counters.audio_tokens ({value['audio_tokens']})",
            )
        for name in ("skipped", "in_a_row_kinds"):
            counts = value[name]
            if not isinstance(counts, dict):
                self.fail(f"_counters.{name}", counts, "must be a dict of reason -> count")
            for reason, count in counts.items():
                if not isinstance(reason, str):
                    self.fail(f"_counters.{name}", counts, "must have str reasons as keys")
                self.int_field(f"_counters.{name}.{reason}", count)
        kinds = value["in_a_row_kinds"]
        if sum(kinds.values()) != value["in_a_row"]:
            self.fail(
                "_counters.in_a_row",
                value["in_a_row"],
                f"must be the sum of _counters.in_a_row_kinds ({sum(kinds.values())})",
            )
        for reason, count in kinds.items():
            if count > value["skipped"].get(reason, 0):
                self.fail(
                    f"_counters.in_a_row_kinds.{reason}",
                    count,
                    f"must be at most _counters.skipped.{reason}",
                )
