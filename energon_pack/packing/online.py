"""Online bin packing: :class:`OnlineBinPacker` packs a stream of lengths into fixed-capacity
rows with a bounded candidate buffer. Pure Python, no I/O, no torch. Its rule:

* Every pushed candidate is held until it leaves in a bin; at most ``buffer_size`` candidates are
  held at once, whether or not they are already part of a planned bin.
* The packer keeps the subset sums reachable by the held candidates as a bitset (one big
  integer, ``capacity // align + 1`` bits), updated in O(1) big-int operations per push. A bin
  leaves as soon as some subset of held candidates fills at least ``min_fill`` of the capacity;
  the subset chosen is the fullest one, preferring older candidates.
* Otherwise nothing leaves: under-filled bins are carried over to later rounds. When the buffer
  is full, the fullest subset leaves.
* ``max_wait``: no candidate waits for more than ``max_wait`` emitted bins. The held candidates
  are kept in best-fit "deadline bins" (a witness that every candidate can still leave in time);
  a bin is only chosen if the remaining deadline bins can still be emitted in deadline order,
  otherwise the most urgent deadline bin leaves, topped up with the fullest subset of the rest.

Emitted bins list their keys in stream order. Same pushes and settings give the same bins;
``state_dict()`` is plain JSON-able data and restoring it reproduces the remaining bins exactly.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NoReturn

from energon_pack.packing.bins import (
    OVERLONG_FIX,
    Bin,
    Key,
    Overlong,
    aligned_length,
    check_capacity_and_align,
    check_length,
    overlong_message,
)

logger = logging.getLogger("energon_pack.packing")

_STATE_VERSION = 2

_STATE_KEYS = (
    "version",
    "settings",
    "emitted",
    "next_deadline_bin",
    "held",
    "deadline_bins",
    "stats",
)
_EMIT_REASONS = ("fill", "buffer", "deadline", "flush")
_STATE_INT_MAX = 2**63 - 1
_STATE_FIX = (
    "the state is corrupt or was edited: restore an untouched checkpoint, or start a fresh run"
)


def _corrupt(name: str, value: object, rule: str) -> NoReturn:
    """Raise the ValueError of a bad field of a packer state."""
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:200] + "..."
    raise ValueError(f"packer state: {name}={shown} {rule}; {_STATE_FIX}")


def _checked_dict(value: object, what: str, names: Sequence[str]) -> dict[str, Any]:
    """``value`` if it is a dict with exactly the keys ``names``; ValueError otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a dict, got {type(value).__name__}; {_STATE_FIX}")
    missing = [name for name in names if name not in value]
    extra = [name for name in value if name not in names]
    if missing or extra:
        raise ValueError(
            f"{what} must have the keys {list(names)}: missing {missing}, unknown {extra}; "
            f"{_STATE_FIX}"
        )
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _state_int(value: object, name: str, low: int = 0, high: int = _STATE_INT_MAX) -> int:
    """``value`` if it is an int in ``[low, high]``; ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        _corrupt(name, value, f"must be an int in [{low}, {high}]")
    return value


@dataclass
class PackerStats:
    """Counters of an :class:`OnlineBinPacker`, as observed so far."""

    capacity: int
    bins: int = 0
    items: int = 0
    rejected: int = 0
    aligned_tokens: int = 0
    real_tokens: int = 0
    total_wait: int = 0
    max_wait: int = 0
    emitted_by: dict[str, int] = field(
        default_factory=lambda: {"fill": 0, "buffer": 0, "deadline": 0, "flush": 0}
    )
    """How many bins left because they were full enough, the buffer was full, a candidate's
    max_wait was due, or the stream ended."""

    @property
    def bin_fill(self) -> float:
        """Aligned tokens over the capacity of all emitted bins."""
        return self.aligned_tokens / (self.bins * self.capacity) if self.bins else 0.0

    @property
    def token_efficiency(self) -> float:
        """Real tokens over aligned tokens (what alignment padding costs)."""
        return self.real_tokens / self.aligned_tokens if self.aligned_tokens else 0.0

    @property
    def items_per_bin(self) -> float:
        return self.items / self.bins if self.bins else 0.0

    @property
    def mean_wait(self) -> float:
        """Mean number of bins emitted between a candidate's push and its own bin."""
        return self.total_wait / self.items if self.items else 0.0


@dataclass
class _Candidate:
    key: Key
    length: int
    units: int
    """Aligned length in units of ``align``."""
    pushed_at: int
    """Number of bins emitted before this candidate was pushed."""
    deadline_bin: int
    """Id of the deadline bin holding it (only used with ``max_wait``)."""
    nbytes: int
    """Memory the caller says the candidate holds (only used with ``max_bytes``)."""


