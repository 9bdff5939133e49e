"""The plots of ``energon-pack tune``: bin fill and projected worker RSS over the buffer size
(``bin_fill.png``, ``rss.png``), and the swept vision caps (``vision_caps.png``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from energon_pack.tune import (
    TuneResult,
    TuneSettings,
    projected_rss_mb,
    tokenizer_label,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_title(settings: TuneSettings, tokenizer: dict[str, object]) -> str:
    """Two lines: the dataset, seq_length, workers and what counted the tokens; then what each
    run measured (the steady state over ``min_packs`` packs, or one epoch with its flush)."""
    setup = (
        f"{Path(settings.dataset).name}: seq_length {settings.seq_length}, "
        f"{settings.num_workers} workers, tokens: {tokenizer_label(tokenizer)}"
    )
    if settings.one_epoch:
        return f"{setup}\none epoch per run, end-of-epoch flush included"
    cap = "" if settings.max_samples is None else f" (or {settings.max_samples} samples)"
    return f"{setup}\nsteady state: dataset repeated to {settings.min_packs} packs per run{cap}"


def rss_axis(values: Sequence[float], budget: float) -> tuple[float, float, bool]:
    """Y range ``(bottom, top)`` of the RSS plot and whether the budget line is inside it.

    The range fits the runs with a margin (from 0 while they are near it) and takes the budget
    in only while the runs keep at least half of the plot's height; a budget far above or below
    them is named instead of drawn, so their differences stay visible.
    """
    low, high = (min(values), max(values)) if values else (budget, budget)
    margin = max(high - low, 0.05 * high, 1.0) * 0.15
    bottom = 0.0 if low < 3 * (high - low) else low - margin
    top = high + margin
    wide_bottom, wide_top = min(bottom, budget - margin), max(top, budget + margin)
    if top - bottom < 0.5 * (wide_top - wide_bottom):
        return bottom, top, False
    return max(wide_bottom, 0.0), wide_top, True


def plot_results(
    results: Sequence[TuneResult],
    out_dir: Path,
    settings: TuneSettings,
    *,
    tokenizer: dict[str, object],
    rss_budget_mb: float,
    best: TuneResult | None,
) -> list[Path]:
    """Write :func:`results_figures` to ``out_dir`` as ``bin_fill.png`` and ``rss.png``."""
    figures = results_figures(
        results, settings, tokenizer=tokenizer, rss_budget_mb=rss_budget_mb, best=best
    )
    import matplotlib.pyplot as plt  # after results_figures chose the Agg backend

    written = []
    for name, figure in figures.items():
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written


def results_figures(
    results: Sequence[TuneResult],
    settings: TuneSettings,
    *,
    tokenizer: dict[str, object],
    rss_budget_mb: float,
    best: TuneResult | None,
) -> dict[str, Figure]:
    """Bin fill (``bin_fill``) and projected worker RSS (``rss``) over buffer size, one line per
    decode mode (and vision cap).

    Both are titled by :func:`plot_title` (``tokenizer``: :func:`~energon_pack.tune.
    describe_tokenizer`'s answer) and mark the recommended run. ``rss`` shows projected worker
    memory with the budget as a horizontal line; ``bin_fill`` crosses out the runs over the
    budget and rings those of fewer than ``min_packs`` packs, each only where there is one.
    Interrupted runs are left out.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if not r.interrupted]
    workers = settings.num_workers
    over = [r for r in done if projected_rss_mb(r, workers) > rss_budget_mb]
    few = [r for r in done if r.packs < settings.min_packs]
    title = plot_title(settings, tokenizer)
    lines = sorted({(r.decode, r.max_vision_tokens) for r in done}, key=_line_order)
    budget_label = f"budget {rss_budget_mb:.0f} MiB"
    charts: list[tuple[str, Callable[[TuneResult], float], str]] = [
        ("bin_fill", lambda r: r.bin_fill, "bin fill"),
        (
            "rss",
            lambda r: projected_rss_mb(r, workers),
            f"worker RSS: {workers} x (peak + decoder) (MiB)",
        ),
    ]
    figures = {}
    for name, value, label in charts:
        figure, axis = plt.subplots(figsize=(7, 4.5))
        for decode, cap in lines:
            own = sorted(
                (r for r in done if (r.decode, r.max_vision_tokens) == (decode, cap)),
                key=lambda r: r.buffer_size,
            )
            line = _run_label(own[0])
            axis.plot([r.buffer_size for r in own], [value(r) for r in own], "o-", label=line)
        if name == "rss":
            bottom, top, budget_shown = rss_axis([value(r) for r in done], rss_budget_mb)
            axis.set_ylim(bottom, top)
            if budget_shown:
                axis.axhline(rss_budget_mb, color="red", linestyle="--", label=budget_label)
            else:  # a budget far above or below would squash the runs into one flat line
                where = "above" if rss_budget_mb > top else "below"
                axis.plot(
                    [], [], color="red", linestyle="--", label=f"{budget_label} (far {where})"
                )
        else:
            _mark(axis, over, value, "x", "red", f"over the {budget_label}")
            few_label = f"under {settings.min_packs} packs: low confidence"
            _mark(axis, few, value, "o", "none", few_label, edge="gray", size=14)
        if best is None:
            empty = "no completed run fits the budget" if done else "no run completed"
            axis.text(0.5, 0.5, empty, transform=axis.transAxes, ha="center")
        else:
            axis.plot(
                [best.buffer_size],
                [value(best)],
                "*",
                color="gold",
                markeredgecolor="black",
                markersize=18,
                label=f"recommended: {best.buffer_size} ({_run_label(best)})",
            )
        axis.set_xscale("log", base=2)
        sizes = sorted({r.buffer_size for r in done})
        axis.set_xticks(sizes, labels=[str(size) for size in sizes])
        axis.set_xlabel("packing_buffer_size")
        axis.set_ylabel(label)
        axis.set_title(title, fontsize="medium")
        axis.legend(fontsize="small")
        figure.tight_layout()
        figures[name] = figure
    return figures


