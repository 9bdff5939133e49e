"""transformers' ``Trainer`` and TRL's ``SFTTrainer`` fed chat rows through the collator.

Tiny Qwen2 / Qwen2-VL / Qwen2.5-VL models (float64, CPU, random weights) train 4 optimizer
steps with gradient accumulation 2 on a ``datasets.Dataset`` of chat rows (images and a video
for the VL models), the collator as ``data_collator``. A reference trains a copy of the same
model unpacked: every sample of a step alone, its summed token losses over the step's target
count (the trainer's ``num_items_in_batch``), plain SGD. Every logged loss and the parameters
after every step must agree (relative 1e-6; transformers' loss is float32). The same holds for
``PackedLoss("sample")`` against the step's mean of sample means, on one rank and on two
(torchrun, gloo); without a token count Qwen2.5-VL trains on means of micro-batch means.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from helpers import SMALL_MEDIA, SUPPORT, torchrun, video_bytes
from hf_qwen import qwen_processor, qwen_tokenizer
from PIL import Image
from test_hf import RELATIVE, mrope, tiny_model
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from trl import SFTConfig, SFTTrainer
from unpacked import token_losses

from energon_pack import ConversationEncoder, MRopeConfig, PackedLoss, VLMPackingCollator
from energon_pack.train.trainers import check_trainer

STEPS, ACCUMULATION, MICRO_BATCH = 4, 2, 3
LEARNING_RATE = 0.05
TOKENIZER: PreTrainedTokenizerFast = qwen_tokenizer()
ENCODER = ConversationEncoder(TOKENIZER, media=SMALL_MEDIA)
FAMILIES = ("qwen2", "qwen2_vl", "qwen2_5_vl")


def model_for(family: str) -> PreTrainedModel:
    """test_hf's tiny model, its vocabulary and vision token ids those of :data:`TOKENIZER`."""
    model = tiny_model(family)
    model.resize_token_embeddings(len(TOKENIZER))
    if family != "qwen2":
        ids = TOKENIZER.convert_tokens_to_ids
        model.config.image_token_id = ids("<|image_pad|>")
        model.config.video_token_id = ids("<|video_pad|>")
        model.config.vision_start_token_id = ids("<|vision_start|>")
    return model.double().train()


def _message(role: str, *parts: str) -> dict[str, Any]:
    content = [
        {"type": p} if p in ("image", "video") else {"type": "text", "text": p} for p in parts
    ]
    return {"role": role, "content": content}


def chat_rows(family: str, count: int = 12) -> datasets.Dataset:
    """``count`` chat rows of different lengths; for VL families some with images, one with a
    video (MP4 bytes), the rest text."""
    rows = []
    for index in range(count):
        question = f"question {index}: " + "tell me more " * (index % 4)
        answer = "answer " * (1 + index % 5) + f"number {index}."
        parts: list[str] = [question]
        images: list[Image.Image] = []
        videos: list[bytes] = []
        if family != "qwen2" and index % 3 == 0:
            parts.insert(0, "image")
            images.append(Image.new("RGB", (40 + 8 * index, 56), (index * 20, 90, 160)))
        if family != "qwen2" and index == 4:
            parts.append("video")
            videos.append(video_bytes(64, 48, frames=4))
        row: dict[str, Any] = {
            "id": f"r{index}",
            "messages": [_message("user", *parts), _message("assistant", answer)],
        }
        if family != "qwen2":
            row.update(images=images, videos=videos)
        rows.append(row)
    table = datasets.Dataset.from_list(rows)
    if family != "qwen2":
        table = table.cast_column("images", datasets.Sequence(datasets.Image()))
    return table


def collator(family: str, model: PreTrainedModel, **options: Any) -> VLMPackingCollator:
    rope: dict[str, Any] = {}
    if family != "qwen2":
        base = mrope(family)
        rope = {
            "position_ids": MRopeConfig.from_tokenizer(
                TOKENIZER,
                tokens_per_second=base.tokens_per_second,
                text_after_vision=base.text_after_vision,
            ),
        }
    return VLMPackingCollator(
        1024,
        pad_to_multiple_of=8,
        encoder=ENCODER,
        output="hf",
        hf_model=model,
        **rope,
        **options,
    )


