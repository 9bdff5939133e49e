"""Checks that a ``transformers.Trainer`` / TRL ``SFTTrainer`` feeds the collator what it packs.

Each setting below silently trains on other data or another loss when it is wrong, so
:func:`check_trainer` names every one that is:

* ``remove_unused_columns=False``: else the trainer drops the chat rows' columns;
* for ``SFTTrainer``, ``dataset_kwargs={"skip_prepare_dataset": True}``: else TRL tokenises text
  rows with its own template before the collator sees them;
* a token count for the loss: with gradient accumulation (or several ranks) the per-token loss
  of a step needs the trainer's ``num_items_in_batch``, which it counts only for models that
  take loss kwargs or with a ``compute_loss_func``. Qwen2.5-VL and Qwen3-VL declare
  ``accepts_loss_kwargs = False``: pass ``compute_loss_func=PackedLoss()``, else the step's loss
  is the mean of its micro-batches' means;
* a collator built with ``output="hf"``.

A :class:`~energon_pack.PlannedDataset` as ``train_dataset`` already holds the packed rows:
it is read with ``output="hf"``, one pack per micro-batch (``per_device_train_batch_size=1``,
``data_collator=PlannedDataset.collate_fn``) in the plan's order
(``train_sampling_strategy="sequential"``), else the trainer shuffles the planned steps.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_trainer"]


def check_trainer(trainer: Any) -> None:
    """Raise ValueError naming each setting of ``trainer`` (a built ``transformers.Trainer`` or
    TRL ``SFTTrainer``) that breaks packed training with the collator, and its fix."""
    _check_is_trainer(trainer)
    args = trainer.args
    planned = _is_plan(getattr(trainer, "train_dataset", None))
    problems = _plan_problems(trainer) if planned else []
    if args.remove_unused_columns and not planned:
        problems.append(
            "remove_unused_columns=True removes the chat rows' columns (messages, images, "
            "videos, id) before the collator: pass remove_unused_columns=False"
        )
    if hasattr(args, "dataset_kwargs") and not (args.dataset_kwargs or {}).get(
        "skip_prepare_dataset"
    ):
        problems.append(
            "SFTTrainer tokenises text rows with its own chat template unless told not to: pass "
            "SFTConfig(dataset_kwargs={'skip_prepare_dataset': True})"
        )
    ranks = getattr(getattr(trainer, "accelerator", None), "num_processes", 1)
    counts_tokens = (
        getattr(trainer, "model_accepts_loss_kwargs", False)
        or getattr(trainer, "compute_loss_func", None) is not None
    )
    if (args.gradient_accumulation_steps > 1 or ranks > 1) and not counts_tokens:
        model_type = getattr(getattr(trainer.model, "config", None), "model_type", "this model")
        problems.append(
            f"{model_type} declares accepts_loss_kwargs=False, so the trainer does not count "
            "num_items_in_batch and a step's loss is the mean of its micro-batches' means, not "
            "the per-token loss: pass compute_loss_func=energon_pack.PackedLoss()"
        )
    # A VLMPackingCollator (or any collator with its ``output`` setting) must give model inputs.
    if not planned and getattr(trainer.data_collator, "output", "hf") != "hf":
        problems.append(
            "the collator gives CollatedBatch objects, which a trainer cannot pass to the "
            "model: build it with VLMPackingCollator(..., output='hf', hf_model=model)"
        )
    if problems:
        listing = "".join(f"\n- {problem}" for problem in problems)
        raise ValueError(f"{type(trainer).__name__} is not set up for packed rows:{listing}")


_ARGS = ("remove_unused_columns", "gradient_accumulation_steps")


def _is_plan(dataset: Any) -> bool:
    """``dataset`` gives packed rows already (a PlannedDataset: ``packed_rows``)."""
    return getattr(dataset, "packed_rows", False) is True


def _plan_problems(trainer: Any) -> list[str]:
    """What makes a trainer read a PlannedDataset in another order or shape than planned."""
    args, dataset, problems = trainer.args, trainer.train_dataset, []
    if dataset.output != "hf":
        problems.append(
            f"the PlannedDataset gives output={dataset.output!r}, which a trainer cannot pass "
            "to the model: build it with PlannedDataset(..., output='hf', hf_model=model)"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy != "sequential":
        problems.append(
            f"train_sampling_strategy={strategy!r} reorders the plan's packs, so its steps "
            "(and their balance over the ranks) are not the planned ones: pass "
            "train_sampling_strategy='sequential'"
        )
    if args.per_device_train_batch_size != 1:
        problems.append(
            f"per_device_train_batch_size={args.per_device_train_batch_size}: each item of a "
            "PlannedDataset is already a packed micro-batch; pass per_device_train_batch_size=1 "
            "(and set the step's size with gradient_accumulation_steps)"
        )
    if trainer.data_collator is not type(dataset).collate_fn:
        problems.append(
            "the data collator would batch packed rows again: pass "
            "data_collator=PlannedDataset.collate_fn"
        )
    return problems


def _check_is_trainer(trainer: Any) -> None:
    """ValueError unless ``trainer`` is a built trainer: it has the ``args`` (with the settings
    read above), ``model`` and ``data_collator`` a ``transformers.Trainer`` has."""
    args = getattr(trainer, "args", None)
    if (
        all(hasattr(args, name) for name in _ARGS)
        and hasattr(trainer, "model")
        and hasattr(trainer, "data_collator")
    ):
        return
    got = "None" if trainer is None else f"a {type(trainer).__name__}"
    if trainer is not None and all(hasattr(trainer, name) for name in _ARGS):
        hint = (
            "that is the trainer's arguments: build the trainer with them, "
            "Trainer(model=model, args=args, data_collator=collator, ...), and pass the trainer"
        )
    elif hasattr(trainer, "parameters") and hasattr(trainer, "forward"):
        hint = "that is a model: pass the trainer built on it, Trainer(model=model, ...)"
    else:
        hint = "pass the built trainer, check_trainer(trainer) after trainer = Trainer(...)"
    raise ValueError(
        f"check_trainer needs a built transformers.Trainer or TRL SFTTrainer (with args."
        f"{' and args.'.join(_ARGS)}, model and data_collator), got {got}: {hint}"
    )
