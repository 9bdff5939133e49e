"""Checked redistribution of per-rank loader states to a new data-parallel world size.

The moving is Energon's own ``energon checkpoint redist`` (``megatron.energon.tools.checkpoint``),
called as it is. Around it, :func:`redistribute` checks what that tool leaves to a bare
assertion, to a late failure or to nothing at all:

* each file is read once and unpickled by a restricted unpickler that resolves only the classes
  a saved loader state holds (Energon's state classes, numpy arrays, tensors): a pickle naming
  anything else (``os.system``, ``builtins.eval``, ...) is refused before it is looked up, and a
  truncated or foreign file is refused by name. Energon's tool then reads copies of exactly
  those checked bytes, so nothing it unpickles can run code;
* the new world size must divide the global worker count, and states saved without worker
  processes cannot move;
* the files must be every rank of one save: each packing state on the global worker it belongs
  to, the same settings, the same micro-batch size, and every rank at the same step (the same
  number of batches delivered, the same next worker), else the resume would replay or skip
  batches;
* the output folder must not hold the inputs or other rank files of their name (Energon would
  overwrite them, or leave stale ranks beside the new ones); it is created (Energon 7.4.1 does
  not), and the new files are moved into it only once all are written.
"""

from __future__ import annotations

import _compat_pickle
import collections
import contextlib
import dataclasses
import io
import logging
import os
import pickle
import re
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from megatron.energon.flavors.base_dataset import State
from megatron.energon.flavors.webdataset.sample_loader import SliceState
from megatron.energon.rng import SystemRngState
from megatron.energon.savable_loader import (
    SavableDataLoaderState,
    SavableDatasetCheckpoint,
    SavableDatasetState,
)
from megatron.energon.state import FlexState
from megatron.energon.tools.checkpoint import (
    command_redist,
    detect_and_replicate_pattern,
    natural_sort_key,
)

from energon_pack.checks import shown
from energon_pack.energon.resume import packing_states, well_formed_worker_states
from energon_pack.energon.workers import resumable_topologies, saved_index

logger = logging.getLogger("energon_pack.energon.redist")

_FIX = (
    "pass the files saved by every rank at one step, as torch.save wrote them, named alike but "
    "for the rank number (state_rank0.pt, state_rank1.pt, ...)"
)


def redistribute(files: Sequence[Path], out: Path, new_world_size: int) -> list[Path]:
    """Redistribute the rank states in ``files`` (one per rank, ``save_state_rank`` results
    or Megatron's ``{"dataloader_state_dict": ...}``) to ``new_world_size`` ranks in ``out``
    with Energon's ``redist``; returns the written files, rank by rank. Raises ValueError,
    before anything is written, naming the file, the problem and the fix (OSError when a file
    cannot be read or written)."""
    if len(files) < 2:
        raise ValueError(
            f"{len(files)} state file given: Energon 7.4.1's redist needs the per-rank files of "
            "at least 2 ranks (it names its output files after the number that differs between "
            "their names), so a checkpoint of one rank cannot be redistributed; resume it on "
            "one rank with the same number of workers"
        )
    files = sorted(files, key=lambda file: natural_sort_key(file.name))  # as Energon reads them
    try:
        name_of = detect_and_replicate_pattern([file.name for file in files])
    except Exception as error:  # Energon raises bare Exceptions here
        raise ValueError(
            f"Energon cannot read {', '.join(map(str, files))} as the rank states of one "
            f"checkpoint ({error}): {_FIX}"
        ) from error
    _check_out(files, out)
    saved = [_load_rank(file) for file in files]
    if len({megatron for _, _, megatron in saved}) > 1:
        bare = next(
            file for file, (_, _, megatron) in zip(files, saved, strict=True) if not megatron
        )
        raise ValueError(
            f"{bare}: a bare loader state, while {files[0] if bare != files[0] else files[1]} "
            "is Megatron's {'dataloader_state_dict': ...}: these are not one checkpoint; "
            f"{_FIX}"
        )
    states = [state for _, state, _ in saved]
    per_rank = len(states[0].worker_states)
    for file, state in zip(files, states, strict=True):
        if len(state.worker_states) != per_rank:
            raise ValueError(
                f"{file}: {len(state.worker_states)} worker states, {files[0]} has {per_rank}: "
                f"every rank of one checkpoint has as many workers; {_FIX}"
            )
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
    _check_one_save(files, states)
    names = [name_of(rank) for rank in range(new_world_size)]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".energon-pack-redist-", dir=out) as staging:
        copies, moved = Path(staging) / "in", Path(staging) / "out"
        copies.mkdir()
        moved.mkdir()  # Energon 7.4.1 writes only into an existing folder
        for file, (data, _, _) in zip(files, saved, strict=True):
            (copies / file.name).write_bytes(data)
        try:
            inputs = [str(copies / file.name) for file in files]
            with contextlib.redirect_stdout(io.StringIO()) as said:  # names the staging folder
                command_redist.main(
                    [*inputs, str(moved), "--new-world-size", str(new_world_size)],
                    standalone_mode=False,
                )
            logger.debug("energon checkpoint redist: %s", said.getvalue().strip())
        except OSError:
            raise
        except Exception as error:  # checked above: what is left is a failed write
            raise OSError(
                f"{out}: Energon's redist failed writing the new rank states "
                f"({type(error).__name__}: {error}); nothing was written to {out}"
            ) from error
        for name in names:
            os.replace(moved / name, out / name)
    return [out / name for name in names]


