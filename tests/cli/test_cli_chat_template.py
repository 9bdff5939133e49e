"""``--chat-template FILE`` on ``offline`` and ``tune``, and the encoding each command prints and
records. Real files, Qwen's real tokenizer saved without its template (as many tokenizer
directories are), the released Qwen2-VL template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_templates import QWEN2_VL, SHA256
from real_qwen import real_qwen_tokenizer
from transformers import AutoTokenizer

from energon_pack import PackingWarning
from energon_pack.cli import main
from energon_pack.offline.build import pack_offline
from energon_pack.offline.spec import PackingSpec

ROOT = Path(__file__).resolve().parents[2]
QWEN2_VL_LINE = f"chat template (sha256 {SHA256['QWEN2_VL'][:12]}), system prompt " + repr(
    "You are a helpful assistant."
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer directory without a chat template, the template as a file, and a JSONL file
    of short conversations."""
    root = tmp_path_factory.mktemp("chat-template")
    tokenizer = real_qwen_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(root / "qwen-no-template")
    (root / "qwen2_vl.jinja").write_text(QWEN2_VL)
    words = [
        "rows",
        "fill",
        "when",
        "short",
        "turns",
        "stream",
        "through",
        "a",
        "bounded",
        "buffer",
    ]
    with (root / "sft.jsonl").open("w") as out:
        for i in range(120):
            question = " ".join(words[(i + k) % len(words)] for k in range(5 + i % 17))
            answer = " ".join(words[(i * 3 + k) % len(words)] for k in range(8 + i % 29))
            turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
            out.write(json.dumps({"conversations": turns}) + "\n")
    return root


def offline(files: Path, out: str, *extra: str) -> list[str]:
    return [
        "offline", str(files / "sft.jsonl"), str(files / out), "--size", "512", "--force",
        "--tokenizer", str(files / "qwen-no-template"), *extra,
    ]  # fmt: skip


def test_offline_without_a_template_says_chatml_and_warns(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.warns(PackingWarning, match="has no chat template"):
        assert main(offline(files, "chatml")) == 0
    out = capsys.readouterr().out
    assert "encoding: ChatML (the built-in rule, no chat template), no system prompt" in out
    manifest = json.loads((files / "chatml" / "manifest.json").read_text())
    assert manifest["tokenizer"]["encoding"] == "chatml"
    assert manifest["tokenizer"]["system_prompt"] is None


def test_offline_chat_template_makes_the_cli_pack_as_python(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = str(files / "qwen2_vl.jinja")
    assert main(offline(files, "cli", "--chat-template", template)) == 0
    assert f"encoding: {QWEN2_VL_LINE}" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(files / "qwen-no-template")
    tokenizer.chat_template = QWEN2_VL  # the user's Python: the template set by hand
    python = pack_offline(files / "sft.jsonl", files / "python", PackingSpec(512), tokenizer)
    cli, ours = (json.loads((files / d / "manifest.json").read_text()) for d in ("cli", "python"))
    assert cli["tokenizer"] == ours["tokenizer"] == python.tokenizer
    assert cli["tokenizer"]["encoding"] == "template"
    assert cli["stats"] == ours["stats"]
    for name in ("input_ids.npy", "loss_mask.npy", "pack_starts.npy"):
        assert (files / "cli" / name).read_bytes() == (files / "python" / name).read_bytes()
    chatml = json.loads((files / "chatml" / "manifest.json").read_text())
    assert chatml["stats"]["tokens"] < cli["stats"]["tokens"]  # the template's system prompt


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["offline", "in.jsonl", "out", "--size", "512", "--chat-template", "t.jinja"],
            "--chat-template 't.jinja' needs --tokenizer",
        ),
        (
            ["tune", str(ROOT / "fixtures" / "vlm_demo"), "--chat-template", "t.jinja"],
            "needs --tokenizer",
        ),
        (["missing.jinja"], "--chat-template {template!r} cannot be read"),
        (["empty.jinja"], "--chat-template {template!r} is empty"),
    ],
)
def test_a_bad_chat_template_flag_is_one_line(
    files: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    expected: str,
) -> None:
    (tmp_path / "empty.jinja").write_text("\n")
    if len(args) == 1:
        template = str(tmp_path / args[0])
        args = offline(files, "bad", "--chat-template", template)
        expected = expected.format(template=template)
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("energon-pack: error: ")
    assert expected in err[0]


def test_tune_prints_and_records_the_encoding(
    files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    template = str(files / "qwen2_vl.jinja")
    args = [
        "tune", str(ROOT / "fixtures" / "vlm_demo"), "--buffer-sizes", "4", "--num-workers", "0",
        "--max-samples", "8", "--pixel-dtype", "uint8", "--out", str(tmp_path),
        "--tokenizer", str(files / "qwen-no-template"), "--chat-template", template,
    ]  # fmt: skip
    assert main(args) == 0
    assert f"\nencoding: {QWEN2_VL_LINE}\n" in capsys.readouterr().out
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["settings"]["chat_template"] == template
    tokenizer = report["tokenizer"]
    assert tokenizer["encoding"] == "template"
    assert tokenizer["chat_template_sha256"] == SHA256["QWEN2_VL"]
    assert tokenizer["system_prompt"] == "You are a helpful assistant."
    assert tokenizer["chat_template"] == template