@dataclass
class _DeadlineBin:
    members: list[_Candidate] = field(default_factory=list)
    units: int = 0

    def add(self, cand: _Candidate) -> None:
        self.members.append(cand)
        self.units += cand.units

    def remove(self, cand: _Candidate) -> None:
        self.members.remove(cand)
        self.units -= cand.units


class OnlineBinPacker:
    """Online packer with a bounded, carry-over candidate buffer (see the module docstring).

    Args:
        capacity: tokens per bin (the packed sequence length).
        buffer_size: most candidates held at once (>= 1).
        align: every length is rounded up to a multiple of this before packing.
        max_wait: most bins a candidate may wait for after its push, so that no sample
            starves and data order stays close to the stream's (None: unbounded).
        overlong: what to do with a candidate whose aligned length exceeds the capacity:
            ``"error"`` raises ValueError, ``"skip"`` counts it in ``stats.rejected`` and logs
            its key.
        min_fill: a bin leaves as soon as it can be filled to at least this fraction.
        max_bytes: if set, the candidates' ``nbytes`` (given to :meth:`push`) held at once are
            also bounded: while they sum above it, the fullest subset leaves.
    """

    def __init__(
        self,
        capacity: int,
        buffer_size: int,
        *,
        align: int = 1,
        max_wait: int | None = 64,
        overlong: Overlong = "error",
        min_fill: float = 0.999,
        max_bytes: int | None = None,
    ) -> None:
        check_capacity_and_align(capacity, align)
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(
                f"buffer_size (packing_buffer_size) must be an int >= 1, got {buffer_size!r}"
            )
        if max_wait is not None and (not isinstance(max_wait, int) or max_wait < 0):
            raise ValueError(f"max_wait must be None or an int >= 0, got {max_wait!r}")
        if overlong not in ("error", "skip"):
            raise ValueError(f"overlong must be 'error' or 'skip', got {overlong!r}")
        if not 0.0 < min_fill <= 1.0:
            raise ValueError(f"min_fill must be in (0, 1], got {min_fill!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ValueError(
                f"max_bytes (packing_buffer_bytes) must be None or an int >= 1, got {max_bytes!r}"
            )
        self.capacity = capacity
        self.buffer_size = buffer_size
        self.align = align
        self.max_wait = max_wait
        self.overlong: Overlong = overlong
        self.min_fill = min_fill
        self.max_bytes = max_bytes
        self._cap_units = capacity // align
        self._mask = (1 << (self._cap_units + 1)) - 1
        # Units a bin needs to leave early; the epsilon keeps min_fill=1.0 exact under rounding.
        self._fill_units = min(self._cap_units, math.ceil(min_fill * capacity / align - 1e-9))
        self._reset()

    def _reset(self) -> None:
        self.stats = PackerStats(capacity=self.capacity)
        self._held: list[_Candidate] = []
        self._held_bytes = 0
        self._prefix: list[int] = [1]  # _prefix[i]: subset sums reachable by _held[:i]
        self._emitted = 0
        self._deadline_bins: dict[int, _DeadlineBin] = {}  # only used with max_wait
        self._next_deadline_bin = 0

    @property
    def held(self) -> int:
        """Number of candidates currently held."""
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        """Sum of the held candidates' ``nbytes``."""
        return self._held_bytes

    @property
    def held_keys(self) -> list[Key]:
        """Keys of the held candidates, in stream order."""
        return [c.key for c in self._held]

    # ----------------------------------------------------------------------------- public API
    def push(self, key: Key, length: int, *, nbytes: int = 0) -> list[Bin]:
        """Add one candidate; return the bins that are ready to leave (possibly none).

        ``nbytes`` is the memory the candidate holds, bounded by ``max_bytes``.
        """
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise ValueError(f"key must be a str or int (JSON-able), got {key!r}")
        length = check_length(key, length)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"sample {key!r}: nbytes must be an int >= 0, got {nbytes!r}")
        units = aligned_length(length, self.align) // self.align
        if units > self._cap_units:
            if self.overlong == "error":
                message = overlong_message(key, length, self.align, self.capacity)
                raise ValueError(f"{message}; {OVERLONG_FIX}")
            self.stats.rejected += 1
            logger.warning("skipping %s", overlong_message(key, length, self.align, self.capacity))
            return []
        out: list[Bin] = []
        deadline_bin = -1 if self.max_wait is None else self._deadline_bin_for(units)
        cand = _Candidate(key, length, units, self._emitted, deadline_bin, nbytes)
        self._held.append(cand)
        self._held_bytes += nbytes
        last = self._prefix[-1]
        self._prefix.append((last | (last << units)) & self._mask)
        if self.max_wait is not None:
            self._deadline_bins.setdefault(deadline_bin, _DeadlineBin()).add(cand)
            while len(self._deadline_bins) > self.max_wait:
                out.append(self._emit(self._most_urgent_subset(), "deadline"))
        while self._prefix[-1] >> self._fill_units:
            chosen = self._next_subset()
            if sum(self._held[i].units for i in chosen) < self._fill_units:
                break
            out.append(self._emit(chosen, "fill"))
        while len(self._held) >= self.buffer_size or (
            self.max_bytes is not None and self._held and self._held_bytes > self.max_bytes
        ):
            out.append(self._emit(self._next_subset(), "buffer"))
        return out

    def flush(self) -> list[Bin]:
        """Emit every held candidate (end of stream)."""
        out: list[Bin] = []
        while self._held:
            out.append(self._emit(self._next_subset(), "flush"))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: settings, held candidates, the deadline bins in their order
        (ties in best fit go to the earlier one), counters."""
        return {
            "version": _STATE_VERSION,
            "settings": self._settings(),
            "emitted": self._emitted,
            "next_deadline_bin": self._next_deadline_bin,
            "held": [[c.key, c.length, c.pushed_at, c.deadline_bin, c.nbytes] for c in self._held],
            "deadline_bins": list(self._deadline_bins),
            "stats": asdict(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the packer then emits exactly what the original would.

        The whole state is checked first (structure, types, ranges, consistency); a bad state
        raises ValueError naming the field and leaves the packer unchanged."""
        held, stats = self._checked_state(state)
        self._reset()
        self.stats = stats
        self._emitted = state["emitted"]
        self._next_deadline_bin = state["next_deadline_bin"]
        self._held = held
        self._held_bytes = sum(c.nbytes for c in held)
        if self.max_wait is not None:
            # Best fit breaks ties by the deadline bins' order: rebuild them in the saved order.
            self._deadline_bins = {bin_id: _DeadlineBin() for bin_id in state["deadline_bins"]}
            for cand in held:
                self._deadline_bins[cand.deadline_bin].add(cand)
        self._rebuild_prefix(0)

    def _checked_state(self, state: object) -> tuple[list[_Candidate], PackerStats]:
        """The held candidates and stats of ``state``, once every field of it is valid."""
        state = _checked_dict(state, "packer state", _STATE_KEYS)
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"packer state version={state['version']!r} must be {_STATE_VERSION}; it was "
                "saved by an incompatible energon_pack: restore with that version or start a "
                "fresh run"
            )
        saved_settings = _checked_dict(
            state["settings"], "packer state: settings", tuple(self._settings())
        )
        for name, value in self._settings().items():
            saved = saved_settings[name]
            if saved != value or isinstance(saved, bool) != isinstance(value, bool):
                raise ValueError(
                    f"packer state was saved with {name}={saved!r} but this packer has "
                    f"{name}={value!r}; restore with the same setting or start a fresh run"
                )
        emitted = _state_int(state["emitted"], "emitted")
        next_bin = _state_int(state["next_deadline_bin"], "next_deadline_bin")
        held = self._checked_held(state["held"], emitted, next_bin)
        self._check_deadline_bins(state["deadline_bins"], held, emitted, next_bin)
        return held, self._checked_stats(state["stats"], emitted)

    def _checked_held(self, value: object, emitted: int, next_bin: int) -> list[_Candidate]:
        if not isinstance(value, list):
            _corrupt(
                "held", value, "must be a list of [key, length, pushed_at, deadline_bin, nbytes]"
            )
        if len(value) >= self.buffer_size:
            _corrupt(
                "len(held)",
                len(value),
                f"must be below buffer_size={self.buffer_size} (the packer emits at that count)",
            )
        held: list[_Candidate] = []
        keys: set[Key] = set()
        for index, item in enumerate(value):
            name = f"held[{index}]"
            if not isinstance(item, (list, tuple)) or len(item) != 5:
                _corrupt(name, item, "must be [key, length, pushed_at, deadline_bin, nbytes]")
            key, length, pushed_at, deadline_bin, nbytes = item
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                _corrupt(f"{name}.key", key, "must be a str or int")
            if key in keys:
                _corrupt(f"{name}.key", key, "must be unique (it is held twice)")
            keys.add(key)
            cap = self._cap_units * self.align
            length = _state_int(length, f"{name}.length", 1, cap)
            low = held[-1].pushed_at if held else 0
            pushed_at = _state_int(pushed_at, f"{name}.pushed_at", low, emitted)
            if self.max_wait is None:
                if deadline_bin != -1:
                    _corrupt(f"{name}.deadline_bin", deadline_bin, "must be -1 without max_wait")
            else:
                deadline_bin = _state_int(deadline_bin, f"{name}.deadline_bin", 0, next_bin - 1)
                if emitted - pushed_at > self.max_wait:
                    _corrupt(
                        f"{name}.pushed_at",
                        pushed_at,
                        f"must be >= emitted - max_wait = "
                        f"{emitted - self.max_wait} (no candidate waits longer)",
                    )
            nbytes = _state_int(nbytes, f"{name}.nbytes")
            units = aligned_length(length, self.align) // self.align
            held.append(_Candidate(key, length, units, pushed_at, deadline_bin, nbytes))
        total = sum(c.nbytes for c in held)
        if self.max_bytes is not None and total > self.max_bytes:
            _corrupt("held nbytes", total, f"must sum to at most max_bytes={self.max_bytes}")
        return held

    def _check_deadline_bins(
        self, order: object, held: list[_Candidate], emitted: int, next_bin: int
    ) -> None:
        if not isinstance(order, list) or not all(_is_int(b) for b in order):
            _corrupt("deadline_bins", order, "must be a list of ints")
        if self.max_wait is None:
            if order or next_bin:
                _corrupt(
                    "deadline_bins", order, "must be [] with next_deadline_bin=0 without max_wait"
                )
            return
        members: dict[int, list[_Candidate]] = {}
        for cand in held:
            members.setdefault(cand.deadline_bin, []).append(cand)
        if len(set(order)) != len(order) or sorted(order) != sorted(members):
            _corrupt(
                "deadline_bins",
                order,
                f"must list each deadline bin of the held candidates once ({sorted(members)})",
            )
        if len(order) > self.max_wait:
            _corrupt("deadline_bins", order, f"must list at most max_wait={self.max_wait} bins")
        for bin_id, cands in members.items():
            if sum(c.units for c in cands) > self._cap_units:
                _corrupt(
                    "deadline_bins",
                    order,
                    f"bin {bin_id} must fit the capacity {self.capacity} (its candidates do not)",
                )
        deadlines = sorted(self._deadline(cands) for cands in members.values())
        if any(deadline < emitted + j for j, deadline in enumerate(deadlines)):
            _corrupt(
                "deadline_bins",
                order,
                f"must be emittable in deadline order after "
                f"emitted={emitted} (deadlines {deadlines})",
            )

    def _checked_stats(self, value: object, emitted: int) -> PackerStats:
        names = tuple(f.name for f in dataclasses.fields(PackerStats))
        value = _checked_dict(value, "packer state: stats", names)
        if value["capacity"] != self.capacity or isinstance(value["capacity"], bool):
            _corrupt("stats.capacity", value["capacity"], f"must be capacity={self.capacity}")
        counts = {
            name: _state_int(value[name], f"stats.{name}")
            for name in names
            if name not in ("capacity", "emitted_by")
        }
        emitted_by = _checked_dict(
            value["emitted_by"], "packer state: stats.emitted_by", _EMIT_REASONS
        )
        by = {r: _state_int(emitted_by[r], f"stats.emitted_by.{r}") for r in _EMIT_REASONS}
        if counts["bins"] != emitted or sum(by.values()) != emitted:
            _corrupt(
                "stats.bins",
                counts["bins"],
                f"must equal emitted={emitted} and the sum "
                f"of stats.emitted_by ({sum(by.values())})",
            )
        if not counts["real_tokens"] <= counts["aligned_tokens"] <= emitted * self.capacity:
            _corrupt(
                "stats.aligned_tokens",
                counts["aligned_tokens"],
                f"must be between stats.real_tokens={counts['real_tokens']} and bins * capacity",
            )
        if counts["items"] < emitted or counts["max_wait"] > counts["total_wait"]:
            _corrupt(
                "stats.items",
                counts["items"],
                "must be >= stats.bins, and stats.max_wait <= stats.total_wait",
            )
        return PackerStats(capacity=self.capacity, emitted_by=by, **counts)

    # ------------------------------------------------------------------------------ internals
    def _settings(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "buffer_size": self.buffer_size,
            "align": self.align,
            "max_wait": self.max_wait,
            "min_fill": self.min_fill,
            "max_bytes": self.max_bytes,
        }

    def _rebuild_prefix(self, start: int) -> None:
        del self._prefix[start + 1 :]
        reach = self._prefix[start]
        mask = self._mask
        for cand in self._held[start:]:
            reach = (reach | (reach << cand.units)) & mask
            self._prefix.append(reach)

    def _fullest_subset(self) -> list[int]:
        """Indices of the fullest subset of held candidates; older ones preferred."""
        prefix = self._prefix
        target = prefix[-1].bit_length() - 1
        chosen = []
        for index in range(len(self._held) - 1, -1, -1):
            if target == 0:
                break
            if not (prefix[index] >> target) & 1:
                chosen.append(index)
                target -= self._held[index].units
        return chosen

    def _next_subset(self) -> list[int]:
        chosen = self._fullest_subset()
        if self.max_wait is None or self._schedulable(chosen):
            return chosen
        return self._most_urgent_subset()

    # --- max_wait: deadline bins -------------------------------------------------------------
    # Every held candidate sits in a deadline bin whose items fit the capacity together. A bin's
    # deadline is the emission index by which all its items must have left: the oldest member's
    # pushed_at + max_wait. Emitting the bins in deadline order is always possible while the j-th
    # earliest deadline (0-based) is >= emitted + j. Every step keeps that true, and keeps at most
    # max_wait deadline bins after each push, so a new candidate can always open a bin with the
    # latest deadline without anything leaving before it entered the buffer.

    def _deadline(self, members: list[_Candidate]) -> int:
        assert self.max_wait is not None
        return min(c.pushed_at for c in members) + self.max_wait

    def _schedulable(self, chosen: list[int]) -> bool:
        """Whether the deadline bins left after emitting ``chosen`` can still all be on time."""
        leaving = {id(self._held[i]) for i in chosen}
        deadlines = []
        for deadline_bin in self._deadline_bins.values():
            staying = [c for c in deadline_bin.members if id(c) not in leaving]
            if staying:
                deadlines.append(self._deadline(staying))
        deadlines.sort()
        after = self._emitted + 1
        return all(deadline >= after + j for j, deadline in enumerate(deadlines))

    def _most_urgent_subset(self) -> list[int]:
        """The earliest-deadline bin, topped up with the fullest subset of the others."""
        urgent_id = min(
            self._deadline_bins, key=lambda b: (self._deadline(self._deadline_bins[b].members), b)
        )
        urgent = [i for i, c in enumerate(self._held) if c.deadline_bin == urgent_id]
        others = [i for i, c in enumerate(self._held) if c.deadline_bin != urgent_id]
        room = self._cap_units - sum(self._held[i].units for i in urgent)
        mask = (1 << (room + 1)) - 1
        prefix = [1]
        for index in others:
            reach = prefix[-1]
            prefix.append((reach | (reach << self._held[index].units)) & mask)
        target = prefix[-1].bit_length() - 1
        for position in range(len(others) - 1, -1, -1):
            if target == 0:
                break
            if not (prefix[position] >> target) & 1:
                urgent.append(others[position])
                target -= self._held[others[position]].units
        return urgent

    def _deadline_bin_for(self, units: int) -> int:
        """Id of the best-fit deadline bin for a new candidate of ``units`` (maybe a new one)."""
        best, best_free = -1, self._cap_units + 1
        for bin_id, deadline_bin in self._deadline_bins.items():
            free = self._cap_units - deadline_bin.units
            if units <= free < best_free:
                best, best_free = bin_id, free
        if best < 0:
            best = self._next_deadline_bin
            self._next_deadline_bin += 1
        return best

    def _emit(self, chosen: list[int], reason: str) -> Bin:
        order = sorted(chosen)
        cands = [self._held[i] for i in order]
        stats = self.stats
        for cand in cands:
            wait = self._emitted - cand.pushed_at
            stats.total_wait += wait
            stats.max_wait = max(stats.max_wait, wait)
        used = sum(c.units for c in cands) * self.align
        stats.bins += 1
        stats.items += len(cands)
        stats.aligned_tokens += used
        stats.real_tokens += sum(c.length for c in cands)
        stats.emitted_by[reason] += 1
        self._emitted += 1
        chosen_set = set(chosen)
        self._held = [c for i, c in enumerate(self._held) if i not in chosen_set]
        self._held_bytes -= sum(c.nbytes for c in cands)
        for cand in cands:
            if cand.deadline_bin in self._deadline_bins:
                deadline_bin = self._deadline_bins[cand.deadline_bin]
                deadline_bin.remove(cand)
                if not deadline_bin.members:
                    del self._deadline_bins[cand.deadline_bin]
        self._rebuild_prefix(order[0])
        return Bin(
            keys=tuple(c.key for c in cands),
            lengths=tuple(c.length for c in cands),
            used=used,
            capacity=self.capacity,
        )
