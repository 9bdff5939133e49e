"""Real Energon loaders on fixtures/vlm_demo: this encoder against a Bridge-style baseline.

Every run is a full ``get_train_dataset`` + ``get_savable_loader`` with two forked workers
(``WorkerConfig(rank=0, world_size=1, num_workers=2)``), ``repeat=True`` and no shuffle buffer,
and reads the same number of samples (``--samples``, default 600: two epochs of the fixture).
Media use the default :class:`~energon_pack.media.MediaConfig` (real Qwen2-VL sizes: a 1280x720
image becomes ~22 MB of fp32 patches). Rows are ``SEQ_LENGTH`` = 8192 tokens, segments aligned to
``pad_seq_to_mult(tp=4, cp=2, sp=True)`` = 8. Schemes, for each packing buffer size:

  lazy    this project's ``PackingTaskEncoder``: text tokenised and media *probed* before the
          buffer, the carry-over online packer, media decoded only for the samples of a chosen
          pack.
  bridge  what Megatron-Bridge's Qwen-VL encoder does, on Energon's own ``PackingDataset``: a
          ``DefaultTaskEncoder`` whose ``encode_sample`` encodes *and decodes* every sample before
          the buffer (each buffered candidate holds its patch tensors), ``select_samples_to_pack``
          = first-fit decreasing over the full window returning every group, and
          ``pack_selected_samples`` = the same row builder as ``lazy`` (``pack_samples``), so
          both emit identical batch types.
  none    the ``lazy`` pipeline with ``packing_buffer_size=1`` (every sample alone in its row):
          the throughput reference.

Measured per run, in a fresh subprocess so that every loader forks its workers from an identical
parent, over the batches the main process received:

  bin fill           real tokens / (packs * SEQ_LENGTH); token efficiency: real / aligned tokens
  samples/s          steady wall-clock rate after the first pack; "vs none": ratio to the
                     no-packing run of the same round
  CPU ms/sample      user + system CPU of the workers (read at the last batch) per sample;
                     "CPU vs none": no-packing's figure over this one (higher is better). Robust
                     to other load on the machine, unlike wall clock.
  first pack s       ``iter(loader)`` to the first batch (includes forking the workers)
  max pack media MB  largest ``pixel_values`` + ``pixel_values_videos`` of one batch
  worker RSS / USS   peaks polled from the main process with ``psutil`` every 50 ms (USS via
                     ``memory_full_info`` every 10th poll: reading smaps costs milliseconds),
                     max over workers; worker HWM: the kernel's exact peak RSS (``VmHWM``, Linux),
                     used for the memory target where available; main RSS: polled peak

Caveats: runs stop at the first pack that reaches ``--samples``, so decoded-but-undelivered
samples at the end (up to a window per worker for bridge, about one pack for lazy) cost CPU that
no delivered sample accounts for, and bridge's first window is decoded before its first pack;
both bias the bridge figures at large buffers (samples/s up, CPU per sample up). The machine may
be shared, so every configuration runs ``--rounds`` times, alternating forward and reverse order;
timings are medians over rounds, ratios are taken within a round, memory peaks are maxima.

Targets: bin fill >= 0.99 at buffer 16 (lazy); lazy throughput >= 0.95x of no packing at buffer
16; lazy peak worker RSS at buffer 64 below the bridge peak at buffer 8.
Prints a table and writes benchmarks/results/energon_loader.json (``--quick``:
energon_loader_quick.json).

``--long-context``: rows of 16384 tokens (``--seq-length``) on a high-resolution mix written once
into benchmarks/results/longctx_dataset (a third of the samples hold one photo-like JPEG of
~10k tokens, the rest are text; ``MediaConfig(max_pixels=28*28*10240)``), so one decoded pack
holds up to ~190 MB of float32 pixels. Runs lazy (float32 pixels) and lazy-uint8
(``pixel_dtype="uint8"``) at buffer 64 against bridge at buffer 8; target: lazy-uint8's peak
worker RSS below bridge's. Writes energon_loader_longctx.json.

Usage:
    .venv/bin/python benchmarks/energon_loader.py           # buffers 4-64, 600 samples, 2 rounds
    .venv/bin/python benchmarks/energon_loader.py --quick   # buffers 8, 64; 300 samples, 1 round
    .venv/bin/python benchmarks/energon_loader.py --dataset DIR/vlm_demo --samples N   # bigger,
        e.g. made by: .venv/bin/python fixtures/make_fixtures.py --out DIR --samples 2000
    .venv/bin/python benchmarks/energon_loader.py --long-context   # 48 samples, 1 round
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
from common import mib_cell, ratio_cell, vm_hwm
from megatron.energon import (
    Cooker,
    DefaultTaskEncoder,
    WorkerConfig,
    get_savable_loader,
    get_train_dataset,
    stateless,
)

from energon_pack.cli.tables import format_table
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.energon import PackedBatch, PackingTaskEncoder
from energon_pack.energon.task_encoder import (
    ConversationSample,
    PreparedSample,
    cook_conversation,
)
from energon_pack.media import MediaConfig, PixelDtype
from energon_pack.packing.bins import first_fit_decreasing
from energon_pack.packing.topology import pad_seq_to_mult

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT / "fixtures" / "vlm_demo"
RESULTS = ROOT / "benchmarks" / "results" / "energon_loader.json"
QUICK_RESULTS = RESULTS.with_name("energon_loader_quick.json")
LONG_RESULTS = RESULTS.with_name("energon_loader_longctx.json")
LONG_DATASET = RESULTS.with_name("longctx_dataset")
SEQ_LENGTH = 8192
LONG_SEQ_LENGTH = 16384
LONG_MEDIA = MediaConfig(max_pixels=28 * 28 * 10240)
LONG_IMAGE_SIZES = ((3584, 2240), (3200, 2400), (2800, 2800), (2240, 3584), (3840, 2160))
LONG_SAMPLES = 96
ALIGN = pad_seq_to_mult(tp=4, cp=2, sp=True)
NUM_WORKERS = 2
BUFFER_SIZES = (4, 8, 16, 32, 64)
QUICK_BUFFER_SIZES = (8, 64)
POLL_SECONDS = 0.05
USS_EVERY = 10
RUN_TIMEOUT_SECONDS = 600
MB = 1 << 20

LAZY, LAZY_UINT8, BRIDGE, NONE = "lazy", "lazy-uint8", "bridge", "none"
MIN_FILL = 0.99
FILL_BUFFER = 16
MIN_THROUGHPUT_RATIO = 0.95
THROUGHPUT_BUFFER = 16
MEMORY_BUFFERS = (64, 8)  # lazy at 64 must stay below bridge at 8
LONG_PLAN = ((LAZY, 64), (LAZY_UINT8, 64), (BRIDGE, 8))


class BridgeStyleTaskEncoder(DefaultTaskEncoder):  # type: ignore[misc]
    """Eager encoding + window first-fit decreasing on Energon's ``PackingDataset``."""

    cookers = (Cooker(cook_conversation),)
    decoder = None

    def __init__(self, *, seq_length: int, pad_to_multiple_of: int, media: MediaConfig) -> None:
        super().__init__()
        self.media = media
        self.encoder = ConversationEncoder(media=media)
        self.seq_length = seq_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.rows = PackingTaskEncoder(
            seq_length=seq_length, pad_to_multiple_of=pad_to_multiple_of, media=media
        )

    @stateless  # type: ignore[untyped-decorator]
    def encode_sample(self, sample: ConversationSample) -> PreparedSample:
        """Tokenise and decode + patchify the media now, before the packing buffer."""
        encoded = self.encoder.encode_sample(sample.__key__, sample.members)
        prepared: PreparedSample = PreparedSample.derive_from(
            sample, encoded=encoded.materialize(self.media)
        )
        return prepared

    def select_samples_to_pack(self, samples: list[PreparedSample]) -> list[list[PreparedSample]]:
        """First-fit decreasing over the whole window; every group leaves (none carried over)."""
        lengths = [sample.encoded.length for sample in samples]
        groups = first_fit_decreasing(lengths, self.seq_length, align=self.pad_to_multiple_of)
        return [[samples[index] for index in sorted(group)] for group in groups]

    @stateless  # type: ignore[untyped-decorator]
    def pack_selected_samples(self, samples: list[PreparedSample]) -> PackedBatch:
        """The THD row (media already decoded, so ``pack_samples`` does not decode again)."""
        return self.rows.pack_selected_samples(samples)

    @stateless  # type: ignore[untyped-decorator]
    def batch(self, samples: list[PackedBatch]) -> PackedBatch:
        """Micro-batch 1: the pack itself, as ``PackingTaskEncoder`` emits it."""
        (pack,) = samples
        return pack


