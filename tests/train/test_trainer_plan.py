"""transformers' ``Trainer`` fed a plan: ``train_dataset=PlannedDataset(..., output="hf")``.

A tiny Qwen2-VL model (float64, CPU, random weights) trains every step of a plan of chat rows
with images and a video on files (one rank, gradient accumulation 2: a global batch of 2
packs). The trainer reads the packs in the plan's order (``train_sampling_strategy=
"sequential"``, ``PlannedDataset.collate_fn``); a reference trains a copy of the model on
every member of a step's packs alone, summed token losses over the step's target count, plain
SGD. Every logged loss and the parameters after every step must agree. ``check_trainer`` names
each setting that would train the plan in another order or shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import video_bytes
from PIL import Image
from test_hf import RELATIVE
from test_trainers import COMMON, ENCODER, LEARNING_RATE, Snapshots, collator, model_for
from transformers import Trainer, TrainingArguments
from unpacked import token_losses

from energon_pack import ChatDataset, PlannedDataset, PlanSpec, RowLayout, plan_dataset
from energon_pack.train.trainers import check_trainer

pytestmark = pytest.mark.usefixtures("ray_cluster")

FAMILY = "qwen2_vl"
ACCUMULATION = 2
LAYOUT = RowLayout(256, 8)


def write_rows(root: Path, count: int = 14) -> Path:
    """``count`` chat rows of different lengths in ``root/rows.jsonl``: some with an image, one
    with a video, their media as files under ``root``."""
    lines = []
    for index in range(count):
        content: list[dict[str, Any]] = [
            {"type": "text", "text": f"question {index}: " + "tell me more " * (index % 5)}
        ]
        row: dict[str, Any] = {"id": f"r{index}"}
        if index % 3 == 0:
            name = f"image{index}.png"
            Image.new("RGB", (40 + 8 * index, 56), (index * 15, 90, 160)).save(root / name)
            content.insert(0, {"type": "image"})
            row["images"] = [name]
        if index == 4:
            (root / "clip.mp4").write_bytes(video_bytes(64, 48, frames=4))
            content.append({"type": "video"})
            row["videos"] = ["clip.mp4"]
        answer = "answer " * (1 + index % 6) + f"number {index}."
        row["messages"] = [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        lines.append(json.dumps(row))
    path = root / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trainer_plan")
    rows = write_rows(root)
    spec = PlanSpec(LAYOUT, data_parallel_size=1, global_batch_size=ACCUMULATION, seed=1)
    plan_dataset(rows, root / "plan", spec, ENCODER, media_root=root)
    return root / "plan", rows


def planned(plan_dir: Path, model: Any) -> PlannedDataset:
    """The plan's packs as the model's inputs, with the positions the trainers' collator uses."""
    reference = collator(FAMILY, model)
    return PlannedDataset(
        plan_dir, ENCODER, position_ids=reference.mrope, output="hf", hf_model=model
    )


def trainer_on(dataset: PlannedDataset, model: Any, out: Path, **overrides: Any) -> Trainer:
    settings = {
        **COMMON,
        "max_steps": dataset.steps_per_epoch(),
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": ACCUMULATION,
        "train_sampling_strategy": "sequential",
        **overrides,
    }
    return Trainer(
        model=model,
        args=TrainingArguments(output_dir=str(out), **settings),
        train_dataset=dataset,
        data_collator=PlannedDataset.collate_fn,
        callbacks=[Snapshots()],
    )


def test_the_trainer_trains_the_plans_packs_as_their_samples_alone(
    plan: tuple[Path, Path], tmp_path: Path
) -> None:
    plan_dir, rows_path = plan
    model, reference = model_for(FAMILY), model_for(FAMILY)
    reference.load_state_dict(model.state_dict())
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    dataset = planned(plan_dir, model)
    assert len(dataset) > 2 * ACCUMULATION  # several steps
    trainer = trainer_on(dataset, model, tmp_path)
    check_trainer(trainer)
    trainer.train()
    snapshots = next(c for c in trainer.callback_handler.callbacks if isinstance(c, Snapshots))
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    # the reference: each step's packs, in the plan's order, every member alone
    rows = ChatDataset(str(rows_path), rows_path.parent)
    steps = [range(i, min(i + ACCUMULATION, len(dataset))) for i in range(0, len(dataset), 2)]
    want_losses, want_states = [], []
    for step in steps:
        samples = [
            ENCODER.encode_sample(*rows[int(key)]) for pack in step for key in dataset.keys[pack]
        ]
        targets = sum(int(s.loss_mask[1:].sum()) for s in samples)
        reference.zero_grad()
        total = 0.0
        for sample in samples:
            loss = token_losses(reference, sample).sum() / targets
            loss.backward()
            total += float(loss.detach())
        with torch.no_grad():
            for parameter in reference.parameters():
                if parameter.grad is not None:
                    parameter -= LEARNING_RATE * parameter.grad
        want_losses.append(total)
        want_states.append({n: p.detach().clone() for n, p in reference.named_parameters()})
    trained = {key for pack in range(len(dataset)) for key in dataset.keys[pack]}
    assert trained == {str(i) for i in range(14)}  # every row of the source, once
    assert losses == pytest.approx(want_losses, rel=RELATIVE)
    assert len(snapshots.states) == len(want_states) == len(steps)
    for step, (state, expected) in enumerate(zip(snapshots.states, want_states, strict=True)):
        for name, value in expected.items():
            update = float((value - initial[name]).abs().max())
            error = float((state[name] - value).abs().max())
            assert error <= RELATIVE * update + 1e-12, (step, name, error, update)


@pytest.mark.parametrize(
    ("overrides", "collate", "named"),
    [
        ({"train_sampling_strategy": "random"}, True, "train_sampling_strategy='sequential'"),
        ({"per_device_train_batch_size": 2}, True, "per_device_train_batch_size=1"),
        ({}, False, "data_collator=PlannedDataset.collate_fn"),
    ],
)
def test_check_trainer_names_what_reorders_or_reshapes_the_plan(
    plan: tuple[Path, Path], tmp_path: Path, overrides: dict[str, Any], collate: bool, named: str
) -> None:
    model = model_for(FAMILY)
    trainer = trainer_on(planned(plan[0], model), model, tmp_path, **overrides)
    if not collate:
        trainer.data_collator = lambda items: items
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        check_trainer(trainer)


def test_a_plan_of_batches_is_refused_by_check_trainer(
    plan: tuple[Path, Path], tmp_path: Path
) -> None:
    model = model_for(FAMILY)
    dataset = PlannedDataset(plan[0], ENCODER, position_ids=collator(FAMILY, model).mrope)
    with pytest.raises(ValueError, match="output='hf'"):
        check_trainer(trainer_on(dataset, model, tmp_path))
