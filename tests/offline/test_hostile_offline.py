"""Offline packs reused when they should not be (issue 35, item 4).

A pack directory is reused only if every input that decides its packs is unchanged (spec,
format, input, tokenizer identity and content: special tokens, ids, vocabulary and rules,
chat template) and its files are what the build wrote: a cut parquet, an edited metadata file
or a changed tokenizer is refused by name, and ``--force`` rebuilds.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import hf_qwen
import pytest
from tokenizers import normalizers

from energon_pack.cli import main
from energon_pack.offline.build import pack_offline
from energon_pack.offline.reader import PackedDataset
from energon_pack.offline.spec import PackingSpec

SEED = 20261201
BRIDGE_SPEC = PackingSpec(256, pad_seq_to_mult=4)


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _pretokenised(path: Path, count: int = 441, length: int = 13) -> Path:
    """``count`` sequences of ``length`` tokens: Bridge feeds 12 of each, 21 to a pack."""
    rng = random.Random(SEED)
    records = [
        {"input_ids": [rng.randrange(1, 300) for _ in range(length)], "loss_mask": [1] * length}
        for _ in range(count)
    ]
    return _jsonl(path, records)


def _text(path: Path, count: int = 60) -> Path:
    rng = random.Random(SEED)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "answers"]
    records = [
        {
            "input": " ".join(rng.choices(words, k=rng.randrange(3, 30))),
            "output": " ".join(rng.choices(words, k=rng.randrange(1, 20))),
        }
        for _ in range(count)
    ]
    return _jsonl(path, records)


def _bridge_rows(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = pq.read_table(path).to_pylist()
    return rows


def test_a_cut_bridge_parquet_is_not_reused(tmp_path: Path) -> None:
    source, out = _pretokenised(tmp_path / "in.jsonl"), tmp_path / "out"
    built = pack_offline(source, out, PackingSpec(256), format="bridge")
    parquet = built.files[0]
    size = parquet.stat().st_size
    parquet.write_bytes(parquet.read_bytes()[: size // 2])
    message = (
        f"pack dir {out} does not hold what its manifest.json records: {parquet.name} has "
        f"{size // 2} bytes, the manifest records {size}"
    )
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        pack_offline(source, out, PackingSpec(256), format="bridge")
    assert "rebuild with --force" in str(error.value)
    assert not pack_offline(source, out, PackingSpec(256), format="bridge", force=True).reused
    again = pack_offline(source, out, PackingSpec(256), format="bridge")
    assert again.reused
    assert parquet.stat().st_size == size


def test_an_edited_bridge_metadata_file_is_not_reused(tmp_path: Path) -> None:
    source, out = _pretokenised(tmp_path / "in.jsonl"), tmp_path / "out"
    built = pack_offline(source, out, PackingSpec(256), format="bridge")
    assert (built.packs, built.metadata.max_samples_per_bin) == (21, 21)
    metadata = built.files[1]
    entries = json.loads(metadata.read_text())
    entries[0]["max_samples_per_bin"] = 1
    metadata.write_text(json.dumps(entries))
    with pytest.raises(
        ValueError, match=r"256_metadata\.jsonl was edited after the build"
    ) as error:
        pack_offline(source, out, PackingSpec(256), format="bridge")
    assert "max_samples_per_bin=1 where the build wrote 21" in str(error.value)
    argv = ["offline", str(source), str(out), "--size", "256", "--format", "bridge"]
    assert main(argv) == 2  # the command refuses it too (exit status 2, one line)
    rebuilt = pack_offline(source, out, PackingSpec(256), format="bridge", force=True)
    assert rebuilt.metadata.max_samples_per_bin == 21


def test_edited_or_cut_npy_packs_are_not_reused_or_read(tmp_path: Path) -> None:
    source, out = _pretokenised(tmp_path / "in.jsonl"), tmp_path / "out"
    spec = PackingSpec(256, pad_to_max_length=True, pad_cu_seqlens=True)
    slots = pack_offline(source, out, spec).metadata.max_samples_per_bin  # 19 of 13 tokens
    path = out / "metadata.json"
    entries = json.loads(path.read_text())
    entries[0]["max_samples_per_bin"] = 1
    path.write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=f"max_samples_per_bin=1 where the build wrote {slots}"):
        pack_offline(source, out, spec)
    with pytest.raises(ValueError, match=r"metadata\.json was edited after the build"):
        PackedDataset(out)  # its cu_seqlens slots would come from the edited file
    pack_offline(source, out, spec, force=True)
    assert len(PackedDataset(out)[0].cu_seqlens) == slots + 1
    ids = out / "seq_lines.npy"
    ids.write_bytes(ids.read_bytes()[:-8])
    with pytest.raises(ValueError, match=rf"{re.escape(str(ids))} has \d+ bytes but its header"):
        pack_offline(source, out, spec)


def test_a_changed_eos_is_not_reused(tmp_path: Path) -> None:
    """Bridge pads each sequence with eos: a fresh build differs in the packs."""
    source, out = _text(tmp_path / "in.jsonl"), tmp_path / "out"
    tokenizer = hf_qwen.qwen_tokenizer()
    before = pack_offline(source, out, BRIDGE_SPEC, tokenizer, format="bridge")
    rows = _bridge_rows(before.files[0])
    changed = hf_qwen.qwen_tokenizer()
    changed.eos_token = "<|endoftext|>"
    expected = (
        f"tokenizer_content.eos_token='<|im_end|>' but the request has '<|endoftext|>'; "
        f"tokenizer_content.eos_token_id={tokenizer.eos_token_id} but the request has "
        f"{changed.eos_token_id}"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        pack_offline(source, out, BRIDGE_SPEC, changed, format="bridge")
    fresh = pack_offline(source, out, BRIDGE_SPEC, changed, format="bridge", force=True)
    differ = sum(a != b for a, b in zip(rows, _bridge_rows(fresh.files[0]), strict=True))
    assert differ > len(rows) // 2  # what reusing would have hidden


@pytest.mark.parametrize(
    ("change", "names"),
    [
        (lambda t: t.add_tokens(["<|new|>"], special_tokens=True), ["length", "added_tokens"]),
        (
            lambda t: setattr(
                t.backend_tokenizer, "normalizer", normalizers.Replace("quick", "slow")
            ),
            ["rules"],
        ),
        (lambda t: setattr(t, "pad_token", "<|im_start|>"), ["pad_token", "pad_token_id"]),
    ],
    ids=["added_token", "rules", "pad"],
)
def test_a_changed_tokenizer_content_is_not_reused(
    tmp_path: Path, change: Any, names: list[str]
) -> None:
    source, out = _text(tmp_path / "in.jsonl", 20), tmp_path / "out"
    pack_offline(source, out, PackingSpec(256), hf_qwen.qwen_tokenizer())
    assert pack_offline(source, out, PackingSpec(256), hf_qwen.qwen_tokenizer()).reused
    tokenizer = hf_qwen.qwen_tokenizer()
    change(tokenizer)
    with pytest.raises(ValueError, match=f"pack dir {re.escape(str(out))} was built with") as e:
        pack_offline(source, out, PackingSpec(256), tokenizer)
    for name in names:
        assert f"tokenizer_content.{name}" in str(e.value)


def test_a_changed_template_is_not_reused(tmp_path: Path) -> None:
    source, out = _text(tmp_path / "in.jsonl", 20), tmp_path / "out"
    pack_offline(source, out, PackingSpec(256), hf_qwen.qwen_tokenizer())
    tokenizer = hf_qwen.qwen_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template.replace("helpful", "terse")
    with pytest.raises(ValueError, match="chat_template_sha256"):
        pack_offline(source, out, PackingSpec(256), tokenizer)


def test_a_manifest_of_an_earlier_version_is_not_reused(tmp_path: Path) -> None:
    source, out = _pretokenised(tmp_path / "in.jsonl", 40), tmp_path / "out"
    pack_offline(source, out, PackingSpec(256))
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["tokenizer_content"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="no record of the tokenizer's special tokens"):
        pack_offline(source, out, PackingSpec(256))
    pack_offline(source, out, PackingSpec(256), force=True)
    manifest = json.loads(path.read_text())
    del manifest["metadata"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"records no size or CRC-32 of metadata\.json"):
        pack_offline(source, out, PackingSpec(256))
    assert len(PackedDataset(out)) == 3  # 40 x 13 tokens; the reader needs no record
