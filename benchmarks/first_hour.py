"""The quick start on short-turn data: the bin fill a new user gets from README.md's setup.

A conversation dataset of short turns (``--samples`` samples of 100-600 tokens under Qwen's real
tokenizer, built offline by ``tests/support/real_qwen.py``; no chat template, so the ChatML
encoding) is written as a prepared Energon dataset, then read by the quick start exactly as
written: ``PackingTaskEncoder(tokenizer, seq_length=8192, pad_to_multiple_of=pad_seq_to_mult(tp=4,
cp=2, sp=True))`` and ``get_train_dataset(..., packing_buffer_size=16)``, one epoch, no workers.

Each ``--tree`` (a checkout of this repository; default: this one) runs in its own child process
with that tree's ``energon_pack`` first on ``sys.path``, so two versions compare on the same data.

Measured per tree: packs; bin fill over every pack, and over the packs before the end-of-epoch
flush (the last three left out); samples per pack; how many packs left because the buffer was
full; the library's warnings (``PackingWarning``) printed during the epoch.

    python benchmarks/first_hour.py --tree /path/to/old/checkout --tree . --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEQ_LENGTH = 8192
BUFFER = 16
WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "or",
    "from",
    "at",
    "an",
    "have",
    "not",
    "which",
    "image",
    "picture",
    "describe",
    "answer",
    "question",
    "what",
    "where",
    "when",
    "how",
    "many",
    "colour",
    "left",
    "right",
    "small",
    "large",
    "person",
    "table",
    "window",
    "street",
    "tree",
    "water",
    "sky",
    "building",
    "car",
    "dog",
    "cat",
    "shows",
    "there",
)


def _turn(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def build(root: Path, samples: int, seed: int) -> list[int]:
    """Write the short-turn dataset at ``root``; return each sample's token count."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    sys.path.insert(0, str(ROOT / "fixtures"))
    import make_fixtures
    from real_qwen import real_qwen_tokenizer

    tokenizer = real_qwen_tokenizer()
    rng = random.Random(seed)
    members, lengths = [], []
    for index in range(samples):
        target = rng.randint(100, 600)
        question = _turn(rng, max(4, target // 8))
        answer = _turn(rng, max(4, target - target // 8 - 20))
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        text = (
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"
        )
        lengths.append(len(tokenizer(text)["input_ids"]))
        members.append((f"s{index:06d}.json", json.dumps({"conversations": turns}).encode()))
    root.mkdir(parents=True, exist_ok=True)
    make_fixtures.write_tar(root / "shard-000000.tar", members)
    make_fixtures.prepare_energon(root, [root / "shard-000000.tar"])
    return lengths


def quick_start(data: Path) -> dict[str, Any]:
    """README.md's quick start over ``data``, one epoch (run with the tree's package first)."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset
    from real_qwen import real_qwen_tokenizer

    import energon_pack
    from energon_pack import PackingTaskEncoder, pad_seq_to_mult

    encoder = PackingTaskEncoder(
        tokenizer=real_qwen_tokenizer(),
        seq_length=SEQ_LENGTH,
        pad_to_multiple_of=pad_seq_to_mult(tp=4, cp=2, sp=True),
    )
    dataset = get_train_dataset(
        str(data),
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
        batch_size=1,
        packing_buffer_size=BUFFER,
        task_encoder=encoder,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        repeat=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", energon_pack.PackingWarning)
        packs = list(get_savable_loader(dataset))
    used = [int(batch.cu_seqlens_padded[-1]) for batch in packs]
    steady = used[:-3]
    last = packs[-1].packing_stats
    return {
        "package": str(Path(energon_pack.__file__).parents[1]),
        "packs": len(packs),
        "samples": sum(len(batch.__keys__) for batch in packs),
        "bin_fill": sum(used) / (len(used) * SEQ_LENGTH),
        "bin_fill_steady": sum(steady) / (len(steady) * SEQ_LENGTH),
        "samples_per_pack": sum(len(batch.__keys__) for batch in packs) / len(packs),
        "left_buffer_full": last.left_buffer_full,
        "warnings": [str(w.message) for w in caught if w.category is energon_pack.PackingWarning],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", type=Path, help="checkout to measure")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(quick_start(args.child)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "short_turns"
        lengths = sorted(build(data, args.samples, args.seed))
        results = []
        for tree in args.tree or [ROOT]:
            env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(data)],
                env=env,
                cwd=tree,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results.append({"tree": str(tree), **json.loads(out.splitlines()[-1])})
    spread = f"{lengths[0]} / {lengths[len(lengths) // 2]} / {lengths[-1]}"
    print(f"{args.samples} samples, tokens min / median / max {spread}; seq {SEQ_LENGTH}, ", end="")
    print(f"packing_buffer_size {BUFFER}")
    header = ("tree", "packs", "fill", "fill (no flush)", "samples/pack", "left full", "warnings")
    rows = [
        (
            r["tree"],
            r["packs"],
            f"{r['bin_fill']:.4f}",
            f"{r['bin_fill_steady']:.4f}",
            f"{r['samples_per_pack']:.1f}",
            r["left_buffer_full"],
            len(r["warnings"]),
        )
        for r in results
    ]
    widths = [max(len(str(v)) for v in column) for column in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)))
    for r in results:
        for message in r["warnings"]:
            print(f"{r['tree']}: PackingWarning: {message}")
    if args.json:
        record = {"samples": args.samples, "token_lengths": spread, "results": results}
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
