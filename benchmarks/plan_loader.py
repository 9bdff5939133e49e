"""Loading from a whole-dataset plan against the online Energon packer, same data and settings.

Three loaders read one pass of ``fixtures/vlm_demo`` (every pack once), each with two forked
workers, rows of ``SEQ_LENGTH`` = 8192 tokens with segments aligned to
``pad_seq_to_mult(tp=4, cp=2, sp=True)`` = 8, and the encoder ``make_encoder(None)`` (the
built-in ByteTokenizer, default :class:`~energon_pack.MediaConfig`: real Qwen2-VL sizes):

  A online   ``PackingTaskEncoder`` on Energon: ``get_train_dataset(..., packing_buffer_size=16,
             repeat=False)`` + ``get_savable_loader`` (``energon_loader.py``'s lazy path at
             buffer 16).
  B planned  a plan of the Energon dataset (``plan_dataset("fixtures/vlm_demo", ...)``, built
             once before the runs, on a local Ray; not timed) read by ``PlannedDataset`` through
             a ``torch.utils.data.DataLoader(dataset, batch_sampler=PlanSampler(dataset, 0, 1),
             collate_fn=PlannedDataset.collate_fn, num_workers=2)``: members read by random
             access through Energon's sample index.
  C local    the same samples as JSONL chat rows with their media as files under a media root
             (``tests/support/plan_rows.py``'s ``write_chat_rows``), planned and read the same
             way as B.

Every run is a fresh interpreter (torch pinned to one thread, ``OMP_NUM_THREADS=1``), so no
memory carries over between runs and every loader forks its workers from a comparable parent;
the runs are interleaved A, B, C, A, B, C, ... for ``--rounds`` rounds. Measured per run:

  samples/s          real samples (A: ``len(batch.__keys__)``; B, C: ``sum(len(k) for k in
                     batch.keys)``) over the wall clock from ``iter(loader)`` (forks the
                     workers) to the last pack; "steady": after the first pack
  first pack s       ``iter(loader)`` to the first pack
  open s             building the dataset and loader (B, C: reading the plan, checking the
                     source's fingerprint, which hashes the source)
  CPU ms/sample      user + system CPU per sample of the descendants reaped by the end
                     (``RUSAGE_CHILDREN``: the workers, and their helpers where they reaped
                     them; robust to other load on the machine, lower is better)
  worker RSS         polled every ``POLL_SECONDS`` with psutil over the loader's workers (the
                     direct children running this script): "max" the largest RSS of one worker,
                     "sum" the largest sum over the workers at one poll; "HWM" the kernel's
                     peak RSS (``VmHWM``) of one worker, last read while it lived; "USS": the
                     largest memory unique to one worker (every ``USS_EVERY``-th poll; RSS
                     also counts the pages a worker shares with the parent it forked from,
                     which differs between the loaders); "all procs":
                     the largest sum over every descendant (workers, their media decoder
                     helpers, resource trackers)

The table shows medians over the rounds; "vs A" columns are medians of per-round ratios to the
online run of the same round.

Targets (the issue's goal): B's and C's peak worker RSS (max over workers) <= A's (online, lazy
media, buffer 16); C's samples/s >= 0.9x A's (planned from local files).

Prints a table and writes benchmarks/results/plan_loader.json.

Usage:
    .venv/bin/python benchmarks/plan_loader.py               # 3 rounds of A, B, C
    .venv/bin/python benchmarks/plan_loader.py --rounds 1    # a smoke run
    .venv/bin/python benchmarks/plan_loader.py --work DIR    # keep (and reuse) rows and plans
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
import torch
from common import mib_cell, ratio_cell, vm_hwm
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

from energon_pack import (
    PackingTaskEncoder,
    PlannedDataset,
    PlanSampler,
    PlanSpec,
    RowLayout,
    make_encoder,
    pad_seq_to_mult,
    plan_dataset,
)
from energon_pack.cli.tables import format_table

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT / "fixtures" / "vlm_demo"
SUPPORT = ROOT / "tests" / "support"
RESULTS = ROOT / "benchmarks" / "results" / "plan_loader.json"
SEQ_LENGTH = 8192
ALIGN = pad_seq_to_mult(tp=4, cp=2, sp=True)
LAYOUT = RowLayout(SEQ_LENGTH, pad_to_multiple_of=ALIGN)
NUM_WORKERS = 2
BUFFER = 16
POLL_SECONDS = 0.1
USS_EVERY = 3
RUN_TIMEOUT_SECONDS = 900
MB = 1 << 20

ONLINE, PLANNED, LOCAL = "A online", "B planned", "C local"
SCHEMES = (ONLINE, PLANNED, LOCAL)
SOURCES = {
    ONLINE: "energon, buffer 16",
    PLANNED: "plan of energon",
    LOCAL: "plan of JSONL+files",
}
MIN_LOCAL_RATIO = 0.9
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


class WorkerMemory:
    """Background thread: RSS of the loader's workers (the children of this process that run
    this same command line) and of every descendant, every ``interval`` seconds."""

    def __init__(self, interval: float = POLL_SECONDS) -> None:
        self.interval = interval
        self.peak: dict[int, int] = {}
        self.hwm: dict[int, int] = {}
        self.uss = 0
        self.sum_peak = 0
        self.all_peak = 0
        self.main_peak = 0
        self.polls = 0
        self._me = psutil.Process()
        self._cmdline = self._me.cmdline()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> WorkerMemory:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self.interval):
                return

    def poll(self) -> None:
        """One sample of every descendant's RSS."""
        self.main_peak = max(self.main_peak, self._me.memory_info().rss)
        workers = everything = 0
        for child in self._me.children(recursive=True):
            try:
                rss = child.memory_info().rss
                is_worker = child.ppid() == self._me.pid and child.cmdline() == self._cmdline
                if is_worker and self.polls % USS_EVERY == 0:
                    self.uss = max(self.uss, child.memory_full_info().uss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            everything += rss
            if not is_worker:
                continue
            workers += rss
            self.peak[child.pid] = max(self.peak.get(child.pid, 0), rss)
            hwm = vm_hwm(child.pid)
            if hwm is not None:
                self.hwm[child.pid] = max(self.hwm.get(child.pid, 0), hwm)
        self.sum_peak = max(self.sum_peak, workers)
        self.all_peak = max(self.all_peak, everything)
        self.polls += 1


def online_loader() -> Iterable[Any]:
    """A: the online packer on Energon, as ``energon_loader.py``'s lazy path at buffer 16."""
    encoder = PackingTaskEncoder(layout=LAYOUT, encoder=make_encoder(None))
    dataset = get_train_dataset(
        DATASET,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=NUM_WORKERS),
        batch_size=1,
        packing_buffer_size=BUFFER,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=False,
    )
    loader: Iterable[Any] = get_savable_loader(dataset)
    return loader


