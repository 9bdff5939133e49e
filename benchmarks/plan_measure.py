"""The plan's measure stage on Ray: rows per second with 1 and 2 CPUs, and a two-node cluster
started on this machine against a local Ray (the plans must be identical).

Rows: the shipped demo dataset as chat rows (fixtures/vlm_demo: text, images and videos as
files under a media root), repeated --copies times, encoded with the real Qwen tokenizer and
the Qwen2-VL chat template (tests/support/real_qwen.py). Each round plans the rows once with a
local Ray of 1 CPU and once with 2 (interleaved, a fresh Ray each time, its start-up not
timed: the measure stage only); the median of the rounds' rates and of their ratio is
reported, over the whole stage and steady (from the first partition's arrival to the last's:
the actors' start-up, a few seconds of imports and unpickling the encoder, left out). Then
``ray start --head --num-cpus 1`` and a second ``ray start --address`` make a two-node cluster;
``energon-pack plan --ray-address`` on it must write the same plan.parquet and the same counts
as the local run.

Usage: python benchmarks/plan_measure.py [--copies N] [--rounds N] [--no-cluster]
       [--out benchmarks/results/plan_measure.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from chat_templates import QWEN2_VL  # noqa: E402
from plan_rows import write_chat_rows  # noqa: E402
from real_qwen import real_qwen_tokenizer  # noqa: E402

from energon_pack import PlanSpec, RowLayout, VisionBudget, make_encoder  # noqa: E402
from energon_pack.cli.tables import format_table  # noqa: E402
from energon_pack.plan import plan_dataset  # noqa: E402
from energon_pack.plan.measure import measure_partitions  # noqa: E402
from energon_pack.sources.rows import JsonSource  # noqa: E402

SPEC = PlanSpec(
    RowLayout(8192, 8), VisionBudget(max_vision_tokens=6000, balance=True), data_parallel_size=8
)


def repeated(rows: Path, copies: int) -> Path:
    lines = rows.read_text().splitlines()
    out = rows.with_name("repeated.jsonl")
    out.write_text("".join(line + "\n" for _ in range(copies) for line in lines))
    return out


def rate(source: JsonSource, encoder: object, cpus: int) -> tuple[float, float]:
    """Rows per second of the measure stage on a fresh local Ray of ``cpus`` CPUs: over the
    whole stage, and steady (the rows after the first partition over the time from its
    arrival to the last one's: the actors' start-up left out)."""
    import ray

    ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    arrivals: list[tuple[float, int]] = []
    try:
        start = time.perf_counter()
        measure_partitions(
            source.partitions(rows=256),
            encoder,  # type: ignore[arg-type]
            SPEC,
            source.media_root,
            on_rows=lambda rows: arrivals.append((time.perf_counter(), rows)),
        )
        whole = len(source) / (time.perf_counter() - start)
    finally:
        ray.shutdown()
    later = sum(rows for _, rows in arrivals[1:])
    return whole, later / (arrivals[-1][0] - arrivals[0][0])


def cluster_matches(rows: Path, media: Path, work: Path, encoder: object) -> dict[str, Any]:
    """Plan locally, then on a two-node cluster on this machine; whether they agree."""
    import pyarrow.parquet as pq

    local = plan_dataset(rows, work / "local", SPEC, encoder, media_root=media)  # type: ignore[arg-type]
    port = "6390"
    ray_cli = str(Path(sys.executable).parent / "ray")  # the venv's, activated or not
    subprocess.run([ray_cli, "start", "--head", "--port", port, "--num-cpus", "1"], check=True)
    try:
        subprocess.run(
            [ray_cli, "start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1"], check=True
        )
        remote = plan_dataset(
            rows,
            work / "cluster",
            SPEC,
            encoder,  # type: ignore[arg-type]
            media_root=media,
            ray_address=f"127.0.0.1:{port}",
        )
    finally:
        subprocess.run([ray_cli, "stop", "--force"], check=False)
    same_table = pq.read_table(work / "local" / "plan.parquet").equals(
        pq.read_table(work / "cluster" / "plan.parquet")
    )
    return {
        "identical_packs": same_table,
        "identical_counts": local.counts == remote.counts,
        "packs": local.packs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-cluster", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/plan_measure.json")
    args = parser.parse_args()
    encoder = make_encoder(real_qwen_tokenizer(chat_template=QWEN2_VL))
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        chat = write_chat_rows(work / "data")
        source = JsonSource.open(repeated(chat.path, args.copies), chat.media_root)
        rounds = []
        for _ in range(args.rounds):
            (one, one_steady), (two, two_steady) = (
                rate(source, encoder, 1),
                rate(source, encoder, 2),
            )
            rounds.append(
                {
                    "one_cpu": one,
                    "two_cpus": two,
                    "ratio": two / one,
                    "one_cpu_steady": one_steady,
                    "two_cpus_steady": two_steady,
                    "steady_ratio": two_steady / one_steady,
                }
            )
        cluster = (
            {} if args.no_cluster else cluster_matches(chat.path, chat.media_root, work, encoder)
        )
    result = {
        "rows": len(source),
        "rounds": rounds,
        "median_rows_per_s_1": statistics.median(r["one_cpu"] for r in rounds),
        "median_rows_per_s_2": statistics.median(r["two_cpus"] for r in rounds),
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "median_steady_ratio": statistics.median(r["steady_ratio"] for r in rounds),
        "cluster": cluster,
    }
    print(
        format_table(
            ["rows", "rows/s, 1 CPU", "rows/s, 2 CPUs", "ratio (median)", "steady ratio"],
            [
                [
                    result["rows"],
                    f"{result['median_rows_per_s_1']:.0f}",
                    f"{result['median_rows_per_s_2']:.0f}",
                    f"{result['median_ratio']:.2f}x",
                    f"{result['median_steady_ratio']:.2f}x",
                ]
            ],
        )
    )
    if cluster:
        print(f"two-node cluster vs local: {cluster}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
