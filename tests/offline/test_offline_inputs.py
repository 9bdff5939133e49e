"""The offline input reads what the collator reads, from JSONL and JSON arrays alike, and its
manifest always names the encoder that counted the tokens. Real files, real tokenizers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_templates import QWEN2_VL, SHA256
from real_qwen import real_qwen_tokenizer

from energon_pack import ChatDataset, PackingWarning, VLMPackingCollator, make_encoder
from energon_pack.offline.build import pack_offline
from energon_pack.offline.reader import PackedDataset
from energon_pack.offline.spec import PackingSpec

SPEC = PackingSpec(512)


def chat_rows() -> list[dict[str, Any]]:
    """Rows as TRL hands them over: ``messages`` (string and typed content), a tool list, a
    system field, and a ShareGPT ``conversations`` row."""
    return [
        {
            "messages": [
                {"role": "user", "content": "What is packing?"},
                {"role": "assistant", "content": "Putting samples in one row."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Count to three."}]},
                {"role": "assistant", "content": [{"type": "text", "text": "One, two, three."}]},
            ],
            "system": "Be brief.",
        },
        {
            "conversations": [
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello!"},
            ]
        },
    ]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def packed_sequences(out_dir: Path) -> dict[int, tuple[list[int], list[int]]]:
    """Each packed sequence's (input_ids, loss_mask) by its source number."""
    dataset = PackedDataset(out_dir)
    ids, mask = np.load(out_dir / "input_ids.npy"), np.load(out_dir / "loss_mask.npy")
    starts, lengths = np.load(out_dir / "seq_starts.npy"), np.load(out_dir / "seq_lengths.npy")
    lines = np.load(out_dir / "seq_lines.npy")
    assert len(dataset) >= 1
    return {
        int(line): (ids[s : s + n].tolist(), mask[s : s + n].tolist())
        for line, s, n in zip(lines, starts, lengths, strict=True)
    }


def test_messages_rows_pack_to_the_collators_tokens(tmp_path: Path) -> None:
    tokenizer = real_qwen_tokenizer(QWEN2_VL)
    rows = chat_rows()
    result = pack_offline(
        write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "out", SPEC, tokenizer
    )
    assert (result.samples, result.sequences) == (3, 3)
    collate = VLMPackingCollator(512, encoder=make_encoder(tokenizer))
    batch = collate(rows)  # the collator takes these rows as they are
    packed = packed_sequences(tmp_path / "out")
    assert batch.num_real_tokens == sum(len(ids) for ids, _ in packed.values())
    for number, row in enumerate(rows, 1):  # the same parser and encoder, the same tokens
        encoded = collate.encoder.encode_sample(f"row{number}", row)
        assert packed[number] == (encoded.input_ids.tolist(), encoded.loss_mask.tolist())


def test_a_json_array_packs_as_its_jsonl(tmp_path: Path) -> None:
    rows = [*chat_rows(), {"input": "Question?", "output": "Answer."}]
    (tmp_path / "rows.json").write_text("  \n" + json.dumps(rows, indent=1))
    array = pack_offline(tmp_path / "rows.json", tmp_path / "from-array", SPEC)
    lines = pack_offline(write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "from-lines", SPEC)
    assert (array.samples, array.packs, array.tokens) == (lines.samples, lines.packs, lines.tokens)
    assert packed_sequences(tmp_path / "from-array") == packed_sequences(tmp_path / "from-lines")
    # ChatDataset, the collator's reader of files, reads the same file as the same rows.
    assert [row for _, row in ChatDataset(str(tmp_path / "rows.json"))] == rows


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('["not a sample"]\n', "sample rows.json[0]: expected a JSON object"),
        ('{"input": "a", "output": "b"}\n[1, 2]\n', "sample rows.json:2: expected a JSON object"),
        ('{"text": "hi"}\n', "sample rows.json:1: unknown record with keys ['text']"),
        ("[{]", "rows.json: starts with '[' but is not one valid JSON array"),
        ('{"messages": \n', "sample rows.json:1: invalid JSON"),
    ],
)
def test_an_unreadable_sample_names_the_expected_format(
    tmp_path: Path, content: str, expected: str
) -> None:
    (tmp_path / "rows.json").write_text(content)
    with pytest.raises(ValueError, match=r"rows\.json") as caught:
        pack_offline(tmp_path / "rows.json", tmp_path / "out", SPEC)
    message = str(caught.value)
    assert expected in message
    if "unknown record" in message or "expected a JSON object" in message:
        assert "{'messages'} or {'conversations'}" in message
        assert "{'input', 'output'}" in message
        assert "{'input_ids', 'loss_mask'}" in message
    if "unknown record" not in message:
        assert "a JSONL file holds one sample object per line" in message
        assert "a JSON file holds one array of sample objects" in message


def test_a_row_with_media_is_refused_as_text_only(tmp_path: Path) -> None:
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "A cat."},
        ],
        "images": ["cat.jpg"],
    }
    with pytest.raises(
        ValueError, match=r"rows.jsonl:1: offline packing is text-only.*\['images'\]"
    ):
        pack_offline(write_jsonl(tmp_path / "rows.jsonl", [row]), tmp_path / "out", SPEC)


def test_the_manifest_always_names_the_encoding(tmp_path: Path) -> None:
    rows = write_jsonl(tmp_path / "rows.jsonl", chat_rows())
    byte = pack_offline(rows, tmp_path / "byte", SPEC)
    manifest = json.loads((tmp_path / "byte" / "manifest.json").read_text())
    assert manifest["tokenizer"]["encoding"] == "chatml"
    assert manifest["tokenizer"]["system_prompt"] is None
    assert byte.tokenizer == manifest["tokenizer"]
    plain = real_qwen_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "qwen-plain")
    plain = type(plain).from_pretrained(tmp_path / "qwen-plain")
    with pytest.warns(PackingWarning, match="has no chat template"):
        pack_offline(rows, tmp_path / "chatml", SPEC, plain)
    chatml = json.loads((tmp_path / "chatml" / "manifest.json").read_text())["tokenizer"]
    assert (chatml["encoding"], chatml["system_prompt"]) == ("chatml", None)
    template = pack_offline(rows, tmp_path / "template", SPEC, real_qwen_tokenizer(QWEN2_VL))
    assert template.tokenizer["encoding"] == "template"
    assert template.tokenizer["chat_template_sha256"] == SHA256["QWEN2_VL"]
    assert template.tokenizer["system_prompt"] == "You are a helpful assistant."
    assert template.tokens > chatml_tokens(tmp_path / "chatml")  # the default system prompt


def chatml_tokens(out_dir: Path) -> int:
    stats: int = json.loads((out_dir / "manifest.json").read_text())["stats"]["tokens"]
    return stats
