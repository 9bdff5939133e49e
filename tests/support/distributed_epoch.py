"""Run by tests/energon/test_energon.py under torchrun: each rank packs its share of an epoch
(gloo, CPU).

Usage: torchrun --nproc_per_node=2 tests/support/distributed_epoch.py DATASET OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

from energon_pack.energon import PackingTaskEncoder
from energon_pack.media import MediaConfig


def main(dataset: str, out: str) -> None:
    dist.init_process_group("gloo")
    worker_config = WorkerConfig.default_worker_config(num_workers=0)
    media = MediaConfig(
        max_pixels=28 * 28 * 64,
        video_max_pixels=28 * 28 * 16,
        video_min_pixels=28 * 28 * 4,
        video_total_pixels=28 * 28 * 256,
    )
    loader = get_savable_loader(
        get_train_dataset(
            dataset,
            worker_config=worker_config,
            batch_size=1,
            packing_buffer_size=16,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=PackingTaskEncoder(seq_length=8192, media=media),
            repeat=False,
        )
    )
    keys = [key for batch in loader for key in batch.__keys__]
    gathered: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, keys)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
