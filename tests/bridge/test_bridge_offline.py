"""Megatron-Bridge 0.6.2's own offline reader on packs written with ``format="bridge"``.

Bridge's ``GPTSFTPackedParquetDataset`` and its ``collate_fn`` load every pack, and every
sequence's loss-weighted targets equal those of the same sequence in this package's own packs.
Runs in the Bridge test environment (``bash scripts/test_bridge.sh``); skipped elsewhere.
"""

from __future__ import annotations

import collections
import itertools
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.bridge.shims import require_bridge

require_bridge()

from megatron.bridge.data.builders.gpt_sft import (  # noqa: E402
    GPTSFTDatasetBuilder,
    GPTSFTDatasetConfig,
    build_gpt_sft_split,
)
from megatron.bridge.data.packing.config import PackedSequenceSpecs  # noqa: E402
from megatron.bridge.data.packing.parquet import GPTSFTPackedParquetDataset  # noqa: E402

from energon_pack.encoding.chatml import ByteTokenizer  # noqa: E402
from energon_pack.offline.bridge import bridge_pad_id  # noqa: E402
from energon_pack.offline.build import pack_offline  # noqa: E402
from energon_pack.offline.reader import PackedDataset  # noqa: E402
from energon_pack.offline.spec import PackingSpec  # noqa: E402

Targets = tuple[tuple[int, float], ...]


