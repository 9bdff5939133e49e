"""Tests of ``energon-pack check-config`` (run in-process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from energon_pack.cli import main

VALID = [
    "check-config",
    "--seq-length", "8192", "--tp", "4", "--cp", "2", "--sp", "--mbs", "1", "--gbs", "8",
    "--dp", "8", "--mode", "online", "--packing-buffer-size", "16", "--calculate-per-token-loss",
]  # fmt: skip


def test_valid_config_prints_derived_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(VALID) == 0
    out = capsys.readouterr().out
    assert re.search(r"pad_seq_to_mult +8\n", out)
    assert re.search(r"token slots per step +65,536\n", out)
    assert re.search(r"packing mode +online\n", out)
    assert "OK: no violations" in out


def test_violations_are_all_printed_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*VALID, "--seq-length", "8190", "--mbs", "2", "--gbs", "16", "--pp", "2", "--mtp", "1"]
    argv += ["--no-calculate-per-token-loss"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "5 violation(s):" in out
    assert "1. micro_batch_size=2: online packing" in out
    assert "mtp" not in out  # MTP rolls its targets inside each packed segment
    assert "calculate_per_token_loss=False: online packing gives each row" in out
    assert "pp=2: online packing does not support pipeline parallelism" in out
    assert "seq_length=8190: context parallelism cp=2" in out
    assert "seq_length=8190 is not a multiple of pad_seq_to_mult=8" in out


def test_cuda_graph_scope_flag(capsys: pytest.CaptureFixture[str]) -> None:
    offline = ["check-config", "--seq-length", "4096", "--mode", "offline", "--cuda-graphs"]
    offline += ["--pad-to-max-length"]
    assert main(offline) == 1
    assert "captures attention, which reads cu_seqlens" in capsys.readouterr().out
    assert main([*offline, "--cuda-graph-scope", "mlp"]) == 0
    assert "OK: no violations" in capsys.readouterr().out
    assert main([*offline, "--cuda-graph-scope", "attn,mlp"]) == 1
    assert "cuda_graph_scope='attn,mlp' captures attention" in capsys.readouterr().out
    assert main([*offline, "--cuda-graph-scope", "everything"]) == 2
    assert "cuda_graph_scope must be 'full' or" in capsys.readouterr().err


def test_yaml_file_with_flag_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "packing.yaml"
    config.write_text(
        "seq_length: 16384\nmode: online\ncp: 2\ntp: 4\nsp: true\nglobal_batch_size: 8\n"
        "packing_buffer_size: 16\nfinetuning: true\ncalculate_per_token_loss: true\n"
    )
    assert main(["check-config", "--from-yaml", str(config)]) == 0
    assert "OK: no violations" in capsys.readouterr().out
    # flags override the YAML keys
    assert main(["check-config", "--from-yaml", str(config), "--no-calculate-per-token-loss"]) == 1
    out = capsys.readouterr().out
    assert "calculate_per_token_loss=False with cp=2 and finetuning" in out


def test_unknown_yaml_key_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("seq_length: 4096\nseq_len: 8\n")
    assert main(["check-config", "--from-yaml", str(config)]) == 2
    err = capsys.readouterr().err
    assert "unknown packing config key(s) 'seq_len'; valid keys: seq_length, mode" in err


def test_bad_yaml_content_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "list.yaml"
    config.write_text("- 1\n- 2\n")
    assert main(["check-config", "--from-yaml", str(config)]) == 2
    assert "expected a mapping of TrainingSetup fields" in capsys.readouterr().err
    config.write_text("seq_length: 4096\nsp: maybe\n")
    assert main(["check-config", "--from-yaml", str(config)]) == 2
    assert "sp must be true or false, got 'maybe'" in capsys.readouterr().err


def test_missing_seq_length_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--tp", "2"]) == 2
    assert "check-config needs --seq-length" in capsys.readouterr().err


def test_missing_yaml_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--from-yaml", str(tmp_path / "absent.yaml")]) == 2
    assert "cannot read --from-yaml" in capsys.readouterr().err