def make_encoder(scheme: str, media: MediaConfig, seq_length: int) -> Any:
    """The task encoder of ``scheme`` (``none`` is ``lazy`` run with a buffer of 1)."""
    if scheme == BRIDGE:
        return BridgeStyleTaskEncoder(seq_length=seq_length, pad_to_multiple_of=ALIGN, media=media)
    pixel_dtype: PixelDtype = "uint8" if scheme == LAZY_UINT8 else "float32"
    media = replace(media, pixel_dtype=pixel_dtype)
    return PackingTaskEncoder(seq_length=seq_length, pad_to_multiple_of=ALIGN, media=media)


def long_context_sample(make: Any, index: int) -> list[tuple[str, bytes]]:
    """Every third sample: one high-resolution JPEG (~10k tokens) and a question; else text."""
    rng = make.np.random.default_rng([make.SEED, 7, index])
    key = f"long{index:05d}"
    question = make.words(rng, 12, 0.5, 60)
    members = []
    if index % 3 != 0:
        answer = make.words(rng, 250, 0.9, 1500)  # text: up to ~9k tokens
    else:
        answer = make.words(rng, 80, 0.6, 400)
        width, height = LONG_IMAGE_SIZES[int(rng.integers(len(LONG_IMAGE_SIZES)))]
        image = make.synthetic_image(rng, width, height, "RGB")
        members.append((f"{key}.0.jpg", make.encode_image(image, "jpg")))
        question = "<image>\n" + question
    conversations = [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
    members.append((f"{key}.json", json.dumps({"conversations": conversations}).encode()))
    return members


def long_context_dataset(samples: int = LONG_SAMPLES) -> Path:
    """The high-resolution mix (written and indexed once, then reused)."""
    if (LONG_DATASET / ".nv-meta" / "dataset.yaml").is_file():
        return LONG_DATASET
    script = ROOT / "fixtures" / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("make_fixtures", script)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {script}")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    LONG_DATASET.mkdir(parents=True, exist_ok=True)
    shards = []
    for shard in range(2):
        members = []
        for index in range(shard, samples, 2):
            members += long_context_sample(make, index)
        path = LONG_DATASET / f"shard-{shard:06d}.tar"
        make.write_tar(path, members)
        shards.append(path)
    make.prepare_energon(LONG_DATASET, shards)
    return LONG_DATASET


class MemoryPoller:
    """Background thread: peak RSS of this process and peak RSS / USS over its children."""

    def __init__(self, interval: float = POLL_SECONDS, uss_every: int = USS_EVERY) -> None:
        self.interval = interval
        self.uss_every = uss_every
        self.main_rss = 0
        self.worker_rss = 0
        self.worker_uss: int | None = None
        self.workers: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> MemoryPoller:
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
        me = psutil.Process()
        tick = 0
        while True:
            self.main_rss = max(self.main_rss, me.memory_info().rss)
            for child in me.children(recursive=True):
                try:
                    if tick % self.uss_every == 0:
                        full = child.memory_full_info()
                        rss, uss = full.rss, getattr(full, "uss", None)
                    else:
                        rss, uss = child.memory_info().rss, None
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                self.workers.setdefault(child.pid, child)
                self.worker_rss = max(self.worker_rss, rss)
                if uss is not None:
                    self.worker_uss = max(self.worker_uss or 0, uss)
            tick += 1
            if self._stop.wait(self.interval):
                return

    def worker_cpu_seconds(self) -> float:
        """User + system CPU time the workers seen so far have used (those still alive)."""
        total = 0.0
        for worker in list(self.workers.values()):
            try:
                times = worker.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def worker_high_water_mark(self) -> int | None:
        """Max over live workers of the kernel's peak RSS (``VmHWM``), or None off Linux."""
        peaks = [peak for pid in list(self.workers) if (peak := vm_hwm(pid)) is not None]
        return max(peaks) if peaks else None


def run_once(
    scheme: str, buffer: int, samples: int, dataset_path: Path, seq_length: int, media: MediaConfig
) -> dict[str, Any]:
    """One loader run in this process (called in a fresh subprocess by :func:`measure`)."""
    dataset = get_train_dataset(
        dataset_path,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=NUM_WORKERS),
        batch_size=1,
        packing_buffer_size=buffer,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=make_encoder(scheme, media, seq_length),
        repeat=True,
    )
    loader = get_savable_loader(dataset)
    load_avg = os.getloadavg()[0]
    packs = seen = real = aligned = first_samples = max_media = 0
    with MemoryPoller() as memory:
        start = time.perf_counter()
        first = last = start
        for batch in loader:
            last = time.perf_counter()
            packs += 1
            seen += len(batch.__keys__)
            real += int(batch.cu_seqlens[-1])
            aligned += int(batch.cu_seqlens_padded[-1])
            pixels = (batch.pixel_values, batch.pixel_values_videos)
            max_media = max(max_media, sum(t.nbytes for t in pixels if t is not None))
            if packs == 1:
                first, first_samples = last, seen
            del batch
            if seen >= samples:
                break
        cpu = memory.worker_cpu_seconds()
        high_water_mark = memory.worker_high_water_mark()
    steady = seen - first_samples
    return {
        "scheme": scheme,
        "buffer": buffer,
        "packs": packs,
        "samples": seen,
        "real_tokens": real,
        "aligned_tokens": aligned,
        "bin_fill": real / (packs * seq_length),
        "token_efficiency": real / aligned,
        "samples_per_s": steady / (last - first) if steady else 0.0,
        "first_pack_s": first - start,
        "wall_s": last - start,
        "max_pack_media_mb": max_media / MB,
        "worker_rss_mb": memory.worker_rss / MB,
        "worker_uss_mb": None if memory.worker_uss is None else memory.worker_uss / MB,
        "worker_hwm_mb": None if high_water_mark is None else high_water_mark / MB,
        "main_rss_mb": memory.main_rss / MB,
        "worker_cpu_ms_per_sample": 1000 * cpu / seen,
        "workers": len(memory.workers),
        "load_avg_1min": load_avg,
    }


