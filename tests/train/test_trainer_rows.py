"""Chat rows straight from a trainer into the collator, and the trainer settings that change them.

Rows given as they are equal the same rows read through ``ChatDataset``; rows a trainer
stripped or tokenised are refused with the setting that did it, on real ``Trainer`` and
``SFTTrainer`` instances, and :func:`~energon_pack.check_trainer` names each setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainers import COMMON, build, chat_rows, collator, model_for
from transformers import Trainer, TrainingArguments

from energon_pack import ChatDataset
from energon_pack.train.trainers import check_trainer


def _same(got: Any, want: Any) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value) if torch.is_tensor(value) else got[name] == value


def test_rows_as_they_are_equal_rows_through_chat_dataset() -> None:
    table = chat_rows("qwen2_5_vl")
    model = model_for("qwen2_5_vl")
    collate = collator("qwen2_5_vl", model)
    rows = [table[i] for i in (3, 4, 5, 6)]
    wrapped = ChatDataset(table)
    _same(collate(rows), collate([wrapped[i] for i in (3, 4, 5, 6)]))
    batch = collate.collate([rows[0], {k: v for k, v in rows[1].items() if k != "id"}])
    assert batch.keys == (("r3", "row[1]"),)


def test_stripped_and_tokenised_rows_are_refused_with_the_setting() -> None:
    collate = collator("qwen2", model_for("qwen2"))
    with pytest.raises(ValueError, match=r"removed their columns; pass remove_unused_columns"):
        collate([{}, {}])
    tokenised = {"input_ids": [1, 2, 3], "assistant_masks": [0, 1, 1]}
    with pytest.raises(ValueError, match=r"tokenised the rows.*skip_prepare_dataset"):
        collate([tokenised, tokenised])
    row = chat_rows("qwen2_vl")[4]
    del row["videos"]
    with pytest.raises(ValueError, match=r"'r4' has video parts but no 'videos' column"):
        collator("qwen2_vl", model_for("qwen2_vl"))([row, row])
    with pytest.raises(ValueError, match="is a int; the collator takes EncodedSample, a chat row"):
        collate([1, 2])


def test_trainer_that_removes_columns_fails_at_the_first_micro_batch(tmp_path: Path) -> None:
    model = model_for("qwen2")
    args = TrainingArguments(output_dir=str(tmp_path), **{**COMMON, "remove_unused_columns": True})
    rows = list(chat_rows("qwen2"))  # a list: Trainer strips each row in its collator wrapper
    trainer = Trainer(
        model=model, args=args, train_dataset=rows, data_collator=collator("qwen2", model)
    )
    with pytest.raises(ValueError, match=r"remove_unused_columns=True removes"):
        check_trainer(trainer)
    with pytest.raises(ValueError, match=r"removed their columns; pass remove_unused_columns"):
        trainer.train()


def test_sft_trainer_that_prepares_the_dataset_fails_at_the_first_micro_batch(
    tmp_path: Path,
) -> None:
    model = model_for("qwen2")
    trainer, _, _ = build(
        "SFTTrainer", "qwen2", model, tmp_path, dataset_kwargs=None, remove_unused_columns=True
    )
    assert "input_ids" in trainer.train_dataset.column_names  # TRL tokenised the rows
    with pytest.raises(ValueError, match=r"removes the chat rows' columns.*\n.*skip_prepare"):
        check_trainer(trainer)
    with pytest.raises(ValueError, match=r"tokenised the rows.*skip_prepare_dataset"):
        trainer.train()


def test_sft_trainer_that_removes_the_videos_column_fails_with_the_setting(
    tmp_path: Path,
) -> None:
    model = model_for("qwen2_vl")
    trainer, _, _ = build("SFTTrainer", "qwen2_vl", model, tmp_path, remove_unused_columns=True)
    with pytest.raises(ValueError, match=r"remove_unused_columns=True removes"):
        check_trainer(trainer)
    with pytest.raises(ValueError, match=r"no 'videos' column .* remove_unused_columns=False"):
        trainer.train()


def test_check_trainer_names_a_batch_collator(tmp_path: Path) -> None:
    model = model_for("qwen2")
    args = TrainingArguments(output_dir=str(tmp_path), **COMMON)
    collate = collator("qwen2", model)
    collate.output = "batch"
    trainer = Trainer(
        model=model, args=args, train_dataset=list(chat_rows("qwen2")), data_collator=collate
    )
    with pytest.raises(ValueError, match=r"output='hf'"):
        check_trainer(trainer)
