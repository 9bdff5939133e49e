"""Seeded mutations of a JSONL source (bytes flipped, lines cut, the file truncated): every row
of the mutated file is measured or left out with a kind and a reason, never raised, and the
index keeps the row count."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from energon_pack import RowLayout, make_encoder
from energon_pack.plan.measure import SKIP_KINDS, measure_partition
from energon_pack.plan.spec import PlanSpec
from energon_pack.sources.rows import JsonSource

MUTATIONS = 1000


def _mutated(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    kind = rng.randrange(3)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    elif kind == 1:
        start = rng.randrange(len(out))
        del out[start : start + rng.randint(1, 40)]
    else:
        del out[rng.randrange(len(out)) :]
    return bytes(out)


def test_mutated_sources_are_measured_or_left_out_never_raised(tmp_path: Path) -> None:
    rows = [{"input": f"question {i} " * (i % 5 + 1), "output": f"answer {i}"} for i in range(12)]
    rows += [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    rows += [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]
    original = "".join(json.dumps(row) + "\n" for row in rows).encode()
    encoder = make_encoder()
    spec = PlanSpec(RowLayout(256))
    rng = random.Random(0)
    outcomes = {"measured": 0, **dict.fromkeys(SKIP_KINDS, 0)}
    for number in range(MUTATIONS):
        path = tmp_path / f"rows-{number % 4}.jsonl"
        path.write_bytes(_mutated(original, rng))
        source = JsonSource.open(path)
        parts = [measure_partition(p, encoder, spec, None) for p in source.partitions(rows=5)]
        if not parts:
            continue
        index = np.concatenate([part["index"] for part in parts])
        assert index.tolist() == list(range(len(source)))
        for part in parts:
            for kind, reason in zip(part["skip"], part["reason"], strict=True):
                outcomes[kind or "measured"] += 1
                assert bool(kind) == bool(reason)
    assert outcomes["measured"] > 8 * MUTATIONS, outcomes
    assert outcomes["bad_row"] > MUTATIONS / 2, outcomes
