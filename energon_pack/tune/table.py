"""What a ``tune`` prints and recommends: the table row of each run, the notes under the
table, and :func:`recommend`, the best-filling buffer whose projected memory fits a budget."""

from __future__ import annotations

from collections.abc import Sequence

from energon_pack.packing.underfilled import CAPPED_SHARE
from energon_pack.tune.runs import TIMED_PACKS, TuneResult, TuneSettings

TUNE_HEADERS = [
    "decode",
    "buffer",
    "vision cap",
    "samples",
    "packs",
    "bin fill",
    "confidence",
    "buffer full",
    "token eff",
    "first pack s",
    "samples/s",
    "pack µs",
    "peak RSS MiB",
    "steady MiB",
    "buffer MiB",
    "decoder MiB",
    "vision/pack",
    "vision max",
    "audio/pack",
    "skipped",
    "status",
]


PLAN_HEADERS = [
    "loader",
    "samples",
    "packs",
    "bin fill",
    "confidence",
    "token eff",
    "first pack s",
    "samples/s",
    "peak RSS MiB",
    "steady MiB",
    "decoder MiB",
    "skipped",
    "status",
]
"""The columns of ``tune`` on a plan: no buffer or vision cap to choose, the plan's packs."""


def plan_row(result: TuneResult, min_packs: int) -> list[object]:
    """The table row of a run over a plan (see :data:`PLAN_HEADERS`)."""
    rate = result.samples_per_second
    return [
        "plan",
        result.samples,
        result.packs,
        result.bin_fill,
        confidence_cell(result, min_packs),
        result.token_efficiency,
        f"{result.first_pack_seconds:.2f}",
        "-" if rate is None else f"{rate:.1f}",
        f"{result.peak_worker_rss_mb:.0f}",
        f"{result.steady_worker_rss_mb:.0f}",
        f"{result.peak_decoder_rss_mb:.0f}",
        skipped_cell(result),
        "interrupted" if result.interrupted else "ok",
    ]


def skipped_cell(result: TuneResult) -> str:
    """``overlong 3, corrupt 1`` (and any unaccounted samples), or ``0``."""
    parts = [f"{kind} {count}" for kind, count in result.skipped.items()]
    if result.unaccounted:
        parts.append(f"unaccounted {result.unaccounted}")
    return ", ".join(parts) or "0"


def confidence_cell(result: TuneResult, min_packs: int) -> str:
    """``ok`` for a run of at least ``min_packs`` packs, else ``low: 12 packs``."""
    return "ok" if result.packs >= min_packs else f"low: {result.packs} packs"


def tune_row(result: TuneResult, min_packs: int) -> list[object]:
    """One table row (see :data:`TUNE_HEADERS`); samples/s ``-`` where too few packs time it."""
    rate = result.samples_per_second
    return [
        result.decode,
        result.buffer_size,
        result.max_vision_tokens or "-",
        result.samples,
        result.packs,
        result.bin_fill,
        confidence_cell(result, min_packs),
        f"{result.buffer_full_share:.0%}",
        result.token_efficiency,
        f"{result.first_pack_seconds:.2f}",
        "-" if rate is None else f"{rate:.1f}",
        f"{result.pack_us_per_sample:.1f}",
        f"{result.peak_worker_rss_mb:.0f}",
        f"{result.steady_worker_rss_mb:.0f}",
        f"{result.peak_buffer_mb:.1f}",
        f"{result.peak_decoder_rss_mb:.0f}",
        f"{result.vision_tokens_mean:.0f}",
        result.vision_tokens_max,
        f"{result.audio_tokens_mean:.0f}",
        skipped_cell(result),
        "interrupted" if result.interrupted else "ok",
    ]


def run_name(result: TuneResult) -> str:
    """``lazy buffer 64`` (``, vision cap 600`` where the run has one)."""
    cap = result.max_vision_tokens
    return f"{result.decode} buffer {result.buffer_size}" + (
        "" if cap is None else f", vision cap {cap}"
    )


def measurement_note(settings: TuneSettings) -> str:
    """What each run's bin fill is measured over, for the line under the table."""
    if settings.one_epoch:
        return (
            "bin fill over one epoch per run (--one-epoch), its end-of-epoch flush included: on "
            "a dataset of few packs the flush's part-filled rows weigh in, and a training run "
            "of several epochs fills more"
        )
    end = f" or --max-samples {settings.max_samples}" if settings.max_samples else ""
    return (
        f"bin fill over the steady state: each run repeats the dataset until it has "
        f"{settings.min_packs} packs (--min-packs){end}, so no end-of-epoch flush is in it "
        "(a training run flushes once per epoch)"
    )


def too_few_packs_note(result: TuneResult, settings: TuneSettings) -> str | None:
    """A warning for a completed run of fewer than ``settings.min_packs`` packs, naming what
    ended it and the fix, else None."""
    if result.interrupted or result.packs >= settings.min_packs:
        return None
    if settings.max_samples is not None and result.samples >= settings.max_samples:
        cause = f"--max-samples {settings.max_samples} ended it; raise or drop it"
    else:
        cause = (
            "one epoch of this dataset makes no more, and its end-of-epoch flush weighs in; "
            "drop --one-epoch to repeat the dataset until the run has enough"
        )
    return (
        f"warning: {run_name(result)}: bin fill {result.bin_fill:.3f} rests on {result.packs} "
        f"packs, fewer than --min-packs {settings.min_packs}, so it is uncertain: {cause}"
    )


