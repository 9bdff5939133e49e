"""A plan reads every kind of source as the loaders read it: a Megatron-Energon dataset through
Energon itself and the task encoder's own preparation (each sample named by its ``__key__``),
and a folder ``datasets`` saved as its rows; each measures as the same samples written as chat
rows, and a sample that cannot be read is listed by its key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from energon_shards import write_dataset
from helpers import SMALL_MEDIA, read_samples
from plan_rows import FIXTURES, ChatRows, sharegpt_rows

from energon_pack import RowLayout, make_encoder
from energon_pack.cli import main
from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.plan import Plan, PlanSpec, plan_dataset
from energon_pack.plan.measure import measure_partition
from energon_pack.sources.energon import EnergonSource
from energon_pack.sources.rows import SavedDatasetSource, Source, open_source

DEMO = FIXTURES / "vlm_demo"
SPEC = PlanSpec(RowLayout(32768))
COMPARED = ("length", "vision_tokens", "media", "skip")


def _measured(
    source: Source,
    encoder: SampleEncoder,
    media_root: Path | None = None,
    partitions: list[str] | None = None,
) -> dict:
    """Every partition measured here (no Ray), as ``plan_dataset`` collects them."""
    partitions = source.partitions() if partitions is None else partitions
    parts = [measure_partition(p, encoder, SPEC, media_root) for p in partitions]
    columns = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    order = np.argsort(columns["index"], kind="stable")
    columns = {name: values[order] for name, values in columns.items()}
    return source.complete(columns) if isinstance(source, EnergonSource) else columns


def test_an_energon_dataset_measures_as_its_samples_written_as_chat_rows(
    chat_rows: ChatRows,
) -> None:
    encoder = make_encoder(None, media=SMALL_MEDIA)
    source = EnergonSource.open(DEMO, rows=128)
    assert len(source) == 300
    assert len(source.partitions()) == 3  # Energon's own split over 3 readers
    from_energon = _measured(source, encoder)
    rows = open_source(chat_rows.path, chat_rows.media_root)
    from_rows = _measured(rows, encoder, chat_rows.media_root)
    assert from_energon["key"].tolist() == sorted(read_samples(DEMO))  # every sample once
    assert from_energon["index"].tolist() == list(range(300))
    for name in COMPARED:
        assert from_energon[name].tolist() == from_rows[name].tolist(), name
    assert from_energon["vision_tokens"].sum() > 0


def test_energon_samples_that_cannot_be_packed_are_listed_by_key(tmp_path: Path) -> None:
    demo = read_samples(DEMO)
    good = next(members for members in demo.values() if "0.jpg" in members)
    samples = [
        ("good", good),
        ("broken_jpeg", {**good, "0.jpg": good["0.jpg"][:40]}),
        ("not_json", {"json": b"{not json"}),
        ("long", {"json": json.dumps({"conversations": _turns("q " * 5000)}).encode()}),
    ]
    source = EnergonSource.open(write_dataset(tmp_path / "bad", samples))
    measured = _measured(source, make_encoder(None, media=SMALL_MEDIA))
    kinds = dict(zip(measured["key"].tolist(), measured["skip"].tolist(), strict=True))
    assert kinds == {"good": "", "broken_jpeg": "media_error", "not_json": "media_error"} | {
        "long": ""  # 10000 tokens fit the 32768 of SPEC; a plan at 4096 refuses it below
    }
    reasons = dict(zip(measured["key"].tolist(), measured["reason"].tolist(), strict=True))
    assert "broken_jpeg" in reasons["broken_jpeg"]
    assert "not_json" in reasons["not_json"]
    # a sample Energon itself could not load is not lost: it is named from the index
    kept = {name: values[:3] for name, values in measured.items()}
    completed = source.complete(kept)
    assert completed["key"].tolist() == ["good", "broken_jpeg", "not_json", "long"]
    assert completed["skip"][3] == "bad_row"
    assert "Energon could not load sample 'long'" in completed["reason"][3]


def _turns(question: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": "a"}]


@pytest.mark.usefixtures("ray_cluster")
def test_a_plan_of_an_energon_dataset_names_its_members_by_key(tmp_path: Path) -> None:
    spec = PlanSpec(RowLayout(4096), data_parallel_size=2)
    encoder = make_encoder(None, media=SMALL_MEDIA)
    plan = plan_dataset(DEMO, tmp_path / "plan", spec, encoder)
    keys = [key for pack in plan.table().to_pylist() for key in pack["keys"]]
    listed = [entry["key"] for entry in plan.record["skipped"]]
    assert sorted(keys + listed) == sorted(read_samples(DEMO))
    assert len(keys) == len(set(keys)) == plan.counts["samples"]
    assert {entry["kind"] for entry in plan.record["skipped"]} == {"overlong"}
    source = plan.record["source"]
    assert source["energon_split_part"] == "train"
    assert [shard[:2] for shard in source["shards"]] == [
        [f"shard-00000{k}.tar", 75] for k in range(4)
    ]
    assert len(source["index_sha256"]) == 64
    assert plan_dataset(DEMO, tmp_path / "plan", spec, encoder).reused


def test_a_saved_datasets_folder_measures_as_its_rows(
    chat_rows: ChatRows, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    monkeypatch.chdir(chat_rows.media_root)  # datasets sizes the path-only images from here
    kept, rows = sharegpt_rows(chat_rows)
    features = datasets.Features(
        {
            "conversations": [
                {"from": datasets.Value("string"), "value": datasets.Value("string")}
            ],
            "system": datasets.Value("string"),
            "images": [datasets.Image()],
            "videos": [datasets.Value("string")],
        }
    )
    saved = datasets.Dataset.from_list(rows, features=features)
    saved.save_to_disk(tmp_path / "one")
    datasets.DatasetDict(train=saved.select(range(10)), test=saved).save_to_disk(tmp_path / "two")
    lines = chat_rows.path.read_text().splitlines()
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(lines[i] + "\n" for i in kept))
    encoder = make_encoder(None, media=SMALL_MEDIA)
    from_rows = _measured(open_source(jsonl, chat_rows.media_root), encoder, chat_rows.media_root)
    assert set(from_rows["skip"].tolist()) == {""}
    for folder, split in ((tmp_path / "one", "train"), (tmp_path / "two", "test")):
        source = open_source(folder, chat_rows.media_root, split)
        assert isinstance(source, SavedDatasetSource)
        assert len(source) == len(kept)
        partitions = source.partitions(rows=64)
        assert len(partitions) == -(-len(kept) // 64)
        measured = _measured(source, encoder, chat_rows.media_root, partitions)
        for name in ("index", *COMPARED):
            assert measured[name].tolist() == from_rows[name].tolist(), (folder, name)
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\], not 'val'"):
        open_source(tmp_path / "two", split="val")


def test_a_folder_that_is_no_dataset_and_a_split_that_is_not_there_are_named(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="neither an Energon dataset"):
        open_source(tmp_path)
    with pytest.raises(ValueError, match="has no split part 'dev'; pass --split"):
        open_source(DEMO, split="dev")


@pytest.mark.usefixtures("ray_cluster")
def test_energon_pack_plan_reads_an_energon_dataset_with_a_progress_bar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is for terminals
    assert main(["plan", str(DEMO), str(tmp_path / "plan"), "--seq-length", "4096"]) == 0
    out, err = capsys.readouterr()
    assert "300/300" in err
    assert "measuring" in err
    plan = Plan.read(tmp_path / "plan")
    assert out.splitlines()[0] == plan.summary()
    hostile = write_dataset(tmp_path / "hostile", [("a", read_samples(DEMO)["demo00000"])])
    (hostile / ".nv-meta" / "dataset.yaml").write_text("__module__: os\n__function__: system\n")
    assert main(["plan", str(hostile), str(tmp_path / "p2"), "--seq-length", "4096"]) == 2
    assert "--trust-dataset-code" in capsys.readouterr().err
