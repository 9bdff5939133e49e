"""Resume on another data-parallel size: real Energon loaders, one per rank through
``WorkerConfig(rank, world_size, num_workers)``, over a small text dataset in a temp dir.

Reproducible scaling: with ``world_size x num_workers`` fixed, each global worker packs the same
stream, so 2x2, 1x4 and 4x1 give the same packs per global worker and the same global batches.
A 2x2 checkpoint redistributed with Energon's own ``energon checkpoint redist`` resumes at 1x4
and 4x1 exactly; another global worker count is refused first, by name."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    SUPPORT,
    packing_states,
    savable_loader,
    stop_workers,
    text_dataset,
    torchrun,
    train_dataset,
)
from megatron.energon.tools.checkpoint import command_redist

from energon_pack.cli import main
from energon_pack.energon import restore_state_rank

SAMPLES = 40
Pack = tuple[int, int, tuple[str, ...]]
"""A pack as (global worker, its index in that worker's stream, sample keys)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 text samples of 60 to 400 tokens: with seq_length 512 and buffer 4, packs hold one to
    several samples and some samples are carried over."""
    lengths = [60 + (index * 97) % 340 for index in range(SAMPLES)]
    return text_dataset(tmp_path_factory.mktemp("scaling"), lengths)


def loader(path: Path, rank: int, world_size: int, workers: int, *, repeat: bool = False) -> Any:
    dataset = train_dataset(
        path, 4, workers=workers, rank=rank, world_size=world_size, repeat=repeat, seq_length=512
    )
    return savable_loader(dataset, checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)


def described(batches: Iterator[Any], count: int | None = None) -> list[Pack]:
    """``count`` packs (None: to the end of the epoch), with the global worker and index that
    Energon's loader puts into each restore key."""
    out: list[Pack] = []
    for batch in batches:
        _, global_worker, index, *_ = batch.__restore_key__
        out.append((global_worker, index, tuple(batch.__keys__)))
        if count is not None and len(out) == count:
            break
    return out


def packs_of(loader: Any, count: int | None = None) -> list[Pack]:
    """``count`` packs of a fresh ``loader`` (None: its epoch), its workers then stopped."""
    try:
        return described(iter(loader), count)
    finally:
        stop_workers(loader)


def by_worker(packs: list[Pack]) -> dict[int, list[tuple[str, ...]]]:
    """Each global worker's packs, in its order."""
    out: dict[int, list[tuple[str, ...]]] = {}
    for global_worker, _, keys in sorted(packs):
        out.setdefault(global_worker, []).append(keys)
    return out


def redistribute(files: list[Path], out: Path, world_size: int) -> list[Path]:
    """Energon's own ``energon checkpoint redist FILES OUT --new-world-size N`` (in process);
    Energon 7.4.1 writes only into an existing folder."""
    out.mkdir()
    command_redist.main(
        [*map(str, files), str(out), "--new-world-size", str(world_size)], standalone_mode=False
    )
    return [out / f"state_rank{rank}.pt" for rank in range(world_size)]


def resumed(path: Path, files: list[Path], workers: int) -> list[Pack]:
    """Every pack to the end of the epoch of one loader per rank file, each restored with the
    checked restore."""
    packs: list[Pack] = []
    for rank, file in enumerate(files):
        rank_loader = loader(path, rank, len(files), workers)
        restore_state_rank(rank_loader, torch.load(file, weights_only=False))
        packs += packs_of(rank_loader)
    return packs


TOPOLOGIES = [(2, 2), (1, 4), (4, 1)]


def test_the_same_global_worker_count_gives_the_same_packs_and_global_batches(
    data: Path,
) -> None:
    """Per rank, Energon's loader takes packs from its workers in turn; a global batch of
    ``world_size x num_workers x k`` packs therefore holds the packs k..2k-1 of every global
    worker at any topology: the same multiset, in another order within the batch."""
    per_rank = 6
    runs: dict[tuple[int, int], list[list[Pack]]] = {}
    for world_size, workers in TOPOLOGIES:
        count = per_rank * 4 // (world_size * workers) * workers
        runs[world_size, workers] = [
            packs_of(loader(data, rank, world_size, workers, repeat=True), count)
            for rank in range(world_size)
        ]
    streams = {
        topology: by_worker([pack for rank in ranks for pack in rank])
        for topology, ranks in runs.items()
    }
    assert streams[2, 2] == streams[1, 4] == streams[4, 1]
    assert sorted(streams[2, 2]) == [0, 1, 2, 3]

    def global_batches(ranks: list[list[Pack]]) -> list[Counter[tuple[str, ...]]]:
        step = len(ranks[0]) // 3  # three global batches, 2 packs of each global worker
        return [
            Counter(keys for rank in ranks for _, _, keys in rank[at : at + step])
            for at in range(0, len(ranks[0]), step)
        ]

    assert global_batches(runs[2, 2]) == global_batches(runs[1, 4]) == global_batches(runs[4, 1])
    # The order within a global batch is not the same (rank by rank, worker by worker).
    order_2x2 = [pack for step in zip(*runs[2, 2], strict=True) for pack in step]
    assert order_2x2 != runs[1, 4][0]


@pytest.fixture(scope="module")
def checkpoint(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A 2x2 run cut after 3 packs per rank (each rank's next worker is then worker 1): the
    rank states saved with ``save_state_rank``, the packs before the cut and those the
    uninterrupted run delivered after it."""
    folder = tmp_path_factory.mktemp("checkpoint") / "saved"
    folder.mkdir()
    before: list[Pack] = []
    after: list[Pack] = []
    files = []
    for rank in range(2):
        rank_loader = loader(data, rank, 2, 2)
        batches = iter(rank_loader)
        before += described(batches, 3)
        state = rank_loader.save_state_rank()
        assert state.next_worker_id == 1
        files.append(folder / f"state_rank{rank}.pt")
        torch.save(state, files[-1])
        after += described(batches)
        stop_workers(rank_loader)
    return {"files": files, "before": before, "after": after}


@pytest.mark.parametrize(("world_size", "workers"), [(1, 4), (4, 1)])
def test_a_2x2_checkpoint_redistributed_by_energon_resumes_exactly(
    data: Path, checkpoint: dict[str, Any], tmp_path: Path, world_size: int, workers: int
) -> None:
    files = redistribute(checkpoint["files"], tmp_path / "redist", world_size)
    after = resumed(data, files, workers)
    assert sorted(after) == sorted(checkpoint["after"])
    assert by_worker(after) == by_worker(checkpoint["after"])
    delivered = [key for _, _, keys in checkpoint["before"] + after for key in keys]
    assert sorted(delivered) == [f"t{index:05d}" for index in range(SAMPLES)], "not once each"
    carried = sum(  # the cut held samples carried over to later packs
        len(state["_buffer_seqs"])
        for file in checkpoint["files"]
        for state in packing_states(torch.load(file, weights_only=False))
    )
    assert carried


def test_another_global_worker_count_is_refused_naming_the_topologies(
    data: Path, checkpoint: dict[str, Any]
) -> None:
    state = torch.load(checkpoint["files"][0], weights_only=False)
    with pytest.raises(
        ValueError,
        match=(
            r"saved at 2 ranks x 2 workers = 4 global workers, this loader runs 1 rank x 2 "
            r"workers = 2 global workers.*use 1x4, 2x2 or 4x1"
        ),
    ):
        restore_state_rank(loader(data, 0, 1, 2), state)
    # Energon's own restore accepts it (same number of workers per rank); the wrapper then
    # refuses it in the worker, before it packs anything.
    plain = loader(data, 0, 1, 2)
    plain.restore_state_rank(state)
    with pytest.raises(ValueError, match=r"saved with 4 global workers.*runs 1 rank x 2 work"):
        next(iter(plain))


def test_a_redistributed_state_on_the_wrong_workers_per_rank_is_refused_first(
    data: Path, checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    files = redistribute(checkpoint["files"], tmp_path / "redist", 4)
    state = torch.load(files[0], weights_only=False)
    with pytest.raises(AssertionError):  # Energon's own restore: a bare assertion
        loader(data, 0, 2, 2).restore_state_rank(state)
    with pytest.raises(
        ValueError,
        match=r"num_workers=1, this loader has num_workers=2 .*--new-world-size 2",
    ):
        restore_state_rank(loader(data, 0, 2, 2), state)


def test_a_rank_restoring_another_ranks_state_is_refused_by_global_worker(
    data: Path, checkpoint: dict[str, Any]
) -> None:
    state = torch.load(checkpoint["files"][1], weights_only=False)
    with pytest.raises(ValueError, match=r"global_worker: saved 2, now 0\. .*rank 0, worker 0"):
        restore_state_rank(loader(data, 0, 2, 2), state)


def test_energon_pack_redist_moves_a_2x2_checkpoint_to_4x1_into_a_new_folder(
    data: Path, checkpoint: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "new" / "redist"  # not there yet: created
    files = [str(file) for file in checkpoint["files"]]
    assert main(["redist", *reversed(files), str(out), "--new-world-size", "4"]) == 0
    written = [out / f"state_rank{rank}.pt" for rank in range(4)]
    assert f"wrote {', '.join(map(str, written))}" in capsys.readouterr().out
    assert by_worker(resumed(data, written, 1)) == by_worker(checkpoint["after"])


@pytest.mark.parametrize(
    ("which", "size", "message"),
    [
        (
            "both",
            "3",
            r"--new-world-size=3 does not divide the 4 global workers \(2 ranks x 2 "
            r"workers\): use one of 1, 2, 4",
        ),
        ("rank1", "1", r"1 state file given: Energon 7\.4\.1's redist needs the per-rank files"),
        (
            "rank1 as rank0",
            "1",
            r"state_rank0\.pt: worker 0 holds the packing state of global worker 2, not 0: "
            r"pass every rank's state file of one checkpoint",
        ),
    ],
)
def test_energon_pack_redist_refuses_before_writing(
    checkpoint: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    which: str,
    size: str,
    message: str,
) -> None:
    files = [str(file) for file in checkpoint["files"]]
    if which == "rank1 as rank0":
        shutil.copy(files[1], tmp_path / "state_rank0.pt")
        files[0] = str(tmp_path / "state_rank0.pt")
    files = files[1:] if which == "rank1" else files
    out = tmp_path / "redist"
    assert main(["redist", *files, str(out), "--new-world-size", size]) == 2
    assert re.search(rf"^energon-pack: error: .*{message}", capsys.readouterr().err)
    assert not out.exists()


def test_energon_pack_redist_names_a_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [str(tmp_path / f"state_rank{rank}.pt") for rank in range(2)]
    assert main(["redist", *files, str(tmp_path / "out"), "--new-world-size", "1"]) == 3
    assert capsys.readouterr().err.startswith(f"energon-pack: error: {files[0]}: No such file")


def test_torchrun_2x2_saved_per_rank_redistributed_by_energon_resumes_at_1x4(
    data: Path, tmp_path: Path
) -> None:
    """Two processes (gloo) save their rank states as Megatron does; Energon's CLI
    redistributes them; this one process resumes them with 4 workers."""
    script = SUPPORT / "distributed_resume.py"
    torchrun(script, data, 3, tmp_path)
    ranks = json.loads((tmp_path / "packs.json").read_text())
    saved = [tmp_path / "saved" / f"state_rank{rank}.pt" for rank in range(2)]
    (tmp_path / "redist").mkdir()  # Energon 7.4.1 writes only into an existing folder
    energon = Path(sys.executable).parent / "energon"
    redist = [str(energon), "checkpoint", "redist", *map(str, saved), str(tmp_path / "redist")]
    subprocess.run([*redist, "--new-world-size", "1"], check=True, timeout=120)
    state = torch.load(tmp_path / "redist" / "state_rank0.pt", weights_only=False)
    resumed_loader = loader(data, 0, 1, 4)
    restore_state_rank(resumed_loader, state["dataloader_state_dict"])
    after = packs_of(resumed_loader)

    def packs(part: str) -> list[Pack]:
        return [(g, index, tuple(keys)) for rank in ranks for g, index, keys in rank[part]]

    assert sorted(after) == sorted(packs("after"))
    delivered = [key for _, _, keys in packs("before") + after for key in keys]
    assert sorted(delivered) == [f"t{index:05d}" for index in range(SAMPLES)], "not once each"
