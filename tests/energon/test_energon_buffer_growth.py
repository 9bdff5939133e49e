"""The quick start's setup on short turns: the Energon loader fills rows at
``packing_buffer_size=16``, warns once when a bounded buffer cannot, and skips an overlong sample
by default (counted and logged) instead of stopping the loader."""

from __future__ import annotations

import logging
import random
import warnings
from pathlib import Path

import pytest
from helpers import batches, make_encoder, text_dataset, train_dataset
from megatron.energon import WorkerConfig, get_train_dataset

from energon_pack import BufferConfig, PackingWarning

SEQ = 8192


@pytest.fixture(scope="module")
def short_turns(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    lengths = [rng.randint(100, 600) for _ in range(600)]
    return text_dataset(tmp_path_factory.mktemp("short_turns"), lengths)


def bounded(path: Path) -> object:
    """The quick start's loader over ``path`` with a buffer bounded by its count alone."""
    return get_train_dataset(
        path,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        packing_buffer_size=16,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=make_encoder(buffer=BufferConfig(min_rows=None)),
        repeat=False,
    )


def fill(dataset: object) -> tuple[float, int]:
    """Bin fill of the packs, the last three left out (the end-of-epoch flush empties a buffer
    of up to two rows' worth), and the number of samples delivered."""
    packs = list(batches(dataset))
    used = sum(int(batch.cu_seqlens_padded[-1]) for batch in packs[:-3])
    return used / ((len(packs) - 3) * SEQ), sum(len(batch.__keys__) for batch in packs)


def test_the_quick_start_setup_fills_rows_of_short_turns(short_turns: Path) -> None:
    grown, delivered = fill(train_dataset(short_turns, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        count_bound, _ = fill(bounded(short_turns))
    assert delivered == 600
    assert grown > 0.99
    assert count_bound < 0.75


def test_a_bounded_buffer_that_cannot_fill_rows_warns_once(short_turns: Path) -> None:
    dataset = bounded(short_turns)
    with pytest.warns(PackingWarning) as caught:
        for _ in batches(dataset):
            pass
    underfilled = [w for w in caught if "candidate buffer was full" in str(w.message)]
    assert len(underfilled) == 1
    assert "raise packing_buffer_size to about" in str(underfilled[0].message)


def test_an_overlong_sample_is_skipped_by_default(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = text_dataset(tmp_path, [300, 9000, 400, 500])
    with caplog.at_level(logging.WARNING, logger="energon_pack.energon"):
        packs = list(batches(train_dataset(path, 16)))
    keys = [key for batch in packs for key in batch.__keys__]
    assert sorted(keys) == ["t00000", "t00002", "t00003"]
    assert packs[-1].packing_stats.skipped == {"overlong": 1}
    assert "skipping sample 't00001' (overlong)" in caplog.text
    with pytest.raises(ValueError, match="t00001"):
        list(batches(train_dataset(path, 16, overlong="error")))
