"""Trainer edges on hostile inputs (issue #35, item 6).

``packed_loss`` / ``PackedLoss`` refuse logits that do not fit the batch (a token more or less,
two rows for one), labels outside the logits' vocabulary and a normaliser that is not a finite
count >= 0, by name and before ``cross_entropy`` raises (or, on GPU, fails a device assertion).
``check_trainer`` names what it was given instead of a trainer. A content part whose ``type``
is a list or a dict is that sample's counted skip under ``on_media_error="skip"``, in the
collator, through a real ``Trainer`` and on the Energon path. What held before still holds:
masked-only targets and a rank without targets give a loss of 0.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from energon_shards import write_dataset
from helpers import batches, train_dataset
from test_trainers import COMMON, chat_rows, collator, model_for
from transformers import Trainer, TrainingArguments

from energon_pack import PackedLoss, VLMPackingCollator, check_trainer, loss_normaliser, packed_loss
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.media import MediaError
from energon_pack.packing.packed import EncodedSample
from energon_pack.train.loss import LOSS_SEGMENTS

VOCAB = 11


def samples(seed: int = 0, count: int = 4) -> list[EncodedSample]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        length = 4 + index * 3
        ids = torch.randint(0, VOCAB, (length,), generator=generator)
        mask = torch.ones(length, dtype=torch.long)
        mask[: length // 2] = 0
        out.append(EncodedSample(f"s{index}", ids, mask))
    return out


def collate(items: list[EncodedSample], **options: Any) -> Any:
    return VLMPackingCollator(
        32, pad_to_multiple_of=4, pad_to_max_length=True, max_segments=3, **options
    )(items)


def logits_for(shape: tuple[int, ...], vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(
        *shape, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )


FLAT = ("labels", LOSS_SEGMENTS)
"""What ``packed_loss`` reads of the flash-attention form (rows flattened to one)."""


def batch_forms() -> dict[str, tuple[Any, tuple[int, ...]]]:
    """Each batch form ``packed_loss`` takes, with the shape of its logits but for V."""
    batch = collate(samples())
    assert batch.num_rows == 2
    rows, width = batch.labels.shape
    hf = collate(samples(), output="hf", loss_segments=True)
    flat = {name: value.reshape(1, -1) for name, value in hf.items() if name in FLAT}
    return {
        "batch": (batch, (rows, width)),
        "hf": (hf, tuple(hf["labels"].shape)),
        "hf flat": (flat, tuple(flat["labels"].shape)),
    }


@pytest.mark.parametrize("form", ["batch", "hf", "hf flat"])
@pytest.mark.parametrize("wrong", ["a token longer", "a token shorter", "two rows for one", "2-d"])
def test_logits_that_do_not_fit_the_batch_are_refused(form: str, wrong: str) -> None:
    batch, shape = batch_forms()[form]
    rows, width = shape
    bad = {
        "a token longer": (rows, width + 1),
        "a token shorter": (rows, width - 1),
        "two rows for one": (2 * rows, width),
        "2-d": (rows * width,),
    }[wrong]
    logits = logits_for(bad)
    labels = batch["labels"] if isinstance(batch, dict) else batch.labels
    for reduction in ("token", "sample", "sqrt"):
        with pytest.raises(
            ValueError,
            match=(
                rf"logits of shape \[{', '.join(map(str, logits.shape))}\] do not fit the "
                rf"batch's labels of shape \[{', '.join(map(str, labels.shape))}\].*one row of "
                r"V > 0 logits per token"
            ),
        ):
            packed_loss(logits, batch, reduction)  # type: ignore[arg-type]
    assert torch.isfinite(packed_loss(logits_for(shape), batch, "sample"))  # type: ignore[arg-type]


def test_the_shifted_batch_still_takes_its_rows_flattened() -> None:
    batch = collate(samples())
    logits = logits_for(tuple(batch.labels.shape))
    flat = logits.reshape(1, -1, VOCAB)
    for reduction in ("token", "sample", "sqrt"):
        assert float(packed_loss(flat, batch, reduction)) == float(
            packed_loss(logits, batch, reduction)
        )


@pytest.mark.parametrize("form", ["batch", "hf"])
def test_labels_outside_the_vocabulary_are_refused(form: str) -> None:
    batch, shape = batch_forms()[form]
    with pytest.raises(
        ValueError,
        match=(
            r"the labels hold the token id (\d+) but the logits have a vocabulary of 5 "
            r"\(ids 0\.\.4; -100 marks no target\).*resize_token_embeddings"
        ),
    ) as info:
        packed_loss(logits_for(shape, vocab=5), batch, "token")  # type: ignore[arg-type]
    assert int(info.value.args[0].split("token id ")[1].split()[0]) >= 5
    hf = collate(samples(), output="hf")
    hf["labels"][0, 3] = -7
    with pytest.raises(ValueError, match=r"the labels hold the token id -7 but"):
        packed_loss(logits_for(tuple(hf["labels"].shape)), hf, "token")
    hf["labels"] = hf["labels"].double()
    with pytest.raises(ValueError, match=r"the labels are torch\.float64, not token ids"):
        packed_loss(logits_for(tuple(hf["labels"].shape)), hf, "token")


def test_loss_segments_of_another_batch_are_refused() -> None:
    hf = collate(samples(), output="hf", loss_segments=True)
    hf[LOSS_SEGMENTS] = hf[LOSS_SEGMENTS][:, :-1]
    with pytest.raises(ValueError, match=r"'loss_segments' has shape \[2, 31\], its labels"):
        packed_loss(logits_for(tuple(hf["labels"].shape)), hf, "sample")


@pytest.mark.parametrize(
    ("normaliser", "shown"),
    [
        (math.nan, "nan"),
        (-3.0, "-3.0"),
        (-1, "-1.0"),
        (math.inf, "inf"),
        (torch.tensor(math.nan), "nan"),
        (torch.tensor(-2.0), "-2.0"),
        (torch.tensor([4.0, 4.0]), "a tensor of shape [2]"),
        (True, "True"),
        ("12", "'12'"),
    ],
)
def test_a_normaliser_that_is_not_a_count_is_refused(normaliser: Any, shown: str) -> None:
    batch = collate(samples())
    logits = logits_for(tuple(batch.labels.shape))
    message = rf"normaliser={re.escape(shown)} must be a finite count >= 0.*loss_normaliser"
    for reduction in ("token", "sample"):
        with pytest.raises(ValueError, match=message):
            packed_loss(logits, batch, reduction, normaliser)
    hf = collate(samples(), output="hf", loss_segments=True)
    outputs = {"logits": logits_for(tuple(hf["labels"].shape))}
    with pytest.raises(ValueError, match=message):
        PackedLoss("token")(outputs, hf["labels"], num_items_in_batch=normaliser)


def test_masked_only_targets_and_an_empty_rank_still_give_zero() -> None:
    masked = [EncodedSample(s.key, s.input_ids, torch.zeros_like(s.loss_mask)) for s in samples()]
    batch = collate(masked)
    logits = logits_for(tuple(batch.labels.shape)).requires_grad_()
    for reduction in ("token", "sample", "sqrt"):
        assert float(loss_normaliser(batch, reduction)) == 0
        for normaliser in (None, 0, 0.0, torch.tensor(0.0), torch.tensor(25.0)):
            loss = packed_loss(logits, batch, reduction, normaliser)
            assert float(loss.detach()) == 0
            (grad,) = torch.autograd.grad(loss, logits)
            assert not grad.any()
    # a rank without targets in a step whose other ranks have some: PackedLoss gives 0
    hf = collate(masked, output="hf")
    outputs = {"logits": logits_for(tuple(hf["labels"].shape))}
    assert float(PackedLoss()(outputs, hf["labels"], num_items_in_batch=torch.tensor(17))) == 0


@pytest.mark.parametrize("what", ["None", "TrainingArguments", "model", "a dict"])
def test_check_trainer_names_what_it_got_instead_of_a_trainer(tmp_path: Path, what: str) -> None:
    given: Any = {
        "None": None,
        "TrainingArguments": TrainingArguments(output_dir=str(tmp_path), **COMMON),
        "model": model_for("qwen2") if what == "model" else None,
        "a dict": {"args": {}},
    }[what]
    hint = {
        "None": r"got None: pass the built trainer",
        "TrainingArguments": r"got a TrainingArguments: that is the trainer's arguments: build",
        "model": r"got a Qwen2ForCausalLM: that is a model: pass the trainer built on it",
        "a dict": r"got a dict: pass the built trainer",
    }[what]
    with pytest.raises(
        ValueError,
        match=rf"check_trainer needs a built transformers\.Trainer or TRL SFTTrainer .*{hint}",
    ):
        check_trainer(given)


def bad_part(type_value: Any, key: str) -> dict[str, Any]:
    content = [{"type": type_value, "text": "look"}, {"type": "text", "text": "what is it?"}]
    return {
        "id": key,
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": "a thing"},
        ],
    }


BAD_TYPES = {"list": ["text"], "dict": {"kind": "image"}, "list of parts": [{"type": "text"}]}


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_a_content_part_type_that_is_a_list_or_dict_is_a_counted_skip(
    tokenizer: str, caplog: pytest.LogCaptureFixture
) -> None:
    from hf_qwen import qwen_tokenizer

    encoder = ConversationEncoder(qwen_tokenizer() if tokenizer == "hf" else None)
    good = [
        {
            "id": f"g{i}",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "ok " * (i + 1)},
            ],
        }
        for i in range(3)
    ]
    bad = [bad_part(value, f"bad {name}") for name, value in BAD_TYPES.items()]
    skip = VLMPackingCollator(4096, encoder=encoder, on_media_error="skip")
    with caplog.at_level(logging.WARNING, logger="energon_pack"):
        batch = skip([good[0], bad[0], good[1], bad[1], bad[2], good[2]])
    assert [key for row in batch.keys for key in row] == ["g0", "g1", "g2"]
    assert batch.skipped_keys == tuple(row["id"] for row in bad)
    for row in bad:
        assert sum(repr(row["id"]) in r.getMessage() for r in caplog.records) == 1
    strict = VLMPackingCollator(4096, encoder=encoder)
    for row in bad:
        with pytest.raises(MediaError, match=rf"sample {row['id']!r}.*has a content part"):
            strict([good[0], row])


def test_a_bad_content_part_does_not_fail_a_trainer_step(tmp_path: Path) -> None:
    model = model_for("qwen2")
    rows: list[dict[str, Any]] = list(chat_rows("qwen2"))
    rows[1] = bad_part(["text"], "bad list")
    rows[6] = bad_part({"a": 1}, "bad dict")
    collate = collator("qwen2", model, on_media_error="skip")
    seen: list[Any] = []

    def recording(micro: list[Any]) -> Any:
        out = collate(micro)
        seen.append(collate.collate(micro).skipped_keys)
        return out

    args = TrainingArguments(output_dir=str(tmp_path), **{**COMMON, "max_steps": 2})
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=recording)
    trainer.train()
    assert Counter(key for keys in seen for key in keys) == Counter(["bad list", "bad dict"])


def test_a_bad_content_part_is_a_counted_skip_on_the_energon_path(tmp_path: Path) -> None:
    def member(messages: list[dict[str, Any]]) -> dict[str, bytes]:
        return {"json": json.dumps({"conversations": messages}).encode()}

    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    items = [(f"g{i}", member(good)) for i in range(4)]
    items.insert(1, ("bad_list", member(bad_part(["text"], "x")["messages"])))
    items.insert(3, ("bad_dict", member(bad_part({"a": 1}, "x")["messages"])))
    path = write_dataset(tmp_path / "data", items)
    packs = list(batches(train_dataset(path, 4)))
    assert sorted(key for pack in packs for key in pack.__keys__) == ["g0", "g1", "g2", "g3"]
    stats = packs[-1].packing_stats
    assert stats is not None
    assert stats.skipped == {"bad_sample": 2}
