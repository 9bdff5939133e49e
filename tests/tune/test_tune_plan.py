"""Memory and speed of a plan's loader: ``PlannedDataset(monitor=...)`` reports each worker's
RSS as the online loaders' monitor does, and ``energon-pack tune PLAN_DIR`` reads the plan's
packs with real workers and prints what it measured (samples/s, worker RSS)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from interrupted import assert_interrupted_exit, interrupt_cli, losing
from plan_rows import ChatRows, write_chat_rows

from energon_pack import MonitorConfig, PlannedDataset, PlanSampler, RowLayout, make_encoder
from energon_pack.cli import main
from energon_pack.memory.report import load_report
from energon_pack.plan import Plan, PlanSpec, plan_dataset

RECEIVED = r"plan:.*?\b[1-9]\d*(?:/\d+ | packs)"  # the progress bar: packs received, n/total


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's rows planned with the encoder ``tune`` builds without flags."""
    root = tmp_path_factory.mktemp("tune_plan")
    rows: ChatRows = write_chat_rows(root / "rows")
    spec = PlanSpec(RowLayout(4096, 8))
    encoder = make_encoder(None)
    plan_dataset(
        rows.path, root / "plan", spec, encoder, media_root=rows.media_root, engine="local"
    )
    assert Plan.read(root / "plan").counts["skipped"]["media_error"] == 0
    return root / "plan"


def test_each_worker_reports_its_memory_and_what_it_read(plan_dir: Path, tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    monitor = MonitorConfig(report_dir=str(reports), every_samples=1)
    dataset = PlannedDataset(plan_dir, make_encoder(None), monitor=monitor)
    dataset[0]  # a pack read in the parent: forked workers start their own counts
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=PlanSampler(dataset),
        collate_fn=PlannedDataset.collate_fn,
        num_workers=2,
    )
    members = sum(len(row.keys[0]) for row in loader)
    readings = load_report(reports)
    last = {reading.pid: reading for reading in readings}  # each process's latest reading
    parent = last.pop(os.getpid())
    assert (parent.worker, parent.packs, parent.samples) == (0, 1, len(dataset.keys[0]))
    assert sorted(reading.worker for reading in last.values()) == [0, 1]
    assert sum(reading.packs for reading in last.values()) == len(dataset)
    assert sum(reading.samples for reading in last.values()) == members
    fill = Plan.read(plan_dir).counts["fill"]
    assert all(r.rss > 0 and r.bin_fill == fill and r.buffer_count == 0 for r in readings)


def test_tune_on_a_plan_reads_every_pack_with_workers(
    plan_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["tune", str(plan_dir), "--num-workers", "2", "--one-epoch", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    plan = Plan.read(plan_dir)
    (result,) = json.loads((out / "tune.json").read_text())["results"]
    assert result["samples"] == plan.counts["samples"]
    assert result["packs"] == plan.packs
    assert result["peak_worker_rss_mb"] > 0
    assert result["samples_per_second"] > 0
    assert result["bin_fill"] == pytest.approx(plan.counts["fill"])
    assert "  plan " in printed
    assert {r.worker for r in load_report(out / "reports" / "plan")} == {0, 1}


def test_tune_on_a_plan_refuses_the_online_runs_flags(
    plan_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tune", str(plan_dir), "--max-vision-tokens", "600", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "--max-vision-tokens: a plan's packs and budgets are fixed" in capsys.readouterr().err
    assert main([*argv, "--vision-share", "0"]) == 2  # a share of 0 is given, too
    assert "--max-vision-tokens, --vision-share: a plan's" in capsys.readouterr().err


@pytest.mark.parametrize("lost", [False, True], ids=["ctrl_c", "ctrl_c_lost"])
def test_ctrl_c_while_tune_reads_a_plan_exits_130(
    plan_dir: Path, tmp_path: Path, lost: bool
) -> None:
    """Ctrl-C once packs arrive: tune stops its workers, writes what it read, marked
    interrupted, and exits 130 within seconds, leaving no process; also where the
    KeyboardInterrupt is lost (tune's own check ends the run at its next pack)."""
    out = tmp_path / "out"
    args = ["tune", str(plan_dir), "--num-workers", "2", "--min-packs", "100000000"]
    path = (losing(tmp_path),) if lost else ()
    status, seconds, stdout, stderr = interrupt_cli(
        [*args, "--out", str(out)], when=("stderr", RECEIVED), path=path
    )
    assert_interrupted_exit(status, seconds, stderr)
    (result,) = json.loads((out / "tune.json").read_text())["results"]
    assert result["interrupted"] is True
    assert result["packs"] > 0
    assert "a plan's packs, 2 workers" in stdout
