"""``plan_dataset`` and ``energon-pack plan`` on Ray (one local Ray for the session): the plan
directory holds every row once or lists why not, keeps the caps and the step layout, is
reused when up to date and refused, naming what differs, when not."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from helpers import SMALL_MEDIA
from plan_rows import ChatRows

from energon_pack import RowLayout, VisionBudget, make_encoder
from energon_pack.cli import main
from energon_pack.plan import Plan, PlanSpec, plan_dataset
from energon_pack.plan.measure import measure_partition, measure_partitions
from energon_pack.sources.engine import ray_session
from energon_pack.sources.rows import JsonSource

pytestmark = pytest.mark.usefixtures("ray_cluster")

SPEC = PlanSpec(
    RowLayout(2048, 8),
    VisionBudget(max_vision_tokens=1500, max_media=6, balance=True),
    data_parallel_size=4,
    global_batch_size=8,
    seed=3,
)


def test_plan_holds_every_row_once_within_the_caps(chat_rows: ChatRows, tmp_path: Path) -> None:
    encoder = make_encoder(None, media=SMALL_MEDIA)
    plan = plan_dataset(
        chat_rows.path, tmp_path / "plan", SPEC, encoder, media_root=chat_rows.media_root
    )
    table = plan.table().to_pylist()
    keys = [key for pack in table for key in pack["keys"]]
    listed = [entry["key"] for entry in plan.record["skipped"]]
    assert sorted(map(int, keys + listed)) == list(range(300))
    assert len(keys) == len(set(keys)) == plan.counts["samples"]
    # the plan's counts are the measure step's, row by row
    (part,) = JsonSource.open(chat_rows.path, chat_rows.media_root).partitions(rows=300)
    measured = measure_partition(part, encoder, SPEC, chat_rows.media_root)
    for pack in table:
        rows = [int(key) for key in pack["keys"]]
        assert pack["lengths"] == measured["length"][rows].tolist()
        assert pack["vision_tokens"] == measured["vision_tokens"][rows].tolist()
        assert pack["media"] == measured["media"][rows].tolist()
        assert sum(SPEC.layout.aligned(n) for n in pack["lengths"]) <= 2048
        assert sum(pack["vision_tokens"]) <= 1500
        assert sum(pack["media"]) <= 6
    # steps: 8 packs, 2 per rank, in step order; the last may hold fewer
    assert plan.packs == len(table)
    assert plan.steps == -(-plan.packs // 8)
    assert [p["step"] for p in table] == sorted(p["step"] for p in table)
    for step in range(plan.steps - 1):
        ranks = sorted(p["rank"] for p in table if p["step"] == step)
        assert ranks == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sorted(p["pack"] for p in table) == list(range(plan.packs))
    counts = plan.counts
    assert counts["rows"] == 300
    assert counts["fill"] == pytest.approx(
        sum(SPEC.layout.aligned(n) for p in table for n in p["lengths"]) / (plan.packs * 2048)
    )
    assert counts["straggler"] <= counts["straggler_floor"] + 0.05
    assert "samples ->" in plan.summary()
    assert (tmp_path / "plan" / "rows.npy").is_file()
    assert Plan.read(tmp_path / "plan").record == plan.record


def test_measured_in_this_process_the_plan_is_the_same(
    chat_rows: ChatRows, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """engine="local" (--local) measures without Ray and writes the plan Ray writes."""
    encoder = make_encoder(None, media=SMALL_MEDIA)
    root = chat_rows.media_root
    on_ray = plan_dataset(chat_rows.path, tmp_path / "ray", SPEC, encoder, media_root=root)
    here = plan_dataset(
        chat_rows.path, tmp_path / "local", SPEC, encoder, media_root=root, engine="local"
    )
    assert here.table().to_pylist() == on_ray.table().to_pylist()
    assert here.record == on_ray.record
    argv = ["plan", str(chat_rows.path), str(tmp_path / "cli"), "--seq-length", "2048"]
    assert main([*argv, "--local", "--media-root", str(root)]) == 0
    assert Plan.read(tmp_path / "cli").counts["samples"] > 0
    assert main([*argv, "--local", "--ray-address", "auto"]) == 2
    assert "--local with --ray-address" in capsys.readouterr().err
    with pytest.raises(ValueError, match="engine must be 'local' or 'ray', got 'spark'"):
        plan_dataset(chat_rows.path, tmp_path / "x", SPEC, encoder, engine="spark")  # type: ignore[arg-type]


def test_rows_left_out_are_counted_and_listed_by_key(chat_rows: ChatRows, tmp_path: Path) -> None:
    lines = chat_rows.path.read_text().splitlines()[:20]
    lines[3] = "{broken"
    lines[7] = json.dumps({"input": "x" * 5000, "output": "y"})
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join(lines) + "\n")
    plan = plan_dataset(
        source,
        tmp_path / "plan",
        PlanSpec(RowLayout(2048)),
        make_encoder(None, media=SMALL_MEDIA),
        media_root=tmp_path,  # the media are elsewhere: every media row fails
    )
    skipped = {entry["key"]: entry["kind"] for entry in plan.record["skipped"]}
    assert skipped["3"] == "bad_row"
    assert skipped["7"] == "overlong"
    assert plan.counts["skipped"]["media_error"] == sum(
        1 for key, kind in skipped.items() if kind == "media_error"
    )
    assert plan.counts["samples"] + len(skipped) == 20
    assert plan.counts["samples"] > 0


def test_media_paths_are_read_next_to_the_source_by_default(
    chat_rows: ChatRows, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without media_root the rows' paths are read inside the source's folder, wherever the
    caller and Ray's workers run; a source whose every row fails names the first reason."""
    source = chat_rows.media_root / "rows.jsonl"  # the rows next to their media
    source.write_text(chat_rows.path.read_text())
    monkeypatch.chdir(tmp_path)
    plan = plan_dataset(source, "plan", SPEC, make_encoder(None, media=SMALL_MEDIA))
    assert plan.counts["skipped"]["media_error"] == 0
    assert plan.record["source"]["media_root"] == str(chat_rows.media_root.resolve())
    images = tmp_path / "images.jsonl"
    turns = [{"from": "human", "value": "<image>\nhi"}, {"from": "gpt", "value": "a"}]
    images.write_text(json.dumps({"conversations": turns, "images": ["gone.png"]}))
    with pytest.raises(ValueError, match=r"left out .*media_error.*the first because .*gone\.png"):
        plan_dataset(images, "other", SPEC, make_encoder(None, media=SMALL_MEDIA))


