"""Worker memory: a psutil RSS monitor, buffer-growth warnings and a JSON-lines report.

:class:`RSSMonitor` runs inside each loader worker (the packing wrapper calls
:meth:`RSSMonitor.observe` after every sample) or in the main process. Every ``every_samples``
observations or ``every_seconds`` it reads the process RSS (and USS where the platform has it)
and writes one JSON line to ``report_dir/rss-rank{R}-worker{W}.jsonl``. It warns with a
:class:`BufferMemoryWarning` (once per threshold and worker) when

* RSS passes ``warn_rss_mb``;
* RSS grows more than ``warn_growth`` times over the worker's first reading with a full buffer,
  while the buffer is full;
* the buffered samples hold more than ``warn_buffer_mb``.

Monitoring only reads: it never changes which packs are emitted, and a report that cannot be
written (a full disk, a read-only folder) never stops the run: the monitor warns once with a
:class:`ReportWriteWarning` and writes no more lines.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from energon_pack.checks import check_int, check_number, check_type
from energon_pack.media.guard import helper_pid

logger = logging.getLogger("energon_pack.memory")


MB = 1024 * 1024


class BufferMemoryWarning(UserWarning):
    """A packing buffer's memory passed a configured threshold."""


class ReportWriteWarning(UserWarning):
    """The memory report could not be written (e.g. a full disk); the run goes on without it."""


@dataclass(frozen=True)
class BufferSnapshot:
    """What a packing buffer holds at one moment."""

    count: int
    capacity: int
    """The buffer's size limit (packing_buffer_size)."""
    bytes: int
    """Bytes held by the buffered samples (compressed media plus any decoded tensors)."""
    decoded_bytes: int
    """The part of ``bytes`` that is decoded pixel data (0 when decoding is lazy)."""
    biggest: tuple[tuple[str, int], ...] = ()
    """``(key, bytes)`` of the largest buffered samples."""
    max_bytes: int | None = None
    """The buffer's byte limit (packing_buffer_bytes), None when only its count is bounded."""

    @property
    def full(self) -> bool:
        """The buffer is (about) full, so memory is at its steady level; always, for a loader
        without a buffer (:data:`NO_BUFFER`)."""
        return self.capacity == 0 or self.count >= max(1, self.capacity - 1)


NO_BUFFER = BufferSnapshot(count=0, capacity=0, bytes=0, decoded_bytes=0)
"""What a loader without a packing buffer reports (a plan's :class:`~energon_pack.PlannedDataset`,
which reads each pack's members by index): every reading is at the steady level."""


@dataclass(frozen=True)
class Reading:
    """One JSON line of the report."""

    time: float
    rank: int
    worker: int
    pid: int
    rss: int
    uss: int | None
    buffer_count: int
    buffer_bytes: int
    buffer_decoded_bytes: int
    samples: int
    packs: int
    bin_fill: float
    decoder_rss: int | None = None
    """RSS of this process's decoder process (:mod:`energon_pack.media.guard`); None while it
    has none."""


@dataclass
class MonitorConfig:
    """Settings of :class:`RSSMonitor`; picklable, so it can travel into loader workers.

    Args:
        report_dir: where each worker appends its JSON lines (None: no report).
        every_samples: read memory every this many observed samples ...
        every_seconds: ... or when this much time passed since the last reading.
        warn_rss_mb: warn when a worker's RSS passes this many MiB.
        warn_growth: warn when RSS exceeds this multiple of the first full-buffer reading.
        warn_buffer_mb: warn when buffered samples hold more than this many MiB.
    """

    report_dir: str | None = None
    every_samples: int = 32
    every_seconds: float = 2.0
    warn_rss_mb: float | None = None
    warn_growth: float | None = 1.5
    warn_buffer_mb: float | None = None

    def __post_init__(self) -> None:
        check_type(
            "MonitorConfig.report_dir",
            self.report_dir,
            (str, os.PathLike),
            "a directory path (str)",
            fix="pass report_dir='rss-report' or None for no report",
        )
        check_int(
            "MonitorConfig.every_samples", self.every_samples, fix="pass e.g. every_samples=32"
        )
        check_number(
            "MonitorConfig.every_seconds", self.every_seconds, fix="pass e.g. every_seconds=2.0"
        )
        for name in ("warn_rss_mb", "warn_buffer_mb"):
            check_number(
                f"MonitorConfig.{name}",
                getattr(self, name),
                none_ok=True,
                fix=f"pass a size in MiB (e.g. {name}=12000) or None for no warning",
            )
        check_number(
            "MonitorConfig.warn_growth",
            self.warn_growth,
            above=1.0,
            none_ok=True,
            fix="pass a factor above 1 (e.g. warn_growth=1.5) or None for no warning",
        )