def planned_loader(plan_dir: Path) -> Iterable[Any]:
    """B, C: a plan read by ``PlannedDataset`` through a plain DataLoader."""
    dataset = PlannedDataset(plan_dir, make_encoder(None))
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=PlanSampler(dataset, 0, 1),
        collate_fn=PlannedDataset.collate_fn,
        num_workers=NUM_WORKERS,
    )


def pack_counts(scheme: str, batch: Any) -> tuple[int, int]:
    """(real samples, real tokens) of one pack."""
    if scheme == ONLINE:
        return len(batch.__keys__), int(batch.cu_seqlens[-1])
    return sum(len(keys) for keys in batch.keys), int(batch.cu_seqlens_flat[-1])


def run_once(scheme: str, plan_dir: Path | None) -> dict[str, Any]:
    """One pass of ``scheme``'s loader in this process (a fresh one, see :func:`measure`)."""
    torch.set_num_threads(1)
    load_avg = os.getloadavg()[0]
    opened = time.perf_counter()
    if scheme == ONLINE:
        loader = online_loader()
    else:
        assert plan_dir is not None
        loader = planned_loader(plan_dir)
    open_s = time.perf_counter() - opened
    packs = samples = tokens = first_samples = 0
    with WorkerMemory() as memory:
        start = time.perf_counter()
        first = last = start
        for batch in loader:
            last = time.perf_counter()
            packs += 1
            count, real = pack_counts(scheme, batch)
            samples += count
            tokens += real
            if packs == 1:
                first, first_samples = last, samples
            del batch
        memory.poll()
    del loader
    gc.collect()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    steady = samples - first_samples
    hwm = max(memory.hwm.values()) if memory.hwm else None
    return {
        "scheme": scheme,
        "packs": packs,
        "samples": samples,
        "real_tokens": tokens,
        "bin_fill": tokens / (packs * SEQ_LENGTH),
        "samples_per_s": samples / (last - start),
        "steady_samples_per_s": steady / (last - first) if steady else 0.0,
        "first_pack_s": first - start,
        "wall_s": last - start,
        "open_s": open_s,
        "cpu_ms_per_sample": 1000 * (children.ru_utime + children.ru_stime) / samples,
        "worker_rss_max_mb": max(memory.peak.values(), default=0) / MB,
        "worker_rss_sum_mb": memory.sum_peak / MB,
        "worker_hwm_max_mb": None if hwm is None else hwm / MB,
        "worker_uss_max_mb": memory.uss / MB,
        "all_procs_rss_mb": memory.all_peak / MB,
        "main_rss_mb": memory.main_peak / MB,
        "worker_peaks_mb": sorted(rss / MB for rss in memory.peak.values()),
        "workers": len(memory.peak),
        "polls": memory.polls,
        "load_avg_1min": load_avg,
    }


