"""Seeded state-tampering fuzzer: real saved states (packer states by the thousand, loader states
of a small text dataset) are mutated (items deleted, duplicated or swapped, values of the wrong
type, out of range, huge, negative or None, keys dropped or added). Each mutant is either
refused by a ValueError naming a field, leaving the restored object unchanged, or restores to
a stream that delivers every sample exactly once (the very same stream where the mutation
changed nothing)."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import savable_loader, text_dataset, train_dataset

from energon_pack.energon import restore_state_rank
from energon_pack.packing.bins import Bin, aligned_length
from energon_pack.packing.online import OnlineBinPacker

Path_ = tuple[Any, ...]
"""Keys and indexes from the root of a state to one of its values."""

BAD_VALUES: list[Any] = [None, "x", -1, 0, 1, 2**63, 10**30, 1.5, True, [], {}, (), [0]]


def paths(tree: Any, prefix: Path_ = ()) -> Iterator[Path_]:
    """Every path into the dicts, lists and tuples of ``tree`` (not the root)."""
    items: Any = ()
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list | tuple):
        items = enumerate(tree)
    for key, value in items:
        yield (*prefix, key)
        yield from paths(value, (*prefix, key))


def get(tree: Any, path: Path_) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def edit(tree: Any, path: Path_, change: Callable[[Any, Any], Any]) -> Any:
    """A copy of ``tree`` where the container holding ``path`` is ``change(container, key)``."""
    if len(path) == 1:
        return change(tree, path[0])
    inner = edit(tree[path[0]], path[1:], change)
    if isinstance(tree, tuple):
        return (*tree[: path[0]], inner, *tree[path[0] + 1 :])
    out = copy.copy(tree)
    out[path[0]] = inner
    return out


def _as(container: Any, items: list[Any]) -> Any:
    return tuple(items) if isinstance(container, tuple) else items


def mutate(tree: Any, rng: random.Random, allowed: Callable[[Path_], bool]) -> tuple[str, Any]:
    """One random mutation of ``tree`` at a path ``allowed`` accepts, and its description."""
    path = rng.choice([p for p in paths(tree) if allowed(p)])
    value = get(tree, path)
    kind = rng.choice(["replace", "replace", "delete", "duplicate", "swap", "add"])

    def change(container: Any, key: Any) -> Any:
        if isinstance(container, dict):
            out = copy.copy(container)
            if kind == "delete":
                del out[key]
            elif kind == "add":
                out["extra"] = rng.choice(BAD_VALUES)
            else:
                out[key] = replacement
            return out
        items = list(container)
        if kind == "delete":
            del items[key]
        elif kind == "duplicate":
            items.insert(key, items[key])
        elif kind == "swap" and len(items) > 1:
            other = rng.randrange(len(items))
            items[key], items[other] = items[other], items[key]
        else:
            items[key] = replacement
        return _as(container, items)

    choices = list(BAD_VALUES)
    if isinstance(value, int) and not isinstance(value, bool):
        choices += [value + 1, value - 1, -value, value * 2 + 7]
    replacement = rng.choice(choices)
    shown = replacement if kind == "replace" else ""
    return f"{kind} {'.'.join(map(str, path))} {shown!r:.80}", edit(tree, path, change)


def attempt(description: str, call: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``call(*args)`` and None, or None and the message of the ValueError it raises; any
    other exception fails the test."""
    try:
        return call(*args), None
    except ValueError as error:
        return None, str(error)
    except Exception as error:
        pytest.fail(f"{description}: {type(error).__name__}: {error}")


def same(a: Any, b: Any) -> bool:
    """Equal, types included (True is not 1, 2.0 is not 2)."""
    return repr(a) == repr(b)