def measure(
    scheme: str, buffer: int, samples: int, dataset_path: Path, seq_length: int, long: bool
) -> dict[str, Any]:
    """:func:`run_once` in a fresh interpreter (clean parent for the forked workers)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        command = [sys.executable, __file__, "--dataset", str(dataset_path)]
        command += ["--seq-length", str(seq_length)] + (["--long-context"] if long else [])
        command += ["--run", scheme, str(buffer), str(samples), str(out)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS)
        if proc.returncode != 0:
            raise RuntimeError(f"{scheme} buffer={buffer} failed:\n{proc.stderr[-4000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        return result


@dataclass(frozen=True)
class Summary:
    """One (scheme, buffer) row: fill is deterministic, timings are medians, memory maxima."""

    scheme: str
    buffer: int
    packs: int
    samples: int
    bin_fill: float
    token_efficiency: float
    samples_per_s: float
    vs_none: float | None
    worker_cpu_ms_per_sample: float
    cpu_vs_none: float | None
    first_pack_s: float
    max_pack_media_mb: float
    worker_rss_mb: float
    worker_uss_mb: float | None
    worker_hwm_mb: float | None
    main_rss_mb: float

    @property
    def worker_peak_mb(self) -> float:
        """The kernel's exact peak RSS where available, else the polled one."""
        return self.worker_rss_mb if self.worker_hwm_mb is None else self.worker_hwm_mb


