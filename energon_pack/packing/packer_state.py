"""What :class:`~energon_pack.OnlineBinPacker` holds and saves: its candidates, deadline bins and
counters, and the check of a saved state (every field valid before anything is restored).

A state is plain JSON-able data (:data:`STATE_KEYS`). Version 3 records each held candidate's
vision tokens and media; a version 2 state (saved before the vision budget existed) is read with
0 of both, and restores only into a packer without a vision budget (its settings have none).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from energon_pack._moved import renamed
from energon_pack.checks import shown
from energon_pack.packing.bins import Key, Overlong, aligned_length
from energon_pack.packing.vision_budget import VisionBudget

STATE_VERSION = 3
STATE_KEYS = (
    "version",
    "settings",
    "emitted",
    "next_deadline_bin",
    "held",
    "deadline_bins",
    "stats",
)
EMIT_REASONS = ("fill", "buffer", "deadline", "flush")
_READABLE_VERSIONS = (2, STATE_VERSION)
_HELD_FIELDS = {
    2: "[key, length, pushed_at, deadline_bin, nbytes]",
    3: "[key, length, pushed_at, deadline_bin, nbytes, vision_tokens, media]",
}
_INT_MAX = 2**63 - 1
GROWTH_SETTINGS = ("min_rows", "max_size")
"""Settings of the growing buffer (:class:`~energon_pack.BufferConfig`): a state saved without
them was saved by a buffer bounded by its count alone, and restores as one."""
_FIX = "the state is corrupt or was edited: restore an untouched checkpoint, or start a fresh run"


@dataclass
class PackerCounters:
    """Counters of an :class:`~energon_pack.OnlineBinPacker`, as observed so far (its
    ``stats``; a worker's figures per batch are :class:`~energon_pack.PackingStats`)."""

    capacity: int
    bins: int = 0
    items: int = 0
    rejected: int = 0
    """Samples refused (counted and logged) because they alone exceed the row or a vision cap."""
    aligned_tokens: int = 0
    real_tokens: int = 0
    total_wait: int = 0
    max_wait: int = 0
    emitted_by: dict[str, int] = field(
        default_factory=lambda: {"fill": 0, "buffer": 0, "deadline": 0, "flush": 0}
    )
    """How many bins left because they were full enough, the buffer was full, a candidate's
    max_wait was due, or the stream ended."""
    vision_tokens: int = 0
    """Vision tokens of all emitted bins."""
    vision_tokens_max: int = 0
    """Most vision tokens in one emitted bin."""
    media: int = 0
    """Images and videos of all emitted bins."""
    media_max: int = 0
    """Most images and videos in one emitted bin."""

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

    @property
    def vision_tokens_mean(self) -> float:
        """Mean vision tokens per emitted bin."""
        return self.vision_tokens / self.bins if self.bins else 0.0

    @property
    def media_mean(self) -> float:
        """Mean images and videos per emitted bin."""
        return self.media / self.bins if self.bins else 0.0


if TYPE_CHECKING:  # the old name, for type checkers
    PackerStats = PackerCounters
else:  # the old name, with a DeprecationWarning
    __getattr__ = renamed(__name__, "PackerStats")


@dataclass(frozen=True)
class Refusal:
    """Why a sample cannot be in any pack: longer than a row, or alone over a vision cap."""

    reason: str
    """``"overlong"``, ``"over_max_vision_tokens"`` or ``"over_max_media"``."""
    message: str
    """The statement naming the sample, its size and the limit."""
    fix: str
    """What to change."""

    def policy(self, overlong: Overlong, budget: VisionBudget) -> Overlong:
        """What the sample gets: ``overlong`` for its tokens, the budget's ``over_cap`` rule
        for a vision cap."""
        return overlong if self.reason == "overlong" else budget.over_cap_policy(overlong)


@dataclass(frozen=True)
class HeldSize:
    """What a held candidate weighs, as the packer recorded it at its push."""

    key: Key
    length: int
    vision_tokens: int
    media: int


@dataclass(eq=False)
class Candidate:
    """One held sample, as the packer sees it (compared by identity)."""

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
    vision: int = 0
    """Vision tokens (image/video pad tokens) among its ``length``."""
    media: int = 0
    """Images plus videos."""

    @property
    def visual(self) -> bool:
        """Whether it carries media (the vision budget's search places these one by one)."""
        return self.vision > 0 or self.media > 0

    def saved(self) -> list[Any]:
        return [
            self.key,
            self.length,
            self.pushed_at,
            self.deadline_bin,
            self.nbytes,
            self.vision,
            self.media,
        ]


@dataclass
class DeadlineBin:
    """Held candidates that fit one row together (the ``max_wait`` witness), in stream order."""

    members: list[Candidate] = field(default_factory=list)
    units: int = 0
    vision: int = 0
    media: int = 0

    def add(self, cand: Candidate) -> None:
        self.members.append(cand)
        self.units += cand.units
        self.vision += cand.vision
        self.media += cand.media

    def remove(self, cand: Candidate) -> None:
        self.members.remove(cand)
        self.units -= cand.units
        self.vision -= cand.vision
        self.media -= cand.media


class PackerSettings(Protocol):
    """The packer settings a state is checked against."""

    capacity: int
    buffer_size: int
    max_held: int
    align: int
    max_wait: int | None
    max_bytes: int | None
    budget: VisionBudget

    def settings(self) -> dict[str, Any]: ...


def corrupt(name: str, value: object, rule: str) -> NoReturn:
    """Raise the ValueError of a bad field of a packer state."""
    raise ValueError(f"packer state: {name}={shown(value)} {rule}; {_FIX}")


def checked_dict(value: object, what: str, names: Sequence[str]) -> dict[str, Any]:
    """``value`` if it is a dict with exactly the keys ``names``; ValueError otherwise."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a dict, got {type(value).__name__}; {_FIX}")
    missing = [name for name in names if name not in value]
    extra = [name for name in value if name not in names]
    if missing or extra:
        raise ValueError(
            f"{what} must have the keys {list(names)}: missing {missing}, unknown {extra}; {_FIX}"
        )
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def state_int(value: object, name: str, low: int = 0, high: int = _INT_MAX) -> int:
    """``value`` if it is an int in ``[low, high]``; ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        corrupt(name, value, f"must be an int in [{low}, {high}]")
    return value


@dataclass(frozen=True)
class CheckedState:
    """A saved state once every field of it is valid."""

    emitted: int
    next_deadline_bin: int
    held: list[Candidate]
    deadline_bins: list[int]
    stats: PackerCounters
    count_bounded: bool
    """Saved by a buffer bounded by its count alone (no growth settings): it restores as one."""


class StateReader:
    """Checks a saved state against ``packer``'s settings (:meth:`read`)."""

    def __init__(self, packer: PackerSettings) -> None:
        self.packer = packer
        self.cap_units = packer.capacity // packer.align

    def read(self, state: object) -> CheckedState:
        """The checked state; ValueError naming the first bad field."""
        state = checked_dict(state, "packer state", STATE_KEYS)
        version = state["version"]
        if version not in _READABLE_VERSIONS or isinstance(version, bool):
            raise ValueError(
                f"packer state version={version!r} must be one of {list(_READABLE_VERSIONS)}; it "
                "was saved by an incompatible energon_pack: restore with that version or start "
                "a fresh run"
            )
        current = self.packer.settings()
        saved_names = state["settings"] if isinstance(state["settings"], dict) else {}
        count_bounded = not any(name in saved_names for name in GROWTH_SETTINGS)
        if count_bounded:
            current = {k: v for k, v in current.items() if k not in GROWTH_SETTINGS}
        saved_settings = checked_dict(state["settings"], "packer state: settings", tuple(current))
        for name, value in current.items():
            saved = saved_settings[name]
            if saved != value or isinstance(saved, bool) != isinstance(value, bool):
                raise ValueError(
                    f"packer state was saved with {name}={saved!r} but this packer has "
                    f"{name}={value!r}; restore with the same setting or start a fresh run"
                )
        emitted = state_int(state["emitted"], "emitted")
        next_bin = state_int(state["next_deadline_bin"], "next_deadline_bin")
        limit = self.packer.buffer_size if count_bounded else self.packer.max_held
        held = self._held(state["held"], emitted, next_bin, version, limit)
        self._check_deadline_bins(state["deadline_bins"], held, emitted, next_bin)
        stats = self._stats(state["stats"], emitted, version)
        deadline_bins = list(state["deadline_bins"])
        return CheckedState(emitted, next_bin, held, deadline_bins, stats, count_bounded)

    def _held(
        self, value: object, emitted: int, next_bin: int, version: int, limit: int
    ) -> list[Candidate]:
        shape = _HELD_FIELDS[version]
        if not isinstance(value, list):
            corrupt("held", value, f"must be a list of {shape}")
        packer = self.packer
        if len(value) >= limit:
            corrupt(
                "len(held)",
                len(value),
                f"must be below {limit}, the most the buffer holds (buffer_size="
                f"{packer.buffer_size}, or max_size with min_rows); the packer emits at that count",
            )
        held: list[Candidate] = []
        keys: set[Key] = set()
        for index, item in enumerate(value):
            name = f"held[{index}]"
            if not isinstance(item, (list, tuple)) or len(item) != shape.count(",") + 1:
                corrupt(name, item, f"must be {shape}")
            key, length, pushed_at, deadline_bin, nbytes, *vision_media = item
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                corrupt(f"{name}.key", key, "must be a str or int")
            if key in keys:
                corrupt(f"{name}.key", key, "must be unique (it is held twice)")
            keys.add(key)
            length = state_int(length, f"{name}.length", 1, self.cap_units * packer.align)
            low = held[-1].pushed_at if held else 0
            pushed_at = state_int(pushed_at, f"{name}.pushed_at", low, emitted)
            if packer.max_wait is None:
                if deadline_bin != -1:
                    corrupt(f"{name}.deadline_bin", deadline_bin, "must be -1 without max_wait")
            else:
                deadline_bin = state_int(deadline_bin, f"{name}.deadline_bin", 0, next_bin - 1)
                if emitted - pushed_at > packer.max_wait:
                    corrupt(
                        f"{name}.pushed_at",
                        pushed_at,
                        f"must be >= emitted - max_wait = "
                        f"{emitted - packer.max_wait} (no candidate waits longer)",
                    )
            nbytes = state_int(nbytes, f"{name}.nbytes")
            vision, media = self._vision(name, vision_media, length)
            units = aligned_length(length, packer.align) // packer.align
            held.append(
                Candidate(key, length, units, pushed_at, deadline_bin, nbytes, vision, media)
            )
        total = sum(c.nbytes for c in held)
        if packer.max_bytes is not None and total > packer.max_bytes:
            corrupt("held nbytes", total, f"must sum to at most max_bytes={packer.max_bytes}")
        return held

    def _vision(self, name: str, saved: list[Any], length: int) -> tuple[int, int]:
        """A held candidate's vision tokens and media, within the budget's caps."""
        if not saved:
            return 0, 0
        budget = self.packer.budget
        vision_cap = min(length, budget.max_vision_tokens or length)
        vision = state_int(saved[0], f"{name}.vision_tokens", 0, vision_cap)
        media = state_int(saved[1], f"{name}.media", 0, budget.max_media or _INT_MAX)
        return vision, media

    def _check_deadline_bins(
        self, order: object, held: list[Candidate], emitted: int, next_bin: int
    ) -> None:
        if not isinstance(order, list) or not all(_is_int(b) for b in order):
            corrupt("deadline_bins", order, "must be a list of ints")
        packer = self.packer
        if packer.max_wait is None:
            if order or next_bin:
                corrupt(
                    "deadline_bins", order, "must be [] with next_deadline_bin=0 without max_wait"
                )
            return
        members: dict[int, list[Candidate]] = {}
        for cand in held:
            members.setdefault(cand.deadline_bin, []).append(cand)
        if len(set(order)) != len(order) or sorted(order) != sorted(members):
            corrupt(
                "deadline_bins",
                order,
                f"must list each deadline bin of the held candidates once ({sorted(members)})",
            )
        if len(order) > packer.max_wait:
            corrupt("deadline_bins", order, f"must list at most max_wait={packer.max_wait} bins")
        budget = packer.budget
        for bin_id, cands in members.items():
            fits = budget.fits(sum(c.vision for c in cands), sum(c.media for c in cands))
            if sum(c.units for c in cands) > self.cap_units or not fits:
                corrupt(
                    "deadline_bins",
                    order,
                    f"bin {bin_id} must fit the capacity {packer.capacity} and the vision caps "
                    "(its candidates do not)",
                )
        assert packer.max_wait is not None
        deadlines = sorted(min(c.pushed_at for c in cands) for cands in members.values())
        deadlines = [d + packer.max_wait for d in deadlines]
        if any(deadline < emitted + j for j, deadline in enumerate(deadlines)):
            corrupt(
                "deadline_bins",
                order,
                f"must be emittable in deadline order after "
                f"emitted={emitted} (deadlines {deadlines})",
            )

    def _stats(self, value: object, emitted: int, version: int) -> PackerCounters:
        names = tuple(f.name for f in dataclasses.fields(PackerCounters))
        if version == 2 and isinstance(value, dict):  # saved before the vision figures
            value = {**{n: 0 for n in names if n.startswith(("vision", "media"))}, **value}
        value = checked_dict(value, "packer state: stats", names)
        capacity = self.packer.capacity
        if value["capacity"] != capacity or isinstance(value["capacity"], bool):
            corrupt("stats.capacity", value["capacity"], f"must be capacity={capacity}")
        counts = {
            name: state_int(value[name], f"stats.{name}")
            for name in names
            if name not in ("capacity", "emitted_by")
        }
        emitted_by = checked_dict(
            value["emitted_by"], "packer state: stats.emitted_by", EMIT_REASONS
        )
        by = {r: state_int(emitted_by[r], f"stats.emitted_by.{r}") for r in EMIT_REASONS}
        if counts["bins"] != emitted or sum(by.values()) != emitted:
            corrupt(
                "stats.bins",
                counts["bins"],
                f"must equal emitted={emitted} and the sum "
                f"of stats.emitted_by ({sum(by.values())})",
            )
        if not counts["real_tokens"] <= counts["aligned_tokens"] <= emitted * capacity:
            corrupt(
                "stats.aligned_tokens",
                counts["aligned_tokens"],
                f"must be between stats.real_tokens={counts['real_tokens']} and bins * capacity",
            )
        if counts["items"] < emitted or counts["max_wait"] > counts["total_wait"]:
            corrupt(
                "stats.items",
                counts["items"],
                "must be >= stats.bins, and stats.max_wait <= stats.total_wait",
            )
        for total, most in (("vision_tokens", "vision_tokens_max"), ("media", "media_max")):
            if not counts[most] <= counts[total] <= counts[most] * emitted:
                corrupt(
                    f"stats.{most}",
                    counts[most],
                    f"must be at most stats.{total}={counts[total]} and at least its mean per bin",
                )
        return PackerCounters(capacity=capacity, emitted_by=by, **counts)
