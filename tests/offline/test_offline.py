"""Tests of offline packing (energon_pack.offline): real files in tmp_path, no mocks."""

from __future__ import annotations

import itertools
import json
import logging
import pickle
import re
import tempfile
import zlib
from pathlib import Path
from typing import Any

import hf_qwen
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack.cli import main as cli_main
from energon_pack.encoding.chatml import ByteTokenizer, ConversationEncoder
from energon_pack.offline import bridge as offline_bridge
from energon_pack.offline import build as offline_build
from energon_pack.offline import manifest as offline_manifest
from energon_pack.offline import spec as offline_spec
from energon_pack.offline.build import pack_offline
from energon_pack.offline.reader import PackedDataset
from energon_pack.offline.spec import PackingSpec
from energon_pack.packing.bins import aligned_length
from energon_pack.packing.row import unpack


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def text_records(count: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for i in range(count):
        if i % 3 == 0:
            turns = [
                {"from": "human", "value": f"question {i} " * (i % 7 + 1)},
                {"from": "gpt", "value": f"answer {i} " * (i % 5 + 1)},
                {"from": "human", "value": "and?"},
                {"from": "gpt", "value": "done é"},
            ]
            records.append({"conversations": turns})
        else:
            records.append({"input": f"prompt {i} " * (i % 9 + 1), "output": f"out {i}" * (i % 4)})
    return records


def expected_tokens(record: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The encoding pack_offline must reproduce, straight from ConversationEncoder."""
    if "input_ids" in record:
        return record["input_ids"], record["loss_mask"]
    if "input" in record:
        turns = [
            {"from": "human", "value": record["input"]},
            {"from": "gpt", "value": record["output"]},
        ]
        record = {"conversations": turns}
    encoded = ConversationEncoder().encode_sample("k", {"json": record})
    return encoded.input_ids.tolist(), encoded.loss_mask.tolist()


def packed_by_line(dataset: PackedDataset) -> dict[int, tuple[list[int], list[int]]]:
    """Every sequence of every pack, keyed by input line; a line seen twice fails."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for index in range(len(dataset)):
        sequences = unpack(dataset[index])
        lines = dataset.source_lines(index)
        assert len(sequences) == len(lines)
        for line, seq in zip(lines, sequences, strict=True):
            assert line not in out, f"line {line} packed twice"
            out[line] = (seq["input_ids"].tolist(), seq["loss_mask"].long().tolist())
    return out


def assert_round_trip(dataset: PackedDataset, records: list[dict[str, Any]]) -> None:
    packed = packed_by_line(dataset)
    assert sorted(packed) == list(range(1, len(records) + 1))
    for line, record in enumerate(records, 1):
        ids, mask = expected_tokens(record)
        got_ids, got_mask = packed[line]
        assert got_ids == ids
        # The row's input-aligned mask never targets a segment's first token.
        assert got_mask == [0, *mask[1:]]


# ------------------------------------------------------------------------------- round trip
def test_text_round_trip(tmp_path: Path) -> None:
    records = text_records(60)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    spec = PackingSpec(512, pad_seq_to_mult=4, pad_to_max_length=True)
    result = pack_offline(source, tmp_path / "out", spec)
    assert (result.samples, result.sequences, result.reused) == (60, 60, False)
    dataset = PackedDataset(tmp_path / "out")
    assert len(dataset) == result.packs
    assert_round_trip(dataset, records)
    for index in range(len(dataset)):
        row = dataset[index]
        assert row.input_ids.shape == (512,)
        assert all(int(c) % 4 == 0 for c in row.cu_seqlens_padded)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=40),
    mult=st.sampled_from([1, 2, 8]),
    algorithm=st.sampled_from(["bfd", "ffd"]),
    seed=st.integers(0, 3),
)
def test_pretokenised_round_trip(lengths: list[int], mult: int, algorithm: str, seed: int) -> None:
    rng = np.random.default_rng(sum(lengths) + seed)
    records = [
        {
            "input_ids": rng.integers(0, 50_000, n).tolist(),
            "loss_mask": rng.integers(0, 2, n).tolist(),
        }
        for n in lengths
    ]
    spec = PackingSpec(80, pad_seq_to_mult=mult, algorithm=algorithm, seed=seed)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        source = write_jsonl(Path(tmp) / "in.jsonl", records)
        result = pack_offline(source, Path(tmp) / "out", spec)
        dataset = PackedDataset(Path(tmp) / "out")
        assert_round_trip(dataset, records)
        assert result.tokens == sum(lengths)
        for index in range(len(dataset)):
            row = dataset[index]
            used = sum(aligned_length(len(s["input_ids"]), mult) for s in unpack(row))
            assert used <= 80