# ---------------------------------------------------------------------------------- the packer
PACKERS = [
    {"capacity": 64, "buffer_size": 6, "align": 4, "max_wait": 3, "min_fill": 0.9},
    {"capacity": 100, "buffer_size": 5, "max_wait": None, "min_fill": 1.0, "max_bytes": 500},
    {"capacity": 1024, "buffer_size": 16, "align": 8},
]
FIELD = re.compile(
    r"^packer state(: [\w.\[\]() ]+(=| must )| version=| was saved with \w+=| must )"
)


def _stream(rng: random.Random, capacity: int, count: int) -> list[tuple[int, int]]:
    return [(rng.randint(1, capacity), rng.randint(0, 200)) for _ in range(count)]


def _run(packer: OnlineBinPacker, stream: list[tuple[int, int]], start: int) -> list[Bin]:
    bins = [
        b for k, (n, nb) in enumerate(stream[start:], start) for b in packer.push(k, n, nbytes=nb)
    ]
    return bins + packer.flush()


def test_tampered_packer_states_are_refused_by_name_or_resume_exactly_once() -> None:
    rng = random.Random(27)
    counts: Counter[str] = Counter()
    for config, _ in itertools.product(PACKERS, range(12)):
        capacity = config["capacity"]
        stream = _stream(rng, capacity, 60)
        cut = rng.randrange(1, len(stream))
        packer = OnlineBinPacker(**config)
        for key, (length, nbytes) in enumerate(stream[:cut]):
            packer.push(key, length, nbytes=nbytes)
        state = packer.state_dict()
        expected_rest = _run(_loaded(config, state), stream, cut)
        for _ in range(100):
            description, mutant = mutate(state, rng, lambda path: True)
            counts["tried"] += 1
            victim = _loaded(config, state)
            kept = victim.state_dict()
            _, error = attempt(description, victim.load_state_dict, mutant)
            if error is not None:
                assert FIELD.match(error), f"{description}: unnamed refusal {error}"
                assert victim.state_dict() == kept, f"{description}: a refusal changed the packer"
                counts["refused by name"] += 1
                continue
            held = victim.held_keys
            bins = _run(victim, stream, cut)
            if same(mutant, state):
                assert bins == expected_rest, f"{description}: a no-op changed the stream"
                counts["restored exactly (no-op)"] += 1
                continue
            emitted = Counter(key for b in bins for key in b.keys)
            assert emitted == Counter(held + list(range(cut, len(stream)))), description
            for b in bins:
                assert b.keys, description
                assert sum(aligned_length(n, victim.align) for n in b.lengths) <= capacity
            counts["restored exactly once"] += 1
    print(dict(counts))
    assert counts["tried"] == 3600
    assert counts["refused by name"] > counts["tried"] // 2


def _loaded(config: dict[str, Any], state: dict[str, Any]) -> OnlineBinPacker:
    packer = OnlineBinPacker(**config)
    packer.load_state_dict(copy.deepcopy(state))
    return packer


# ---------------------------------------------------------------------------------- the loader
LOADER = {"buffer_size": 6, "seq_length": 1024, "max_wait": 2, "min_fill": 0.9}
SAMPLES = 40
LOADER_MUTANTS = 600


class Epoch:
    """A loader over one epoch (``repeat=False``, no workers); ``rest`` gives the keys of each
    pack left in the epoch."""

    def __init__(self, path: Path) -> None:
        dataset = train_dataset(path, workers=0, repeat=False, **LOADER)
        self.loader = savable_loader(
            dataset, checkpoint_every_sec=0, checkpoint_every_min_n_samples=1
        )
        self._iterator: Iterator[Any] | None = None

    def step(self) -> tuple[str, ...] | None:
        if self._iterator is None:
            self._iterator = iter(self.loader)
        batch = next(self._iterator, None)
        return None if batch is None else tuple(batch.__keys__)

    def rest(self) -> list[tuple[str, ...]]:
        return list(iter(self.step, None))


@pytest.fixture(scope="module")
def epoch_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lengths = list(itertools.islice(itertools.cycle([120, 300, 500, 80, 700, 260, 410]), SAMPLES))
    return text_dataset(tmp_path_factory.mktemp("tamper"), lengths)