class Recording:
    """The data collator, remembering the rows of every micro-batch in order."""

    def __init__(self, collate: VLMPackingCollator) -> None:
        self.collate = collate
        self.rows: list[list[Mapping[str, Any]]] = []

    def __call__(self, rows: list[Mapping[str, Any]]) -> Any:
        self.rows.append(rows)
        return self.collate(rows)


class Snapshots(TrainerCallback):
    """The parameters after every optimizer step."""

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.states.append({n: p.detach().clone() for n, p in model.named_parameters()})


COMMON: dict[str, Any] = {
    "max_steps": STEPS,
    "per_device_train_batch_size": MICRO_BATCH,
    "gradient_accumulation_steps": ACCUMULATION,
    "learning_rate": LEARNING_RATE,
    "optim": "sgd",
    "lr_scheduler_type": "constant",
    "max_grad_norm": 0.0,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": [],
    "use_cpu": True,
    "bf16": False,
    "remove_unused_columns": False,
    "dataloader_num_workers": 0,
    "seed": 0,
}


def build(
    kind: str, family: str, model: PreTrainedModel, tmp_path: Path, **overrides: Any
) -> tuple[Trainer, Recording, Snapshots]:
    """A ``kind`` trainer (``"Trainer"`` / ``"SFTTrainer"``) of ``model`` on chat rows."""
    loss: PackedLoss | None = overrides.pop("compute_loss_func", None)
    options = {"loss_segments": True} if loss is not None and loss.reduction != "token" else {}
    collate = Recording(collator(family, model, **options))
    snapshots = Snapshots()
    dataset = chat_rows(family)
    settings = {**COMMON, **overrides}
    if kind == "Trainer":
        args = TrainingArguments(output_dir=str(tmp_path), **settings)
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=collate,
            compute_loss_func=loss,
            callbacks=[snapshots],
        )
    else:
        settings.setdefault("dataset_kwargs", {"skip_prepare_dataset": True})
        config = SFTConfig(output_dir=str(tmp_path), **settings)
        processing = TOKENIZER if family == "qwen2" else qwen_processor(TOKENIZER, SMALL_MEDIA)
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=dataset,
            data_collator=collate,
            processing_class=processing,
            compute_loss_func=loss,
            callbacks=[snapshots],
        )
    if loss is not None and loss.reduction != "token":
        loss.attach(trainer)
    return trainer, collate, snapshots


def train(trainer: Trainer, collate: Recording, snapshots: Snapshots) -> Any:
    """The logged losses, the parameters after each step and the steps' micro-batches."""
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    micro_batches = collate.rows
    assert len(micro_batches) == STEPS * ACCUMULATION
    assert all(len(rows) == MICRO_BATCH for rows in micro_batches)
    assert all("messages" in row for rows in micro_batches for row in rows)  # rows as they are
    steps = [
        micro_batches[i : i + ACCUMULATION] for i in range(0, STEPS * ACCUMULATION, ACCUMULATION)
    ]
    return losses, snapshots.states, steps


def unpacked_training(
    model: PreTrainedModel, steps: list[list[list[Mapping[str, Any]]]], reduction: str = "token"
) -> Any:
    """Per step: every sample alone; its summed token losses over the step's target count
    (``"token"``) or its mean token loss over the step's sample count (``"sample"``); SGD."""
    losses, states = [], []
    for step in steps:
        samples = [ENCODER.encode_sample(str(row["id"]), row) for rows in step for row in rows]
        targets = sum(int(s.loss_mask[1:].sum()) for s in samples)
        model.zero_grad()
        total = 0.0
        for sample in samples:
            each = token_losses(model, sample)
            loss = each.sum() / targets if reduction == "token" else each.mean() / len(samples)
            loss.backward()
            total += float(loss.detach())
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter -= LEARNING_RATE * parameter.grad
        losses.append(total)
        states.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, states


