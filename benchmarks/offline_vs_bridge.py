"""Offline packing of text SFT data: energon_pack against Megatron-Bridge 0.6.2's own packer.

Every contender packs the same JSONL of ``{"input", "output"}`` samples with Qwen's real
tokenizer (built offline by ``tests/support/real_qwen.py``) at the same packed_sequence_size and
pad_seq_to_mult, into Bridge's packed parquet (``training_<size>.idx.parquet`` and
``<size>_metadata.jsonl``), each run in its own child process:

  bridge-w1   Bridge's ``prepare_gpt_sft_packed_data`` called as ``GPTSFTDatasetBuilder.
              _prepare_packed_split`` calls it (``dataset_builder=build_gpt_sft_split``, the
              builder's default seed 1234 and packing algorithm, no dataset_kwargs) with a
              MegatronTokenizer from ``build_tokenizer(TokenizerConfig("HuggingFaceTokenizer"))``,
              ``num_tokenizer_workers=1``; run by ``.bridge-venv/bin/python`` (built by
              ``scripts/bridge_env.sh``) with the import shims of ``tests/bridge/shims.py``
  bridge-w2   the same with ``num_tokenizer_workers=2``
  ours        ``energon-pack offline SOURCE OUT --format bridge --tokenizer DIR --force``
              (tokenised in that process)
  ours-ray    the same with ``--ray``: tokenised on Ray Data with a local Ray on every core;
              its wall time includes starting and stopping Ray, as a user would see it

Data: ``--samples`` synthetic short-turn samples, deterministic from ``--seed``; each sample's
word count is drawn lognormal (median about 350, clipped to 50..3000 words, about one token per
word) and split between the prompt and the answer; the file is copied afresh for every run so
that no run reuses another's index files (Bridge writes ``.idx`` files beside its input).

Rounds: the contenders run interleaved (A, B, C, D, A, B, C, D, ...) for ``--rounds`` rounds.
Measured per run: wall seconds of the whole child (interpreter start, imports, tokenizer load,
tokenising, packing, writing); peak memory of the child's whole process tree (the sum of each
process's PSS, sampled every ``--sample-interval`` seconds, so Bridge's tokenizer pool and Ray's
workers count, shared pages once); the child's own peak RSS (``ru_maxrss`` from ``wait4``).
Reported: medians over the rounds, and ratios against bridge-w1.

Packs and fill are read from each tool's own output parquet. The numerators DIFFER between the
tools: Bridge tokenises ``input + " " + output`` with its default prompt template and no chat
template (plus eos), while energon_pack encodes the sample as a ChatML conversation
(``<|im_start|>user ... <|im_end|>`` turns), so the same sample has more tokens under
energon_pack. Each tool's real tokens are therefore its own: the tokens its packs feed the model,
``L - 1`` for each stored sequence of ``L`` tokens (the count Bridge's ``packing_efficiency``
uses; at pad_seq_to_mult 1 no sequence is padded, above 1 this includes each sequence's
padding). fill = real tokens / (packs * packed_sequence_size); ``metadata %`` is the
``packing_efficiency`` each tool wrote into its metadata file, as a cross-check.

Targets: ours at least as fast as bridge-w1 with lower peak memory and no worse fill.

Usage: python benchmarks/offline_vs_bridge.py [--samples 20000] [--rounds 3] [--size 4096]
           [--pad-seq-to-mult 1] [--seed 1] [--out benchmarks/results/offline_vs_bridge.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pyarrow.compute as pc
import pyarrow.parquet as pq

from energon_pack.cli.tables import format_table

ROOT = Path(__file__).resolve().parents[1]
BRIDGE_PYTHON = ROOT / ".bridge-venv" / "bin" / "python"
OURS = ROOT / ".venv" / "bin" / "energon-pack"
BASELINE = "bridge-w1"
_WORD_TEXT = (
    "the of and to in is that for it as with was on be by this are or from at an have not which "
    "model data train packing sequence token answer question what where when how many value "
    "function returns list number string file error result first second third table column row "
    "image describe explain because therefore however example small large left right before "
    "after during between under over again each every other another same different"
)
WORDS = tuple(_WORD_TEXT.split())

# The Bridge child: argv[1] is a JSON object of settings; prints one JSON object on stdout.
BRIDGE_DRIVER = r"""
import json, resource, sys, time
from pathlib import Path

settings = json.loads(sys.argv[1])
sys.path.insert(0, settings["root"])
from tests.bridge.shims import install

install()
from megatron.bridge.data.builders.gpt_sft import GPTSFTDatasetConfig, build_gpt_sft_split
from megatron.bridge.data.packing.offline import prepare_gpt_sft_packed_data
from megatron.bridge.training.tokenizers.config import TokenizerConfig
from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer

