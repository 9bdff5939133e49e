"""Reading a monitor's JSON-lines report back: per-worker summaries (peak, steady, growth), their
table and the RSS plot.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from energon_pack.memory.monitor import MB, Reading

logger = logging.getLogger("energon_pack.memory")


@dataclass(frozen=True)
class WorkerSummary:
    """Memory of one worker over a run (bytes)."""

    rank: int
    worker: int
    readings: int
    peak_rss: int
    steady_rss: int
    """Median RSS over the second half of the readings."""
    growth: float
    """Peak over the first reading."""
    peak_buffer_bytes: int
    peak_uss: int | None
    peak_decoder_rss: int | None = None
    """Peak RSS of the worker's decoder process (None: it had none)."""


def load_report(report_dir: str | Path) -> list[Reading]:
    """Every reading of every worker in ``report_dir``, in time order."""
    readings = []
    files = sorted(Path(report_dir).glob("rss-rank*-worker*.jsonl"))
    if not files:
        raise ValueError(
            f"no rss-rank*-worker*.jsonl files in {report_dir}; point to the report_dir of a "
            "run with MonitorConfig(report_dir=...) or energon-pack tune --out"
        )
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{path}: not a report (not UTF-8 text: {error}); point to the report_dir of a "
                "run, holding only the monitor's rss-rank*-worker*.jsonl files"
            ) from None
        lines = text.splitlines()
        for number, line in enumerate(lines, start=1):
            try:
                readings.append(_reading(json.loads(line)))
            except (json.JSONDecodeError, ValueError) as error:
                if number == len(lines) and not text.endswith("\n"):
                    # the run stopped (or its disk filled) while writing this line
                    logger.warning("%s:%d: skipping the cut last line (%s)", path, number, error)
                    continue
                raise ValueError(
                    f"{path}:{number}: not a report line ({error}); a report holds the lines an "
                    "RSSMonitor wrote: remove this line or point to the report_dir of a run"
                ) from None
    return sorted(readings, key=lambda r: r.time)


_COUNTS = {
    name: 1 if name == "rss" else 0
    for name in (
        "rank",
        "worker",
        "pid",
        "rss",
        "buffer_count",
        "buffer_bytes",
        "buffer_decoded_bytes",
        "samples",
        "packs",
    )
}
"""Integer fields of a reading and their least value (an RSS of 0 is no reading)."""
_OPTIONAL_COUNTS = ("uss", "decoder_rss")
_NUMBERS = ("time", "bin_fill")


def _reading(value: Any) -> Reading:
    """The :class:`Reading` of one decoded line; ValueError naming the first bad field."""
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    names = {field.name for field in dataclasses.fields(Reading)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}")
    for name, least in _COUNTS.items():
        if name not in value:
            raise ValueError(f"no {name!r}")
        if not _is_int(value[name]) or value[name] < least:
            raise ValueError(f"{name}={_short(value[name])} is not an int >= {least}")
    for name in _OPTIONAL_COUNTS:
        found = value.get(name)
        if found is not None and (not _is_int(found) or found < 0):
            raise ValueError(f"{name}={_short(found)} is not null or an int >= 0")
    for name in _NUMBERS:
        if name not in value:
            raise ValueError(f"no {name!r}")
        found = value[name]
        if isinstance(found, bool) or not isinstance(found, (int, float)):
            raise ValueError(f"{name}={_short(found)} is not a number")
        if not math.isfinite(found):
            raise ValueError(f"{name}={found} is not finite")
    return Reading(**value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    shown = json.dumps(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def summarize(readings: Sequence[Reading]) -> list[WorkerSummary]:
    """Per-worker peak, steady and growth of RSS."""
    by_worker: dict[tuple[int, int], list[Reading]] = {}
    for reading in readings:
        by_worker.setdefault((reading.rank, reading.worker), []).append(reading)
    summaries = []
    for (rank, worker), own in sorted(by_worker.items()):
        rss = [r.rss for r in own]
        later = sorted(rss[len(rss) // 2 :])
        uss = [r.uss for r in own if r.uss is not None]
        decoder = [r.decoder_rss for r in own if r.decoder_rss is not None]
        summaries.append(
            WorkerSummary(
                rank=rank,
                worker=worker,
                readings=len(own),
                peak_rss=max(rss),
                steady_rss=later[len(later) // 2],
                growth=max(rss) / rss[0],
                peak_buffer_bytes=max(r.buffer_bytes for r in own),
                peak_uss=max(uss) if uss else None,
                peak_decoder_rss=max(decoder) if decoder else None,
            )
        )
    return summaries


def plot_report(readings: Sequence[Reading], path: str | Path) -> Path:
    """PNG of RSS and buffer bytes over time, one line per worker, written to exactly ``path``
    (whatever its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(r.time for r in readings)
    figure, (rss_axis, buffer_axis) = plt.subplots(2, 1, sharex=True, figsize=(8, 6))
    by_worker: dict[tuple[int, int], list[Reading]] = {}
    for reading in readings:
        by_worker.setdefault((reading.rank, reading.worker), []).append(reading)
    for (rank, worker), own in sorted(by_worker.items()):
        seconds = [r.time - start for r in own]
        label = f"rank {rank} worker {worker}"
        rss_axis.plot(seconds, [r.rss / MB for r in own], label=label)
        buffer_axis.plot(seconds, [r.buffer_bytes / MB for r in own], label=label)
    rss_axis.set_ylabel("RSS (MiB)")
    buffer_axis.set_ylabel("buffered samples (MiB)")
    buffer_axis.set_xlabel("seconds")
    rss_axis.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    out = Path(path)
    try:
        figure.savefig(out, dpi=100, format="png")
    finally:
        plt.close(figure)
    return out


def summary_rows(summaries: Sequence[WorkerSummary]) -> list[list[Any]]:
    """Table rows (MiB) for :func:`energon_pack.cli.tables.format_table`."""
    return [
        [
            s.rank,
            s.worker,
            s.readings,
            round(s.peak_rss / MB, 1),
            round(s.steady_rss / MB, 1),
            round(s.growth, 3),
            round(s.peak_buffer_bytes / MB, 2),
            "-" if s.peak_decoder_rss is None else round(s.peak_decoder_rss / MB, 1),
        ]
        for s in summaries
    ]


SUMMARY_HEADERS = [
    "rank",
    "worker",
    "readings",
    "peak MiB",
    "steady MiB",
    "growth",
    "buffer MiB",
    "decoder MiB",
]