def test_overlong_error_stops_naming_the_row(tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(json.dumps({"input": "q" * n, "output": "a"}) + "\n" for n in (10, 900, 20))
    )
    with pytest.raises(ValueError, match=r"sample '1' has \d+ tokens.*--overlong skip"):
        plan_dataset(
            source, tmp_path / "plan", PlanSpec(RowLayout(512), overlong="error"), make_encoder()
        )
    assert not (tmp_path / "plan" / "plan.json").exists()


def test_up_to_date_plan_is_reused_and_a_stale_one_refused(tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(json.dumps({"input": "q" * n, "output": "a"}) + "\n" for n in range(1, 60))
    )
    out = tmp_path / "plan"
    first = plan_dataset(source, out, PlanSpec(RowLayout(512)), make_encoder())
    assert not first.reused
    again = plan_dataset(source, out, PlanSpec(RowLayout(512)), make_encoder())
    assert again.reused
    assert again.record == first.record
    with pytest.raises(ValueError, match=r"spec\.layout\.seq_length=512 but the request has 256"):
        plan_dataset(source, out, PlanSpec(RowLayout(256)), make_encoder())
    source.write_text(source.read_text() + json.dumps({"input": "new", "output": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"source\.sha256="):
        plan_dataset(source, out, PlanSpec(RowLayout(512)), make_encoder())
    rebuilt = plan_dataset(source, out, PlanSpec(RowLayout(512)), make_encoder(), force=True)
    assert rebuilt.counts["rows"] == 60


def test_cli_plan_prints_the_summary_and_refuses_a_stale_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(json.dumps({"input": "q" * n, "output": "a"}) + "\n" for n in range(1, 90))
    )
    out = tmp_path / "plan"
    argv = ["plan", str(source), str(out), "--seq-length", "512", "--data-parallel-size", "2"]
    assert main([*argv, "--global-batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    plan = Plan.read(out)
    assert plan.summary() in printed
    assert f"{plan.counts['packs']} packs in {plan.counts['steps']} steps" in printed
    assert main([*argv, "--global-batch-size", "2"]) == 2
    assert "spec.global_batch_size=4 but the request has 2" in capsys.readouterr().err
    assert main([*argv, "--global-batch-size", "3"]) == 2
    assert "not a multiple of data_parallel_size=2" in capsys.readouterr().err


def test_a_template_encoder_travels_to_the_ray_tasks(tmp_path: Path) -> None:
    from chat_templates import QWEN3
    from real_qwen import real_qwen_tokenizer

    source = tmp_path / "rows.jsonl"
    source.write_text(
        "".join(
            json.dumps({"input": f"question {i} " * (1 + i % 7), "output": "answer " * i}) + "\n"
            for i in range(1, 40)
        )
    )
    encoder = make_encoder(real_qwen_tokenizer(chat_template=QWEN3))
    plan = plan_dataset(source, tmp_path / "plan", PlanSpec(RowLayout(1024)), encoder)
    (part,) = JsonSource.open(source).partitions()
    measured = measure_partition(part, encoder, PlanSpec(RowLayout(1024)), None)
    planned = {
        int(k): n
        for p in plan.table().to_pylist()
        for k, n in zip(p["keys"], p["lengths"], strict=True)
    }
    assert planned == dict(enumerate(measured["length"].tolist()))
    assert plan.record["encoder"]["encoding"] == "template"


def test_measuring_reports_each_partitions_rows_as_it_comes_back(chat_rows: ChatRows) -> None:
    source = JsonSource.open(chat_rows.path, chat_rows.media_root)
    parts = source.partitions(rows=64)
    arrived: list[int] = []
    encoder = make_encoder(None, media=SMALL_MEDIA)
    columns = measure_partitions(parts, encoder, SPEC, source.media_root, on_rows=arrived.append)
    assert sorted(arrived) == sorted([64] * 4 + [300 - 4 * 64])
    assert columns["index"].tolist() == list(range(300))


def test_an_address_where_no_cluster_answers_is_refused_by_name() -> None:
    with socket.socket() as bound:  # a port that is surely closed once this socket goes
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
    refused = rf"--ray-address '127\.0\.0\.1:{port}': nothing answers"
    with pytest.raises(ValueError, match=refused), ray_session(f"127.0.0.1:{port}"):
        pass
