"""Global workers: which worker of the whole job a packing state belongs to.

Energon splits the data among ``world_size x num_workers`` global workers (a rank without
worker processes counts as one) and numbers them ``rank x num_workers + local worker``. A
worker's data slice and seed depend only on that number and the global count, so a carry-over
buffer belongs to a global worker, not to a (rank, local worker) pair: it resumes on any
topology with the same global count, once ``energon checkpoint redist`` has moved the per-rank
states (which keeps the global order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron.energon.worker import WorkerConfig


@dataclass(frozen=True)
class Topology:
    """Ranks and workers per rank of a data-parallel job (``num_workers=0``: no worker
    processes, each rank then is one global worker)."""

    world_size: int
    num_workers: int

    @classmethod
    def of(cls, worker_config: WorkerConfig) -> Topology:
        return cls(worker_config.world_size, worker_config.num_workers)

    @property
    def global_workers(self) -> int:
        """``world_size x num_workers``, a rank without workers counting as one."""
        return self.world_size * max(self.num_workers, 1)

    def global_worker(self, rank: int, local_worker: int) -> int:
        """The global index of ``local_worker`` of ``rank`` (Energon's numbering)."""
        return rank * max(self.num_workers, 1) + local_worker

    def __str__(self) -> str:
        ranks = "rank" if self.world_size == 1 else "ranks"
        workers = "worker" if self.num_workers == 1 else "workers"
        return f"{self.world_size} {ranks} x {self.num_workers} {workers}"


def current_global_worker(worker_config: WorkerConfig) -> int:
    """The global index of the worker (or worker-less rank) this code runs in."""
    return Topology.of(worker_config).global_worker(
        worker_config.rank, worker_config.rank_worker_id()
    )


def saved_index(saved: Mapping[str, Any], name: str) -> int | None:
    """``saved[name]`` (``global_workers`` or ``global_worker`` of a saved fingerprint) if it is
    an int >= 0, else None (a malformed value is left to the fingerprint comparison)."""
    value = saved.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def resumable_topologies(global_workers: int) -> list[str]:
    """Every ``RANKSxWORKERS`` with ``global_workers`` global workers (workers > 0)."""
    return [
        f"{ranks}x{global_workers // ranks}"
        for ranks in range(1, global_workers + 1)
        if global_workers % ranks == 0
    ]


def topology_refusal(saved: Topology | None, saved_global: int, current: Topology) -> str:
    """The message refusing a state of ``saved_global`` global workers, saved at ``saved``
    (None: not known), on a loader of the ``current`` topology."""
    count = _global_workers(saved_global)
    at = f"at {saved} = {count}" if saved is not None else f"with {count}"
    if saved is not None and saved.num_workers == 0:
        use = (
            f"restore it at {saved} (a state saved without worker processes cannot be "
            "redistributed)"
        )
    else:
        choices = resumable_topologies(saved_global)
        listed = ", ".join(choices[:-1]) + " or " + choices[-1] if choices[1:] else choices[0]
        use = (
            f"use {listed} (ranks x workers per rank; redistribute the per-rank states with "
            "`energon checkpoint redist --new-world-size N` when the number of ranks changes)"
        )
    return (
        f"cannot restore the loader state: it was saved {at}, this loader runs {current} = "
        f"{_global_workers(current.global_workers)}. Each packing state "
        "belongs to one global worker (world_size x num_workers), so that count must stay "
        f"{saved_global}: {use}, or start a fresh run"
    )


def _global_workers(count: int) -> str:
    return f"{count} global worker" if count == 1 else f"{count} global workers"
