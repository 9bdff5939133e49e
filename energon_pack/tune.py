"""``energon-pack tune``: measure packing and worker memory per buffer size on real data.

For each buffer size (and decode mode) the dataset streams through the real Energon loader with
real workers and a :class:`~energon_pack.memory.RSSMonitor` in each worker. A run records bin
fill, token efficiency, first-pack latency, throughput and worker RSS; :func:`recommend` picks
the largest buffer whose projected memory fits a budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from energon_pack.media import MediaConfig, PixelDtype
from energon_pack.memory import MB, MonitorConfig, load_report, summarize

Decode = Literal["lazy", "eager"]


@dataclass(frozen=True)
class TuneSettings:
    """What every run of a tune shares."""

    dataset: str
    seq_length: int = 8192
    pad_to_multiple_of: int = 1
    num_workers: int = 2
    max_samples: int | None = None
    """Stop each run after this many source samples (None: one epoch)."""
    pixel_dtype: PixelDtype = "float32"
    """Dtype of the batches' pixels (``MediaConfig.pixel_dtype``)."""


@dataclass(frozen=True)
class TuneResult:
    """Measurements of one run."""

    buffer_size: int
    decode: Decode
    samples: int
    packs: int
    bin_fill: float
    token_efficiency: float
    first_pack_seconds: float
    packs_per_second: float
    samples_per_second: float
    peak_worker_rss_mb: float
    steady_worker_rss_mb: float
    peak_buffer_mb: float
    interrupted: bool = False


def default_dataset() -> Path:
    """The shipped ``fixtures/vlm_demo`` next to the package (a source checkout)."""
    return Path(__file__).resolve().parents[1] / "fixtures" / "vlm_demo"


def run_once(
    settings: TuneSettings,
    buffer_size: int,
    decode: Decode,
    report_dir: Path,
    on_samples: Callable[[int], object] = lambda count: None,
) -> TuneResult:
    """Stream the dataset once with this buffer size; Ctrl-C ends the run early (marked)."""
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from energon_pack.energon import PackingTaskEncoder

    encoder = PackingTaskEncoder(
        seq_length=settings.seq_length,
        pad_to_multiple_of=settings.pad_to_multiple_of,
        media=MediaConfig(pixel_dtype=settings.pixel_dtype),
        decode=decode,
        monitor=MonitorConfig(report_dir=str(report_dir), every_samples=4, every_seconds=0.25),
    )
    dataset = get_train_dataset(
        settings.dataset,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=settings.num_workers),
        batch_size=1,
        packing_buffer_size=buffer_size,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=settings.max_samples is not None,
    )
    samples = packs = used = real = 0
    interrupted = False
    start = time.perf_counter()
    first_pack = steady_start = 0.0
    try:
        for batch in get_savable_loader(dataset):
            if packs == 0:
                first_pack = steady_start = time.perf_counter() - start
            packs += 1
            samples += len(batch.__keys__)
            used += int(batch.cu_seqlens_padded[-1])
            real += int(batch.cu_seqlens[-1])
            on_samples(len(batch.__keys__))
            if settings.max_samples is not None and samples >= settings.max_samples:
                break
    except KeyboardInterrupt:
        interrupted = True
    elapsed = time.perf_counter() - start - steady_start
    workers = summarize(load_report(report_dir)) if packs else []
    return TuneResult(
        buffer_size=buffer_size,
        decode=decode,
        samples=samples,
        packs=packs,
        bin_fill=used / (packs * settings.seq_length) if packs else 0.0,
        token_efficiency=real / used if used else 0.0,
        first_pack_seconds=first_pack,
        packs_per_second=(packs - 1) / elapsed if packs > 1 and elapsed > 0 else 0.0,
        samples_per_second=samples / elapsed if packs > 1 and elapsed > 0 else 0.0,
        peak_worker_rss_mb=max((w.peak_rss for w in workers), default=0) / MB,
        steady_worker_rss_mb=max((w.steady_rss for w in workers), default=0) / MB,
        peak_buffer_mb=max((w.peak_buffer_bytes for w in workers), default=0) / MB,
        interrupted=interrupted,
    )


TUNE_HEADERS = [
    "decode",
    "buffer",
    "samples",
    "bin fill",
    "token eff",
    "first pack s",
    "samples/s",
    "peak RSS MiB",
    "steady MiB",
    "buffer MiB",
]


def tune_row(result: TuneResult) -> list[object]:
    """One table row (see :data:`TUNE_HEADERS`)."""
    return [
        result.decode,
        result.buffer_size,
        result.samples,
        result.bin_fill,
        result.token_efficiency,
        f"{result.first_pack_seconds:.2f}",
        f"{result.samples_per_second:.1f}",
        f"{result.peak_worker_rss_mb:.0f}",
        f"{result.steady_worker_rss_mb:.0f}",
        f"{result.peak_buffer_mb:.1f}",
    ]


def projected_rss_mb(result: TuneResult, num_workers: int) -> float:
    """Worker memory of a training run: ``num_workers`` workers at this run's peak RSS."""
    return result.peak_worker_rss_mb * max(1, num_workers)


def recommend(
    results: Sequence[TuneResult], *, num_workers: int, rss_budget_mb: float
) -> TuneResult | None:
    """The largest-buffer lazy run (else any) whose projected worker RSS fits the budget."""
    fitting = [
        r
        for r in results
        if not r.interrupted and projected_rss_mb(r, num_workers) <= rss_budget_mb
    ]
    if not fitting:
        return None
    return max(fitting, key=lambda r: (r.decode == "lazy", r.buffer_size, r.bin_fill))


def plot_results(results: Sequence[TuneResult], out_dir: Path) -> list[Path]:
    """``bin_fill.png`` and ``rss.png``: one line per decode mode over buffer size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charts: list[tuple[str, Callable[[TuneResult], float], str]] = [
        ("bin_fill", lambda r: r.bin_fill, "bin fill"),
        ("rss", lambda r: r.peak_worker_rss_mb, "peak worker RSS (MiB)"),
    ]
    written = []
    for name, value, label in charts:
        figure, axis = plt.subplots(figsize=(6, 4))
        for decode in ("lazy", "eager"):
            own = sorted((r for r in results if r.decode == decode), key=lambda r: r.buffer_size)
            if own:
                axis.plot([r.buffer_size for r in own], [value(r) for r in own], "o-", label=decode)
        axis.set_xscale("log", base=2)
        sizes = sorted({r.buffer_size for r in results})
        axis.set_xticks(sizes, labels=[str(size) for size in sizes])
        axis.set_xlabel("packing_buffer_size")
        axis.set_ylabel(label)
        axis.legend()
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written