def _packing_state(state: Any) -> dict[str, Any]:
    """The CarryOverPackingDataset state inside a loader state (the object itself)."""
    found = [
        node
        for path in paths(state.worker_states)
        if isinstance(node := get(state.worker_states, path), dict)
        and node.get("__class__") == "CarryOverPackingDataset"
    ]
    assert len(found) == 1
    return found[0]


def _loader_mutant(state: Any, rng: random.Random) -> tuple[str, Any]:
    """A copy of the loader ``state`` with one mutation of its packing state or of its own
    fields (the states of Energon's inner datasets are left alone)."""
    mutant = copy.deepcopy(state)
    if rng.random() < 0.1:
        field, value = rng.choice(
            [
                ("worker_states", []),
                ("worker_states", None),
                ("worker_states", mutant.worker_states * 2),
                ("next_worker_id", rng.choice(BAD_VALUES)),
            ]
        )
        return f"loader {field}={value!r:.80}", dataclasses.replace(mutant, **{field: value})
    packing = _packing_state(mutant)
    description, mutated = mutate(
        dict(packing), rng, lambda path: path[0] != "datasets" and path[:1] != ("__class__",)
    )
    packing.clear()
    packing.update(mutated)
    return description, mutant


def test_tampered_loader_states_are_refused_by_name_or_resume_exactly_once(
    epoch_path: Path,
) -> None:
    rng = random.Random(6)
    run = Epoch(epoch_path)
    before: list[tuple[str, ...]] = []
    cuts: list[tuple[Any, list[str], list[tuple[str, ...]]]] = []
    while (pack := run.step()) is not None:
        before.append(pack)
        state = run.loader.save_state_rank()
        seqs = _packing_state(state)["_buffer_seqs"]
        if seqs and len(cuts) < 8 and rng.random() < 0.5:
            cuts.append((state, [k for p in before for k in p], []))
    for state, delivered, rest in cuts:
        resumed = Epoch(epoch_path)
        restore_state_rank(resumed.loader, state)
        rest += resumed.rest()
        assert Counter(delivered + [k for p in rest for k in p]) == _all_keys()
    counts: Counter[str] = Counter()
    target = Epoch(epoch_path)  # refused mutants leave it untouched: reused
    for index in range(LOADER_MUTANTS):
        state, delivered, rest = cuts[index % len(cuts)]
        description, mutant = _loader_mutant(state, rng)
        counts["tried"] += 1
        _, error = attempt(description, restore_state_rank, target.loader, mutant)
        if error is not None:
            assert NAMED.search(error), f"{description}: unnamed refusal {error}"
            counts["refused by name"] += 1
            continue
        # A saved length is checked once its sample is read back: refused then.
        got, error = attempt(f"{description} (accepted)", target.rest)
        target = Epoch(epoch_path)
        if error is not None:
            assert NAMED.search(error), f"{description}: unnamed late refusal {error}"
            counts["refused by name once the buffer is read"] += 1
            continue
        if same(mutant, state):
            assert got == rest, f"{description}: a no-op changed the stream"
            counts["restored exactly (no-op)"] += 1
        elif any(part in description for part in UNCHECKABLE):
            counts["restored, not checkable without the data"] += 1
        else:
            keys = Counter(delivered + [k for p in got for k in p])
            assert keys == _all_keys(), f"{description}: not every sample exactly once"
            counts["restored exactly once"] += 1
    print(dict(counts))
    assert counts["refused by name"] > counts["tried"] // 2


NAMED = re.compile(r"\w+(\[\d+\])*(\.\w+)*(=| must |: saved )")
UNCHECKABLE = ("_buffer._restore_keys.", "_source_done")
"""Mutations a valid state can also hold: a restore key pointing at another sample of the
dataset, and whether the source ran dry (only the data tells)."""


def _all_keys() -> Counter[str]:
    return Counter(f"t{index:05d}" for index in range(SAMPLES))
