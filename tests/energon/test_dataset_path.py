"""A wrong dataset path in Python: Energon answers ``Invalid dataset at PATH`` before a task
encoder sees anything; :func:`check_dataset_path` says what is there and the fix, with the
words of ``energon-pack tune``, and passes what Energon opens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from megatron.energon import WorkerConfig, get_train_dataset

from energon_pack import PackingTaskEncoder
from energon_pack.energon import check_dataset_path


def test_energon_alone_gives_a_bare_message(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^Invalid dataset at "):
        get_train_dataset(
            str(tmp_path),
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
            batch_size=1,
            task_encoder=PackingTaskEncoder(tokenizer=None, seq_length=256),
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
        )


@pytest.mark.parametrize(
    ("where", "words"),
    [
        ("folder", r"is not a prepared Energon dataset \(no \.nv-meta/\); prepare it with"),
        ("missing", r"does not exist; pass the folder of a dataset prepared with 'energon prep"),
        ("file.txt", r"is a file but neither a metadataset \.yaml nor a \.jsonl dataset"),
    ],
)
def test_a_wrong_path_is_named_with_the_fix(tmp_path: Path, where: str, words: str) -> None:
    path = tmp_path / where
    if where == "folder":
        path.mkdir()
    elif where.endswith(".txt"):
        path.write_text("x")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} {words}"):
        check_dataset_path(str(path))


def test_what_energon_opens_passes(vlm_demo_path: Path, tmp_path: Path) -> None:
    assert check_dataset_path(str(vlm_demo_path)) == vlm_demo_path
    for name in ("mix.yaml", "rows.jsonl"):
        (tmp_path / name).write_text("")
        assert check_dataset_path(tmp_path / name) == tmp_path / name
