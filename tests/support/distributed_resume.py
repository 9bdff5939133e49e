"""Run by tests/energon/test_energon_scaling.py under torchrun (gloo, CPU): each rank (2
workers) packs a few packs, saves its loader state as Megatron does
(``{"dataloader_state_dict": state}``, one file per rank), then runs on to the end of the epoch.

Usage: torchrun --nproc_per_node=2 tests/support/distributed_resume.py DATASET CUT OUT_DIR

Writes ``OUT_DIR/saved/state_rank{R}.pt`` and ``OUT_DIR/packs.json``: per rank, the packs
(global worker, index, keys) before and after the save.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import savable_loader, stop_workers, train_dataset  # next to this script

from energon_pack.energon import PackedBatch


def described(batch: PackedBatch) -> list[object]:
    _, global_worker, index, *_ = batch.__restore_key__
    return [global_worker, index, list(batch.__keys__)]


def main(dataset: str, cut: int, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    loader = savable_loader(
        train_dataset(
            Path(dataset), 4, workers=2, rank=rank, world_size=world_size, seq_length=512
        ),
        checkpoint_every_sec=0,
        checkpoint_every_min_n_samples=1,
    )
    batches = iter(loader)
    before = [described(next(batches)) for _ in range(cut)]
    (out / "saved").mkdir(parents=True, exist_ok=True)
    state = {"dataloader_state_dict": loader.save_state_rank()}
    torch.save(state, out / "saved" / f"state_rank{rank}.pt")
    after = [described(batch) for batch in batches]
    stop_workers(loader)  # now, not seconds later at exit
    gathered: list[object] = [None] * world_size
    dist.all_gather_object(gathered, {"before": before, "after": after})
    if rank == 0:
        (out / "packs.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