def twins(family: str) -> tuple[PreTrainedModel, PreTrainedModel, dict[str, torch.Tensor]]:
    """The model to train, a copy for the reference, and its initial parameters."""
    model = model_for(family)
    reference = model_for(family)
    reference.load_state_dict(model.state_dict())
    return model, reference, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_training(got: Any, want: Any, initial: dict[str, torch.Tensor]) -> None:
    """Equal logged losses, and parameters after each step equal relative to the update."""
    assert got[0] == pytest.approx(want[0], rel=RELATIVE)
    assert len(got[1]) == len(want[1]) == STEPS
    for step, (state, expected) in enumerate(zip(got[1], want[1], strict=True)):
        for name, value in expected.items():
            update = float((value - initial[name]).abs().max())
            error = float((state[name] - value).abs().max())
            assert error <= RELATIVE * update + 1e-12, (step, name, error, update)


# Qwen2.5-VL declares accepts_loss_kwargs=False: the trainer counts num_items_in_batch only
# with a compute_loss_func, so it trains with PackedLoss() (check_trainer says so; see below).
CASES = [(kind, family) for kind in ("Trainer", "SFTTrainer") for family in FAMILIES]


@pytest.mark.parametrize(("kind", "family"), CASES)
def test_trainer_on_chat_rows_equals_unpacked_training(
    kind: str, family: str, tmp_path: Path
) -> None:
    model, reference, initial = twins(family)
    loss = {"compute_loss_func": PackedLoss()} if family == "qwen2_5_vl" else {}
    trainer, collate, snapshots = build(kind, family, model, tmp_path, **loss)
    check_trainer(trainer)
    losses, states, steps = train(trainer, collate, snapshots)
    if family != "qwen2":
        assert any(row["videos"] for step in steps for rows in step for row in rows)
        assert any(row["images"] for step in steps for rows in step for row in rows)
    assert_same_training((losses, states), unpacked_training(reference, steps), initial)


@pytest.mark.parametrize("kind", ["Trainer", "SFTTrainer"])
def test_sample_reduction_through_the_trainer_equals_unpacked_sample_means(
    kind: str, tmp_path: Path
) -> None:
    model, reference, initial = twins("qwen2_vl")
    trainer, collate, snapshots = build(
        kind, "qwen2_vl", model, tmp_path, compute_loss_func=PackedLoss("sample")
    )
    check_trainer(trainer)
    losses, states, steps = train(trainer, collate, snapshots)
    want = unpacked_training(reference, steps, "sample")
    assert_same_training((losses, states), want, initial)


@pytest.mark.parametrize("kind", ["Trainer", "SFTTrainer"])
def test_without_a_token_count_qwen2_5_vl_trains_on_means_of_means(
    kind: str, tmp_path: Path
) -> None:
    model, reference, _ = twins("qwen2_5_vl")
    assert model.accepts_loss_kwargs is False
    trainer, collate, snapshots = build(kind, "qwen2_5_vl", model, tmp_path)
    with pytest.raises(ValueError, match=r"accepts_loss_kwargs=False.*PackedLoss\(\)"):
        check_trainer(trainer)
    losses, _, steps = train(trainer, collate, snapshots)
    want, _ = unpacked_training(reference, steps)
    assert max(abs(a - b) / b for a, b in zip(losses, want, strict=True)) > 1e-5


def test_sample_reduction_on_two_ranks_equals_unpacked_sample_means(tmp_path: Path) -> None:
    """PackedLoss.attach sums the step's normaliser over both ranks' micro-batches."""
    torchrun(SUPPORT / "distributed_trainer.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    by_id = {row["id"]: row for row in chat_rows("qwen2")}
    steps = [
        [[by_id[i] for i in rows] for rank in ranks for rows in rank["steps"][step]]
        for step in range(STEPS)
    ]
    for step in range(STEPS):  # each step: 2 micro-batches per rank, other rows on each rank
        assert [len(rank["steps"][step]) for rank in ranks] == [ACCUMULATION, ACCUMULATION]
        first, second = ({i for rows in rank["steps"][step] for i in rows} for rank in ranks)
        assert not first & second
    _, reference, initial = twins("qwen2")
    want = unpacked_training(reference, steps, "sample")
    states = torch.load(tmp_path / "states.pt")
    assert_same_training((ranks[0]["losses"], states), want, initial)