def versus_none(
    mine: list[dict[str, Any]], reference: dict[int, dict[str, Any]], field: str, inverse: bool
) -> float | None:
    """Median per-round ratio of ``field`` to the no-packing run (None without one)."""
    if not all(run["round"] in reference for run in mine):
        return None
    ratios = [float(run[field] / reference[run["round"]][field]) for run in mine]
    return statistics.median(1 / r if inverse else r for r in ratios)


def summarize(runs: list[dict[str, Any]]) -> list[Summary]:
    """Combine the rounds; ``*vs_none`` are medians of per-round ratios to the no-packing run
    (``cpu_vs_none``: its worker CPU per sample over ours, so higher is better for both)."""
    reference = {run["round"]: run for run in runs if run["scheme"] == NONE}
    keys = list(dict.fromkeys((run["scheme"], run["buffer"]) for run in runs))
    summaries = []
    for scheme, buffer in keys:
        mine = [run for run in runs if (run["scheme"], run["buffer"]) == (scheme, buffer)]
        uss = [run["worker_uss_mb"] for run in mine if run["worker_uss_mb"] is not None]
        hwm = [run["worker_hwm_mb"] for run in mine if run["worker_hwm_mb"] is not None]
        summaries.append(
            Summary(
                scheme=scheme,
                buffer=buffer,
                packs=mine[0]["packs"],
                samples=mine[0]["samples"],
                bin_fill=mine[0]["bin_fill"],
                token_efficiency=mine[0]["token_efficiency"],
                samples_per_s=statistics.median(run["samples_per_s"] for run in mine),
                vs_none=versus_none(mine, reference, "samples_per_s", inverse=False),
                worker_cpu_ms_per_sample=statistics.median(
                    run["worker_cpu_ms_per_sample"] for run in mine
                ),
                cpu_vs_none=versus_none(mine, reference, "worker_cpu_ms_per_sample", inverse=True),
                first_pack_s=statistics.median(run["first_pack_s"] for run in mine),
                max_pack_media_mb=max(run["max_pack_media_mb"] for run in mine),
                worker_rss_mb=max(run["worker_rss_mb"] for run in mine),
                worker_uss_mb=max(uss) if uss else None,
                worker_hwm_mb=max(hwm) if hwm else None,
                main_rss_mb=max(run["main_rss_mb"] for run in mine),
            )
        )
    return summaries


