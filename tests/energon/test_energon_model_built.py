"""Families whose packed rows need inputs built by the model, on the Energon path: the
Qwen2.5-Omni and Qwen3-Omni thinkers (positions from the rope index per segment) and Gemma 3
(4-D masks per layer type) in a real loader (2 workers) over a native WebDataset of PNG images
(and for the thinkers WAV / FLAC audio) next to text-only samples. Every pack equals what the
collator makes of the same samples (ids, labels, every processor output),
``batch.hf_model_inputs(model, family=...)`` equals the collator's ``output="hf"`` dict for
them (which trains as its samples alone: ``test_family_omni``, ``test_family_gemma3``), every
sample leaves exactly once, and a loader restored at three cut points continues exactly as one
that never stopped."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import test_family_gemma3 as gemma3
import test_family_omni as omni
from energon_family import assert_model_inputs_are_the_collators, assert_pack_is_the_collators
from energon_shards import image_audio_samples, write_dataset
from helpers import (
    CUT_POINTS,
    FamilyLoaderRun,
    assert_loader_resumes,
    batches,
    train_dataset,
)

from energon_pack import VLMPackingCollator, model_family

SETTINGS: dict[str, Any] = {"seq_length": 2048, "pad_to_multiple_of": 8, "tokenizer": None}
FAMILIES = {  # name -> (its processor, its tiny model, whether its samples hold audio)
    "qwen2_5_omni": (
        lambda: omni.processor("qwen2_5_omni"),
        lambda: omni.tiny_model("qwen2_5_omni", omni.processor("qwen2_5_omni")),
        True,
    ),
    "qwen3_omni": (
        lambda: omni.processor("qwen3_omni"),
        lambda: omni.tiny_model("qwen3_omni", omni.processor("qwen3_omni")),
        True,
    ),
    "gemma3": (gemma3.make_processor, gemma3.tiny_model, False),
}


def samples(name: str) -> list[tuple[str, dict[str, bytes]]]:
    """The native samples of :func:`image_audio_samples`, with audio where the family takes it."""
    return image_audio_samples(audio=FAMILIES[name][2])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def dataset(name: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp(name) / "ds", samples(name))


def _dataset(name: str, path: Path, *, repeat: bool = False) -> Any:
    processor = FAMILIES[name][0]()
    return train_dataset(path, 6, workers=2, repeat=repeat, family=processor, **SETTINGS)


@cache
def tiny(name: str) -> Any:
    return FAMILIES[name][1]()


def test_packs_and_model_inputs_equal_the_collators(name: str, dataset: Path) -> None:
    by_key = dict(samples(name))
    family = model_family(FAMILIES[name][0]())
    model = tiny(name)
    settings = {"seq_length": SETTINGS["seq_length"], "family": family}
    collator = VLMPackingCollator(pad_to_multiple_of=SETTINGS["pad_to_multiple_of"], **settings)
    hf = VLMPackingCollator(
        pad_to_multiple_of=SETTINGS["pad_to_multiple_of"], output="hf", hf_model=model, **settings
    )
    seen: list[str] = []
    for batch in batches(_dataset(name, dataset)):
        keys = list(batch.__keys__)
        seen += keys
        want = assert_pack_is_the_collators(batch, collator, by_key)
        assert_model_inputs_are_the_collators(batch, want, hf, model, by_key)
        inputs = batch.hf_model_inputs(model, family=family)
        if family.packing == "mrope":
            assert inputs["position_ids"].shape[:2] == (4, 1)
        else:  # block_mask: a 4-D mask per layer type
            assert isinstance(inputs["attention_mask"], dict)
    assert sorted(seen) == sorted(by_key)


def test_model_inputs_without_the_model_or_the_family_are_refused_by_name(
    name: str, dataset: Path
) -> None:
    batch = next(iter(batches(_dataset(name, dataset))))
    family = model_family(FAMILIES[name][0]())
    collated = VLMPackingCollator(seq_length=2048, family=family)(
        [{"__key__": key, **members} for key, members in samples(name)[:4]]
    )
    for model, given in ((tiny(name), None), (tiny(name).config, family)):
        for form in (batch, collated):
            with pytest.raises(ValueError, match=rf"'{family.packing}' inputs that its model"):
                form.hf_model_inputs(model, family=given)


@pytest.mark.parametrize("at", CUT_POINTS)
def test_resume_is_exact_at_three_cut_points(name: str, dataset: Path, at: int) -> None:
    assert_loader_resumes(lambda: FamilyLoaderRun(_dataset(name, dataset, repeat=True)), at)
