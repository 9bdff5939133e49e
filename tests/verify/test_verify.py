"""``verify_packing`` / ``energon-pack verify`` on model directories as checkpoints ship them
(no weights): every documented family is exact with eager and sdpa, and each real packing
failure planted in the inputs (or in the architecture) turns the verdict, naming its cause."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from model_dirs import model_dir

from energon_pack import verify_packing
from energon_pack.cli import main
from energon_pack.verify import VerifyReport

EXACT_FAMILIES = (
    "qwen2",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "gemma3",
    "idefics3",
)
"""Every family of docs/families.md whose processor loads here without torchvision, and a
text model."""


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("models")
    return lambda name: model_dir(root / name, name)


def verdicts(report: VerifyReport) -> dict[str, str]:
    return {result.attn_implementation: result.verdict for result in report.results}


@pytest.mark.parametrize("name", EXACT_FAMILIES)
def test_documented_families_are_exact(dirs: Callable[[str], Path], name: str) -> None:
    report = verify_packing(dirs(name))
    assert verdicts(report) == {"eager": "exact", "sdpa": "exact"}, report.table()
    assert report.exit_status == 0
    assert len(report.samples) == 4
    assert report.refusal is None
    for result in report.results:
        assert result.leak == 0.0  # no other segment moves at all in float64
        assert result.loss_error is not None
        assert result.loss_error < 1e-6
        assert result.gradient_error is not None
        assert result.gradient_error < 1e-5
        assert result.reason == ""
        assert result.layer is None
    if name == "qwen2":  # a text model takes no media: those samples are counted, not packed
        assert report.skipped["media_for_text_model"] > 0


def test_the_cut_model_keeps_each_layer_type(dirs: Callable[[str], Path]) -> None:
    report = verify_packing(dirs("gemma3"), attn_implementations=["sdpa"])
    assert report.layer_types == ("sliding_attention", "full_attention")
    assert report.model_class == "Gemma3ForConditionalGeneration"


def _with_2d_mask(inputs: dict[str, Any]) -> dict[str, Any]:
    return {**inputs, "attention_mask": torch.ones_like(inputs["input_ids"])}


def _text_positions_only(inputs: dict[str, Any]) -> dict[str, Any]:
    return {**inputs, "position_ids": inputs["position_ids"][0]}


def _boundary_dropped(inputs: dict[str, Any]) -> dict[str, Any]:
    """The second segment's positions continue the first's, as when cu_seqlens loses the
    boundary between them."""
    positions = inputs["position_ids"].clone()
    text = positions[0, 0] if positions.dim() == 3 else positions[0]
    starts = (text == 0).nonzero().flatten().tolist()
    second = slice(starts[1], starts[2])
    text[second] += int(text[starts[1] - 1]) + 1
    return {**inputs, "position_ids": positions}


def _block_mask_dropped(inputs: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in inputs.items() if name != "attention_mask"}


PLANTED = {
    "2-D mask, text model": ("qwen2", _with_2d_mask, "2-D attention_mask"),
    "2-D mask, Qwen2-VL": ("qwen2_vl", _with_2d_mask, "2-D attention_mask"),
    "1-D positions, Qwen2-VL": ("qwen2_vl", _text_positions_only, "1-D position_ids"),
    "1-D positions, Qwen3-VL": ("qwen3_vl", _text_positions_only, "1-D position_ids"),
    "boundary dropped": ("qwen2", _boundary_dropped, "do not restart at token"),
    "boundary dropped, mRoPE": ("qwen3_vl", _boundary_dropped, "do not restart at token"),
    "Gemma 3 by positions only": ("gemma3", _block_mask_dropped, "4-D block masks"),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_planted_failures_are_caught_and_named(dirs: Callable[[str], Path], case: str) -> None:
    name, adapt, cause = PLANTED[case]
    report = verify_packing(dirs(name), adapt=adapt)
    assert verdicts(report) == {"eager": "leaks", "sdpa": "leaks"}, report.table()
    assert report.exit_status == 1
    for result in report.results:
        assert cause in result.reason, result.reason
        assert result.layer is not None
        assert result.layer.startswith("0 (")


def test_a_linear_attention_model_is_refused_and_its_leak_measured(
    dirs: Callable[[str], Path],
) -> None:
    report = verify_packing(dirs("qwen3_5"), attn_implementations=["sdpa"])
    assert report.refusal is not None
    assert "linear-attention" in report.refusal
    (result,) = report.results
    assert result.verdict == "leaks"
    assert result.leak is not None
    assert result.leak > 1e-3
    assert result.layer == "0 (linear_attention)"
    assert "linear-attention layers" in result.reason
    assert report.layer_types[:2] == ("linear_attention", "full_attention")


@pytest.mark.parametrize("seed", range(20))
def test_no_false_alarm_over_seeds(dirs: Callable[[str], Path], seed: int) -> None:
    report = verify_packing(dirs("qwen2"), seed=seed, samples=3, attn_implementations=["sdpa"])
    assert verdicts(report) == {"sdpa": "exact"}, report.table()


def test_an_implementation_that_cannot_run_says_why(dirs: Callable[[str], Path]) -> None:
    report = verify_packing(
        dirs("qwen2"), attn_implementations=["sdpa", "flash_attention_2", "no_such_kernel"]
    )
    assert verdicts(report) == {
        "sdpa": "exact",
        "flash_attention_2": "cannot_run",
        "no_such_kernel": "cannot_run",
    }
    reasons = {r.attn_implementation: r.reason for r in report.results}
    assert "FlashAttention2" in reasons["flash_attention_2"]
    assert "no_such_kernel" in reasons["no_such_kernel"]
    assert report.exit_status == 0  # every implementation that ran is exact


def test_user_data_from_a_jsonl_file(dirs: Callable[[str], Path], tmp_path: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": "an answer " * (i + 1)},
            ]
        }
        for i in range(5)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = verify_packing(dirs("qwen2"), data=data, samples=5, attn_implementations=["eager"])
    assert report.samples == tuple(f"rows.jsonl:{i}" for i in range(1, 6))
    assert verdicts(report) == {"eager": "exact"}


def test_bad_inputs_are_value_errors_naming_them(
    dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        verify_packing(tmp_path)
    with pytest.raises(ValueError, match=r"\.tar shards"):
        verify_packing(dirs("qwen2"), data=tmp_path)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="at least 2 are needed"):
        verify_packing(dirs("qwen2"), data=one)
    with pytest.raises(ValueError, match="dtype"):
        verify_packing(dirs("qwen2"), dtype=torch.int64)


def test_cli_table_json_and_exit_status(
    dirs: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    args = ["verify", "--model", str(dirs("qwen2")), "--attn", "sdpa", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "sdpa" in printed
    assert "exact" in printed
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["verdict"] == "exact"
    assert result["attn_implementation"] == "sdpa"
    assert report["dtype"] == "float64"
    assert report["tolerance"]["gradient"] == 1e-5

    assert main(["verify", "--model", str(dirs("qwen3_5")), "--attn", "sdpa"]) == 1
    assert "linear-attention" in capsys.readouterr().out
    assert main(["verify", "--model", str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert main(["verify", "--model", str(dirs("qwen2")), "--json", "/dev/full"]) == 3
