"""Collate-time packing vs a plain padding collator over the same micro-batches (1 CPU thread).

Micro-batches of 8 text and image samples from fixtures/vlm_demo, encoded once up front. Times
each collator per micro-batch with media decoding excluded (samples pre-materialised) and
included, side by side in one run, and the padding waste of each: tokens computed / real tokens.
Packing is measured as one row per micro-batch (the real tokens plus alignment) and with fixed
width rows of SEQ_LENGTH (split into the fewest rows).

Targets: packing adds < 10% over padding with decode excluded; its waste (tokens computed beyond
the real ones) is >= 3x lower.
Prints a table and writes benchmarks/results/collate.json.
Run: .venv/bin/python benchmarks/collate.py
"""

from __future__ import annotations

import json
import statistics
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from energon_pack.cli.tables import format_table
from energon_pack.collate import CollatedBatch, VLMPackingCollator
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.media import MediaTensors
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row import IGNORE_INDEX
from energon_pack.packing.topology import pad_seq_to_mult

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "collate.json"
MICRO_BATCH = 8
NUM_BATCHES = 8
SEQ_LENGTH = 8192
ALIGN = pad_seq_to_mult(tp=4, cp=2, sp=True)
REPEATS_NO_DECODE = 60
REPEATS_DECODE = 5
MAX_OVERHEAD = 0.10
MIN_WASTE_RATIO = 3.0
ONE_ROW = "packing, one row"
FIXED = f"packing, fixed width {SEQ_LENGTH}"


def load_samples(count: int) -> list[EncodedSample]:
    """The first ``count`` fixture samples without video, encoded (media still compressed)."""
    encoder = ConversationEncoder()
    raw: dict[str, dict[str, Any]] = {}
    for shard in sorted((ROOT / "fixtures" / "vlm_demo").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                file = tar.extractfile(member)
                if file is not None:
                    key, _, ext = member.name.partition(".")
                    raw.setdefault(key, {})[ext] = file.read()
    samples = [
        encoder.encode_sample(key, members)
        for key, members in raw.items()
        if not any(ext.endswith("mp4") for ext in members)
    ]
    return samples[:count]


def pad_collate(samples: Sequence[EncodedSample]) -> dict[str, Any]:
    """Plain padding collator: right-pad to the batch's longest sample, stack, concat media."""
    ready = [sample.materialize() for sample in samples]
    width = max(sample.length for sample in ready)
    input_ids = torch.zeros(len(ready), width, dtype=torch.long)
    attention_mask = torch.zeros(len(ready), width, dtype=torch.long)
    labels = torch.full((len(ready), width), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(ready):
        n = sample.length
        input_ids[row, :n] = sample.input_ids
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.where(sample.loss_mask != 0, sample.input_ids, IGNORE_INDEX)
    vision = MediaTensors.concat([s.vision for s in ready if s.vision is not None])
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": labels,
        **vision.tensors(),
    }


def time_per_batch(
    collate: Callable[[Sequence[EncodedSample]], Any], batches: list[list[EncodedSample]]
) -> float:
    start = time.perf_counter()
    for batch in batches:
        collate(batch)
    return (time.perf_counter() - start) / len(batches)


def measure(
    collators: dict[str, Callable[[Sequence[EncodedSample]], Any]],
    batches: list[list[EncodedSample]],
    repeats: int,
) -> dict[str, float]:
    """Median ms per micro-batch of each collator, the collators interleaved in every repeat."""
    times: dict[str, list[float]] = {name: [] for name in collators}
    for collate in collators.values():  # warm-up
        time_per_batch(collate, batches[:1])
    for _ in range(repeats):
        for name, collate in collators.items():
            times[name].append(time_per_batch(collate, batches))
    return {name: 1000 * statistics.median(values) for name, values in times.items()}


def row_tokens(batch: CollatedBatch | dict[str, Any]) -> int:
    """Tokens of a collated batch's rows, padding included."""
    assert isinstance(batch, CollatedBatch)  # the collator's default output
    return batch.input_ids.numel()


def main() -> None:
    torch.set_num_threads(1)
    encoded = load_samples(MICRO_BATCH * NUM_BATCHES)
    decoded = [sample.materialize() for sample in encoded]
    split = [decoded[i : i + MICRO_BATCH] for i in range(0, len(decoded), MICRO_BATCH)]
    split_encoded = [encoded[i : i + MICRO_BATCH] for i in range(0, len(encoded), MICRO_BATCH)]
    real = sum(sample.length for sample in decoded)
    one_row_length = max(sum(-(-s.length // ALIGN) * ALIGN for s in b) for b in split)
    one_row = VLMPackingCollator(-(-one_row_length // ALIGN) * ALIGN, pad_to_multiple_of=ALIGN)
    fixed = VLMPackingCollator(SEQ_LENGTH, pad_to_multiple_of=ALIGN, pad_to_max_length=True)
    collators: dict[str, Callable[[Sequence[EncodedSample]], Any]] = {
        "padding": pad_collate,
        ONE_ROW: one_row,
        FIXED: fixed,
    }
    waste = {
        "padding": sum(pad_collate(b)["input_ids"].numel() for b in split) / real,
        ONE_ROW: sum(row_tokens(one_row(b)) for b in split) / real,
        FIXED: sum(row_tokens(fixed(b)) for b in split) / real,
    }
    no_decode = measure(collators, split, REPEATS_NO_DECODE)
    with_decode = measure(collators, split_encoded, REPEATS_DECODE)

    base = no_decode["padding"]
    rows = []
    results: dict[str, Any] = {
        "micro_batch": MICRO_BATCH,
        "num_batches": NUM_BATCHES,
        "pad_to_multiple_of": ALIGN,
        "real_tokens": real,
        "collators": {},
    }
    for name in collators:
        overhead = no_decode[name] / base - 1
        rows.append(
            [name, no_decode[name], f"{100 * overhead:+.1f}%", with_decode[name], waste[name]]
        )
        results["collators"][name] = {
            "ms_per_batch_decode_excluded": no_decode[name],
            "ms_per_batch_decode_included": with_decode[name],
            "overhead_vs_padding_decode_excluded": overhead,
            "tokens_computed_per_real_token": waste[name],
        }
    headers = ["collator", "ms (no decode)", "vs padding", "ms (decode)", "computed/real"]
    print(format_table(headers, rows))
    # Waste = tokens computed beyond the real ones, per real token (computed/real - 1).
    overhead = no_decode[ONE_ROW] / base - 1
    waste_ratio = {name: (waste["padding"] - 1) / (waste[name] - 1) for name in (ONE_ROW, FIXED)}
    results["targets"] = {
        "overhead_decode_excluded": overhead,
        "overhead_ok": overhead < MAX_OVERHEAD,
        "padding_waste_over_packing_waste": waste_ratio,
        "computed_ratio_padding_over_packing": {
            name: waste["padding"] / waste[name] for name in (ONE_ROW, FIXED)
        },
        "waste_ok": waste_ratio[ONE_ROW] >= MIN_WASTE_RATIO,
    }
    print(
        f"\npacking (one row) overhead vs padding, decode excluded: {100 * overhead:+.1f}% "
        f"(target < {100 * MAX_OVERHEAD:.0f}%)\nwasted tokens (computed - real), padding / "
        f"packing: one row {waste_ratio[ONE_ROW]:.1f}x, fixed width {waste_ratio[FIXED]:.1f}x "
        f"(target >= {MIN_WASTE_RATIO:.0f}x)"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