def _run_label(result: TuneResult) -> str:
    """``lazy`` or ``lazy, vision cap 600``."""
    cap = result.max_vision_tokens
    return result.decode if cap is None else f"{result.decode}, vision cap {cap}"


def _line_order(line: tuple[str, int | None]) -> tuple[bool, int]:
    """Lazy lines first, then by vision cap (none first)."""
    decode, cap = line
    return decode != "lazy", cap or 0


def _mark(
    axis: Any,
    runs: Sequence[TuneResult],
    value: Callable[[TuneResult], float],
    marker: str,
    color: str,
    label: str,
    *,
    edge: str | None = None,
    size: int = 12,
) -> None:
    """Mark ``runs`` with ``marker`` and a legend entry, where there is any run to mark."""
    if runs:
        axis.plot(
            [r.buffer_size for r in runs],
            [value(r) for r in runs],
            marker,
            color=color,
            markeredgecolor=edge or color,
            markersize=size,
            markeredgewidth=2,
            linestyle="none",
            label=label,
        )


def plot_vision_caps(results: Sequence[TuneResult], out_dir: Path, settings: TuneSettings) -> Path:
    """``vision_caps.png``: bin fill and vision tokens per pack (mean, max) over the swept
    ``max_vision_tokens``, one line per buffer size (lazy runs; interrupted ones left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if not r.interrupted and r.max_vision_tokens is not None]
    figure, (fill_axis, vision_axis) = plt.subplots(1, 2, figsize=(11, 4.5))
    for buffer_size in sorted({r.buffer_size for r in done}):
        own = sorted(
            (r for r in done if r.buffer_size == buffer_size and r.decode == "lazy"),
            key=lambda r: r.max_vision_tokens or 0,
        )
        caps = [r.max_vision_tokens for r in own]
        fill_axis.plot(caps, [r.bin_fill for r in own], "o-", label=f"buffer {buffer_size}")
        line = vision_axis.plot(caps, [r.vision_tokens_mean for r in own], "o-")[0]
        vision_axis.plot(
            caps,
            [r.vision_tokens_max for r in own],
            "^--",
            color=line.get_color(),
            label=f"buffer {buffer_size}: mean (o), max (^)",
        )
    swept = sorted({r.max_vision_tokens for r in done if r.max_vision_tokens is not None})
    vision_axis.plot(swept, swept, ":", color="gray", label="the cap")
    for axis, label in ((fill_axis, "bin fill"), (vision_axis, "vision tokens per pack")):
        axis.set_xlabel("max_vision_tokens")
        axis.set_ylabel(label)
        axis.legend(fontsize="small")
    figure.suptitle(
        f"{Path(settings.dataset).name}: seq_length {settings.seq_length}, "
        f"max_media {settings.vision.max_media}, vision_balance {settings.vision.balance}",
        fontsize="medium",
    )
    figure.tight_layout()
    path = out_dir / "vision_caps.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
