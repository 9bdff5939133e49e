"""Checked restore of an Energon loader that packs with :class:`CarryOverPackingDataset`.

Energon restores a rank's state only into a loader with the same number of workers and fails
with a bare assertion otherwise. :func:`restore_state_rank` first compares the state with the
loader, naming each difference (``num_workers``, ``world_size``, packing settings, ...), and
only then hands it to ``loader.restore_state_rank``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from megatron.energon import SavableDataLoader
from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint

from energon_pack.energon.carry_over import CarryOverPackingDataset
from energon_pack.fingerprint import check_fingerprint


def restore_state_rank(
    loader: SavableDataLoader[Any], state: SavableDataLoaderState | None
) -> None:
    """``loader.restore_state_rank(state)``, after checking that ``state`` was saved by a loader
    with the same settings (ValueError naming each difference otherwise)."""
    if state is not None:
        check_loader_state(loader, state)
    loader.restore_state_rank(state)


def check_loader_state(loader: SavableDataLoader[Any], state: SavableDataLoaderState) -> None:
    """Raise ValueError if ``state`` (from ``save_state_rank``) cannot resume ``loader`` exactly:
    another number of workers, or packing states saved under other settings."""
    wrapper = _packing_wrapper(loader.dataset)
    num_workers = wrapper.worker_config.num_workers
    saved_workers = (
        len(state.worker_states)
        if all(isinstance(s, SavableDatasetCheckpoint) for s in state.worker_states)
        else 0
    )
    for index, worker_state in enumerate(state.worker_states):
        for packing_state in _packing_states(worker_state):
            check_fingerprint(
                packing_state.get("settings"),
                wrapper.fingerprint,
                what=f"the packing state of worker {index}",
            )
    if saved_workers != num_workers:
        raise ValueError(
            f"cannot restore the loader state: it was saved with num_workers={saved_workers}, "
            f"this loader has num_workers={num_workers}. An exact resume needs the same number "
            "of workers: restore with those, or start a fresh run."
        )


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


def _packing_states(value: Any) -> Iterator[Mapping[str, Any]]:
    """Every saved CarryOverPackingDataset state nested in ``value``."""
    if isinstance(value, Mapping):
        if value.get("__class__") == CarryOverPackingDataset.__name__:
            yield value
            return
        for item in value.values():
            yield from _packing_states(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _packing_states(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _packing_states(getattr(value, field.name))
