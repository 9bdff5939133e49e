"""``energon-pack redist`` on hostile inputs (issue #35, item 5).

Real 2x2 Energon loaders save their rank states at steps 2, 4 and 5. Each attack is refused by
name before anything is written: a truncated or corrupt file, ranks of different steps or
settings, an output folder holding the inputs or other rank files, and a pickle that would run
code (run in a child process, which must not create its marker file). The files that pass move
exactly as Energon's own tool moves them.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import packing_states, savable_loader, stop_workers, text_dataset, train_dataset
from megatron.energon.tools.checkpoint import command_redist

from energon_pack.cli import main
from energon_pack.energon import redistribute

ROOT = Path(__file__).resolve().parents[2]
STEPS = (2, 4, 5)


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Path]]:
    """Per step, the two rank files of a 2x2 run saved after that many packs per rank."""
    base = tmp_path_factory.mktemp("hostile_redist")
    data = text_dataset(base / "data", [60 + (index * 97) % 340 for index in range(40)])
    out: dict[int, list[Path]] = {}
    for step in STEPS:
        folder = base / f"step{step}"
        folder.mkdir()
        out[step] = []
        for rank in range(2):
            dataset = train_dataset(data, 4, workers=2, rank=rank, world_size=2, seq_length=512)
            loader = savable_loader(
                dataset, checkpoint_every_sec=0, checkpoint_every_min_n_samples=1
            )
            batches = iter(loader)
            for _ in range(step):
                next(batches)
            out[step].append(folder / f"state_rank{rank}.pt")
            torch.save(loader.save_state_rank(), out[step][-1])
            stop_workers(loader)
    return out


def copied(files: list[Path], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy(file, folder / file.name)) for file in files]


def refused(files: list[Path], out: Path, capsys: pytest.CaptureFixture[str], size: int = 1) -> str:
    """The one-line error of ``energon-pack redist`` (exit status 2); nothing written."""
    assert main(["redist", *map(str, files), str(out), "--new-world-size", str(size)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("energon-pack: error: "), err
    assert err.count("\n") == 1, err
    return err


def contents(path: Path) -> dict[str, bytes]:
    """What a torch.save file holds, but for its random serialization id."""
    with zipfile.ZipFile(path) as archive:
        return {
            name.split("/", 1)[1]: archive.read(name)
            for name in archive.namelist()
            if not name.endswith("serialization_id")
        }


@pytest.mark.parametrize("world_size", [1, 4])
def test_checked_files_move_exactly_as_energons_own_redist(
    saves: dict[int, list[Path]], tmp_path: Path, world_size: int
) -> None:
    written = redistribute(saves[5], tmp_path / "ours", world_size)
    (tmp_path / "energon").mkdir()
    command_redist.main(
        [*map(str, saves[5]), str(tmp_path / "energon"), "--new-world-size", str(world_size)],
        standalone_mode=False,
    )
    assert [path.name for path in written] == [f"state_rank{r}.pt" for r in range(world_size)]
    assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "energon"))
    for path in written:
        assert contents(path) == contents(tmp_path / "energon" / path.name)


def test_what_a_state_may_hold_is_read(saves: dict[int, list[Path]], tmp_path: Path) -> None:
    """Values of the types the unpickler resolves (protocol 2 names some as Python 2's
    ``__builtin__``) come through the move unchanged."""
    files = copied(saves[4], tmp_path / "ckpt")
    state = torch.load(files[1], weights_only=False)
    held = {
        "set": {1, 2},
        "frozenset": frozenset({"a"}),
        "bytearray": bytearray(b"xy"),
        "complex": 1 + 2j,
        "ordered": collections.OrderedDict(a=1),
        "scalar": np.int64(7),
        "array": np.arange(3, dtype=np.float32),
        "tensor": torch.arange(4),
        "bytes": b"\x00\xff",
    }
    next(iter(packing_states(state)))["_extra"] = held
    torch.save(state, files[1])
    [moved] = redistribute(files, tmp_path / "out", 1)
    got = next(
        packing["_extra"]
        for packing in packing_states(torch.load(moved, weights_only=False))
        if "_extra" in packing
    )
    assert got.keys() == held.keys()
    assert torch.equal(got.pop("tensor"), held.pop("tensor"))
    assert np.array_equal(got.pop("array"), held.pop("array"))
    assert got == held


def test_megatron_style_files_move_and_a_mix_with_bare_ones_is_refused(
    saves: dict[int, list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "megatron").mkdir()
    files = []
    for file in saves[4]:
        files.append(tmp_path / "megatron" / file.name)
        torch.save({"dataloader_state_dict": torch.load(file, weights_only=False)}, files[-1])
    [moved] = redistribute(files, tmp_path / "moved", 1)
    state = torch.load(moved, weights_only=False)["dataloader_state_dict"]
    assert len(state.worker_states) == 4
    mixed = [saves[4][0], files[1]]
    err = refused(mixed, tmp_path / "mixed", capsys)
    assert f"{saves[4][0]}: a bare loader state, while {files[1]} is Megatron's" in err
    assert not (tmp_path / "mixed").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncated", r"not a file written by torch\.save \(\d+ bytes, no zip archive: truncated"),
        ("empty", r"not a file written by torch\.save \(0 bytes"),
        ("corrupt", r"cannot be read as a saved loader state \(.*truncated or corrupt\?\)"),
        ("tensor", r"holds a Tensor, not a SavableDataLoaderState"),
        ("worker states", r"worker_states must be a non-empty list of SavableDatasetCheckpoint"),
    ],
)
def test_a_damaged_rank_file_is_refused_naming_it(
    saves: dict[int, list[Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: str,
    message: str,
) -> None:
    files = copied(saves[5], tmp_path / "ckpt")
    data = files[1].read_bytes()
    if damage == "truncated":
        files[1].write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        files[1].write_bytes(b"")
    elif damage == "corrupt":  # the pickle's bytes overwritten, the archive intact
        with zipfile.ZipFile(files[1]) as archive:
            pickled = next(name for name in archive.namelist() if name.endswith("data.pkl"))
            start = data.index(archive.read(pickled)[:64])
        files[1].write_bytes(data[:start] + b"\x00" * 64 + data[start + 64 :])
    elif damage == "tensor":
        torch.save(torch.zeros(3), files[1])
    else:
        state = torch.load(files[1], weights_only=False)
        state.worker_states = []
        torch.save(state, files[1])
    err = refused(files, tmp_path / "out", capsys)
    assert re.match(rf"energon-pack: error: {re.escape(str(files[1]))}: {message}", err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("first", "second"), [(2, 5), (2, 4), (4, 5)])
def test_ranks_saved_at_different_steps_are_refused(
    saves: dict[int, list[Path]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    first: int,
    second: int,
) -> None:
    """Energon's own tool takes them, and the resume would replay the packs of steps
    ``first``..``second`` of the earlier rank's workers."""
    files = copied([saves[first][0]], tmp_path / "ckpt") + copied(
        [saves[second][1]], tmp_path / "ckpt"
    )
    err = refused(files, tmp_path / "out", capsys)
    assert (
        f"{files[1]}: its 2 workers had delivered {second} batches (next worker {second % 2}), "
        f"those of {files[0]} {first} (next worker {first % 2}): the ranks were saved at "
        "different steps"
    ) in err
    assert "pass every rank's file of one save" in err
    assert not (tmp_path / "out").exists()
    (tmp_path / "energon").mkdir()
    command_redist.main(
        [*map(str, files), str(tmp_path / "energon"), "--new-world-size", "1"],
        standalone_mode=False,
    )