def measure(scheme: str, plan_dir: Path | None) -> dict[str, Any]:
    """:func:`run_once` in a fresh interpreter with one thread per library."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        command = [sys.executable, __file__, "--run", scheme, str(plan_dir or "-"), str(out)]
        proc = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_SECONDS,
            env={**os.environ, **THREAD_ENV},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{scheme} failed:\n{proc.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


def build_plans(work: Path) -> dict[str, Path]:
    """The plans of B (the Energon dataset) and C (its samples as JSONL rows and media files),
    built on a local Ray (reused when ``work`` already holds them up to date)."""
    sys.path.insert(0, str(SUPPORT))
    from plan_rows import write_chat_rows

    spec = PlanSpec(LAYOUT)
    energon = plan_dataset(DATASET, work / "plan-energon", spec, make_encoder(None))
    rows = write_chat_rows(work / "rows")
    local = plan_dataset(
        rows.path, work / "plan-local", spec, make_encoder(None), media_root=rows.media_root
    )
    for name, plan in (("B", energon), ("C", local)):
        print(f"plan {name}: {plan.summary()}", file=sys.stderr)
    return {PLANNED: energon.out_dir, LOCAL: local.out_dir}


@dataclass(frozen=True)
class Summary:
    """One scheme over the rounds: medians, and medians of per-round ratios to A."""

    scheme: str
    packs: int
    samples: int
    bin_fill: float
    samples_per_s: float
    samples_vs_a: float | None
    steady_samples_per_s: float
    steady_vs_a: float | None
    first_pack_s: float
    open_s: float
    cpu_ms_per_sample: float
    cpu_vs_a: float | None
    worker_rss_max_mb: float
    rss_max_vs_a: float | None
    worker_rss_sum_mb: float
    rss_sum_vs_a: float | None
    worker_hwm_max_mb: float | None
    worker_uss_max_mb: float
    uss_vs_a: float | None
    all_procs_rss_mb: float
    main_rss_mb: float


def versus_a(
    mine: Sequence[dict[str, Any]], reference: dict[int, dict[str, Any]], field: str
) -> float | None:
    """Median over rounds of ``field`` / A's ``field`` in the same round."""
    ratios = [
        run[field] / reference[run["round"]][field]
        for run in mine
        if run["round"] in reference and reference[run["round"]][field]
    ]
    return statistics.median(ratios) if ratios else None