KEEP_READINGS = 256
"""How many recent readings an :class:`RSSMonitor` keeps in memory (the report has them all)."""


@dataclass
class RSSMonitor:
    """Samples this process's memory and the buffer it is told about; see the module doc.

    Memory stays bounded over any run: ``readings`` keeps the last :data:`KEEP_READINGS`
    readings; ``count`` and ``peak_rss`` summarise all of them.
    """

    config: MonitorConfig
    rank: int = 0
    worker: int = 0
    readings: deque[Reading] = field(default_factory=lambda: deque(maxlen=KEEP_READINGS))
    count: int = 0
    peak_rss: int = 0
    _observed: int = 0
    _last_time: float = 0.0
    _steady_rss: int | None = None
    _fired: set[str] = field(default_factory=set)
    _report_failed: bool = False
    """A report write failed: the monitor writes no more lines (see :meth:`_append`)."""

    def observe(
        self, snapshot: Callable[[], BufferSnapshot], *, samples: int, packs: int, bin_fill: float
    ) -> Reading | None:
        """Count one sample; when a reading is due, take it (calling ``snapshot``) and return it."""
        self._observed += 1
        now = time.monotonic()
        due = self._observed >= self.config.every_samples
        if not due and now - self._last_time < self.config.every_seconds:
            return None
        self._observed = 0
        self._last_time = now
        return self.read(snapshot(), samples=samples, packs=packs, bin_fill=bin_fill)

    def read(self, buffer: BufferSnapshot, *, samples: int, packs: int, bin_fill: float) -> Reading:
        """Take a reading now, warn if a threshold is passed, and append it to the report."""
        rss, uss = _memory()
        reading = Reading(
            time=time.time(),
            rank=self.rank,
            worker=self.worker,
            pid=os.getpid(),
            rss=rss,
            uss=uss,
            buffer_count=buffer.count,
            buffer_bytes=buffer.bytes,
            buffer_decoded_bytes=buffer.decoded_bytes,
            samples=samples,
            packs=packs,
            bin_fill=bin_fill,
            decoder_rss=_decoder_rss(),
        )
        self.readings.append(reading)
        self.count += 1
        self.peak_rss = max(self.peak_rss, rss)
        if buffer.full and self._steady_rss is None:
            self._steady_rss = rss
        self._check(reading, buffer)
        if self.config.report_dir is not None and not self._report_failed:
            self._append(reading)
        return reading

    def _append(self, reading: Reading) -> None:
        """Append ``reading`` to this worker's report file. A failed write (a full disk, a
        read-only or removed folder, ...) never stops the run: it warns once, naming the file,
        and the monitor stops writing (its readings and warnings go on)."""
        path = Path(str(self.config.report_dir)) / f"rss-rank{self.rank}-worker{self.worker}.jsonl"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as report:
                report.write(json.dumps(asdict(reading)) + "\n")
        except OSError as error:
            self._report_failed = True
            message = (
                f"rank {self.rank} worker {self.worker}: cannot write the memory report {path} "
                f"({error.strerror or error}); no more report lines from this worker in this "
                "run, training goes on. To fix: free space on that disk, or point "
                "MonitorConfig.report_dir to a writable folder with room (None: no report)"
            )
            logger.warning("%s", message)
            warnings.warn(message, ReportWriteWarning, stacklevel=3)

    def _check(self, reading: Reading, buffer: BufferSnapshot) -> None:
        config = self.config
        rss_mb, buffer_mb = reading.rss / MB, buffer.bytes / MB
        if config.warn_rss_mb is not None and rss_mb > config.warn_rss_mb:
            room = config.warn_rss_mb * MB - (reading.rss - buffer.bytes)
            what = f"RSS {rss_mb:.0f} MiB passed warn_rss_mb={config.warn_rss_mb}"
            self._warn("rss", what, buffer, room)
        if (
            config.warn_growth is not None
            and self._steady_rss is not None
            and buffer.full
            and reading.rss > config.warn_growth * self._steady_rss
        ):
            steady_mb = self._steady_rss / MB
            self._warn(
                "growth",
                f"RSS {rss_mb:.0f} MiB grew over {config.warn_growth}x the first full-buffer "
                f"reading of {steady_mb:.0f} MiB",
                buffer,
                self._steady_rss - (reading.rss - buffer.bytes),
            )
        if config.warn_buffer_mb is not None and buffer_mb > config.warn_buffer_mb:
            self._warn(
                "buffer",
                f"buffered samples hold {buffer_mb:.1f} MiB, above warn_buffer_mb="
                f"{config.warn_buffer_mb}",
                buffer,
                config.warn_buffer_mb * MB,
            )

    def _warn(self, threshold: str, what: str, buffer: BufferSnapshot, room: float) -> None:
        if threshold in self._fired:
            return
        self._fired.add(threshold)
        biggest = ", ".join(f"{key} ({size / MB:.1f} MiB)" for key, size in buffer.biggest)
        held = (
            "no packing buffer (each pack's members are read by index)"
            if buffer.capacity == 0
            else f"the packing buffer holds {buffer.count} samples, {buffer.bytes / MB:.1f} MiB "
            f"(largest: {biggest or '-'})"
        )
        message = (
            f"rank {self.rank} worker {self.worker}: {what}; {held}. To fix: "
            f"{advice(buffer, room)}."
        )
        logger.warning("%s", message)
        warnings.warn(message, BufferMemoryWarning, stacklevel=2)


