"""An offline pack reads every source a plan reads (JSONL, a JSON array, Parquet, a saved
``datasets`` folder, a Megatron-Energon dataset) and tokenises on Ray Data or in this process:
each writes, array for array, what the same samples in a JSONL file give in this process."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from energon_shards import write_dataset
from helpers import read_samples
from plan_rows import FIXTURES

from energon_pack.cli import main
from energon_pack.offline import build as offline_build
from energon_pack.offline.build import pack_offline
from energon_pack.offline.spec import PackingSpec

SPEC = PackingSpec(256, pad_seq_to_mult=8)
DEMO = FIXTURES / "vlm_demo"


def rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` text samples of every form an offline input holds, of varied lengths."""
    random = np.random.default_rng(seed)
    out: list[dict[str, Any]] = []
    for n in range(count):
        words = " ".join(f"w{k}" for k in range(int(random.integers(1, 40))))
        form = n % 3
        if form == 0:
            out.append({"input": f"q{n} {words}", "output": f"a{n}"})
        elif form == 1:
            turns = [{"role": "user", "content": f"u{n}"}, {"role": "assistant", "content": words}]
            out.append({"messages": turns})
        else:
            length = int(random.integers(2, 200))
            ids = random.integers(0, 256, length).tolist()
            out.append(
                {"input_ids": ids, "loss_mask": [0] * (length // 2) + [1] * (length - length // 2)}
            )
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]], blank_every: int = 0) -> Path:
    lines = []
    for n, record in enumerate(records):
        if blank_every and n % blank_every == 0:
            lines.append("")
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def written(out: Path) -> dict[str, Any]:
    """Every array of a packed directory, its metadata and its build statistics."""
    found: dict[str, Any] = {path.name: np.load(path) for path in sorted(out.glob("*.npy"))}
    for path in sorted(out.glob("*.parquet")):
        found[path.name] = pq.read_table(path).to_pylist()
    manifest = json.loads((out / "manifest.json").read_text())
    found["stats"] = manifest["stats"]
    found["metadata"] = json.loads(next(out.glob("*metadata.json*")).read_text())
    return found


def assert_same(one: dict[str, Any], other: dict[str, Any]) -> None:
    assert one.keys() == other.keys()
    for name, value in one.items():
        if isinstance(value, np.ndarray):
            assert value.dtype == other[name].dtype, name
            np.testing.assert_array_equal(value, other[name], err_msg=name)
        else:
            assert value == other[name], name


# ------------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("format", ["energon_pack", "bridge"])
def test_ray_tokenises_as_this_process_does(tmp_path: Path, ray_cluster: None, format: str) -> None:
    source = write_jsonl(tmp_path / "rows.jsonl", rows(4500), blank_every=7)  # 3 partitions
    here = pack_offline(source, tmp_path / "here", SPEC, format=format)  # type: ignore[arg-type]
    on_ray = pack_offline(
        source,
        tmp_path / "ray",
        SPEC,
        format=format,
        engine="ray",  # type: ignore[arg-type]
    )
    assert (here.samples, here.sequences) == (on_ray.samples, on_ray.sequences) == (4500, 4500)
    assert_same(written(tmp_path / "here"), written(tmp_path / "ray"))
    if format == "energon_pack":  # the input's line numbers, blank lines counted
        lines = np.sort(np.load(tmp_path / "ray" / "seq_lines.npy"))
        assert lines[:8].tolist() == [2, 3, 4, 5, 6, 7, 8, 10]


def test_partitions_coming_back_in_any_order_pack_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray hands partitions back as they finish; the packs follow the source's order."""
    source = write_jsonl(tmp_path / "rows.jsonl", rows(4500))
    pack_offline(source, tmp_path / "in-order", SPEC)
    worked = offline_build.run_partitions

    def reversed_order(*args: Any) -> Iterator[tuple[int, dict[str, Any]]]:
        yield from reversed(list(worked(*args)))

    monkeypatch.setattr(offline_build, "run_partitions", reversed_order)
    pack_offline(source, tmp_path / "reversed", SPEC)
    assert_same(written(tmp_path / "in-order"), written(tmp_path / "reversed"))


