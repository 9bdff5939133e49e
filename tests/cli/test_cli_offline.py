"""Tests of ``energon-pack offline`` (run in-process)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from energon_pack.cli import main
from energon_pack.offline.reader import PackedDataset


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


def test_bridge_format_and_tokenizer_flags(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import hf_qwen
    import pyarrow.parquet as pq

    tokenizer_dir = tmp_path / "qwen-tokenizer"
    hf_qwen.qwen_tokenizer().save_pretrained(tokenizer_dir)
    out_dir = tmp_path / "bridge"
    argv = ["offline", str(source), str(out_dir), "--size", "512", "--tp", "2", "--sp"]
    argv += ["--format", "bridge", "--tokenizer", str(tokenizer_dir)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    parquet, metadata = out_dir / "training_512.idx.parquet", out_dir / "512_metadata.jsonl"
    assert f"wrote {out_dir}: training_512.idx.parquet, 512_metadata.jsonl" in out
    assert (
        f"PackedSequenceSpecs(packed_sequence_size=512, packed_train_data_path='{parquet}', "
        f"packed_metadata_path='{metadata}', pad_seq_to_mult=2, pad_cu_seqlens=False)" in out
    )
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["format"] == "bridge"
    assert manifest["tokenizer"]["name_or_path"] == str(tokenizer_dir)
    ids = [t for row in pq.read_table(parquet).column("input_ids").to_pylist() for t in row]
    assert max(ids) > 262  # the tokenizer's ids, not the byte tokenizer's 0-262
    # the newline convention is a flag too, and part of the spec
    assert main([*argv, "--train-newline-after-im-end"]) == 2
    assert "train_newline_after_im_end=False but the spec asks True" in capsys.readouterr().err


def test_unloadable_tokenizer_exits_2(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["offline", str(source), str(tmp_path / "out"), "--size", "512"]
    assert main([*argv, "--tokenizer", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer '{tmp_path / 'missing'}' cannot be loaded offline" in err
    assert "save_pretrained" in err
    assert not (tmp_path / "out").exists()
