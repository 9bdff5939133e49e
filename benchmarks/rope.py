"""Time packed_mrope_position_ids on a 32,768-token row with 20 images (1 CPU thread).

Prints a table and writes benchmarks/results/rope.json. Target: best time < 5 ms.
Run: .venv/bin/python benchmarks/rope.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from energon_pack.cli.tables import format_table
from energon_pack.encoding.chatml import ByteTokenizer
from energon_pack.packing.mrope import MRopeConfig, packed_mrope_position_ids
from energon_pack.packing.row import PackedRow, build_packed_row

SEQ_LENGTH = 32768
NUM_SEGMENTS = 16
NUM_MEDIA = 20
REPEATS = 200
TARGET_MS = 5.0
RESULTS = Path(__file__).resolve().parent / "results" / "rope.json"
TOKENIZER = ByteTokenizer()


def make_row(videos: int) -> tuple[PackedRow, dict[str, torch.Tensor | None]]:
    """NUM_SEGMENTS sequences holding NUM_MEDIA media blocks (the last ``videos`` are videos)."""
    generator = torch.Generator().manual_seed(0)
    start = TOKENIZER.convert_tokens_to_ids("<|vision_start|>")
    end = TOKENIZER.convert_tokens_to_ids("<|vision_end|>")
    pads = {
        "image": TOKENIZER.convert_tokens_to_ids("<|image_pad|>"),
        "video": TOKENIZER.convert_tokens_to_ids("<|video_pad|>"),
    }
    owner = torch.randint(0, NUM_SEGMENTS, (NUM_MEDIA,), generator=generator).sort().values
    sizes = torch.randint(8, 40, (NUM_MEDIA, 2), generator=generator) * 2
    grids: dict[str, list[list[int]]] = {"image": [], "video": []}
    pieces: list[list[torch.Tensor]] = [[] for _ in range(NUM_SEGMENTS)]
    for index, (segment, (h, w)) in enumerate(zip(owner.tolist(), sizes.tolist(), strict=True)):
        kind = "video" if index >= NUM_MEDIA - videos else "image"
        t = 4 if kind == "video" else 1
        grids[kind].append([t, h, w])
        block = [start, *[pads[kind]] * (t * h * w // 4), end]
        pieces[segment].append(torch.tensor(block))
    media_tokens = sum(len(p) for segment in pieces for p in segment)
    text_budget = SEQ_LENGTH - media_tokens - 8 * NUM_SEGMENTS
    weights = torch.rand(NUM_SEGMENTS, generator=generator) + 0.25
    text = (weights / weights.sum() * text_budget).long().clamp(min=1).tolist()
    sequences = []
    for segment, length in enumerate(text):
        ids = torch.randint(0, 256, (length,), generator=generator)
        ids = torch.cat([ids[: length // 2], *pieces[segment], ids[length // 2 :]])
        sequences.append({"input_ids": ids, "loss_mask": torch.ones(ids.numel())})
    row = build_packed_row(
        sequences,
        seq_length=SEQ_LENGTH,
        pad_to_multiple_of=8,
        pad_to_max_length=True,
        pad_cu_seqlens=True,
        max_segments=32,
        pad_token_id=TOKENIZER.pad_token_id,
    )
    vision = {
        "image_grid_thw": torch.tensor(grids["image"]).reshape(-1, 3),
        "video_grid_thw": torch.tensor(grids["video"]).reshape(-1, 3) if videos else None,
        "second_per_grid_ts": torch.full((videos,), 0.5) if videos else None,
    }
    return row, vision


def time_calls(
    row: PackedRow, vision: dict[str, torch.Tensor | None], config: MRopeConfig
) -> list[float]:
    """Milliseconds of REPEATS calls on ``row``, after one warm-up call."""
    times = []
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        packed_mrope_position_ids(
            row.input_ids, row.cu_seqlens_padded, row.cu_seqlens, **vision, config=config
        )
        times.append((time.perf_counter() - start) * 1e3)
    return times[1:]


CASES: list[tuple[str, int, float | None]] = [
    ("Qwen2-VL, 20 images", 0, None),
    ("Qwen2.5-VL (25 tokens/s), 20 images", 0, 25),
    ("Qwen2.5-VL (25 tokens/s), 16 images + 4 videos", 4, 25),
]


def main() -> None:
    torch.set_num_threads(1)
    table = []
    results: list[dict[str, Any]] = []
    for name, videos, tokens_per_second in CASES:
        row, vision = make_row(videos)
        config = MRopeConfig.from_tokenizer(TOKENIZER, tokens_per_second=tokens_per_second)
        times = time_calls(row, vision, config)
        best, median = min(times), statistics.median(times)
        pads = (config.image_token_id, config.video_token_id)
        vision_tokens = int(torch.isin(row.input_ids, torch.tensor(pads)).sum())
        table.append(
            [name, row.num_segments, vision_tokens, f"{best:.3f}", f"{median:.3f}",
             "yes" if best < TARGET_MS else "NO"]
        )  # fmt: skip
        results.append(
            {
                "case": name,
                "tokens": SEQ_LENGTH,
                "segments": row.num_segments,
                "media": NUM_MEDIA,
                "videos": videos,
                "vision_tokens": vision_tokens,
                "tokens_per_second": tokens_per_second,
                "repeats": REPEATS,
                "best_ms": best,
                "median_ms": median,
                "target_ms": TARGET_MS,
            }
        )
    print(f"packed_mrope_position_ids: {SEQ_LENGTH} tokens, 1 thread, best of {REPEATS}")
    headers = ["case", "segments", "vision tokens", "best ms", "median ms", f"< {TARGET_MS} ms"]
    print(format_table(headers, table))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