tokenizer = build_tokenizer(
    TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=settings["tokenizer"])
)
start = time.perf_counter()
prepare_gpt_sft_packed_data(
    input_path=Path(settings["input"]),
    output_path=Path(settings["output"]),
    output_metadata_path=Path(settings["metadata"]),
    packed_sequence_size=settings["size"],
    tokenizer=tokenizer,
    max_seq_length=settings["size"],
    seed=GPTSFTDatasetConfig.seed,
    dataset_kwargs={},
    pad_seq_to_mult=settings["pad_seq_to_mult"],
    num_tokenizer_workers=settings["workers"],
    dataset_builder=build_gpt_sft_split,
)
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"call_seconds": seconds, "self_rss_mb": rss}))
"""


@dataclass(frozen=True)
class Job:
    """One child run: its command line and where its packs land."""

    argv: list[str]
    parquet: Path
    metadata: Path


@dataclass(frozen=True)
class Contender:
    """A named way to pack ``source`` into ``out`` (a fresh folder)."""

    name: str
    job: Callable[[Path, Path], Job]


def write_samples(path: Path, samples: int, seed: int) -> dict[str, float]:
    """Write the short-turn JSONL at ``path``; return word-count statistics."""
    rng = random.Random(seed)
    counts: list[int] = []
    with path.open("w") as out:
        for index in range(samples):
            words = min(3000, max(50, round(rng.lognormvariate(math.log(350), 0.8))))
            prompt_words = max(5, round(words * rng.uniform(0.1, 0.5)))
            prompt = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
            answer = " ".join(rng.choice(WORDS) for _ in range(words - prompt_words))
            out.write(json.dumps({"input": f"Q{index}: {prompt}?", "output": answer}) + "\n")
            counts.append(words)
    counts.sort()
    return {
        "samples": samples,
        "words_total": sum(counts),
        "words_min": counts[0],
        "words_median": statistics.median(counts),
        "words_p99": counts[int(0.99 * (len(counts) - 1))],
        "words_max": counts[-1],
        "mb": round(path.stat().st_size / 1e6, 1),
    }


def contenders(tokenizer: Path, size: int, mult: int) -> list[Contender]:
    """bridge-w1, bridge-w2, ours, ours-ray."""
    parquet, metadata = f"training_{size}.idx.parquet", f"{size}_metadata.jsonl"

    def bridge(workers: int) -> Callable[[Path, Path], Job]:
        def job(source: Path, out: Path) -> Job:
            settings = {
                "root": str(ROOT),
                "tokenizer": str(tokenizer),
                "input": str(source),
                "output": str(out / parquet),
                "metadata": str(out / metadata),
                "size": size,
                "pad_seq_to_mult": mult,
                "workers": workers,
            }
            argv = [str(BRIDGE_PYTHON), "-c", BRIDGE_DRIVER, json.dumps(settings)]
            return Job(argv, out / parquet, out / metadata)

        return job

    def ours(*extra: str) -> Callable[[Path, Path], Job]:
        def job(source: Path, out: Path) -> Job:
            argv = [str(OURS), "offline", str(source), str(out), "--size", str(size)]
            argv += ["--pad-seq-to-mult", str(mult), "--format", "bridge"]
            argv += ["--tokenizer", str(tokenizer), "--force", *extra]
            return Job(argv, out / parquet, out / metadata)

        return job

    return [
        Contender("bridge-w1", bridge(1)),
        Contender("bridge-w2", bridge(2)),
        Contender("ours", ours()),
        Contender("ours-ray", ours("--ray")),
    ]


def _tree_pss(root: psutil.Process) -> int:
    """Bytes of PSS summed over ``root`` and its descendants (those still alive)."""
    total = 0
    try:
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            total += process.memory_full_info().pss
    return total


def run_child(argv: list[str], cwd: Path, log: Path, interval: float) -> dict[str, Any]:
    """Run ``argv``; wall seconds, peak tree PSS and the child's own peak RSS (MB), stdout."""
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONWARNINGS": "ignore"}
    with log.open("w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=err)
        handle = psutil.Process(proc.pid)
        peak = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            peak = max(peak, _tree_pss(handle))
            time.sleep(interval)
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.stdout is not None
    stdout = proc.stdout.read().decode(errors="replace")
    proc.stdout.close()
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{argv[0]} exited {proc.returncode}; stderr tail:\n{tail}")
    return {
        "wall_s": wall,
        "peak_tree_mb": peak / 2**20,
        "child_rss_mb": usage.ru_maxrss / 1024,
        "stdout": stdout,
    }


def read_packs(parquet: Path, metadata: Path, size: int) -> dict[str, Any]:
    """Packs, sequences, stored and real (fed) tokens and fill of a Bridge packed parquet."""
    table = pq.read_table(parquet, columns=["input_ids", "seq_start_id"])
    stored = pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0
    sequences = pc.sum(pc.list_value_length(table["seq_start_id"])).as_py() or 0
    packs = table.num_rows
    real = stored - sequences
    entries = json.loads(metadata.read_text())
    return {
        "packs": packs,
        "sequences": sequences,
        "stored_tokens": stored,
        "real_tokens": real,
        "fill": real / (packs * size) if packs else 0.0,
        "metadata_efficiency_percent": entries[-1].get("packing_efficiency"),
        "metadata": entries[-1],
    }


def bench(args: argparse.Namespace, tokenizer: Path, work: Path) -> dict[str, Any]:
    """Write the data, run every contender ``args.rounds`` times interleaved; the report."""
    source = work / "training.jsonl"
    data = write_samples(source, args.samples, args.seed)
    print(f"data: {data}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {}
    packs: dict[str, dict[str, Any]] = {}
    for round_number in range(args.rounds):
        for contender in contenders(tokenizer, args.size, args.pad_seq_to_mult):
            run_dir = work / f"{contender.name}-{round_number}"
            (run_dir / "out").mkdir(parents=True)
            copy = shutil.copy(source, run_dir / "training.jsonl")
            job = contender.job(Path(copy), run_dir / "out")
            result = run_child(job.argv, run_dir, run_dir / "stderr.log", args.sample_interval)
            if contender.name.startswith("bridge"):
                result.update(json.loads(result["stdout"].strip().splitlines()[-1]))
            del result["stdout"]
            found = read_packs(job.parquet, job.metadata, args.size)
            previous = packs.setdefault(contender.name, found)
            if (previous["packs"], previous["real_tokens"]) != (
                found["packs"],
                found["real_tokens"],
            ):
                print(f"warning: {contender.name} packed differently in round {round_number + 1}")
            runs.setdefault(contender.name, []).append(result)
            print(
                f"round {round_number + 1} {contender.name}: {result['wall_s']:.1f} s, "
                f"peak {result['peak_tree_mb']:.0f} MB, {found['packs']} packs",
                flush=True,
            )
            shutil.rmtree(run_dir)
    summary = {}
    for name, results in runs.items():
        summary[name] = {
            key: statistics.median(r[key] for r in results)
            for key in results[0]
            if isinstance(results[0][key], float)
        } | {key: value for key, value in packs[name].items() if key != "metadata"}
    base = summary[BASELINE]
    for row in summary.values():
        row["wall_vs_bridge_w1"] = row["wall_s"] / base["wall_s"]
        row["peak_vs_bridge_w1"] = row["peak_tree_mb"] / base["peak_tree_mb"]
    return {
        "settings": {
            "packed_sequence_size": args.size,
            "pad_seq_to_mult": args.pad_seq_to_mult,
            "rounds": args.rounds,
            "seed": args.seed,
            "cpus": os.cpu_count(),
            "tokenizer": "Qwen (tests/support/real_qwen.py)",
        },
        "data": data,
        "summary": summary,
        "metadata": {name: found["metadata"] for name, found in packs.items()},
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=4096, help="packed_sequence_size")
    parser.add_argument("--pad-seq-to-mult", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sample-interval", type=float, default=0.2, help="seconds")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "offline_vs_bridge.json")
    )
    args = parser.parse_args()
    if not BRIDGE_PYTHON.is_file():
        sys.exit(f"{BRIDGE_PYTHON} is missing; build it with bash scripts/bridge_env.sh")

    sys.path.insert(0, str(ROOT / "tests" / "support"))  # the shared test helpers
    from real_qwen import qwen_tokenizer_dir

    tokenizer = qwen_tokenizer_dir()
    with tempfile.TemporaryDirectory(prefix="offline_vs_bridge-") as tmp:
        report = bench(args, tokenizer, Path(tmp))

    print(
        f"\n{args.samples} samples, packed_sequence_size {args.size}, pad_seq_to_mult "
        f"{args.pad_seq_to_mult}, medians of {args.rounds} round(s) on {os.cpu_count()} CPUs "
        "(real tokens are each tool's own: Bridge has no chat template, ours ChatML)"
    )
    headers = [
        "contender",
        "wall s",
        "x w1",
        "peak MB",
        "x w1",
        "child RSS MB",
        "packs",
        "seqs",
        "real tokens",
        "fill",
        "metadata %",
    ]
    rows = [
        [
            name,
            f"{row['wall_s']:.1f}",
            f"{row['wall_vs_bridge_w1']:.2f}",
            f"{row['peak_tree_mb']:.0f}",
            f"{row['peak_vs_bridge_w1']:.2f}",
            f"{row['child_rss_mb']:.0f}",
            row["packs"],
            row["sequences"],
            row["real_tokens"],
            row["fill"],
            row["metadata_efficiency_percent"],
        ]
        for name, row in report["summary"].items()
    ]
    print(format_table(headers, rows))
    for name, row in report["summary"].items():
        if "call_seconds" in row:
            print(f"{name}: {row['call_seconds']:.1f} s inside prepare_gpt_sft_packed_data")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
