"""The committed fixture datasets: size, content mix, Energon loading, reproducibility."""

from __future__ import annotations

import json
import statistics
import tarfile
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import Samples, load_script, read_samples

from energon_pack import media
from energon_pack.formats.native import parse_sample

MAX_FIXTURE_BYTES = 10 * 1024 * 1024


def _load_generator(fixtures_dir: Path) -> ModuleType:
    return load_script(fixtures_dir / "make_fixtures.py")


def _samples(path: Path) -> Samples:
    """The samples, after checking the tar members carry no machine-specific metadata."""
    for shard in sorted(path.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for info in tar.getmembers():
                assert info.mtime == 0
                assert (info.uid, info.gid, info.uname) == (0, 0, "")
    return read_samples(path)


def test_fixtures_fit_the_size_budget(fixtures_dir: Path) -> None:
    total = sum(p.stat().st_size for p in fixtures_dir.rglob("*") if p.is_file())
    assert total < MAX_FIXTURE_BYTES


def test_vlm_demo_mix(vlm_demo_path: Path) -> None:
    samples = _samples(vlm_demo_path)
    assert len(samples) == 300
    assert len(list(vlm_demo_path.glob("*.tar"))) == 4
    counts: Counter[str] = Counter()
    answer_words: list[int] = []
    sizes = set()
    for key, sample in samples.items():
        meta = json.loads(sample["json"])
        refs = parse_sample(key, sample).media
        counts["text_only" if not refs else f"{len(refs)}_media"] += 1
        counts["explicit_order"] += "media" in meta
        counts["system"] += "system" in meta
        turns = meta["conversations"]
        counts["multi_turn"] += len(turns) > 2
        counts["role_content"] += "role" in turns[0]
        for turn in turns:
            if turn.get("from") == "gpt" or turn.get("role") == "assistant":
                answer_words.append(len((turn.get("value") or turn["content"]).split()))
        for member, kind, data in refs:
            counts[member.rsplit(".", 1)[-1]] += 1
            if kind == "image":
                probe = media.probe_image(data)
                sizes.add((probe.width, probe.height))
    for needed in ("text_only", "1_media", "3_media", "explicit_order", "system", "multi_turn"):
        assert counts[needed] >= 5, needed
    assert counts["role_content"] >= 30
    for ext in ("jpg", "png", "webp", "mp4"):
        assert counts[ext] >= 20, ext
    assert (1280, 720) in sizes
    assert (64, 64) in sizes
    # Lognormal-ish answers: many short, a long tail.
    median = statistics.median(answer_words)
    assert median < statistics.mean(answer_words)
    assert max(answer_words) > 8 * median
    assert min(answer_words) <= 3


@pytest.mark.parametrize("dataset", ["vlm_demo", "broken"])
def test_energon_loads_prepared_dataset(fixtures_dir: Path, dataset: str) -> None:
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        WorkerConfig,
        get_loader,
        get_train_dataset,
        stateless,
    )

    @stateless
    def cook(raw: dict[str, Any]) -> dict[str, Any]:
        return raw

    class RawEncoder(DefaultTaskEncoder):  # type: ignore[misc]
        cookers = (Cooker(cook),)
        decoder = None  # keep members as compressed bytes

        def encode_sample(self, sample: Any) -> Any:
            return sample

        def batch(self, samples: list[Any]) -> list[Any]:
            return samples

        def encode_batch(self, batch: Any) -> Any:
            return batch

    yaml_text = (fixtures_dir / dataset / ".nv-meta" / "dataset.yaml").read_text()
    assert "CrudeWebdataset" in yaml_text
    ds = get_train_dataset(
        fixtures_dir / dataset,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=RawEncoder(),
        repeat=False,
    )
    expected = _samples(fixtures_dir / dataset)
    seen = {}
    for (sample,) in get_loader(ds):
        seen[sample["__key__"]] = sample
    assert set(seen) == set(expected)
    for key, sample in seen.items():
        for ext, data in expected[key].items():
            assert sample[ext] == data


def test_regeneration_is_byte_identical(fixtures_dir: Path, tmp_path: Path) -> None:
    """Shard 0 of vlm_demo (75 samples incl. video) and the broken set, rebuilt from scratch."""
    generator = _load_generator(fixtures_dir)
    per_shard = generator.DEMO_SAMPLES // generator.DEMO_SHARDS
    generator.main(["--out", str(tmp_path), "--samples", str(per_shard), "--shards", "1"])
    pairs = [
        ("vlm_demo/shard-000000.tar", "vlm_demo/shard-000000.tar"),
        ("broken/broken-000000.tar", "broken/broken-000000.tar"),
        ("broken/expected.json", "broken/expected.json"),
        ("broken/.nv-meta/dataset.yaml", "broken/.nv-meta/dataset.yaml"),
        ("broken/.nv-meta/split.yaml", "broken/.nv-meta/split.yaml"),
    ]
    for fresh, shipped in pairs:
        assert (tmp_path / fresh).read_bytes() == (fixtures_dir / shipped).read_bytes(), fresh
    assert any(name.endswith(".mp4") for name in _samples(tmp_path / "vlm_demo")["demo00036"])
