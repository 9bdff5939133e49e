"""``tune`` on a plan: the plan's packs through a torch DataLoader (its workers, each with an RSS
monitor) as training reads them, measured as :func:`~energon_pack.tune.run_once` measures the
online loader: samples/s, first-pack latency and worker memory. The packs are the plan's, so
there is no buffer to choose; the run shows what training from the plan costs with these
workers, next to an online run of the same data."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from energon_pack.encoding.family import model_family
from energon_pack.memory.monitor import MB, MonitorConfig
from energon_pack.plan.dataset import PlannedDataset
from energon_pack.plan.sampler import PlanSampler
from energon_pack.tune.runs import (
    TIMED_PACKS,
    TuneError,
    TuneResult,
    TuneSettings,
    run_error,
    start_workers_whole,
    wind_up,
)
from energon_pack.tune.tokenizers import encoder_of


def is_plan(path: Path) -> bool:
    """``path`` is a plan's directory (it holds ``plan.json``)."""
    from energon_pack.plan.store import PLAN_FILE

    return (path / PLAN_FILE).is_file()


def run_plan(
    settings: TuneSettings, report_dir: Path, on_pack: Callable[[], object] = lambda: None
) -> TuneResult:
    """Read the plan in ``settings.dataset`` pack by pack, in rank 0's order at one rank
    (every pack), with ``settings.num_workers`` workers, until ``settings.min_packs`` packs
    (the epoch repeats), ``settings.max_samples`` samples or, with ``settings.one_epoch``, the
    epoch's end. The encoder is the flags' (:func:`~energon_pack.tune.tokenizers.encoder_of`);
    one other than the plan's is refused by name. Ctrl-C ends the run early (marked).

    Raises :class:`TuneError` (one line) when the run stops on an error.
    """
    family = model_family(settings.family) if settings.family else None
    encoder = encoder_of(settings.tokenizer, settings.chat_template, family)
    monitor = MonitorConfig(report_dir=str(report_dir), every_samples=4, every_seconds=0.25)
    dataset = PlannedDataset(settings.dataset, encoder, family=family, monitor=monitor)
    seq_length = dataset.collator.layout.seq_length
    samples = packs = used = real = skipped = 0
    interrupted = False
    first_pack = wall = 0.0
    loader: Any = None
    failure: TuneError | None = None
    start = time.perf_counter()
    try:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=_Epochs(PlanSampler(dataset), repeat=not settings.one_epoch),
            collate_fn=PlannedDataset.collate_fn,
            num_workers=settings.num_workers,
            persistent_workers=settings.num_workers > 0,
        )
        start_workers_whole(loader)
        for row in loader:
            wall = time.perf_counter() - start
            if packs == 0:
                first_pack = wall
            packs += 1
            samples += len(row.keys[0])
            skipped += len(row.skipped_keys)
            used += int(row.cu_seqlens_padded[0][-1])
            real += int(row.cu_seqlens[0][-1])
            on_pack()
            if settings.enough(samples, packs):
                break
    except KeyboardInterrupt:
        interrupted = True
    except Exception as error:
        failure = run_error(f"plan {settings.dataset}", error)
    workers, came = wind_up(loader, failure, report_dir, packs)
    timed = packs >= TIMED_PACKS and wall > 0
    return TuneResult(
        buffer_size=0,
        decode="lazy",
        samples=samples,
        packs=packs,
        bin_fill=used / (packs * seq_length) if packs else 0.0,
        token_efficiency=real / used if used else 0.0,
        first_pack_seconds=first_pack,
        packs_per_second=packs / wall if timed else None,
        samples_per_second=samples / wall if timed else None,
        peak_worker_rss_mb=max((w.peak_rss for w in workers), default=0) / MB,
        steady_worker_rss_mb=max((w.steady_rss for w in workers), default=0) / MB,
        peak_decoder_rss_mb=max((w.peak_decoder_rss or 0 for w in workers), default=0) / MB,
        skipped={"member": skipped} if skipped else {},
        interrupted=interrupted or came,
    )


class _Epochs:
    """The micro-batches of ``sampler``'s epochs one after another: without end with
    ``repeat``, else its current epoch."""

    def __init__(self, sampler: PlanSampler, *, repeat: bool) -> None:
        self.sampler, self.repeat = sampler, repeat

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.sampler
        while self.repeat:
            yield from self.sampler
