"""The vision budget on the Energon path: real loaders over the shipped fixture (real JPEG/PNG
images and MP4 videos), two workers, exact resume, counted skips, refused restores."""

from __future__ import annotations

import copy
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    SMALL_MEDIA,
    LoaderRun,
    assert_resume_equivalent,
    batches,
    packing_states,
    read_samples,
    train_dataset,
)

from energon_pack import VisionBudget
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.energon import restore_state_rank

BUDGET = {"max_vision_tokens": 300, "max_media": 6, "vision_balance": True}
"""Caps that bind on the fixture at seq_length 8192 (uncapped packs hold up to about 700
vision tokens and 14 media), with the balance on."""


@pytest.fixture(scope="module")
def demo_samples(vlm_demo_path: Path) -> dict[str, dict[str, bytes]]:
    return read_samples(vlm_demo_path)


def _vision(batch: Any, encoder_pads: tuple[int, int]) -> tuple[int, int]:
    """Vision pad tokens and media of a packed batch, read off its tensors."""
    image_pad, video_pad = encoder_pads
    ids = batch.input_ids
    pads = int(((ids == image_pad) | (ids == video_pad)).sum())
    media = sum(
        0 if grid is None else grid.shape[0]
        for grid in (batch.image_grid_thw, batch.video_grid_thw)
    )
    return pads, media


def _pads() -> tuple[int, int]:
    tokenizer = ConversationEncoder().tokenizer
    return (
        tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        tokenizer.convert_tokens_to_ids("<|video_pad|>"),
    )


def test_every_pack_holds_the_caps_and_every_sample_leaves_once(
    vlm_demo_path: Path, demo_samples: dict[str, Any]
) -> None:
    pads = _pads()
    uncapped = [_vision(b, pads) for b in batches(train_dataset(vlm_demo_path, 16, workers=2))]
    assert max(v for v, _ in uncapped) > BUDGET["max_vision_tokens"]  # the caps bind
    assert max(m for _, m in uncapped) > BUDGET["max_media"]
    keys: Counter[str] = Counter()
    for batch in batches(train_dataset(vlm_demo_path, 16, workers=2, **BUDGET)):
        vision, media = _vision(batch, pads)
        assert vision <= BUDGET["max_vision_tokens"]
        assert media <= BUDGET["max_media"]
        stats = batch.packing_stats
        assert stats.vision_tokens_max <= BUDGET["max_vision_tokens"]
        assert stats.media_max <= BUDGET["max_media"]
        keys.update(batch.__keys__)
    assert keys == Counter(list(demo_samples))


@pytest.mark.parametrize("at", [2, 7, 13])
def test_resume_with_caps_and_balance_at_three_cut_points(vlm_demo_path: Path, at: int) -> None:
    steps = [LoaderRun.step] * (at + 8)
    assert_resume_equivalent(
        lambda: LoaderRun(vlm_demo_path, workers=2, **BUDGET),
        steps,
        at,
        save=LoaderRun.save,
        load=LoaderRun.load,
        roundtrip=lambda state: pickle.loads(pickle.dumps(state)),
    )


def test_a_sample_over_a_cap_is_counted_or_refused_by_name(
    vlm_demo_path: Path, demo_samples: dict[str, Any]
) -> None:
    encoder = ConversationEncoder(media=SMALL_MEDIA)
    over = {
        k for k, raw in demo_samples.items() if encoder.encode_sample(k, raw).vision_tokens > 100
    }
    assert over
    emitted: Counter[str] = Counter()
    skipped: dict[str, int] = {}
    for batch in batches(train_dataset(vlm_demo_path, 16, max_vision_tokens=100, overlong="skip")):
        emitted.update(batch.__keys__)
        skipped = batch.packing_stats.skipped
    assert skipped == {"over_max_vision_tokens": len(over)}
    assert emitted == Counter(k for k in demo_samples if k not in over)
    with pytest.raises(
        ValueError, match=r"vision tokens, above max_vision_tokens=100; raise the cap"
    ):
        list(batches(train_dataset(vlm_demo_path, 16, max_vision_tokens=100, overlong="error")))
    # What a sample over a cap gets is its own setting: skipped here while overlong="error".
    budget = VisionBudget(max_vision_tokens=100, over_cap="skip")
    kept = Counter(
        k
        for b in batches(train_dataset(vlm_demo_path, 16, vision=budget, overlong="error"))
        for k in b.__keys__
    )
    assert kept == emitted


def test_a_restore_under_another_cap_is_refused_by_name(vlm_demo_path: Path) -> None:
    run = LoaderRun(vlm_demo_path, **BUDGET)
    for _ in range(3):
        run.step()
    state = run.save()
    other = LoaderRun(vlm_demo_path, **{**BUDGET, "max_vision_tokens": 400})
    with pytest.raises(ValueError, match=r"max_vision_tokens.*300.*400"):
        other.load(state)
    unbalanced = LoaderRun(vlm_demo_path, max_vision_tokens=300, max_media=6)
    with pytest.raises(ValueError, match=r"vision_balance"):
        unbalanced.load(state)


def test_the_caps_are_checked_at_construction() -> None:
    with pytest.raises(ValueError, match=r"max_vision_tokens must be None .* or an int >= 1"):
        train_dataset(Path("unused"), 16, max_vision_tokens=0)


def test_pixels_match_the_packs_vision_tokens(vlm_demo_path: Path) -> None:
    """The pixel tensors of a capped pack hold exactly its probed grids (4 patches per token)."""
    for batch in batches(train_dataset(vlm_demo_path, 16, **BUDGET)):
        if batch.image_grid_thw is not None:
            patches = int(batch.image_grid_thw.prod(dim=1).sum())
            assert batch.pixel_values.shape[0] == patches
            assert isinstance(batch.pixel_values, torch.Tensor)


def test_a_held_vision_figure_that_is_not_the_samples_is_refused_once_read(
    vlm_demo_path: Path,
) -> None:
    run = LoaderRun(vlm_demo_path, **BUDGET)
    state = None
    for _ in range(6):
        run.step()
        state = run.save()
        (packing,) = packing_states(state)
        held = packing["_packer"]["held"]
        if any(entry[5] for entry in held):
            break
    else:
        pytest.fail("no saved state holds a candidate with vision tokens")
    index = next(i for i, entry in enumerate(held) if entry[5])
    edited = copy.deepcopy(state)
    (packing,) = packing_states(edited)
    packing["_packer"]["held"][index][5] -= 1
    resumed = LoaderRun(vlm_demo_path, **BUDGET)
    restore_state_rank(resumed.loader, edited)
    with pytest.raises(
        ValueError, match=rf"_packer\.held\[{index}\]\.vision_tokens=\d+, but its buffered sample"
    ):
        resumed.step()