def test_a_bad_sample_on_ray_stops_naming_its_line(tmp_path: Path, ray_cluster: None) -> None:
    source = write_jsonl(tmp_path / "rows.jsonl", [*rows(2100), {"text": "x"}])
    with pytest.raises(ValueError, match=r"sample rows\.jsonl:2101: unknown record"):
        pack_offline(source, tmp_path / "out", SPEC, engine="ray")
    assert not (tmp_path / "out" / "manifest.json").exists()


# ------------------------------------------------------------------------------ the sources
def test_parquet_and_saved_datasets_pack_as_their_jsonl(tmp_path: Path) -> None:
    import datasets  # type: ignore[import-untyped]

    records = [row for row in rows(900) if "messages" in row or "input" in row]
    chats = [row if "messages" in row else _as_messages(row) for row in records]
    expected = pack_offline(write_jsonl(tmp_path / "rows.jsonl", chats), tmp_path / "jsonl", SPEC)
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "rows.parquet", row_group_size=200)
    datasets.DatasetDict({"test": datasets.Dataset.from_list(chats)}).save_to_disk(
        tmp_path / "saved"
    )
    from_parquet = pack_offline(tmp_path / "rows.parquet", tmp_path / "parquet", SPEC)
    from_saved = pack_offline(tmp_path / "saved", tmp_path / "saved-out", SPEC, split="test")
    assert expected.sequences == from_parquet.sequences == from_saved.sequences == len(chats)
    for out in ("parquet", "saved-out"):
        assert_same(written(tmp_path / "jsonl"), written(tmp_path / out))
    # The saved folder is recorded by its data files: another content is another input.
    datasets.DatasetDict({"test": datasets.Dataset.from_list(chats[1:])}).save_to_disk(
        tmp_path / "saved"
    )
    with pytest.raises(ValueError, match="input_sha256="):
        pack_offline(tmp_path / "saved", tmp_path / "saved-out", SPEC, split="test")


def _as_messages(row: dict[str, Any]) -> dict[str, Any]:
    turns = [
        {"role": "user", "content": row["input"]},
        {"role": "assistant", "content": row["output"]},
    ]
    return {"messages": turns}


@pytest.mark.parametrize("newline", [False, True])
def test_an_energon_text_dataset_packs_as_its_jsonl(tmp_path: Path, newline: bool) -> None:
    text = [
        (key, members) for key, members in read_samples(DEMO).items() if set(members) == {"json"}
    ]
    assert len(text) == 72
    dataset = write_dataset(tmp_path / "energon", text)
    records = [json.loads(members["json"]) for _, members in text]
    spec = PackingSpec(4096, pad_seq_to_mult=8, train_newline_after_im_end=newline)
    expected = pack_offline(write_jsonl(tmp_path / "rows.jsonl", records), tmp_path / "jsonl", spec)
    from_energon = pack_offline(dataset, tmp_path / "energon-out", spec)
    assert from_energon.sequences == expected.sequences == 72
    assert expected.packs > 1
    assert_same(written(tmp_path / "jsonl"), written(tmp_path / "energon-out"))
    assert from_energon.reused is False
    assert pack_offline(dataset, tmp_path / "energon-out", spec).reused
    targets = int(np.load(tmp_path / "energon-out" / "loss_mask.npy").sum())
    answers = sum(
        turn.get("from") == "gpt" or turn.get("role") == "assistant"
        for record in records
        for turn in record["conversations"]
    )
    assert answers == 120
    assert targets == 30189 + (answers if newline else 0)  # the newline after each answer


def test_an_energon_sample_with_media_is_refused_by_its_key(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"sample demo\d{5}: offline packing is text-only"):
        pack_offline(DEMO, tmp_path / "out", SPEC)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_the_cli_packs_a_parquet_file_on_ray_with_a_progress_bar(
    tmp_path: Path,
    ray_cluster: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chats = [_as_messages(row) for row in rows(300) if "input" in row]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "rows.parquet", row_group_size=40)
    args = ["offline", str(tmp_path / "rows.parquet"), str(tmp_path / "out"), "--size", "256"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is for terminals
    assert main([*args, "--ray"]) == 0
    out, err = capsys.readouterr()
    assert f"{len(chats)} samples -> {len(chats)} sequences" in out
    assert "tokenising" in err
    assert f"{len(chats)}/{len(chats)}" in err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main([*args, "--split", "train"]) == 0  # the same pack, from this process
    out, err = capsys.readouterr()
    assert "reused the up-to-date pack" in out
    assert not err  # no bar where stderr is no terminal