def untimed_note(results: Sequence[TuneResult]) -> str | None:
    """The line that explains a ``-`` in the samples/s column, where one is."""
    if all(r.samples_per_second is not None for r in results):
        return None
    return (
        f"samples/s '-': a run of fewer than {TIMED_PACKS} packs is too short to time (samples/s "
        "is over each run's wall time, its first pack's latency included)"
    )


STILL_RISING = 0.005
"""Bin fill gained from the second-largest buffer size to the largest above which tune suggests
trying larger sizes (:func:`still_rising_notes`), unless the largest fills
:data:`FULL_ENOUGH`."""
FULL_ENOUGH = 0.995


def still_rising_notes(results: Sequence[TuneResult]) -> list[str]:
    """One suggestion per decode mode (and vision cap) whose bin fill still rises by more than
    :data:`STILL_RISING` at the largest buffer size tried, to below :data:`FULL_ENOUGH`
    (completed runs only)."""
    groups: dict[tuple[str, int | None], list[TuneResult]] = {}
    for result in results:
        if not result.interrupted:
            groups.setdefault((result.decode, result.max_vision_tokens), []).append(result)
    notes = []
    for runs in groups.values():
        runs = sorted(runs, key=lambda r: r.buffer_size)
        if len(runs) < 2:
            continue
        before, last = runs[-2], runs[-1]
        if last.bin_fill - before.bin_fill <= STILL_RISING or last.bin_fill >= FULL_ENOUGH:
            continue
        larger = ",".join(str(last.buffer_size * factor) for factor in (1, 2, 4))
        notes.append(
            f"{run_name(last)}: bin fill still rises at the largest size tried "
            f"({before.bin_fill:.3f} at {before.buffer_size}, {last.bin_fill:.3f} at "
            f"{last.buffer_size}); a larger buffer may fill more: try --buffer-sizes {larger}"
        )
    return notes


BUFFER_BOUND_SHARE = 0.5
"""A run is buffer-bound where more than this share of its packs left because the buffer was
full and its bin fill is below :data:`BUFFER_BOUND_FILL` (:func:`buffer_bound_note`)."""
BUFFER_BOUND_FILL = 0.95


def buffer_bound_note(result: TuneResult) -> str | None:
    """A line for a completed run whose packs mostly left a full buffer under-filled, else None:
    the buffer holds fewer samples than a row needs, or, where in :data:`CAPPED_SHARE` of those
    packs the vision caps kept out samples that fit by tokens, the caps hold the fill."""
    if (
        result.interrupted
        or result.buffer_full_share <= BUFFER_BOUND_SHARE
        or result.bin_fill >= BUFFER_BOUND_FILL
    ):
        return None
    if result.capped_share >= CAPPED_SHARE * result.buffer_full_share:
        return (
            f"{result.decode} buffer {result.buffer_size}: bin fill {result.bin_fill:.3f} with "
            f"{result.buffer_full_share:.0%} of packs leaving because the buffer was full, "
            f"{result.capped_share:.0%} with the vision caps keeping out samples that fit by "
            "tokens: the caps, not the buffer, hold the fill at this mix (raise "
            "--max-vision-tokens / --max-media where the model's memory allows)"
        )
    grows = (
        " (decoded samples weigh MBs, so an eager buffer does not grow)"
        if result.decode == "eager"
        else ", or a buffer that grows to --min-rows rows' worth"
    )
    return (
        f"{result.decode} buffer {result.buffer_size}: bin fill {result.bin_fill:.3f} with "
        f"{result.buffer_full_share:.0%} of packs leaving because the buffer was full: it holds "
        f"fewer samples than a row needs, so a larger packing_buffer_size fills more{grows} "
        "(and lets a vision budget hold samples back without costing fill)"
    )


def vision_share_note(results: Sequence[TuneResult]) -> str | None:
    """The dataset's vision share, as the longest completed run measured it, and where to pass
    it; None where no run packed vision tokens."""
    done = [r for r in results if not r.interrupted and r.vision_share > 0]
    if not done:
        return None
    share = round(max(done, key=lambda r: r.samples).vision_share, 3)
    return (
        f"vision share {share}: vision tokens per token of the packed samples. With balance, "
        f"pass VisionBudget(balance=True, vision_share={share}) so every worker's target starts "
        "there, not at the few samples its buffer holds first (more even steps early in a run)"
    )


def worker_total_mb(result: TuneResult) -> float:
    """Peak memory of one worker: its RSS and its decoder process's."""
    return result.peak_worker_rss_mb + result.peak_decoder_rss_mb


def projected_rss_mb(result: TuneResult, num_workers: int) -> float:
    """Worker memory of a training run: ``num_workers`` workers, each at this run's peak RSS
    plus its decoder process's."""
    return worker_total_mb(result) * max(1, num_workers)


def recommend(
    results: Sequence[TuneResult], *, num_workers: int, rss_budget_mb: float
) -> TuneResult | None:
    """Among the completed runs whose projected worker RSS fits the budget, the best bin fill
    (to three decimals; lazy decoding first), and of equal fills the smallest buffer, which
    holds less memory and makes the first pack sooner."""
    fitting = [
        r
        for r in results
        if not r.interrupted and projected_rss_mb(r, num_workers) <= rss_budget_mb
    ]
    if not fitting:
        return None
    return max(fitting, key=lambda r: (r.decode == "lazy", round(r.bin_fill, 3), -r.buffer_size))