def summarize(runs: Sequence[dict[str, Any]]) -> list[Summary]:
    """One :class:`Summary` per scheme, in the order A, B, C."""
    reference = {run["round"]: run for run in runs if run["scheme"] == ONLINE}
    summaries = []
    for scheme in SCHEMES:
        mine = [run for run in runs if run["scheme"] == scheme]
        if not mine:
            continue

        def median(field: str, runs: Sequence[dict[str, Any]] = mine) -> float:
            return float(statistics.median(run[field] for run in runs))

        hwm = [run["worker_hwm_max_mb"] for run in mine if run["worker_hwm_max_mb"] is not None]
        summaries.append(
            Summary(
                scheme=scheme,
                packs=mine[0]["packs"],
                samples=mine[0]["samples"],
                bin_fill=mine[0]["bin_fill"],
                samples_per_s=median("samples_per_s"),
                samples_vs_a=versus_a(mine, reference, "samples_per_s"),
                steady_samples_per_s=median("steady_samples_per_s"),
                steady_vs_a=versus_a(mine, reference, "steady_samples_per_s"),
                first_pack_s=median("first_pack_s"),
                open_s=median("open_s"),
                cpu_ms_per_sample=median("cpu_ms_per_sample"),
                cpu_vs_a=versus_a(mine, reference, "cpu_ms_per_sample"),
                worker_rss_max_mb=median("worker_rss_max_mb"),
                rss_max_vs_a=versus_a(mine, reference, "worker_rss_max_mb"),
                worker_rss_sum_mb=median("worker_rss_sum_mb"),
                rss_sum_vs_a=versus_a(mine, reference, "worker_rss_sum_mb"),
                worker_hwm_max_mb=statistics.median(hwm) if hwm else None,
                worker_uss_max_mb=median("worker_uss_max_mb"),
                uss_vs_a=versus_a(mine, reference, "worker_uss_max_mb"),
                all_procs_rss_mb=median("all_procs_rss_mb"),
                main_rss_mb=median("main_rss_mb"),
            )
        )
    return summaries


def check_targets(summaries: Sequence[Summary]) -> list[str]:
    """PASS/FAIL lines for the issue's targets (those whose schemes were measured)."""
    by_scheme = {s.scheme: s for s in summaries}
    online = by_scheme.get(ONLINE)
    if online is None:
        return []
    lines = []
    for scheme in (PLANNED, LOCAL):
        planned = by_scheme.get(scheme)
        if planned is None:
            continue
        ok = planned.worker_rss_max_mb <= online.worker_rss_max_mb
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: {scheme} peak worker RSS {planned.worker_rss_max_mb:.0f}"
            f" MB vs online lazy at buffer {BUFFER} {online.worker_rss_max_mb:.0f} MB (target: "
            f"<=); HWM {mib_cell(planned.worker_hwm_max_mb)} vs "
            f"{mib_cell(online.worker_hwm_max_mb)} MB, "
            f"USS {planned.worker_uss_max_mb:.0f} vs {online.worker_uss_max_mb:.0f} MB"
        )
    local = by_scheme.get(LOCAL)
    if local is not None and local.samples_vs_a is not None:
        ok = local.samples_vs_a >= MIN_LOCAL_RATIO
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: {LOCAL} samples/s = {local.samples_vs_a:.3f}x online "
            f"(target >= {MIN_LOCAL_RATIO}); steady {ratio_cell(local.steady_vs_a)}x, CPU per "
            f"sample {ratio_cell(local.cpu_vs_a)}x"
        )
    if len({s.samples for s in summaries}) > 1:
        counts = ", ".join(f"{s.scheme} {s.samples}" for s in summaries)
        lines.append(f"NOTE: the schemes read different sample counts ({counts})")
    return lines