def test_ranks_saved_under_other_settings_or_micro_batch_sizes_are_refused(
    saves: dict[int, list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = copied(saves[4], tmp_path / "ckpt")
    state = torch.load(files[1], weights_only=False)
    for packing in packing_states(state):
        packing["settings"]["seq_length"] = 1024
    torch.save(state, files[1])
    err = refused(files, tmp_path / "out", capsys)
    assert (
        f"{files[1]}: packed under other settings than {files[0]} (seq_length: 512 vs 1024)" in err
    )
    state = torch.load(saves[4][1], weights_only=False)
    state.micro_batch_size = 2
    torch.save(state, files[1])
    err = refused(files, tmp_path / "out", capsys)
    assert f"{files[1]}: saved with micro_batch_size=2, {files[0]} with None" in err
    assert not (tmp_path / "out").exists()


def test_an_output_folder_holding_the_inputs_or_rank_files_is_refused(
    saves: dict[int, list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = copied(saves[5], tmp_path / "ckpt")
    before = {file: file.read_bytes() for file in files}
    err = refused(files, tmp_path / "ckpt", capsys)
    assert f"OUT_DIR {tmp_path / 'ckpt'} holds the input {files[0]}" in err
    err = refused(files, tmp_path / "ckpt" / ".." / "ckpt", capsys, size=4)  # the same folder
    assert "holds the input" in err
    assert {file: file.read_bytes() for file in files} == before
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["state_rank0.pt", "state_rank1.pt"]
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "state_rank3.pt").write_bytes(b"an earlier redistribution")
    err = refused(files, tmp_path / "earlier", capsys)
    assert f"OUT_DIR {tmp_path / 'earlier'} already holds state_rank3.pt" in err
    assert os.listdir(tmp_path / "earlier") == ["state_rank3.pt"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("kept")
    assert main(["redist", *map(str, files), str(tmp_path / "other"), "--new-world-size", "1"]) == 0
    assert sorted(os.listdir(tmp_path / "other")) == ["notes.txt", "state_rank0.pt"]


CHILD = textwrap.dedent(
    """
    import json, sys
    from energon_pack.cli import main
    out, *files = sys.argv[1:]
    code = main(["redist", *files, out, "--new-world-size", "1"])
    print(json.dumps(code))
    """
)

UNSAFE_LOAD = "import sys, torch; torch.load(sys.argv[1], weights_only=False)"


class _RunsCode:
    """Pickles as a call of ``function(*args)``: unpickling it runs that call."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.function, self.args


def _with_payload(state: Any, payload: Any, where: str) -> Any:
    if where == "file":
        return payload
    if where == "rng":  # deep inside an otherwise genuine state
        state.worker_states[1].state.rng.random = payload
        return state
    packing = next(iter(packing_states(state)))
    packing["_counters"]["skipped"] = payload
    return state


@pytest.mark.parametrize(
    ("name", "where", "named"),
    [
        ("os.system", "file", "posix.system"),
        ("os.system", "rng", "posix.system"),
        ("builtins.exec", "packing", "builtins.exec"),
        ("subprocess.call", "rng", "subprocess.call"),
    ],
)
def test_a_pickle_that_runs_code_is_refused_without_running_it(
    saves: dict[int, list[Path]], tmp_path: Path, name: str, where: str, named: str
) -> None:
    marker = tmp_path / "ran"
    call = {
        "os.system": _RunsCode(os.system, f"touch {marker}"),
        "builtins.exec": _RunsCode(exec, f"open({str(marker)!r}, 'w').close()"),
        "subprocess.call": _RunsCode(subprocess.call, ["touch", str(marker)]),
    }[name]
    files = copied(saves[4], tmp_path / "ckpt")
    torch.save(_with_payload(torch.load(files[1], weights_only=False), call, where), files[1])
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "out"), *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "2"
    assert f"energon-pack: error: {files[1]}: its pickle names {named}" in done.stderr
    assert "nothing in it was run" in done.stderr
    assert not marker.exists()
    assert not (tmp_path / "out").exists()
    # The payload is real: an unrestricted load of the same file runs it.
    subprocess.run(
        [sys.executable, "-c", UNSAFE_LOAD, str(files[1])], capture_output=True, timeout=300
    )
    assert marker.exists()


def test_a_class_of_energon_that_is_not_a_state_is_refused(
    saves: dict[int, list[Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron.energon.epathlib import EPath

    files = copied(saves[4], tmp_path / "ckpt")
    state = torch.load(files[1], weights_only=False)
    state.worker_states[0].state.rng.random = EPath(str(tmp_path))
    torch.save(state, files[1])
    err = refused(files, tmp_path / "out", capsys)
    assert f"{files[1]}: its pickle names megatron.energon.epathlib.epath.EPath" in err
