"""Voxtral on the Energon path: ``PackingTaskEncoder(family=VoxtralProcessor)`` in a real loader
(2 workers) over a native WebDataset of WAV and FLAC audio (one past a 30 s chunk) next to
text-only samples. Every pack equals what the collator makes of the same samples (ids, labels,
``input_features``; the collator's packed row trains as its samples alone:
``test_family_voxtral``), its model inputs built with the tiny model equal the collator's,
every sample leaves exactly once, nothing is skipped, and a loader restored at three cut points
continues exactly as one that never stopped.

mistral-common is importable in the mistral child of :mod:`torchvision_child` only, so the run
happens there and sends back plain values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from energon_shards import write_dataset
from torchvision_child import MISTRAL_DIR, available, run_in_child

SETTINGS: dict[str, Any] = {"seq_length": 2048, "pad_to_multiple_of": 8, "tokenizer": None}
AUDIO: list[list[tuple[str, float]]] = [
    [],
    [("wav", 1.2)],
    [("flac", 0.8), ("wav", 2.0)],
    [("flac", 1.6)],
    [("wav", 0.5)],
]
"""Each sample's audio (format, seconds), cycled; sample 7 has a 31 s clip (two chunks)."""


def samples() -> list[tuple[str, dict[str, bytes]]]:
    """15 native samples: the audio of :data:`AUDIO` as members named in text order, each
    placeholder before the question, and the assistant's reply."""
    from audio_files import encode_audio

    out = []
    for index in range(15):
        clips = [("wav", 31.0)] if index == 7 else AUDIO[index % len(AUDIO)]
        members = {
            f"{position}.{fmt}": encode_audio(fmt, 16000, 1, int(16000 * seconds), sweep=True)
            for position, (fmt, seconds) in enumerate(clips)
        }
        turns = [
            {"from": "human", "value": "<audio>" * len(clips) + f"What is it? {index}"},
            {"from": "gpt", "value": f"The quick brown fox {index}."},
        ]
        names = list(members)
        members["json"] = json.dumps({"conversations": turns, "media": names}).encode()
        out.append((f"s{index:03d}", members))
    return out


def chunks(key: str) -> int:
    """The 30 s chunks of sample ``key``'s audio: one per clip, two for the 31 s one."""
    index = int(key.removeprefix("s"))
    clips = [("wav", 31.0)] if index == 7 else AUDIO[index % len(AUDIO)]
    return sum(1 + int(seconds // 30) for _, seconds in clips)


def energon_run(path: str) -> dict[str, Any]:
    """The Energon path over the dataset at ``path``, as plain values
    (:func:`~energon_family.family_run_report`); each pack holds one ``input_features`` chunk
    per started 30 s of its audio, and its statistics count 375 audio tokens per chunk."""
    import voxtral_kit
    from energon_family import family_run_report

    counted: dict[int, list[int]] = {}  # each worker's audio tokens per pack

    def check(batch: Any) -> None:
        want = sum(chunks(key) for key in batch.__keys__)
        features = batch.family_inputs.tensors().get("input_features")
        assert (0 if features is None else features.shape[0]) == want, batch.__keys__
        stats = batch.packing_stats
        own = counted.setdefault(stats.worker, [])
        own.append(375 * want)
        assert stats.audio_tokens_mean * stats.packs == pytest.approx(sum(own))
        assert stats.audio_tokens_max == max(own)

    return family_run_report(
        Path(path),
        voxtral_kit.processor(),
        dict(samples()),
        SETTINGS,
        model=voxtral_kit.tiny_model,
        check=check,
    )


def test_packs_equal_the_collators_and_resume_is_exact(tmp_path: Path) -> None:
    if not available() or not MISTRAL_DIR.is_dir():
        pytest.skip("the reference mistral-common is not installed (scripts/venv.sh)")
    path = write_dataset(tmp_path / "ds", samples())
    result = run_in_child("test_energon_voxtral:energon_run", str(path), 500, mistral=True)
    assert "error" not in result, result.get("error")
    assert result["unequal"] == []
    assert sorted(result["seen"]) == sorted(key for key, _ in samples())
    assert not any(sum(counts.values()) for counts in result["skipped"].values())
    assert result["resumed"] == {1: "exact", 4: "exact", 9: "exact"}
