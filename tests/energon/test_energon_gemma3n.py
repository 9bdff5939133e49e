"""Gemma 3n on the Energon path: ``PackingTaskEncoder(family=Gemma3nProcessor)`` in a real loader
(2 workers) over a native WebDataset of PNG images and WAV / FLAC audio next to text-only
samples. Every pack equals what the collator makes of the same samples (ids, labels, every
processor output; the collator's packed row trains as its samples alone:
``test_family_gemma3n``), its statistics count each audio's fixed soft-token run, every sample
leaves exactly once, and a loader restored at three cut points continues exactly as one that
never stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import test_family_gemma3n as gemma3n
from energon_family import assert_pack_is_the_collators
from energon_shards import image_audio_samples, write_dataset
from helpers import (
    CUT_POINTS,
    FamilyLoaderRun,
    assert_loader_resumes,
    batches,
    train_dataset,
)

from energon_pack import VLMPackingCollator, model_family

SETTINGS: dict[str, Any] = {"seq_length": 512, "pad_to_multiple_of": 8, "tokenizer": None}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("gemma3n") / "ds", image_audio_samples(audio=True))


def _dataset(path: Path, *, repeat: bool = False) -> Any:
    processor = gemma3n.processor()
    return train_dataset(path, 6, workers=2, repeat=repeat, family=processor, **SETTINGS)


def test_packs_equal_the_collators_and_every_sample_leaves_once(dataset: Path) -> None:
    by_key = dict(image_audio_samples(audio=True))
    family = model_family(gemma3n.processor())
    collator = VLMPackingCollator(
        seq_length=SETTINGS["seq_length"],
        pad_to_multiple_of=SETTINGS["pad_to_multiple_of"],
        family=family,
    )
    run = gemma3n.processor().audio_seq_length
    seen: list[str] = []
    audio: dict[int, list[int]] = {}  # each worker's audio tokens per pack
    for batch in batches(_dataset(dataset)):
        seen += list(batch.__keys__)
        want = assert_pack_is_the_collators(batch, collator, by_key)
        clips = sum(
            name.endswith((".wav", ".flac")) for key in batch.__keys__ for name in by_key[key]
        )
        if clips:
            assert want.family_inputs.tensors()["input_features"].shape[0] == clips
        stats = batch.packing_stats
        own = audio.setdefault(stats.worker, [])
        own.append(run * clips)
        assert stats.audio_tokens_mean * stats.packs == pytest.approx(sum(own))
        assert stats.audio_tokens_max == max(own)
    assert sorted(seen) == sorted(by_key)
    assert min(max(own) for own in audio.values()) > 0


@pytest.mark.parametrize("at", CUT_POINTS)
def test_resume_is_exact_at_three_cut_points(dataset: Path, at: int) -> None:
    assert_loader_resumes(lambda: FamilyLoaderRun(_dataset(dataset, repeat=True)), at)
