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
from model_dirs import audio_rows, model_dir
from torchvision_child import available, run_in_child
from torchvision_models import AUDIO_NAMES
from torchvision_models import NAMES as TORCHVISION_FAMILIES

from energon_pack import verify_packing
from energon_pack.cli import main
from energon_pack.verify import VerifyReport, default_attn_implementations

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
text model (the others: :data:`TORCHVISION_FAMILIES`, run where torchvision imports)."""


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


def test_an_audio_family_on_audio_rows_is_exact(
    dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    """Qwen2-Audio's released config (a Whisper-large encoder, cut like the text model) on rows
    that each hold an audio: the packed row's audio features train as each sample's alone."""
    report = verify_packing(dirs("qwen2_audio"), data=audio_rows(tmp_path / "rows.jsonl"))
    assert verdicts(report) == {"eager": "exact", "sdpa": "exact"}, report.table()
    assert report.model_class == "Qwen2AudioForConditionalGeneration"
    assert len(report.samples) == 4
    for result in report.results:
        assert result.loss_error is not None
        assert result.loss_error < 1e-6
        assert result.gradient_error is not None
        assert result.gradient_error < 1e-5


@pytest.mark.skipif(not available(), reason="the reference torchvision is not installed")
def test_omni_thinkers_on_audio_rows_are_exact() -> None:
    """An Omni checkpoint (its whole config, the thinker inside) is checked through its
    thinker; on rows that each hold an audio, exact with eager and sdpa."""
    results = run_in_child("torchvision_models:verify_audio", {"names": list(AUDIO_NAMES)})
    results.pop("child_seconds")
    assert sorted(results) == sorted(AUDIO_NAMES)
    for name, report in results.items():
        found = {r["attn_implementation"]: r["verdict"] for r in report["results"]}
        assert found == {"eager": "exact", "sdpa": "exact"}, (name, report)
        assert report["model_class"].endswith("ThinkerForConditionalGeneration"), name
        assert len(report["samples"]) == 4, name


@pytest.mark.skipif(not available(), reason="the reference torchvision is not installed")
def test_families_whose_processors_need_torchvision_are_exact() -> None:
    """Gemma 4, GLM-4V, InternVL, LLaVA-OneVision, Pixtral, SmolVLM and Kimi K2.5 load from a
    saved directory only where torchvision imports: verified there, each exact."""
    job = {"names": list(TORCHVISION_FAMILIES)}
    results = run_in_child("torchvision_models:verify_families", job)
    results.pop("child_seconds")
    assert sorted(results) == sorted(TORCHVISION_FAMILIES)
    for name, (report,) in results.items():
        found = {r["attn_implementation"]: r for r in report["results"]}
        assert {a: r["verdict"] for a, r in found.items()} == {
            "eager": "exact",
            "sdpa": "exact",
        }, (name, found)
        assert len(report["samples"]) == 4, name
        assert report["family"] is not None, name
        for result in found.values():
            assert result["leak"] == 0.0, (name, result)
            assert result["loss_error"] < 1e-6, (name, result)
            assert result["gradient_error"] < 1e-5, (name, result)


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


def test_flex_attention_is_checked_forward_only_on_a_cpu(dirs: Callable[[str], Path]) -> None:
    report = verify_packing(dirs("qwen2"), samples=3, attn_implementations=["flex_attention"])
    (result,) = report.results
    assert result.verdict == "exact", report.table()
    assert result.gradient_error is None
    assert result.leak == 0.0
    assert result.loss_error is not None
    assert result.loss_error < 1e-6
    assert result.reason.startswith("forward only, gradients not compared")
    assert "backward on CPU" in result.reason


def test_a_family_without_inputs_for_an_implementation_cannot_run(
    dirs: Callable[[str], Path],
) -> None:
    """Gemma 3 packs with 4-D block masks, which flex_attention does not take: the library
    refuses the combination and verify reports it, naming the implementations that work."""
    report = verify_packing(dirs("gemma3"), attn_implementations=["flex_attention", "sdpa"])
    assert verdicts(report) == {"flex_attention": "cannot_run", "sdpa": "exact"}
    assert "takes no 4-D mask" in report.results[0].reason
    assert report.exit_status == 0


def test_default_implementations_are_those_of_the_device() -> None:
    import importlib.util

    assert default_attn_implementations("cpu") == ("eager", "sdpa")
    on_gpu = default_attn_implementations("cuda:0")
    assert on_gpu[:3] == ("eager", "sdpa", "flex_attention")
    flash = importlib.util.find_spec("flash_attn") is not None
    assert ("flash_attention_2" in on_gpu) == flash


def test_a_chat_template_file_replaces_the_tokenizers(
    dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    template = tmp_path / "short.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{{ part.get('text', '') }}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}"
    )
    plain = verify_packing(dirs("qwen2"), samples=2, attn_implementations=["sdpa"])
    templated = verify_packing(
        dirs("qwen2"), samples=2, attn_implementations=["sdpa"], chat_template=template
    )
    assert verdicts(templated) == {"sdpa": "exact"}
    assert plain.samples == templated.samples
    assert sum(templated.segment_tokens) < sum(plain.segment_tokens)  # no system prompt
    with pytest.raises(ValueError, match="not for a processor family"):
        verify_packing(dirs("gemma3"), chat_template=template)
    with pytest.raises(ValueError, match="--chat-template"):
        verify_packing(dirs("qwen2"), chat_template=tmp_path / "missing.jinja")


def test_a_damaged_shard_is_a_value_error_naming_it(
    dirs: Callable[[str], Path], vlm_demo_path: Path, tmp_path: Path
) -> None:
    """The reader is lazy: a shard damaged after the samples verify takes costs nothing; one
    damaged before them is a ValueError naming the shard (exit status 2 on the command line)."""
    shard = (vlm_demo_path / "shard-000000.tar").read_bytes()
    late = tmp_path / "late"
    late.mkdir()
    (late / "shard-000000.tar").write_bytes(shard[: len(shard) // 2])
    report = verify_packing(dirs("qwen2"), data=late, samples=2, attn_implementations=["sdpa"])
    assert verdicts(report) == {"sdpa": "exact"}
    early = tmp_path / "early"
    early.mkdir()
    (early / "shard-000000.tar").write_bytes(b"\x00" * 100 + shard[100:4096])
    with pytest.raises(ValueError, match=r"shard .*shard-000000\.tar is not a readable tar"):
        verify_packing(dirs("qwen2"), data=early)
    assert main(["verify", "--model", str(dirs("qwen2")), "--data", str(early)]) == 2


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


def test_image_paths_of_a_jsonl_file_are_read_from_its_folder(
    dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    """Rows naming their images by a path relative to the file (as ``ChatDataset`` reads them
    with its media root): each image is read and packed, none skipped; a path leaving the
    folder is a counted skip."""
    from family_kit import png_bytes, test_images

    rows = []
    for index in range(4):
        name = f"pictures/{index}.png"
        (tmp_path / "pictures").mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(png_bytes(test_images(index, [(40 + 9 * index, 70)])[0]))
        user = [{"type": "image"}, {"type": "text", "text": f"What is it? {index}"}]
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": f"A fox {index}."},
        ]
        rows.append({"messages": messages, "images": [name]})
    rows.append({**rows[0], "images": ["../outside.png"]})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in [rows[-1], *rows[:-1]]))
    report = verify_packing(dirs("gemma3"), data=data, attn_implementations=["sdpa"])
    assert verdicts(report) == {"sdpa": "exact"}, report.table()
    assert len(report.samples) == 4
    assert sum(report.skipped.values()) == 1


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