def check_targets(summaries: Sequence[Summary]) -> list[str]:
    """PASS/FAIL lines for the targets whose configurations were measured."""
    by_key = {(s.scheme, s.buffer): s for s in summaries}
    lines = []
    if fill := by_key.get((LAZY, FILL_BUFFER)):
        ok = fill.bin_fill >= MIN_FILL
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: lazy bin fill at buffer {FILL_BUFFER} = "
            f"{fill.bin_fill:.4f} (target >= {MIN_FILL})"
        )
    speed = by_key.get((LAZY, THROUGHPUT_BUFFER))
    if speed and speed.vs_none is not None and speed.cpu_vs_none is not None:
        ok = speed.vs_none >= MIN_THROUGHPUT_RATIO
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: lazy throughput at buffer {THROUGHPUT_BUFFER} = "
            f"{speed.vs_none:.3f}x no packing by wall clock (target >= {MIN_THROUGHPUT_RATIO}); "
            f"{speed.cpu_vs_none:.3f}x by worker CPU per sample"
        )
    lazy_buffer, bridge_buffer = MEMORY_BUFFERS
    bridge = by_key.get((BRIDGE, bridge_buffer))
    for scheme in (LAZY, LAZY_UINT8):
        lazy = by_key.get((scheme, lazy_buffer))
        if not (lazy and bridge):
            continue
        ok = lazy.worker_peak_mb < bridge.worker_peak_mb
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: {scheme} peak worker RSS at buffer {lazy_buffer} = "
            f"{lazy.worker_peak_mb:.0f} MB vs bridge at buffer {bridge_buffer} = "
            f"{bridge.worker_peak_mb:.0f} MB (target: below); polled RSS "
            f"{lazy.worker_rss_mb:.0f} vs {bridge.worker_rss_mb:.0f} MB, polled USS "
            f"{mib_cell(lazy.worker_uss_mb)} vs {mib_cell(bridge.worker_uss_mb)} MB"
        )
    return lines