def _check_out(files: Sequence[Path], out: Path) -> None:
    """Refuse an output folder that holds an input, or any file named like a rank file of
    ``files`` (which Energon would overwrite, or leave beside the new ranks)."""
    if not out.is_dir():
        return
    for file in files:
        if file.parent.exists() and os.path.samefile(file.parent, out):
            raise ValueError(
                f"OUT_DIR {out} holds the input {file}: Energon would write the new rank files "
                "over the inputs (and leave the old ranks past the new world size beside them); "
                "write into a new or empty folder"
            )
    pattern = _rank_name_pattern([file.name for file in files])
    held = sorted(
        (entry.name for entry in out.iterdir() if pattern.fullmatch(entry.name)),
        key=natural_sort_key,
    )
    if held:
        raise ValueError(
            f"OUT_DIR {out} already holds {', '.join(held)}: the new rank files would overwrite "
            "them or be mixed with them; write into a new or empty folder"
        )


def _rank_name_pattern(names: Sequence[str]) -> re.Pattern[str]:
    """Names like ``names`` but for the rank number (the one numeric part that differs)."""
    tokens = [re.split(r"(\d+)", name) for name in names]
    varying = next(
        (
            position
            for position in range(1, len(tokens[0]), 2)
            if len({int(token[position]) for token in tokens}) > 1
        ),
        None,
    )
    if varying is None:  # not reached: Energon's pattern check found one
        return re.compile(re.escape(names[0]))
    first = tokens[0]
    return re.compile(
        re.escape("".join(first[:varying])) + r"\d+" + re.escape("".join(first[varying + 1 :]))
    )


