"""Tests of ``energon-pack offline`` (run in-process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from energon_pack.cli import main
from energon_pack.offline import PackedDataset


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "sft.jsonl"
    lines = [
        json.dumps({"input": f"question {i} " * (i % 6 + 1), "output": f"answer {i}"})
        for i in range(40)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_offline_writes_then_reuses(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "packed"
    argv = ["offline", str(source), str(out_dir), "--size", "512", "--tp", "4", "--cp", "2"]
    assert main([*argv, "--sp", "--pad-to-max-length", "--pad-cu-seqlens"]) == 0
    out = capsys.readouterr().out
    for key in (
        "dataset_max_seqlen",
        "max_samples_per_bin",
        "packing_factor",
        "packing_efficiency",
        "min_packed_seqlen",
    ):
        assert re.search(rf"{key} +\d", out), key
    assert re.search(r"pack_size +512\n", out)
    assert "40 samples -> 40 sequences" in out
    assert "pad_seq_to_mult=8" in out
    assert f"wrote {out_dir}" in out
    dataset = PackedDataset(out_dir)
    assert dataset.spec.pad_seq_to_mult == 8
    assert dataset.spec.pad_cu_seqlens

    assert main([*argv, "--sp", "--pad-to-max-length", "--pad-cu-seqlens"]) == 0
    assert f"reused the up-to-date pack in {out_dir}" in capsys.readouterr().out


def test_stale_dir_exits_2_until_forced(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "packed"
    argv = ["offline", str(source), str(out_dir), "--size", "512"]
    assert main([*argv, "--pad-seq-to-mult", "4"]) == 0
    capsys.readouterr()
    assert main([*argv, "--pad-seq-to-mult", "8"]) == 2
    err = capsys.readouterr().err
    assert "energon-pack: error: pack dir" in err
    assert "pad_seq_to_mult=4 but the spec asks 8" in err
    assert main([*argv, "--pad-seq-to-mult", "8", "--force"]) == 0
    assert f"wrote {out_dir}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pad-seq-to-mult", "4", "--tp", "2"], "either the topology"),
        (["--pad-cu-seqlens"], "set pad_to_max_length=True"),
        (["--size", "510", "--cp", "2"], "not a multiple of pad_seq_to_mult=4"),
    ],
)
def test_bad_settings_exit_2(
    source: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    argv = ["offline", str(source), str(tmp_path / "o"), "--size", "512", *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_overlong_flag(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["offline", str(source), str(tmp_path / "o"), "--size", "64"]
    assert main(argv) == 2
    assert "sft.jsonl:" in capsys.readouterr().err
    assert main([*argv, "--overlong", "truncate"]) == 0
    assert re.search(
        r"40 samples -> 40 sequences .*0 skipped, \d+ truncated", capsys.readouterr().out
    )
