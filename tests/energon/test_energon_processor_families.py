"""Processor families on the Energon path: ``PackingTaskEncoder(family=processor)`` in a real
loader over ``fixtures/vlm_demo`` (2 workers, real JPEG/PNG/WebP images; its videos are
counted skips), for InternVL and Idefics3. Every pack equals what the collator makes of the same
samples (ids, labels, the processor's media outputs), every image sample leaves exactly once, and
a loader restored at three cut points continues exactly as one that never stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_family_idefics3 as idefics3
import test_family_internvl as internvl
from energon_family import assert_pack_is_the_collators
from helpers import (
    CUT_POINTS,
    FamilyLoaderRun,
    assert_loader_resumes,
    batches,
    read_samples,
    train_dataset,
)

from energon_pack import PackingTaskEncoder, VLMPackingCollator, model_family

PROCESSORS = {
    "internvl": lambda: internvl.default()[0],
    "idefics3": lambda: idefics3.small("idefics3"),
}
SETTINGS: dict[str, Any] = {"seq_length": 8192, "pad_to_multiple_of": 8, "tokenizer": None}


def _dataset(path: Path, name: str, *, repeat: bool = False) -> Any:
    return train_dataset(path, 16, workers=2, repeat=repeat, family=PROCESSORS[name](), **SETTINGS)


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_packs_equal_the_collators_and_every_sample_leaves_once(
    vlm_demo_path: Path, name: str
) -> None:
    samples = read_samples(vlm_demo_path)
    collator = VLMPackingCollator(
        seq_length=SETTINGS["seq_length"],
        pad_to_multiple_of=SETTINGS["pad_to_multiple_of"],
        family=model_family(PROCESSORS[name]()),
    )
    seen: list[str] = []
    for batch in batches(_dataset(vlm_demo_path, name)):
        keys = list(batch.__keys__)
        seen += keys
        assert_pack_is_the_collators(batch, collator, samples)
    videos = {key for key, sample in samples.items() if any(m.endswith(".mp4") for m in sample)}
    assert len(seen) == len(set(seen))
    assert set(seen) == set(samples) - videos


@pytest.mark.parametrize("name", sorted(PROCESSORS))
@pytest.mark.parametrize("at", CUT_POINTS)
def test_resume_is_exact_at_three_cut_points(vlm_demo_path: Path, name: str, at: int) -> None:
    assert_loader_resumes(lambda: FamilyLoaderRun(_dataset(vlm_demo_path, name, repeat=True)), at)


def test_settings_the_family_does_not_take_are_refused_by_name() -> None:
    processor = PROCESSORS["internvl"]()
    for option, value in (("output", "bridge"), ("decode", "eager"), ("position_ids", "mrope")):
        with pytest.raises(ValueError, match=option):
            PackingTaskEncoder(seq_length=64, family=processor, **{option: value})
    with pytest.raises(ValueError, match="processor's tokenizer"):
        PackingTaskEncoder(idefics3.small("idefics3").tokenizer, seq_length=64, family=processor)
