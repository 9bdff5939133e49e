"""``PackingTaskEncoder`` without a packing buffer warns once, naming the setting."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

from helpers import batches, make_encoder
from megatron.energon import WorkerConfig, get_train_dataset

from energon_pack import PackingTaskEncoder, PackingWarning


def build(path: Path, encoder: PackingTaskEncoder, buffer: int | None) -> object:
    return get_train_dataset(
        path,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        packing_buffer_size=buffer,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )


def packing_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PackingWarning)]


def test_no_packing_buffer_warns_once_with_a_starting_value(vlm_demo_path: Path) -> None:
    encoder = make_encoder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = build(vlm_demo_path, encoder, None)
        build(vlm_demo_path, encoder, None)
    (message,) = packing_warnings(caught)
    assert "no packing_buffer_size" in message
    assert "every row holds one sample" in message
    assert "e.g. 16 to start with" in message
    # The warning is true: rows hold one sample each.
    rows = [batch.__keys__ for batch in itertools.islice(batches(dataset), 12)]
    assert [len(keys) for keys in rows] == [1] * 12


def test_a_packing_buffer_does_not_warn(vlm_demo_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dataset = build(vlm_demo_path, make_encoder(), 16)
    assert packing_warnings(caught) == []
    first = next(iter(batches(dataset)))
    assert len(first.__keys__) > 1