def _load_rank(file: Path) -> tuple[bytes, SavableDataLoaderState, bool]:
    """The bytes of ``file``, the loader state they hold (unpickled without running code) and
    whether it is Megatron's ``{"dataloader_state_dict": state}``; ValueError naming the file."""
    data = file.read_bytes()
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise ValueError(
            f"{file}: not a file written by torch.save ({len(data)} bytes, no zip archive: "
            f"truncated, or another format); {_FIX}"
        )
    try:
        value = torch.load(
            io.BytesIO(data), map_location="cpu", pickle_module=_RESTRICTED, weights_only=False
        )
    except _Refused as error:
        raise ValueError(
            f"{file}: {error}; a loader state holds only Energon's state classes, numpy arrays "
            "and tensors, so this file is not one (nothing in it was run); " + _FIX
        ) from None
    except Exception as error:
        raise ValueError(
            f"{file}: cannot be read as a saved loader state ({type(error).__name__}: {error}; "
            f"truncated or corrupt?); {_FIX}"
        ) from None
    megatron = isinstance(value, Mapping) and "dataloader_state_dict" in value
    state = value["dataloader_state_dict"] if megatron else value
    if isinstance(state, list):
        raise ValueError(
            f"{file}: holds a list of rank states (save_state_global), which this "
            "redistribution does not take; save each rank's state with save_state_rank"
        )
    if not isinstance(state, SavableDataLoaderState):
        raise ValueError(
            f"{file}: holds a {type(state).__name__}, not a SavableDataLoaderState (what "
            f"save_state_rank returns, bare or as Megatron's {{'dataloader_state_dict': ...}}); "
            f"{_FIX}"
        )
    workers = state.worker_states
    if not well_formed_worker_states(workers):
        raise ValueError(
            f"{file}: worker_states must be a non-empty list of SavableDatasetCheckpoint (one "
            f"per worker) or one FlexState, got {shown(workers, 77)}; {_FIX}"
        )
    for index, worker in enumerate(workers):
        if isinstance(worker, SavableDatasetCheckpoint) and _delivered(worker) is None:
            raise ValueError(
                f"{file}: worker_states[{index}] has offset={shown(worker.offset, 77)} and "
                f"sample_index={shown(getattr(worker.state, 'sample_index', None), 77)}, not ints "
                f">= 0; {_FIX}"
            )
    return data, state, megatron


def _delivered(worker: SavableDatasetCheckpoint) -> int | None:
    """Batches the worker had delivered when its rank saved (None: malformed)."""
    base: object = 0 if worker.state is None else getattr(worker.state, "sample_index", None)
    offset: object = worker.offset
    if not isinstance(base, int) or not isinstance(offset, int) or not _is_count(base):
        return None
    return base + offset if _is_count(offset) else None


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


def _check_one_save(files: Sequence[Path], states: Sequence[SavableDataLoaderState]) -> None:
    """Every rank saved at the same step of one run: same micro-batch size, packing settings,
    next worker and number of delivered batches (each rank delivers one per step)."""
    first = states[0]
    first_settings = _run_settings(files[0], first)
    first_steps = sum(_delivered(worker) or 0 for worker in first.worker_states)
    for file, state in zip(files[1:], states[1:], strict=True):
        if state.micro_batch_size != first.micro_batch_size:
            raise ValueError(
                f"{file}: saved with micro_batch_size={state.micro_batch_size!r}, {files[0]} "
                f"with {first.micro_batch_size!r}: these are not one run's checkpoint; {_FIX}"
            )
        settings = _run_settings(file, state)
        if settings is not None and first_settings is not None and settings != first_settings:
            differ = sorted(
                name
                for name in settings.keys() | first_settings.keys()
                if settings.get(name) != first_settings.get(name)
            )
            listing = ", ".join(
                f"{name}: {shown(first_settings.get(name), 77)} vs {shown(settings.get(name), 77)}"
                for name in differ[:5]
            )
            raise ValueError(
                f"{file}: packed under other settings than {files[0]} ({listing}"
                f"{', ...' if len(differ) > 5 else ''}): these are not one run's checkpoint; "
                f"{_FIX}"
            )
        steps = sum(_delivered(worker) or 0 for worker in state.worker_states)
        if steps != first_steps or state.next_worker_id != first.next_worker_id:
            raise ValueError(
                f"{file}: its {len(state.worker_states)} workers had delivered {steps} batches "
                f"(next worker {state.next_worker_id!r}), those of {files[0]} {first_steps} "
                f"(next worker {first.next_worker_id!r}): the ranks were saved at different "
                "steps, and a resume would replay or skip batches; pass every rank's file of "
                "one save (one iteration's checkpoint). A run that was itself resumed from "
                "a redistribution can deliver unequal counts per rank; such files move only "
                "unchecked, with Energon's `energon checkpoint redist`"
            )


