"""Checked restore of an Energon loader that packs with :class:`CarryOverPackingDataset`.

Energon restores a rank's state only into a loader with the same number of workers and fails
with a bare assertion otherwise. :func:`restore_state_rank` first compares the state with the
loader, naming each difference (the global worker count ``world_size x num_workers`` and the
topologies that keep it, the global worker each packing state belongs to, packing settings,
...), and only then hands it to ``loader.restore_state_rank``.

A state resumes on another topology with the same global worker count once Energon has moved
the per-rank states (``energon checkpoint redist``, or ``energon-pack redist``): each packing
state then lands on the worker of the same global index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from megatron.energon import SavableDataLoader
from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint
from megatron.energon.state import FlexState

from energon_pack.checks import shown
from energon_pack.energon.carry_over import CarryOverPackingDataset
from energon_pack.energon.state_check import STATE_FIX
from energon_pack.energon.workers import Topology, saved_index, topology_refusal


def well_formed_worker_states(value: object) -> bool:
    """Whether ``value`` (a loader state's ``worker_states``) is a non-empty list of
    ``SavableDatasetCheckpoint`` (one per worker) or ``FlexState`` (no workers)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(s, (SavableDatasetCheckpoint, FlexState)) for s in value)
    )


def restore_state_rank(
    loader: SavableDataLoader[Any], state: SavableDataLoaderState | None
) -> None:
    """``loader.restore_state_rank(state)``, after checking that ``state`` was saved by a loader
    with the same settings (ValueError naming each difference otherwise)."""
    if state is not None:
        check_loader_state(loader, state)
    loader.restore_state_rank(state)


def check_loader_state(loader: SavableDataLoader[Any], state: SavableDataLoaderState) -> None:
    """Raise ValueError if ``state`` (from ``save_state_rank``, possibly redistributed by
    ``energon checkpoint redist``) cannot resume ``loader`` exactly: a malformed state, another
    global worker count, another number of workers per rank, packing states of other global
    workers, or saved under other settings, over another dataset, or with a malformed or
    inconsistent field (each named)."""
    wrapper = _packing_wrapper(loader.dataset)
    config = wrapper.worker_config
    num_workers = config.num_workers
    current = Topology.of(config)
    if not isinstance(state, SavableDataLoaderState):
        raise ValueError(
            f"the loader state must be a SavableDataLoaderState (from save_state_rank), got "
            f"{type(state).__name__}; pass what save_state_rank returned, or None for a fresh run"
        )
    worker_states = state.worker_states
    kind = SavableDatasetCheckpoint if num_workers else FlexState
    if not well_formed_worker_states(worker_states):
        raise ValueError(
            f"the loader state's worker_states={shown(worker_states)} must be a non-empty list "
            f"of {kind.__name__} (one per worker, or one FlexState without workers); "
            f"{STATE_FIX}"
        )
    saved_workers = (
        len(worker_states)
        if all(isinstance(s, SavableDatasetCheckpoint) for s in worker_states)
        else 0
    )
    packing = [
        (index, packing_state)
        for index, worker_state in enumerate(worker_states)
        for packing_state in packing_states(worker_state)
    ]
    for _, packing_state in packing:
        _check_global_count(packing_state.get("settings"), saved_workers, current)
    if saved_workers != num_workers:
        raise ValueError(_workers_refusal(saved_workers, current))
    for index, packing_state in packing:
        wrapper.check_settings(
            packing_state.get("settings"),
            what=f"the packing state of worker {index}",
            global_worker=current.global_worker(config.rank, index),
        )
    if not num_workers and len(worker_states) != 1:
        raise ValueError(
            f"the loader state's worker_states=<{len(worker_states)} FlexStates> must be exactly "
            f"one (a loader without workers saves one); {STATE_FIX}"
        )
    next_worker = state.next_worker_id
    if not _is_int(next_worker) or not 0 <= next_worker < max(num_workers, 1):
        raise ValueError(
            f"the loader state's next_worker_id={next_worker!r} must be an int in "
            f"[0, {max(num_workers, 1)}); {STATE_FIX}"
        )
    for index, worker_state in enumerate(worker_states):
        if isinstance(worker_state, SavableDatasetCheckpoint) and (
            not _is_int(worker_state.offset) or worker_state.offset < 0
        ):
            raise ValueError(
                f"the loader state's worker_states[{index}].offset={worker_state.offset!r} "
                f"must be an int >= 0; {STATE_FIX}"
            )
    for index, packing_state in packing:
        wrapper.check_state(
            packing_state,
            what=f"the packing state of worker {index}",
            global_worker=current.global_worker(config.rank, index),
        )


def _check_global_count(saved: object, saved_workers: int, current: Topology) -> None:
    """Refuse a packing state saved with another global worker count, naming the topology it
    was saved (or redistributed) for and those that would resume it. Values that are not
    positive ints are left to the fingerprint comparison."""
    if not isinstance(saved, Mapping):
        return
    saved_global = saved_index(saved, "global_workers")
    if not saved_global or saved_global == current.global_workers:
        return
    per_rank = max(saved_workers, 1)
    topology = (
        Topology(saved_global // per_rank, saved_workers) if saved_global % per_rank == 0 else None
    )
    raise ValueError(topology_refusal(topology, saved_global, current))


def _workers_refusal(saved_workers: int, current: Topology) -> str:
    """The message refusing a rank state of ``saved_workers`` workers (same global count)."""
    if not saved_workers or not current.num_workers:
        return (
            f"cannot restore the loader state: it was saved with num_workers={saved_workers}, "
            f"this loader has num_workers={current.num_workers}. Energon keeps the state of a "
            "loader without worker processes apart from one with workers, so either both have "
            "num_workers=0 or neither: restore with num_workers="
            f"{saved_workers}, or start a fresh run"
        )
    return (
        f"cannot restore the loader state: it holds the worker states of num_workers="
        f"{saved_workers}, this loader has num_workers={current.num_workers} ({current}). It "
        "was saved "
        "or redistributed for another world size: redistribute the per-rank states for this "
        f"one (`energon checkpoint redist ... --new-world-size {current.world_size}`), run "
        f"{saved_workers} workers per rank, or start a fresh run"
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _packing_wrapper(dataset: Any) -> CarryOverPackingDataset[Any, Any]:
    node = dataset
    while not isinstance(node, CarryOverPackingDataset):
        node = getattr(node, "dataset", None)
        if node is None:
            raise ValueError(
                f"loader dataset {dataset} does not pack with CarryOverPackingDataset; build it "
                "with PackingTaskEncoder and packing_buffer_size set"
            )
    return node


def packing_states(value: Any) -> Iterator[Mapping[str, Any]]:
    """Every saved CarryOverPackingDataset state nested in ``value``."""
    if isinstance(value, Mapping):
        if value.get("__class__") == CarryOverPackingDataset.__name__:
            yield value
            return
        for item in value.values():
            yield from packing_states(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from packing_states(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from packing_states(getattr(value, field.name))
