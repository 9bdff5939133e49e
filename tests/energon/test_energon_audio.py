"""Audio on the Energon path: ``PackingTaskEncoder(family=Qwen2AudioProcessor)`` in a real
loader (2 workers) over a native WebDataset of WAV, FLAC, MP3 and Opus members next to text-only
samples and one cut file. Every pack equals what the collator makes of the same samples (ids,
labels, the feature extractor's outputs), every sample leaves exactly once or is the counted
skip, and a loader restored at three cut points continues exactly as one that never stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import test_family_qwen2_audio as qwen2_audio
from audio_files import encode_audio
from energon_family import assert_pack_is_the_collators
from energon_shards import write_dataset
from helpers import (
    CUT_POINTS,
    FamilyLoaderRun,
    assert_loader_resumes,
    batches,
    train_dataset,
)

from energon_pack import VLMPackingCollator, model_family

SETTINGS: dict[str, Any] = {"seq_length": 2048, "pad_to_multiple_of": 8, "tokenizer": None}
FORMATS = [("wav", 16000), ("flac", 22050), ("mp3", 44100), ("opus", 48000)]
BROKEN = "s007"


def samples() -> list[tuple[str, dict[str, bytes]]]:
    """24 native samples: every third text-only, the others with one or two audio members of
    0.2-3 s; sample ``s007``'s first audio is cut in half (its header says more)."""
    out = []
    for index in range(24):
        count = 0 if index % 3 == 0 else 1 + index % 2
        members: dict[str, bytes] = {}
        names = []
        for position in range(count):
            kind, rate = FORMATS[(index + position) % len(FORMATS)]
            seconds = 0.2 + (index * 7 + position * 3) % 28 / 10
            data = encode_audio(kind, rate, 1 + position % 2, int(rate * seconds), sweep=True)
            extension = "ogg" if kind == "opus" else kind
            name = f"{position}.{extension}"
            members[name] = data
            names.append(name)
        key = f"s{index:03d}"
        if key == BROKEN:
            members[names[0]] = members[names[0]][: len(members[names[0]]) // 2]
        turns = [
            {"from": "human", "value": "<audio>" * count + f"What is that sound? {index}"},
            {"from": "gpt", "value": f"The quick brown fox {index}."},
        ]
        members["json"] = json.dumps({"conversations": turns, "media": names}).encode()
        out.append((key, members))
    return out


@pytest.fixture(scope="module")
def audio_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("audio") / "ds", samples())


def _dataset(path: Path, *, repeat: bool = False) -> Any:
    family = qwen2_audio.processor(2)
    return train_dataset(path, 8, workers=2, repeat=repeat, family=family, **SETTINGS)


def test_packs_equal_the_collators_and_every_sample_leaves_once(audio_dataset: Path) -> None:
    by_key = dict(samples())
    collator = VLMPackingCollator(
        seq_length=SETTINGS["seq_length"],
        pad_to_multiple_of=SETTINGS["pad_to_multiple_of"],
        family=model_family(qwen2_audio.processor(2)),
    )
    audio_id = qwen2_audio.processor(2).tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    seen: list[str] = []
    skipped: dict[int, dict[str, int]] = {}  # each worker's running counts
    audio: dict[int, list[int]] = {}  # each worker's audio tokens per pack
    for batch in batches(_dataset(audio_dataset)):
        keys = list(batch.__keys__)
        seen += keys
        stats = batch.packing_stats
        skipped[stats.worker] = dict(stats.skipped)
        own = audio.setdefault(stats.worker, [])
        own.append(int((batch.input_ids == audio_id).sum()))
        assert stats.audio_tokens_mean * stats.packs == pytest.approx(sum(own))
        assert stats.audio_tokens_max == max(own)
        assert stats.vision_tokens_mean >= stats.audio_tokens_mean  # one encoder budget
        assert_pack_is_the_collators(batch, collator, by_key)
    assert len(seen) == len(set(seen))
    assert sum(sum(counts.values()) for counts in skipped.values()) == 1
    assert set(seen) == set(by_key) - {BROKEN}
    assert min(max(own) for own in audio.values()) > 0


@pytest.mark.filterwarnings("ignore:VLMPackingCollator got a micro-batch of 1 sample")
def test_tune_reports_the_audio_tokens_per_pack(
    audio_dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tune --family DIR`` over the audio dataset: its audio tokens per pack are those of the
    packed samples over the packs, and the table prints them."""
    from energon_pack.cli import main
    from energon_pack.tune import TUNE_HEADERS

    saved = tmp_path / "qwen2-audio"
    qwen2_audio.processor(2).save_pretrained(saved)
    command = ["tune", str(audio_dataset), "--family", str(saved), "--buffer-sizes", "8"]
    command += ["--seq-length", "2048", "--num-workers", "1", "--one-epoch", "--min-rows", "none"]
    assert main([*command, "--out", str(tmp_path / "tune")]) == 0
    (run,) = json.loads((tmp_path / "tune" / "tune.json").read_text())["results"]
    collator = VLMPackingCollator(seq_length=2048, family=model_family(qwen2_audio.processor(2)))
    audio_id = qwen2_audio.processor(2).tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    total = 0
    for key, members in samples():
        if key != BROKEN:
            alone = collator([{"__key__": key, **members}])
            total += int((alone.input_ids == audio_id).sum())
    assert run["skipped"] == {"corrupt": 1}
    assert run["audio_tokens_mean"] * run["packs"] == pytest.approx(total)
    assert 0 < run["audio_tokens_max"] <= run["vision_tokens_max"]
    header = next(line for line in capsys.readouterr().out.splitlines() if "audio/pack" in line)
    assert header.split()[:2] == TUNE_HEADERS[:2]


@pytest.mark.parametrize("at", CUT_POINTS)
def test_resume_is_exact_at_three_cut_points(audio_dataset: Path, at: int) -> None:
    assert_loader_resumes(lambda: FamilyLoaderRun(_dataset(audio_dataset, repeat=True)), at)