def advice(buffer: BufferSnapshot, room_bytes: float) -> str:
    """What brings memory back under a threshold, given how the buffer is set up.

    ``room_bytes`` is what the buffered samples may hold for the threshold to pass; when it is
    not above zero, the memory is outside the buffer and shrinking the buffer would not help.
    """
    steps = []
    if buffer.decoded_bytes:
        steps.append(
            f"decode media lazily (decode='lazy'): {buffer.decoded_bytes / MB:.1f} MiB of the "
            "buffer is decoded pixels"
        )
    if 0 < room_bytes < buffer.bytes:
        if buffer.max_bytes is not None:
            steps.append(
                f"lower BufferConfig(max_bytes=...) from {buffer.max_bytes} to {int(room_bytes)}"
            )
        else:
            size = suggest_buffer_size(buffer, room_bytes)
            steps.append(
                f"a packing_buffer_size of {size} would fit, with BufferConfig(max_bytes="
                f"{int(room_bytes)}) (which also bounds a buffer grown for short samples)"
            )
    elif not buffer.decoded_bytes:
        steps.append(
            f"the buffer ({buffer.bytes / MB:.1f} MiB) is not what fills memory, so a smaller "
            "one would not help: lower the image/video pixel limits (MediaConfig max_pixels, "
            "video_max_pixels) so each pack's pixels take less, or run fewer workers"
        )
    return "; or ".join(steps)


def suggest_buffer_size(buffer: BufferSnapshot, room_bytes: float) -> int:
    """Largest buffer size whose samples, at the current mean size, fit in ``room_bytes``."""
    if buffer.count == 0 or buffer.bytes == 0:
        return buffer.capacity
    per_sample = buffer.bytes / buffer.count
    return max(1, min(buffer.capacity, int(room_bytes // per_sample)))


def _decoder_rss() -> int | None:
    pid = helper_pid()
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:  # it is being restarted
        return None


def _memory() -> tuple[int, int | None]:
    process = psutil.Process()
    try:
        full = process.memory_full_info()
    except (psutil.AccessDenied, NotImplementedError):
        return process.memory_info().rss, None
    return full.rss, getattr(full, "uss", None)
