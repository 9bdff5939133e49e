"""Checked redistribution of per-rank loader states to a new data-parallel world size.

The moving is Energon's own ``energon checkpoint redist`` (``megatron.energon.tools.checkpoint``),
called as it is. Around it, :func:`redistribute` checks what that tool leaves to a bare
assertion or to a late failure: the new world size must divide the global worker count, states
saved without worker processes cannot move, and the files must be every rank of one checkpoint
(each packing state on the global worker it belongs to); and it creates the output folder,
which Energon 7.4.1 does not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron.energon.epathlib import EPath
from megatron.energon.state import FlexState
from megatron.energon.tools.checkpoint import RankStateIterable, command_redist, natural_sort_key

from energon_pack.energon.resume import packing_states
from energon_pack.energon.workers import resumable_topologies, saved_index


def redistribute(files: Sequence[Path], out: Path, new_world_size: int) -> list[Path]:
    """Redistribute the rank states in ``files`` (one per rank, ``save_state_rank`` results
    or Megatron's ``{"dataloader_state_dict": ...}``) to ``new_world_size`` ranks in ``out``
    with Energon's ``redist``; returns the written files, rank by rank. Raises ValueError,
    before anything is written, naming the problem and the fix."""
    if len(files) < 2:
        raise ValueError(
            f"{len(files)} state file given: Energon 7.4.1's redist needs the per-rank files of "
            "at least 2 ranks (it names its output files after the number that differs between "
            "their names), so a checkpoint of one rank cannot be redistributed; resume it on "
            "one rank with the same number of workers"
        )
    files = sorted(files, key=lambda file: natural_sort_key(file.name))  # as Energon reads them
    try:
        ranks = RankStateIterable([EPath(str(file)) for file in files])
    except OSError:
        raise
    except Exception as error:  # Energon raises bare Exceptions and assertions here
        raise ValueError(
            f"Energon cannot read {', '.join(map(str, files))} as the rank states of one "
            f"checkpoint ({type(error).__name__}: {error}): pass the files saved by every rank, "
            "named alike but for the rank number (state_rank0.pt, state_rank1.pt, ...)"
        ) from error
    states = ranks.rank_states
    per_rank = ranks.get_num_workers()
    if any(isinstance(worker, FlexState) for state in states for worker in state.worker_states):
        raise ValueError(
            f"{files[0]}: the states were saved without worker processes (num_workers=0, one "
            "FlexState per rank), which Energon cannot redistribute: resume them at "
            f"world_size={len(states)} with num_workers=0, or save with num_workers >= 1"
        )
    global_workers = len(states) * per_rank
    if new_world_size <= 0 or global_workers % new_world_size:
        sizes = [int(topology.split("x")[0]) for topology in resumable_topologies(global_workers)]
        raise ValueError(
            f"--new-world-size={new_world_size} does not divide the {global_workers} global "
            f"workers ({len(states)} ranks x {per_rank} workers): use one of "
            f"{', '.join(map(str, sizes))}"
        )
    _check_complete(files, [list(state.worker_states) for state in states], global_workers)
    out.mkdir(parents=True, exist_ok=True)
    command_redist.main(
        [*map(str, files), str(out), "--new-world-size", str(new_world_size)],
        standalone_mode=False,
    )
    if ranks.is_global_checkpoint:
        return [out / files[0].name]
    return [out / ranks.file_pattern_func(rank) for rank in range(new_world_size)]


def _check_complete(files: Sequence[Path], ranks: list[list[Any]], global_workers: int) -> None:
    """Each packing state must sit on its global worker: in the file of rank r (the r-th in
    Energon's order), worker w on r x workers + w of ``global_workers`` (states of an earlier
    energon_pack, without the index, are not checked)."""
    per_rank = len(ranks[0])
    for rank, workers in enumerate(ranks):
        for worker, worker_state in enumerate(workers):
            expected = rank * per_rank + worker
            for settings in _settings(worker_state):
                count = saved_index(settings, "global_workers")
                index = saved_index(settings, "global_worker")
                if count is not None and count != global_workers:
                    raise ValueError(
                        f"{files[rank]}: the states were saved with {count} global "
                        f"workers, these {len(ranks)} files hold {global_workers}: pass every "
                        "rank's state file of one checkpoint"
                    )
                if index is not None and index != expected:
                    raise ValueError(
                        f"{files[rank]}: worker {worker} holds the packing state of "
                        f"global worker {index}, not {expected}: pass every rank's state file "
                        "of one checkpoint, named so that they sort by rank (state_rank0.pt, "
                        "state_rank1.pt, ...)"
                    )


def _settings(worker_state: Any) -> Iterator[Mapping[str, Any]]:
    for state in packing_states(worker_state):
        settings = state.get("settings")
        if isinstance(settings, Mapping):
            yield settings
