"""Run by tests/train/test_trainers.py under torchrun: ``Trainer`` with ``PackedLoss("sample")``
on 2 ranks.

Each rank trains the tiny Qwen2 model of test_trainers on chat rows (gloo, CPU) and writes the
row ids of its micro-batches, its logged losses and (rank 0) the parameters after every step.

Usage: torchrun --nproc_per_node=2 tests/support/distributed_trainer.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# Run by path, this script has its own folder (tests/support) on sys.path; test_trainers is in
# tests/train.
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "train"))
from test_trainers import build, model_for, train

from energon_pack import PackedLoss


def main(out: Path) -> None:
    model = model_for("qwen2")
    trainer, collate, snapshots = build(
        "Trainer", "qwen2", model, out / "run", compute_loss_func=PackedLoss("sample")
    )
    losses, states, steps = train(trainer, collate, snapshots)
    ids = [[[row["id"] for row in rows] for rows in step] for step in steps]
    (out / f"rank{_rank()}.json").write_text(json.dumps({"losses": losses, "steps": ids}))
    if _rank() == 0:
        torch.save(states, out / "states.pt")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    if dist.is_initialized():  # stop gloo's threads before the interpreter exits
        dist.destroy_process_group()
    # The results are written; leave without the interpreter's teardown, where a native thread
    # the Trainer started can still abort the process ('terminate called without an active
    # exception', seen in CI after every result was written).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