def _write_input(path: Path, count: int, longest: int, seed: int) -> None:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "packing", "rows", "é", "文字"]
    lines = []
    for index in range(count):
        size = rng.randint(8, longest)
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, size // 8 + 1)))
        answer = " ".join(rng.choice(words) for _ in range(size // 6 + 1))
        lines.append(json.dumps({"input": f"{index}: {prompt}", "output": answer}))
    path.write_text("\n".join(lines) + "\n")


def _our_targets(out_dir: Path) -> collections.Counter[Targets]:
    """Each sequence's (label, weight) pairs where the weight is > 0, over every pack."""
    found: collections.Counter[Targets] = collections.Counter()
    dataset = PackedDataset(out_dir)
    for index in range(len(dataset)):
        row = dataset[index]
        bounds = row.cu_seqlens_padded.tolist()[: len(dataset.source_lines(index)) + 1]
        for start, stop in itertools.pairwise(bounds):
            labels, weights = row.labels[start:stop], row.loss_mask[start:stop]
            keep = weights > 0
            found[tuple(zip(labels[keep].tolist(), weights[keep].tolist(), strict=True))] += 1
    return found


def _bridge_dataset(
    result: Any, spec: PackingSpec, tokenizer: Any = None
) -> GPTSFTPackedParquetDataset:
    parquet, metadata = result.files
    specs = PackedSequenceSpecs(
        packed_sequence_size=spec.packed_sequence_size,
        packed_train_data_path=str(parquet),
        packed_metadata_path=str(metadata),
        pad_cu_seqlens=spec.pad_cu_seqlens,
        pad_seq_to_mult=spec.pad_seq_to_mult,
    )
    # Bridge's tokenizer wrappers give eos_id; the pack was padded with the same id.
    eos = bridge_pad_id(tokenizer if tokenizer is not None else ByteTokenizer())
    # How Bridge's GPT SFT data builder opens a training split from PackedSequenceSpecs.
    dataset = build_gpt_sft_split(
        specs.packed_train_data_path,
        tokenizer=SimpleNamespace(eos_id=eos),
        seq_length=spec.packed_sequence_size,
        memmap_workers=1,
        seed=1234,
        packed_sequence_size=specs.packed_sequence_size,
        pack_metadata_path=specs.packed_metadata_path,
        pad_cu_seqlens=specs.pad_cu_seqlens,
        pad_seq_to_mult=specs.pad_seq_to_mult,
        dataset_kwargs={"pad_to_max_length": spec.pad_to_max_length},
    )
    assert isinstance(dataset, GPTSFTPackedParquetDataset)
    return dataset


def _bridge_targets(
    dataset: GPTSFTPackedParquetDataset, spec: PackingSpec
) -> collections.Counter[Targets]:
    found: collections.Counter[Targets] = collections.Counter()
    mult = spec.pad_seq_to_mult
    for index in range(len(dataset)):
        item = dataset[index]
        batch = dataset.collate_fn([item])
        stored = [
            b - a
            for a, b in zip(item["seq_boundaries"][:-1], item["seq_boundaries"][1:], strict=False)
        ]
        spans = [n - 1 for n in stored]  # Bridge feeds L - 1 of each stored sequence
        physical = batch["cu_seqlens_q_padded" if mult > 1 else "cu_seqlens_q"][0].tolist()
        real = batch["cu_seqlens_q"][0].tolist()
        width = batch["tokens"].shape[1]
        assert physical[: len(spans) + 1] == [sum(spans[:i]) for i in range(len(spans) + 1)]
        assert all(span % mult == 0 for span in spans)
        assert physical[-1] == width  # the row tail (if any) is one more boundary
        if spec.pad_to_max_length:
            assert width == spec.packed_sequence_size
        if spec.pad_cu_seqlens:
            # static shapes: max_samples_per_bin + 2 boundaries; max_seqlen covers every span
            metadata = dataset.pack_metadata[0]
            assert len(physical) == metadata["max_samples_per_bin"] + 2
            assert int(batch["max_seqlen_q"].reshape(-1)[0]) >= max(spans)
        logical = [b - a for a, b in itertools.pairwise(real)][: len(spans)]
        labels, weights = batch["labels"][0], batch["loss_mask"][0]
        for number, (start, stop) in enumerate(itertools.pairwise(physical)):
            if number >= len(spans):
                assert weights[start:stop].sum() == 0  # padding trains nothing
                continue
            assert logical[number] <= spans[number]
            keep = weights[start:stop] > 0
            pairs = zip(
                labels[start:stop][keep].tolist(),
                weights[start:stop][keep].to(torch.float32).tolist(),
                strict=True,
            )
            found[tuple(pairs)] += 1
    return found


CASES = [
    pytest.param(2048, {}, id="2048"),
    pytest.param(2048, {"pad_to_max_length": True, "pad_cu_seqlens": True}, id="2048-static"),
    pytest.param(2048, {"tp": 4, "sp": True}, id="2048-tp4-sp"),
    pytest.param(4096, {"tp": 2, "cp": 2, "sp": True}, id="4096-tp2-cp2-sp"),
    pytest.param(
        4096,
        {"cp": 2, "pad_to_max_length": True, "pad_cu_seqlens": True, "algorithm": "ffd"},
        id="4096-cp2-static-ffd",
    ),
    pytest.param(4096, {"tp": 4, "sp": True, "pad_to_max_length": True}, id="4096-tp4-sp-fixed"),
]


@pytest.mark.parametrize(("size", "settings"), CASES)
def test_bridge_reads_every_pack_with_our_targets(
    tmp_path: Path, size: int, settings: dict[str, Any]
) -> None:
    source = tmp_path / "sft.jsonl"
    _write_input(source, count=120, longest=size // 3, seed=size)
    spec = PackingSpec.for_topology(size, **settings)
    ours = pack_offline(source, tmp_path / "ours", spec)
    bridge = pack_offline(source, tmp_path / "bridge", spec, format="bridge")
    dataset = _bridge_dataset(bridge, spec)
    assert len(dataset) == bridge.packs
    bridge_targets = _bridge_targets(dataset, spec)
    assert sum(bridge_targets.values()) == ours.sequences == 120
    assert bridge_targets == _our_targets(ours.out_dir)


def test_readme_config_builds_with_bridges_dataset_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPTSFTDatasetConfig of docs/quickstart/offline.md, given what ``energon-pack
    offline`` printed, builds Bridge's training dataset from the pack (no preparation of its
    own)."""
    monkeypatch.chdir(tmp_path)
    _write_input(tmp_path / "sft.jsonl", count=40, longest=900, seed=1)
    spec = PackingSpec.for_topology(4096, tp=2, cp=2, sp=True)
    result = pack_offline("sft.jsonl", "packed/", spec, format="bridge")
    parquet, metadata = result.files
    config = GPTSFTDatasetConfig(
        seq_length=4096,
        dataset_root="packed/",
        enable_offline_packing=True,
        offline_packing_specs=PackedSequenceSpecs(
            packed_sequence_size=4096,
            packed_train_data_path=str(parquet),
            packed_metadata_path=str(metadata),
            pad_seq_to_mult=spec.pad_seq_to_mult,
            pad_cu_seqlens=False,
        ),
        dataset_kwargs={"pad_to_max_length": False},
        do_validation=False,
        do_test=False,
    )
    config.validate()
    config.finalize()
    pad = bridge_pad_id(ByteTokenizer())
    train, validation, test = GPTSFTDatasetBuilder(
        config, SimpleNamespace(eos_id=pad, eod=pad)
    ).build()
    assert isinstance(train, GPTSFTPackedParquetDataset)
    assert (validation, test) == (None, None)
    assert len(train) == result.packs
    assert sorted(p.name for p in (tmp_path / "packed").iterdir()) == [
        "4096_metadata.jsonl",
        "manifest.json",
        "training_4096.idx.parquet",
    ]
    batch = train.collate_fn([train[0]])
    assert batch["cu_seqlens_q_padded"][0, -1] == batch["tokens"].shape[1]


def test_bridge_reads_packs_of_a_chatml_tokenizer(tmp_path: Path) -> None:
    """A Qwen-style tokenizer whose eos is <|im_end|>: Bridge pads with it and takes no loss
    where the input is <|im_end|>, which with the default convention is never a target."""
    import hf_qwen

    tokenizer = hf_qwen.qwen_tokenizer()
    assert tokenizer.eos_token == "<|im_end|>"
    source = tmp_path / "sft.jsonl"
    _write_input(source, count=60, longest=600, seed=3)
    spec = PackingSpec.for_topology(
        2048, tp=4, sp=True, pad_to_max_length=True, pad_cu_seqlens=True
    )
    ours = pack_offline(source, tmp_path / "ours", spec, tokenizer)
    bridge = pack_offline(source, tmp_path / "bridge", spec, tokenizer, format="bridge")
    targets = _bridge_targets(_bridge_dataset(bridge, spec, tokenizer), spec)
    assert sum(targets.values()) == 60
    assert targets == _our_targets(ours.out_dir)