def _run_settings(file: Path, state: SavableDataLoaderState) -> dict[str, Any] | None:
    """The packing settings of ``state`` but for each worker's own global index (None: no
    packing state), checked to be the same on every worker of the rank."""
    found: dict[str, Any] | None = None
    for index, worker in enumerate(state.worker_states):
        for settings in _settings(worker):
            own = {name: value for name, value in settings.items() if name != "global_worker"}
            if found is None:
                found = own
            elif own != found:
                raise ValueError(
                    f"{file}: worker {index} packed under other settings than worker 0 of the "
                    f"same rank: the file is not one rank's saved state; {_FIX}"
                )
    return found


def _settings(worker_state: Any) -> Iterator[Mapping[str, Any]]:
    for state in packing_states(worker_state):
        settings = state.get("settings")
        if isinstance(settings, Mapping):
            yield settings


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# The restricted unpickler.


class _Refused(pickle.UnpicklingError):
    """A pickle names something a loader state does not hold."""


def _latin1(text: object, encoding: object) -> bytes:
    """Protocol-2 pickles spell bytes as ``_codecs.encode(str, "latin1")``; nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise _Refused("the pickle encodes text other than latin1 bytes")
    return text.encode("latin1")


_MULTIARRAY = sys.modules.get("numpy._core.multiarray") or sys.modules["numpy.core.multiarray"]
_NAMED: dict[tuple[str, str], Any] = {
    ("_codecs", "encode"): _latin1,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "bytearray"): bytearray,
    ("builtins", "complex"): complex,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    **{  # numpy 2 pickles name numpy._core, numpy 1 numpy.core: both are the same functions
        (module, name): getattr(_MULTIARRAY, name)
        for module in ("numpy.core.multiarray", "numpy._core.multiarray")
        for name in ("_reconstruct", "scalar")
    },
    **{
        (kind.__module__, kind.__qualname__): kind
        for kind in (
            SavableDataLoaderState,
            SavableDatasetCheckpoint,
            SavableDatasetState,
            SystemRngState,
            SliceState,
            FlexState,
        )
    },
}
"""What the saved states of Energon 7.4.1 name (torch resolves its storage types itself)."""


def _allowed(module: str, name: str) -> Any:
    """The object a loader state's pickle may name as ``module.name``, without importing
    anything: the names above, or another of Energon's state classes (a subclass of its
    ``State`` or ``FlexState``) in a module already imported."""
    if (module, name) in _NAMED:
        return _NAMED[(module, name)]
    loaded = sys.modules.get(module) if module.startswith("megatron.energon.") else None
    kind = getattr(loaded, name, None) if "." not in name else None
    if (
        isinstance(kind, type)
        and kind.__module__ == module
        and (
            issubclass(kind, FlexState)
            or (issubclass(kind, State) and dataclasses.is_dataclass(kind))
        )
    ):
        return kind
    raise _Refused(f"its pickle names {module}.{name}")


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # torch.save writes protocol 2, whose names are Python 2's (__builtin__.set): mapped
        # as pickle's own find_class maps them
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        return _allowed(module, name)


def _restricted_load(file: Any, **kwargs: Any) -> Any:
    return _StateUnpickler(file, **kwargs).load()


_RESTRICTED = ModuleType("energon_pack_restricted_pickle")
"""A ``pickle_module`` for ``torch.load`` whose unpickler resolves only :func:`_allowed`."""
_RESTRICTED.Unpickler = _StateUnpickler  # type: ignore[attr-defined]
_RESTRICTED.load = _restricted_load  # type: ignore[attr-defined]
_RESTRICTED.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