def test_gather_in_small_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pass 3 copies a bounded number of tokens at a time; chunk edges must not lose any."""
    monkeypatch.setattr(offline_build, "_COPY_CHUNK_TOKENS", 7)
    records = [{"input_ids": list(range(1, n + 1)), "loss_mask": [1] * n} for n in (3, 9, 1, 5, 12)]
    pack_offline(write_jsonl(tmp_path / "in.jsonl", records), tmp_path / "out", PackingSpec(16))
    assert_round_trip(PackedDataset(tmp_path / "out"), records)


def test_same_input_same_packs_and_seed_changes_order(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(40))
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        pack_offline(source, tmp_path / name, PackingSpec(256, seed=seed))
    lines = {
        name: [PackedDataset(tmp_path / name).source_lines(i) for i in range(5)]
        for name in ("a", "b", "c")
    }
    assert lines["a"] == lines["b"]
    assert lines["a"] != lines["c"]


def test_dataset_pickles_and_works_in_a_loader(tmp_path: Path) -> None:
    pack_offline(
        write_jsonl(tmp_path / "in.jsonl", text_records(20)), tmp_path / "o", PackingSpec(256)
    )
    dataset = PackedDataset(tmp_path / "o")
    _ = dataset[0]
    clone = pickle.loads(pickle.dumps(dataset))
    assert torch.equal(clone[-1].input_ids, dataset[len(dataset) - 1].input_ids)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None)
    assert sum(1 for _ in loader) == len(dataset)
    with pytest.raises(IndexError):
        dataset[len(dataset)]


# ------------------------------------------------------------------------------- metadata
def test_metadata_matches_a_direct_computation(tmp_path: Path) -> None:
    records = text_records(80)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    result = pack_offline(source, tmp_path / "out", PackingSpec(384, pad_seq_to_mult=2))
    dataset = PackedDataset(tmp_path / "out")
    per_pack = [[len(s["input_ids"]) for s in unpack(dataset[i])] for i in range(len(dataset))]
    lengths = [len(expected_tokens(r)[0]) for r in records]
    expected: dict[str, Any] = {
        "dataset_max_seqlen": max(lengths),
        "max_samples_per_bin": max(len(p) for p in per_pack),
        "packing_factor": round(len(lengths) / len(per_pack), 2),
        "packing_efficiency": round(100 * sum(lengths) / (len(per_pack) * 384), 2),
        "pack_size": 384,
        "min_packed_seqlen": min(sum(p) for p in per_pack),
    }
    on_disk = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert on_disk == [expected]
    assert result.metadata == offline_spec.PackMetadata(**expected)


# ------------------------------------------------------------------------- manifest / reuse
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"packed_sequence_size": 512}, "packed_sequence_size=256 but the spec asks 512"),
        ({"pad_seq_to_mult": 8}, "pad_seq_to_mult=4 but the spec asks 8"),
    ],
)
def test_stale_spec_is_refused_then_forced(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(10))
    base: dict[str, Any] = {"packed_sequence_size": 256, "pad_seq_to_mult": 4}
    pack_offline(source, tmp_path / "out", PackingSpec(**base))
    new_spec = PackingSpec(**{**base, **change})
    with pytest.raises(ValueError, match=message) as error:
        pack_offline(source, tmp_path / "out", new_spec)
    assert f"pack dir {tmp_path / 'out'}" in str(error.value)
    assert "--force" in str(error.value)
    with pytest.raises(ValueError, match=message):
        PackedDataset(tmp_path / "out", new_spec)
    rebuilt = pack_offline(source, tmp_path / "out", new_spec, force=True)
    assert not rebuilt.reused
    assert PackedDataset(tmp_path / "out", new_spec).spec == new_spec


def test_changed_input_is_refused(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(10))
    pack_offline(source, tmp_path / "out", PackingSpec(256))
    write_jsonl(source, text_records(11))
    with pytest.raises(ValueError, match="input_sha256="):
        pack_offline(source, tmp_path / "out", PackingSpec(256))


def test_changed_tokenizer_is_refused(tmp_path: Path) -> None:
    class OtherTokenizer(ByteTokenizer):
        name_or_path = "other/tok"

    source = write_jsonl(tmp_path / "in.jsonl", text_records(5))
    pack_offline(source, tmp_path / "out", PackingSpec(256))
    with pytest.raises(ValueError, match=r"tokenizer=.*other/tok"):
        pack_offline(source, tmp_path / "out", PackingSpec(256), OtherTokenizer())


def test_same_manifest_is_reused(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(10))
    first = pack_offline(source, tmp_path / "out", PackingSpec(256))
    stamp = (tmp_path / "out" / "input_ids.npy").stat().st_mtime_ns
    again = pack_offline(source, tmp_path / "out", PackingSpec(256))
    assert again.reused
    assert (tmp_path / "out" / "input_ids.npy").stat().st_mtime_ns == stamp
    assert again.metadata == first.metadata
    assert again.packs == first.packs
    forced = pack_offline(source, tmp_path / "out", PackingSpec(256), force=True)
    assert not forced.reused
    assert (tmp_path / "out" / "input_ids.npy").stat().st_mtime_ns != stamp


def test_non_empty_dir_without_manifest_is_refused(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(5))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"not empty and has no manifest\.json"):
        pack_offline(source, tmp_path / "out", PackingSpec(256))
    pack_offline(source, tmp_path / "out", PackingSpec(256), force=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------ static metadata
def test_pad_cu_seqlens_uses_max_samples_per_bin(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(30))
    spec = PackingSpec(512, pad_to_max_length=True, pad_cu_seqlens=True)
    result = pack_offline(source, tmp_path / "out", spec)
    dataset = PackedDataset(tmp_path / "out")
    slots = result.metadata.max_samples_per_bin + 1
    assert {dataset[i].cu_seqlens.shape[0] for i in range(len(dataset))} == {slots}
    assert {dataset[i].max_seqlen for i in range(len(dataset))} == {512}


def test_missing_metadata_with_pad_cu_seqlens_is_readable(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(10))
    spec = PackingSpec(256, pad_to_max_length=True, pad_cu_seqlens=True)
    pack_offline(source, tmp_path / "out", spec)
    (tmp_path / "out" / "metadata.json").unlink()
    expected = f"needs {tmp_path / 'out' / 'metadata.json'} for max_samples_per_bin"
    with pytest.raises(ValueError, match=expected) as error:
        PackedDataset(tmp_path / "out")
    assert "re-run energon-pack offline" in str(error.value)


def test_max_segments_splits_packs_and_fixes_slots(tmp_path: Path) -> None:
    records = [{"input_ids": [5] * 3, "loss_mask": [1] * 3} for _ in range(20)]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    spec = PackingSpec(64, pad_to_max_length=True, pad_cu_seqlens=True, max_segments=6)
    result = pack_offline(source, tmp_path / "out", spec)
    assert result.packs == 4  # one pack of 20 split into 6 + 6 + 6 + 2
    assert result.split_packs == 3
    (tmp_path / "out" / "metadata.json").unlink()  # not needed with max_segments
    dataset = PackedDataset(tmp_path / "out")
    assert {dataset[i].cu_seqlens.shape[0] for i in range(4)} == {7}
    assert_round_trip(dataset, records)


# -------------------------------------------------------------------------------- overlong
OVERLONG = [
    {"input_ids": list(range(1, 11)), "loss_mask": [1] * 10},
    {"input_ids": list(range(1, 41)), "loss_mask": [0] * 20 + [1] * 20},
    {"input_ids": [7, 8], "loss_mask": [0, 1]},
]


def test_overlong_error_names_sample_length_and_limit(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", OVERLONG)
    with pytest.raises(ValueError, match=r"sample 'in\.jsonl:2' has 40 tokens.*seq_length=32"):
        pack_offline(source, tmp_path / "out", PackingSpec(32))


def test_overlong_counts_alignment(tmp_path: Path) -> None:
    records = [{"input_ids": [1] * 30, "loss_mask": [1] * 30}]
    source = write_jsonl(tmp_path / "in.jsonl", records)
    with pytest.raises(ValueError, match="32 after padding to a multiple of 16"):
        pack_offline(source, tmp_path / "out", PackingSpec(16, pad_seq_to_mult=16))


def test_overlong_skip_is_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", OVERLONG)
    with caplog.at_level(logging.WARNING, logger="energon_pack.offline"):
        result = pack_offline(source, tmp_path / "out", PackingSpec(32, overlong="skip"))
    assert (result.samples, result.sequences, result.skipped, result.truncated) == (3, 2, 1, 0)
    assert [r.getMessage() for r in caplog.records if "in.jsonl:2" in r.getMessage()] == [
        "skipping: sample 'in.jsonl:2' has 40 tokens (40 after padding to a multiple of 1), above "
        "seq_length=32"
    ]
    assert sorted(packed_by_line(PackedDataset(tmp_path / "out"))) == [1, 3]


def test_overlong_truncate_keeps_first_tokens(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", OVERLONG)
    result = pack_offline(source, tmp_path / "out", PackingSpec(32, overlong="truncate"))
    assert (result.sequences, result.skipped, result.truncated) == (3, 0, 1)
    assert result.metadata.dataset_max_seqlen == 32
    ids, mask = packed_by_line(PackedDataset(tmp_path / "out"))[2]
    assert ids == list(range(1, 33))
    assert mask == [0] * 20 + [1] * 12


def test_nothing_left_to_pack_is_an_error(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", OVERLONG[1:2])
    with pytest.raises(ValueError, match=r"no sequences to pack \(1 samples read, 1 skipped"):
        pack_offline(source, tmp_path / "out", PackingSpec(32, overlong="skip"))


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"sample in\.jsonl:2: invalid JSON"),
        ('{"text": "x"}', r"sample in\.jsonl:2: unknown record with keys \['text'\]"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "input_ids has 2 tokens and loss_mask 1"),
        ('{"input_ids": [-1, 2], "loss_mask": [0, 1]}', r"token id -1 is outside \[0, "),
        ('{"input_ids": [1.5, 2], "loss_mask": [0, 1]}', "input_ids must be a list of ints"),
        ('{"input_ids": [1, 2], "loss_mask": [0, 2]}', "loss_mask of 0/1 values"),
        ('{"input_ids": [1, [2]], "loss_mask": [0, 1]}', "input_ids must be a list of ints"),
    ],
)
def test_bad_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"input": "a", "output": "b"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        pack_offline(source, tmp_path / "out", PackingSpec(256))


def test_explicit_tokenizer_checks_vocab(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": [1, 300], "loss_mask": [0, 1]}])
    with pytest.raises(ValueError, match=r"token id 300 is outside \[0, 263\)"):
        pack_offline(source, tmp_path / "out", PackingSpec(256), ByteTokenizer())


# --------------------------------------------------------------------------------- the spec
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"packed_sequence_size": 100, "pad_seq_to_mult": 8},
            "packed_sequence_size=100 is not a multiple of pad_seq_to_mult=8.*e.g. 104",
        ),
        (
            {"packed_sequence_size": 128, "pad_cu_seqlens": True},
            "pad_cu_seqlens=True .* set pad_to_max_length=True",
        ),
        ({"packed_sequence_size": 0}, "packed_sequence_size must be a positive int, got 0"),
        ({"packed_sequence_size": 8, "algorithm": "nf"}, "algorithm must be 'bfd' or 'ffd'"),
        ({"packed_sequence_size": 8, "overlong": "drop"}, "overlong must be 'error', 'skip'"),
        ({"packed_sequence_size": 8, "max_segments": 0}, "max_segments must be a positive int"),
    ],
)
def test_spec_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PackingSpec(**kwargs)


def test_spec_for_topology() -> None:
    spec = PackingSpec.for_topology(8192, tp=4, cp=2, sp=True, pad_to_max_length=True)
    assert spec.pad_seq_to_mult == 8
    assert spec.pad_to_max_length
    with pytest.raises(ValueError, match="not a multiple of pad_seq_to_mult=8"):
        PackingSpec.for_topology(8190, tp=4, cp=2, sp=True)


# ---------------------------------------------------------------------------- bad text (issue 27)
def test_placeholders_in_a_system_prompt_are_text(tmp_path: Path) -> None:
    source = write_jsonl(
        tmp_path / "in.jsonl", [{"input": "a", "output": "b", "system": "Use <image> tags"}]
    )
    pack_offline(source, tmp_path / "out", PackingSpec(256))
    ((ids, _),) = packed_by_line(PackedDataset(tmp_path / "out")).values()
    assert ByteTokenizer().decode(ids).startswith("<|im_start|>system\nUse <image> tags<|im_end|>")
    assert cli_main(["offline", str(source), str(tmp_path / "cli"), "--size", "256"]) == 0


@pytest.mark.parametrize(
    ("record", "hf", "message"),
    [
        ({"input": "cut emoji \ud83d", "output": "b"}, False, r"surrogate.*\[bad_sample\]"),
        ({"input": "a", "output": "b", "system": "\ud83d"}, False, r"surrogate.*\[bad_sample\]"),
        ({"input": "cut emoji \ud83d", "output": "b"}, True, r"surrogate.*\[bad_sample\]"),
        ({"input": "a <|image_pad|>", "output": "b"}, True, r"<\|image_pad\|>.*mismatch\]"),
    ],
)
def test_text_that_cannot_be_encoded_names_the_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    record: dict[str, Any],
    hf: bool,
    message: str,
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [{"input": "a", "output": "b"}, record])
    tokenizer = hf_qwen.qwen_tokenizer() if hf else None
    with pytest.raises(ValueError, match=rf"sample 'in\.jsonl:2'.*{message}"):
        pack_offline(source, tmp_path / "out", PackingSpec(256), tokenizer)
    if not hf:  # the command line says the same, without a traceback
        assert cli_main(["offline", str(source), str(tmp_path / "cli"), "--size", "256"]) == 2
        err = capsys.readouterr().err
        assert "sample 'in.jsonl:2'" in err
        assert "Traceback" not in err


# ------------------------------------------------------------- array records (issue 27, item 8)
def pretokenised(count: int, length: int, token: int) -> list[dict[str, Any]]:
    return [{"input_ids": [token] * length, "loss_mask": [1] * length} for _ in range(count)]


def manifest_of(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / "manifest.json").read_text())
    return data


def test_manifest_records_every_array(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(20))
    pack_offline(source, tmp_path / "out", PackingSpec(256))
    manifest = manifest_of(tmp_path / "out")
    assert manifest["format_version"] == offline_manifest.FORMAT_VERSION == 2
    assert sorted(manifest["arrays"]) == sorted(offline_spec.ARRAY_FILES)
    for name, record in manifest["arrays"].items():
        path = tmp_path / "out" / name
        array = np.load(path)
        assert record["bytes"] == path.stat().st_size
        assert (record["shape"], record["dtype"]) == (list(array.shape), array.dtype.str)
        assert record["crc32"] == zlib.crc32(path.read_bytes())
        assert record["sample_crc32"] == record["crc32"]  # small files: the sample is all of it


def test_swapped_array_of_the_same_length_is_refused(tmp_path: Path) -> None:
    for name, token in (("a", 5), ("b", 6)):
        source = write_jsonl(tmp_path / f"{name}.jsonl", pretokenised(30, 20, token))
        pack_offline(source, tmp_path / name, PackingSpec(128))
    swapped = tmp_path / "a" / "input_ids.npy"
    swapped.write_bytes((tmp_path / "b" / "input_ids.npy").read_bytes())
    with pytest.raises(ValueError, match=rf"^{swapped} does not match .*sample_crc32 is") as error:
        PackedDataset(tmp_path / "a")
    assert "rebuild the pack with energon-pack offline --force" in str(error.value)


def test_truncated_array_is_refused_naming_the_file(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", pretokenised(30, 20, 5))
    pack_offline(source, tmp_path / "out", PackingSpec(128))
    path = tmp_path / "out" / "input_ids.npy"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ValueError, match=rf"^{path} has \d+ bytes but its header describes"):
        PackedDataset(tmp_path / "out")
    path.write_bytes(b"\x93NUMPY")
    with pytest.raises(ValueError, match=rf"^{path} is not a \.npy array file"):
        PackedDataset(tmp_path / "out")


def test_a_change_outside_the_sample_needs_verify(tmp_path: Path) -> None:
    # 300,000 tokens: input_ids.npy is 1.2 MB, more than the 16 sampled blocks of 64 KiB.
    source = write_jsonl(tmp_path / "in.jsonl", pretokenised(300, 1000, 5))
    pack_offline(source, tmp_path / "out", PackingSpec(1024))
    path = tmp_path / "out" / "input_ids.npy"
    data = bytearray(path.read_bytes())
    block = offline_manifest._SAMPLE_BLOCK_BYTES
    step = (len(data) - block) // (offline_manifest._SAMPLE_BLOCKS - 1)
    data[block + (step - block) // 2] ^= 1  # between the first and the second sampled block
    path.write_bytes(bytes(data))
    assert len(PackedDataset(tmp_path / "out")) == 300  # the sample still matches
    with pytest.raises(ValueError, match=rf"^{path} does not match .*: crc32 is"):
        PackedDataset(tmp_path / "out", verify=True)


def as_format_1(out: Path) -> None:
    """Rewrite the manifest as the previous version wrote it."""
    manifest = manifest_of(out)
    del manifest["arrays"]
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1}))


def test_format_1_opens_unchecked_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = text_records(20)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    pack_offline(source, tmp_path / "out", PackingSpec(256))
    as_format_1(tmp_path / "out")
    with caplog.at_level(logging.WARNING, logger="energon_pack.offline"):
        assert_round_trip(PackedDataset(tmp_path / "out"), records)
        PackedDataset(tmp_path / "out")
    (warning,) = [r.getMessage() for r in caplog.records if "format 1" in r.getMessage()]
    assert warning.startswith(f"{tmp_path / 'out'} was written by an older energon_pack")
    assert "not checked" in warning
    path = tmp_path / "out" / "seq_lines.npy"  # the header still tells a truncated file
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=rf"^{path} has \d+ bytes but its header describes"):
        PackedDataset(tmp_path / "out")


def test_format_1_is_rebuilt_not_reused(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(10))
    pack_offline(source, tmp_path / "out", PackingSpec(256))
    as_format_1(tmp_path / "out")
    with pytest.raises(ValueError, match="format_version=1 but the request has 2"):
        pack_offline(source, tmp_path / "out", PackingSpec(256))
    assert not pack_offline(source, tmp_path / "out", PackingSpec(256), force=True).reused
    assert "arrays" in manifest_of(tmp_path / "out")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.pop("spec"), "it has no spec (JSON object)"),
        (lambda m: m.update(spec=[1]), "it has no spec (JSON object)"),
        (lambda m: m.pop("tokenizer"), "it has no tokenizer (JSON object)"),
        (lambda m: m.pop("stats"), "it has no stats (JSON object)"),
        (lambda m: m.pop("arrays"), "it has no arrays (JSON object)"),
        (lambda m: m["spec"].pop("packed_sequence_size"), "its spec is not a PackingSpec"),
        (lambda m: m["spec"].update(pad_seq_to_mult=0), "its spec is not a PackingSpec"),
        (lambda m: m["tokenizer"].pop("pad_token_id"), "no int tokenizer.pad_token_id"),
        (lambda m: m["stats"].pop("packs"), "its stats are not the int counters samples"),
        (lambda m: m["arrays"].pop("loss_mask.npy"), "no arrays.loss_mask.npy record"),
        (lambda m: m["arrays"]["seq_lines.npy"].pop("crc32"), "no arrays.seq_lines.npy record"),
        (lambda m: m.update(format_version=3), "format 1 or 2 (format_version=3)"),
    ],
)
def test_malformed_manifest_names_the_file_and_the_key(
    tmp_path: Path, edit: Any, message: str
) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(5))
    pack_offline(source, tmp_path / "out", PackingSpec(256))
    manifest = manifest_of(tmp_path / "out")
    edit(manifest)
    path = tmp_path / "out" / "manifest.json"
    path.write_text(json.dumps(manifest))
    for call in (
        lambda: PackedDataset(tmp_path / "out"),
        lambda: pack_offline(source, tmp_path / "out", PackingSpec(256)),
    ):
        with pytest.raises(ValueError, match=rf"^{path} .*{re.escape(message)}"):
            call()


# ------------------------------------------------- Megatron-Bridge's packed parquet (issue 25)
def bridge_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a Bridge packed parquet, checking its schema on the way."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    assert table.schema.names == ["input_ids", "loss_mask", "seq_start_id"]
    assert pa.types.is_integer(table.schema.field("input_ids").type.value_type)
    assert table.schema.field("loss_mask").type.value_type == pa.int8()
    assert pa.types.is_integer(table.schema.field("seq_start_id").type.value_type)
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def bridge_sequences(row: dict[str, Any]) -> list[tuple[list[int], list[int]]]:
    """Each stored sequence of a row: (input_ids, label-aligned loss_mask)."""
    bounds = [*row["seq_start_id"], len(row["input_ids"])]
    return [(row["input_ids"][a:b], row["loss_mask"][a:b]) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize(("mult", "hf"), [(1, False), (4, False), (8, True)])
def test_bridge_parquet_holds_every_sequence_rolled_and_aligned(
    tmp_path: Path, mult: int, hf: bool
) -> None:
    records = text_records(60)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    tokenizer = hf_qwen.qwen_tokenizer() if hf else None
    spec = PackingSpec(512, pad_seq_to_mult=mult)
    result = pack_offline(source, tmp_path / "out", spec, tokenizer, format="bridge")
    assert [p.name for p in result.files] == ["training_512.idx.parquet", "512_metadata.jsonl"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        ["training_512.idx.parquet", "512_metadata.jsonl", "manifest.json"]
    )
    # Bridge pads with (and strips) its tokenizer's eos: <|im_end|> here, not the pad token.
    pad = tokenizer.eos_token_id if tokenizer is not None else ByteTokenizer().pad_token_id
    assert offline_bridge.bridge_pad_id(tokenizer or ByteTokenizer()) == pad
    reference = {}
    for record in records:
        if tokenizer is None:
            ids, mask = expected_tokens(record)
        else:
            turns = record.get("conversations") or [
                {"from": "human", "value": record["input"]},
                {"from": "gpt", "value": record["output"]},
            ]
            encoded = ConversationEncoder(tokenizer).encode_sample(
                "k", {"json": {"conversations": turns}}
            )
            ids, mask = encoded.input_ids.tolist(), encoded.loss_mask.long().tolist()
        reference[tuple(ids)] = mask
    found = []
    rows = bridge_rows(result.files[0])
    assert len(rows) == result.packs
    for row in rows:
        fed = 0
        for ids, rolled in bridge_sequences(row):
            real = next(n for n in range(len(ids), 0, -1) if tuple(ids[:n]) in reference)
            mask = reference[tuple(ids[:real])]
            assert (len(ids) - 1) % mult == 0  # the span Bridge feeds meets the multiple
            assert len(ids) - real < mult or (mult == 1 and len(ids) == real)
            assert ids[real:] == [pad] * (len(ids) - real)
            assert rolled == [*mask[1:], *[0] * (len(ids) - real + 1)]  # label-aligned
            fed += len(ids) - 1
            found.append(tuple(ids[:real]))
        assert fed <= 512  # the pack holds what Bridge feeds, L - 1 per sequence
    assert sorted(found) == sorted(reference)


def test_bridge_metadata_counts_the_fed_tokens(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(80))
    spec = PackingSpec(256, pad_seq_to_mult=4, pad_to_max_length=True, pad_cu_seqlens=True)
    result = pack_offline(source, tmp_path / "out", spec, format="bridge")
    rows = bridge_rows(result.files[0])
    spans = [[len(ids) - 1 for ids, _ in bridge_sequences(row)] for row in rows]
    listed = json.loads(result.files[1].read_text())
    assert listed == [
        {
            "dataset_max_seqlen": max(max(s) for s in spans),
            "max_samples_per_bin": max(len(s) for s in spans),
            "packing_factor": round(sum(len(s) for s in spans) / len(spans), 2),
            "packing_efficiency": round(100 * sum(map(sum, spans)) / (len(spans) * 256), 2),
            "pack_size": 256,
            "min_packed_seqlen": min(map(sum, spans)),
        }
    ]
    # Bridge's static max_seqlen, max(dataset_max_seqlen, size - min_packed_seqlen), covers
    # every span it lays out (the real segments and the row tail).
    meta = result.metadata
    static_max = max(meta.dataset_max_seqlen, 256 - meta.min_packed_seqlen)
    assert all(max(*s, 256 - sum(s)) <= static_max for s in spans)
    # this package's own format counts the L real tokens of each sequence instead
    ours = pack_offline(source, tmp_path / "ours", spec).metadata
    assert meta.dataset_max_seqlen == aligned_length(ours.dataset_max_seqlen - 1, 4)


def test_bridge_format_fits_fed_tokens_and_truncates_to_them(tmp_path: Path) -> None:
    # 257 tokens: Bridge feeds 256, so it fits a 256 pack in Bridge's format only.
    source = write_jsonl(tmp_path / "in.jsonl", pretokenised(2, 257, 7))
    assert pack_offline(source, tmp_path / "b", PackingSpec(256), format="bridge").packs == 2
    with pytest.raises(ValueError, match="has 257 tokens"):
        pack_offline(source, tmp_path / "ours", PackingSpec(256))
    longer = write_jsonl(tmp_path / "long.jsonl", pretokenised(1, 300, 7))
    spec = PackingSpec(256, pad_seq_to_mult=8, overlong="truncate")
    result = pack_offline(longer, tmp_path / "cut", spec, format="bridge")
    assert result.truncated == 1
    (row,) = bridge_rows(result.files[0])
    assert row["input_ids"] == [7] * 257  # 256 fed tokens and the last label, no padding


def test_bridge_format_reuse_refusals_and_reader(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", text_records(10))
    out = tmp_path / "out"
    first = pack_offline(source, out, PackingSpec(256), format="bridge")
    assert first.format == "bridge"
    assert not first.reused
    again = pack_offline(source, out, PackingSpec(256), format="bridge")
    assert again.reused
    assert again.metadata == first.metadata
    with pytest.raises(ValueError, match="format='bridge' but the request has 'energon_pack'"):
        pack_offline(source, out, PackingSpec(256))
    with pytest.raises(ValueError, match=r"Megatron-Bridge packs .* PackedSequenceSpecs\("):
        PackedDataset(out)
    with pytest.raises(ValueError, match="format must be one of 'energon_pack', 'bridge'"):
        pack_offline(source, tmp_path / "x", PackingSpec(256), format="npy")  # type: ignore[arg-type]
    one = write_jsonl(tmp_path / "one.jsonl", [{"input_ids": [5], "loss_mask": [1]}])
    with pytest.raises(ValueError, match=r"sample one\.jsonl:1 has 1 token; .* at least 2"):
        pack_offline(one, tmp_path / "one", PackingSpec(256), format="bridge")
    # the manifest records the parquet file as it records the arrays
    record = manifest_of(out)["arrays"]["training_256.idx.parquet"]
    data = first.files[0].read_bytes()
    assert (record["bytes"], record["crc32"]) == (len(data), zlib.crc32(data))


def test_train_newline_after_im_end(tmp_path: Path) -> None:
    records = text_records(12)
    source = write_jsonl(tmp_path / "in.jsonl", records)
    plain = PackedDataset(pack_offline(source, tmp_path / "plain", PackingSpec(512)).out_dir)
    spec = PackingSpec(512, train_newline_after_im_end=True)
    newline = PackedDataset(pack_offline(source, tmp_path / "nl", spec).out_dir)
    im_end = ByteTokenizer().convert_tokens_to_ids("<|im_end|>")
    before, after = packed_by_line(plain), packed_by_line(newline)
    assert sorted(before) == sorted(after)
    changed = 0
    for line, (ids, mask) in before.items():
        new_ids, new_mask = after[line]
        assert new_ids == ids
        for t, (old, new) in enumerate(zip(mask, new_mask, strict=True)):
            trained_end = t > 0 and ids[t - 1] == im_end and mask[t - 1] == 1
            if trained_end and ids[t] == ord("\n"):
                assert (old, new) == (0, 1)
                changed += 1
            else:
                assert old == new
    # one per assistant turn: 2 in conversations (every third record), 1 in pairs
    assert changed == sum(2 if "conversations" in r else 1 for r in records)
    with pytest.raises(ValueError, match="train_newline_after_im_end=False but the spec asks True"):
        PackedDataset(plain.out_dir, spec)