def plan(buffers: Sequence[int], rounds: int, long: bool) -> list[tuple[int, str, int]]:
    """(round, scheme, buffer) in run order: forward in even rounds, reversed in odd ones."""
    order = [(NONE, 1)] + [(scheme, b) for b in buffers for scheme in (LAZY, BRIDGE)]
    if long:
        order = list(LONG_PLAN)
    runs = []
    for index in range(rounds):
        runs += [(index, s, b) for s, b in (order if index % 2 == 0 else order[::-1])]
    return runs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="buffers 8 and 64, fewer samples")
    parser.add_argument("--samples", type=int, help="samples per run (default 600, quick 300)")
    parser.add_argument("--rounds", type=int, help="repeats of every run (default 2, quick 1)")
    parser.add_argument("--dataset", type=Path, help="prepared Energon dataset (default: fixture)")
    parser.add_argument("--seq-length", type=int, help="row length (default 8192, long 16384)")
    parser.add_argument(
        "--long-context", action="store_true", help="high-resolution mix, lazy/uint8 vs bridge"
    )
    parser.add_argument("--out", type=Path, help=f"JSON report (default {RESULTS.name})")
    parser.add_argument("--run", nargs=4, help=argparse.SUPPRESS)  # internal: one subprocess run
    args = parser.parse_args(argv)
    long = args.long_context
    seq_length = args.seq_length or (LONG_SEQ_LENGTH if long else SEQ_LENGTH)
    media = LONG_MEDIA if long else MediaConfig()
    if args.run:
        scheme, buffer, samples, out = args.run
        result = run_once(scheme, int(buffer), int(samples), args.dataset, seq_length, media)
        Path(out).write_text(json.dumps(result))
        return
    dataset = args.dataset or (long_context_dataset() if long else DATASET)
    buffers = QUICK_BUFFER_SIZES if args.quick else BUFFER_SIZES
    samples = args.samples or (48 if long else 300 if args.quick else 600)
    rounds = args.rounds or (1 if args.quick or long else 2)
    runs = []
    started = time.perf_counter()
    for index, scheme, buffer in plan(buffers, rounds, long):
        run = {"round": index, **measure(scheme, buffer, samples, dataset, seq_length, long)}
        runs.append(run)
        print(
            f"round {index} {scheme:>6} buffer {buffer:>2}: {run['samples_per_s']:.1f} samples/s, "
            f"worker RSS {run['worker_rss_mb']:.0f} MB, load {run['load_avg_1min']:.1f}",
            file=sys.stderr,
        )
    summaries = summarize(runs)
    headers = [
        "scheme",
        "buffer",
        "packs",
        "samples",
        "bin fill",
        "token eff",
        "samples/s",
        "vs none",
        "CPU ms/sample",
        "CPU vs none",
        "first pack s",
        "max pack media MB",
        "worker RSS MB",
        "worker USS MB",
        "worker HWM MB",
        "main RSS MB",
    ]
    rows = [
        [
            s.scheme,
            s.buffer,
            s.packs,
            s.samples,
            s.bin_fill,
            s.token_efficiency,
            f"{s.samples_per_s:.1f}",
            ratio_cell(s.vs_none),
            f"{s.worker_cpu_ms_per_sample:.1f}",
            ratio_cell(s.cpu_vs_none),
            f"{s.first_pack_s:.2f}",
            f"{s.max_pack_media_mb:.0f}",
            mib_cell(s.worker_rss_mb),
            mib_cell(s.worker_uss_mb),
            mib_cell(s.worker_hwm_mb),
            mib_cell(s.main_rss_mb),
        ]
        for s in summaries
    ]
    print(
        f"{samples} samples per run, {NUM_WORKERS} workers, seq_length {seq_length}, "
        f"align {ALIGN}, {rounds} round(s), {time.perf_counter() - started:.0f} s"
    )
    print(format_table(headers, rows))
    targets = check_targets(summaries)
    print("\n".join(targets))
    out = args.out or (LONG_RESULTS if long else QUICK_RESULTS if args.quick else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "settings": {
            "dataset": str(dataset),
            "media": str(media),
            "samples_per_run": samples,
            "rounds": rounds,
            "num_workers": NUM_WORKERS,
            "seq_length": seq_length,
            "pad_to_multiple_of": ALIGN,
            "poll_seconds": POLL_SECONDS,
            "cpu_count": os.cpu_count(),
        },
        "summary": [asdict(s) for s in summaries],
        "targets": targets,
        "runs": runs,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