def table(summaries: Sequence[Summary]) -> str:
    """The summary table."""
    headers = [
        "scheme",
        "source",
        "packs",
        "samples",
        "bin fill",
        "samples/s",
        "vs A",
        "steady/s",
        "vs A",
        "first pack s",
        "open s",
        "CPU ms/sample",
        "vs A",
        "worker RSS max MB",
        "vs A",
        "worker RSS sum MB",
        "vs A",
        "worker HWM MB",
        "worker USS MB",
        "vs A",
        "all procs MB",
    ]
    rows = [
        [
            s.scheme,
            SOURCES[s.scheme],
            s.packs,
            s.samples,
            s.bin_fill,
            f"{s.samples_per_s:.1f}",
            ratio_cell(s.samples_vs_a),
            f"{s.steady_samples_per_s:.1f}",
            ratio_cell(s.steady_vs_a),
            f"{s.first_pack_s:.2f}",
            f"{s.open_s:.2f}",
            f"{s.cpu_ms_per_sample:.1f}",
            ratio_cell(s.cpu_vs_a),
            mib_cell(s.worker_rss_max_mb),
            ratio_cell(s.rss_max_vs_a),
            mib_cell(s.worker_rss_sum_mb),
            ratio_cell(s.rss_sum_vs_a),
            mib_cell(s.worker_hwm_max_mb),
            mib_cell(s.worker_uss_max_mb),
            ratio_cell(s.uss_vs_a),
            mib_cell(s.all_procs_rss_mb),
        ]
        for s in summaries
    ]
    return format_table(headers, rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of A, B, C (default 3)")
    parser.add_argument("--work", type=Path, help="folder for the rows and plans (default: temp)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"default {RESULTS.name}")
    parser.add_argument("--run", nargs=3, help=argparse.SUPPRESS)  # internal: one child run
    args = parser.parse_args(argv)
    if args.run:
        scheme, plan_dir, out = args.run
        result = run_once(scheme, None if plan_dir == "-" else Path(plan_dir))
        Path(out).write_text(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        built = time.perf_counter()
        plans = build_plans(work)
        build_s = time.perf_counter() - built
        started = time.perf_counter()
        runs = []
        for index in range(args.rounds):
            for scheme in SCHEMES:
                run = {"round": index, **measure(scheme, plans.get(scheme))}
                runs.append(run)
                print(
                    f"round {index} {scheme:>9}: {run['samples']} samples, "
                    f"{run['samples_per_s']:.1f} samples/s, worker RSS max "
                    f"{run['worker_rss_max_mb']:.0f} MB, sum {run['worker_rss_sum_mb']:.0f} MB, "
                    f"load {run['load_avg_1min']:.1f}",
                    file=sys.stderr,
                )
    summaries = summarize(runs)
    print(
        f"{NUM_WORKERS} workers, seq_length {SEQ_LENGTH}, align {ALIGN}, online buffer {BUFFER}, "
        f"{args.rounds} round(s), {time.perf_counter() - started:.0f} s (plans built in "
        f"{build_s:.0f} s, not timed); medians over rounds"
    )
    print(table(summaries))
    targets = check_targets(summaries)
    print("\n".join(targets))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "settings": {
            "dataset": str(DATASET.relative_to(ROOT)),
            "encoder": "make_encoder(None)",
            "layout": LAYOUT.fingerprint(),
            "packing_buffer_size": BUFFER,
            "num_workers": NUM_WORKERS,
            "rounds": args.rounds,
            "poll_seconds": POLL_SECONDS,
            "uss_every": USS_EVERY,
            "torch_threads": 1,
            "cpu_count": os.cpu_count(),
            "plan_build_s": build_s,
        },
        "summary": [asdict(s) for s in summaries],
        "targets": targets,
        "runs": runs,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
