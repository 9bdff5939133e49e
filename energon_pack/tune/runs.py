"""One ``tune`` run: the settings every run shares, a run's result, and :func:`run_once`, which
streams the dataset through the real Energon loader with real workers and an RSS monitor in each
(the loader's workers started whole, Ctrl-C held until a run can stop cleanly)."""

from __future__ import annotations

import contextlib
import functools
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import psutil

from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.family import model_family
from energon_pack.formats.dataset_trust import check_dataset_code
from energon_pack.media import MediaConfig, PixelDtype
from energon_pack.memory.monitor import MB, MonitorConfig
from energon_pack.memory.report import WorkerSummary, load_report, summarize
from energon_pack.packing.bins import Overlong
from energon_pack.packing.buffer import DEFAULT_MIN_ROWS, BufferConfig
from energon_pack.packing.packed import Decode
from energon_pack.packing.vision_budget import VisionBudget
from energon_pack.tune.tokenizers import tokenizer_of


@dataclass(frozen=True)
class TuneSettings:
    """What every run of a tune shares."""

    dataset: str
    seq_length: int = 8192
    pad_to_multiple_of: int = 1
    num_workers: int = 2
    max_samples: int | None = None
    """Stop each run after this many source samples, even short of ``min_packs`` (None: no
    cap)."""
    min_packs: int = 200
    """Packs each run measures: the dataset repeats until the run has this many, so its bin fill
    is the steady state's (a repeated stream has no end-of-epoch flush). A run with fewer (ended
    by ``max_samples`` or ``one_epoch``) is flagged as resting on too few packs."""
    min_rows: float | None = DEFAULT_MIN_ROWS
    """The buffer's :attr:`~energon_pack.BufferConfig.min_rows`: it grows past the run's size
    while its samples hold less than this many rows' worth of tokens (None: size alone)."""
    one_epoch: bool = False
    """Stream one epoch per run instead, without repeating: the end-of-epoch flush is in the bin
    fill (on a small dataset it can dominate), and every sample is accounted for
    (``TuneResult.unaccounted``)."""
    pixel_dtype: PixelDtype = "float32"
    """Dtype of the batches' pixels (``MediaConfig.pixel_dtype``)."""
    tokenizer: str | None = None
    """A transformers tokenizer directory, or a name in the local cache (None: ByteTokenizer)."""
    chat_template: str | None = None
    """A Jinja chat template file set as the tokenizer's ``chat_template`` (None: the
    tokenizer's own, if it has one; needs ``tokenizer``)."""
    overlong: Overlong = "skip"
    """Samples longer than ``seq_length``: count and skip them, or stop with an error."""
    dataset_config: str | None = None
    """The dataset's description file in ``.nv-meta`` (None: Energon's ``dataset.yaml``)."""
    family: str | None = None
    """A model family preset name, a model directory or a saved processor directory
    (:func:`~energon_pack.model_family`) whose media settings the runs use (None:
    ``MediaConfig`` defaults); a processor family brings its tokenizer and pixels."""
    vision: VisionBudget = field(default_factory=VisionBudget)
    """The vision budget of every run (a run's ``max_vision_tokens`` argument, where given,
    replaces its cap)."""
    trust_dataset_code: bool = False
    """Open a dataset whose description names code outside Energon's and energon_pack's sample
    types (:func:`~energon_pack.formats.dataset_trust.check_dataset_code`; else refused)."""

    def enough(self, samples: int, packs: int) -> bool:
        """A run with ``samples`` and ``packs`` so far has what it measures (``max_samples``,
        or ``min_packs`` unless it streams ``one_epoch``)."""
        return (self.max_samples is not None and samples >= self.max_samples) or (
            not self.one_epoch and packs >= self.min_packs
        )

    def record(self) -> dict[str, Any]:
        """The settings as the tune report writes them (the vision budget's ``max_media``,
        ``vision_balance`` and ``vision_share`` as keys of their own)."""
        out: dict[str, Any] = {}
        for name in (f.name for f in fields(self)):
            if name == "vision":
                vision = self.vision
                out.update(
                    max_media=vision.max_media,
                    vision_balance=vision.balance,
                    vision_share=vision.vision_share,
                )
            else:
                out[name] = getattr(self, name)
        return out


@dataclass(frozen=True)
class TuneResult:
    """Measurements of one run (all zero for a run interrupted before its first pack)."""

    buffer_size: int
    """The run's ``packing_buffer_size``."""
    decode: Decode
    """When media were decoded: ``"lazy"`` (after selection) or ``"eager"`` (before the buffer)."""
    max_vision_tokens: int | None = None
    """The run's cap on vision tokens per pack (None: no cap)."""
    samples: int = 0
    """Source samples packed."""
    packs: int = 0
    """Packed rows emitted."""
    bin_fill: float = 0.0
    """Aligned tokens over the capacity of all packs."""
    token_efficiency: float = 0.0
    """Real tokens over aligned tokens (what alignment padding costs)."""
    first_pack_seconds: float = 0.0
    """From the loader's start to its first pack."""
    packs_per_second: float | None = None
    """Packs over the run's wall time, from the loader's start to the last pack (so the first
    pack's latency counts); None for a run of fewer than :data:`TIMED_PACKS` packs."""
    samples_per_second: float | None = None
    """Samples over the same wall time (None as above)."""
    pack_us_per_sample: float = 0.0
    """Microseconds the packers took per sample to choose packs, in the workers (their
    ``packing_stats.pack_us_per_sample``, weighted by samples): the pack step's part of the
    loader's time per sample, beside reading, encoding and decoding."""
    peak_worker_rss_mb: float = 0.0
    """Highest RSS of any worker, in MiB."""
    steady_worker_rss_mb: float = 0.0
    """Highest steady RSS of any worker (after warm-up), in MiB."""
    peak_buffer_mb: float = 0.0
    """Most bytes any worker's packing buffer held, in MiB."""
    peak_decoder_rss_mb: float = 0.0
    """Peak RSS of a worker's decoder process (:mod:`energon_pack.media.guard`), 0 without one."""
    buffer_full_share: float = 0.0
    """Share of the packs that left because the buffer was full (over all workers)."""
    capped_share: float = 0.0
    """Share of the packs that left a full buffer under-filled while the vision caps kept out a
    held sample that fit by tokens (over all workers)."""
    vision_tokens_mean: float = 0.0
    """Vision tokens per pack, over all workers."""
    vision_tokens_max: int = 0
    """Most vision tokens in one pack."""
    media_max: int = 0
    """Most images, videos and audios in one pack."""
    vision_share: float = 0.0
    """Vision tokens per token of the packed samples (``VisionBudget(vision_share=...)``)."""
    audio_tokens_mean: float = 0.0
    """Audio tokens per pack, over all workers (part of ``vision_tokens_mean``)."""
    audio_tokens_max: int = 0
    """Most audio tokens in one pack."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Skipped samples by kind (``overlong`` or a ``MediaError`` kind), over all workers."""
    unaccounted: int = 0
    """Samples of a full epoch neither packed nor in any worker's skip counts (counted only for a
    whole ``one_epoch`` run)."""
    interrupted: bool = False


class TuneError(ValueError):
    """A run stopped on an error. ``str()`` is one line; ``details`` is the full traceback."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


class CtrlC:
    """Ctrl-C (SIGINT) in the main thread while active: the first one raises KeyboardInterrupt,
    unless :meth:`hold` was called; every later one, and any while held, is only counted, so
    stopping the workers and writing what was measured is never cut short (no traceback).
    A run's per-pack callback wrapped by :meth:`checked` raises it again where it was lost."""

    def __init__(self) -> None:
        self.count = 0
        self.held = False
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def hold(self) -> None:
        """From now on a Ctrl-C is only counted."""
        self.held = True

    def checked(self, on_pack: Callable[[], object]) -> Callable[[], None]:
        """``on_pack``, then KeyboardInterrupt once a Ctrl-C came and nothing is held. The one
        the Ctrl-C raised can be lost: raised inside the module init of a C extension being
        imported (``numpy.random`` as a run starts), it is cleared there, and the run would go
        on to its end."""

        def call() -> None:
            on_pack()
            if self.count and not self.held:
                raise KeyboardInterrupt

        return call

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.count == 1 and not self.held:
            raise KeyboardInterrupt


@contextlib.contextmanager
def sigint_held() -> Iterator[list[int]]:
    """Hold Ctrl-C off while the block runs (in the main thread); the list it yields gets one
    entry per SIGINT that came meanwhile."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield came
    finally:
        signal.signal(signal.SIGINT, previous)


STOP_GRACE_S = 2.0
"""Seconds :func:`stop_workers` lets the loader workers, then the processes they started, end
on their own before it terminates them."""


def stop_workers(loader: Any, grace_s: float = STOP_GRACE_S) -> None:
    """Stop the worker processes of a savable ``loader`` now (none started: nothing to do), and
    the processes they started (their media decoder processes).

    Energon's loader keeps its torch iterator (persistent workers) in a reference cycle, so
    without this the workers live until gc finalizes it, at a random later point and about 5 s
    per worker; torch has no public call for it, so this is the one that finalizer makes. A
    worker still busy with a pack after ``grace_s`` is terminated (torch would wait 5 s for each
    in turn), and so is a process it started that is still there ``grace_s`` after it (a decoder
    process still starting reads its end of input only once it has started).
    """
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:
        return
    workers = list(getattr(iterator, "_workers", ()))
    started = _started_by(workers)

    def terminate_stragglers() -> None:
        started.update(_started_by(workers))  # and what they started meanwhile
        for worker in workers:
            with contextlib.suppress(OSError, ValueError):  # gone, or closed meanwhile
                if worker.is_alive():
                    worker.terminate()

    stragglers = threading.Timer(grace_s, terminate_stragglers)
    stragglers.start()
    try:
        shutdown()
    finally:
        stragglers.cancel()
        stragglers.join()
    alive = _still_running(list(started.values()), grace_s)
    for process in alive:  # Python's resource trackers ignore SIGTERM, and end after the rest
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _still_running(alive, grace_s)


def _started_by(workers: list[Any]) -> dict[int, psutil.Process]:
    """The live processes the ``workers`` started, and those started by them, and so on, by
    process id."""
    started: dict[int, psutil.Process] = {}
    for worker in workers:
        with contextlib.suppress(psutil.Error, ValueError):  # gone, or closed
            if worker.pid is not None:  # started
                children = psutil.Process(worker.pid).children(recursive=True)
                started.update((child.pid, child) for child in children)
    return started


def _still_running(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of ``processes`` still running after up to ``timeout_s`` (an exited one whose
    parent has not reaped it yet has ended: :func:`psutil.wait_procs` would wait for it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for process in processes:
            with contextlib.suppress(psutil.Error):  # gone
                if process.status() != psutil.STATUS_ZOMBIE:
                    running.append(process)
        if not running or time.monotonic() >= deadline:
            return running
        processes = running
        time.sleep(0.05)


def _quiet_on_reset(hook: Callable[..., object], kind: type[BaseException], *rest: Any) -> None:
    """``sys.excepthook`` of a loader worker: a connection the main process dropped (reset, or
    closed halfway through the sharing thread's handshake: an EOFError) is no error of the
    worker's."""
    if not issubclass(kind, (ConnectionError, EOFError)):
        hook(kind, *rest)


def start_workers_whole(loader: Any) -> None:
    """Let no Ctrl-C cut the starting of a savable ``loader``'s workers in half.

    Torch makes the iterator that starts the workers before the loader keeps it; a Ctrl-C in
    between would leave those workers to gc, whose finalizer then fails on the half-made
    iterator (a traceback on stderr). Here a Ctrl-C while they start is raised once the loader
    keeps the iterator, so :func:`stop_workers` stops them. The workers ignore Ctrl-C, and so
    do the decoder processes they start (:mod:`energon_pack.media.guard`; from their first
    line): this process stops them, and none prints a traceback of its own.
    """
    make = getattr(loader, "_get_iterator", None)
    if make is None or not (loader.persistent_workers and loader.num_workers > 0):
        return
    init = loader.worker_init_fn

    def init_worker(worker_id: int) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited through exec
        # A Ctrl-C can cut the main process off while it fetches a batch's shared memory from
        # this worker; the worker's sharing thread then reports the reset connection.
        sys.excepthook = functools.partial(_quiet_on_reset, sys.excepthook)
        if init is not None:
            init(worker_id)

    def get_iterator() -> Any:
        with sigint_held() as came:
            iterator = loader._iterator = make()
        if came:
            raise KeyboardInterrupt
        return iterator

    loader.worker_init_fn = init_worker
    loader._get_iterator = get_iterator


def default_dataset() -> Path:
    """The shipped ``fixtures/vlm_demo`` next to the package (a source checkout)."""
    return Path(__file__).resolve().parents[2] / "fixtures" / "vlm_demo"


# Library settings named in error messages, as the tune flags that set them.
_FLAGS = (
    (re.compile(r"overlong=['\"]skip['\"]"), "--overlong skip"),
    (re.compile(r"\bseq_length\b"), "--seq-length"),
    (re.compile(r"\bpad_to_multiple_of\b"), "--pad-to-multiple-of"),
)
_PLAIN_ERRORS = ("ValueError", "RuntimeError", "MediaError")


def error_line(error: BaseException) -> str:
    """One line for an error of a run, also when a loader worker raised it.

    A worker's error reaches the main process as its whole traceback in the message; the line
    is the original error's message, with setting names written as the tune flags.
    """
    text = str(error).strip()
    if "Original Traceback" in text:
        last: list[str] = []
        for line in reversed(text.splitlines()):
            if not line.strip() or line[0].isspace():
                break
            last.insert(0, line)
        text = " ".join(last)
    else:
        text = f"{type(error).__name__}: {text}"
    kind, _, message = text.partition(": ")
    if kind.rsplit(".", 1)[-1] in _PLAIN_ERRORS and message:
        text = message
    for pattern, flag in _FLAGS:
        text = pattern.sub(flag, text)
    return text


def run_error(run: str, error: Exception) -> TuneError:
    """The :class:`TuneError` of ``run`` (its name) stopped by ``error``."""
    details = "".join(traceback.format_exception(error))
    return TuneError(f"{run}: {error_line(error)}", details)


def wind_up(
    loader: Any, failure: TuneError | None, report_dir: Path, packs: int
) -> tuple[list[WorkerSummary], bool]:
    """Stop the run's loader workers (no Ctrl-C cuts that short), raise its ``failure`` if it
    had one, and return each worker's memory summary and whether a Ctrl-C came meanwhile."""
    with sigint_held() as came:
        stop_workers(loader)
        if failure is not None:
            raise failure
        workers = summarize(load_report(report_dir)) if packs else []
    return workers, bool(came)


TIMED_PACKS = 20
"""Fewest packs of a run that time its throughput: a run of fewer is mostly its start."""


def run_once(
    settings: TuneSettings,
    buffer_size: int,
    decode: Decode,
    report_dir: Path,
    on_pack: Callable[[], object] = lambda: None,
    max_vision_tokens: int | None = None,
) -> TuneResult:
    """Stream the dataset with this buffer size until the run has ``settings.min_packs`` packs
    (repeating it), ``settings.max_samples`` samples or, with ``settings.one_epoch``, the end of
    one epoch; Ctrl-C ends the run early (marked). ``on_pack`` is called once per pack.

    Raises :class:`TuneError` (one line, naming the run) when the run stops on an error, in the
    main process or in a loader worker.
    """
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from energon_pack.energon import PackingStats, PackingTaskEncoder

    if not settings.trust_dataset_code:
        check_dataset_code(settings.dataset, settings.dataset_config)
    family = model_family(settings.family) if settings.family else None
    if isinstance(family, ProcessorFamily):  # its processor's tokenizer and pixels
        if settings.tokenizer or settings.chat_template:
            raise ValueError(
                f"--tokenizer or --chat-template with the {family.name!r} family: its "
                "processor brings its own tokenizer and template; drop them"
            )
        if settings.pixel_dtype != "float32":
            raise ValueError(
                f"--pixel-dtype {settings.pixel_dtype} with the {family.name!r} family: its "
                "processor gives float32 pixels; drop --pixel-dtype"
            )
        tokenizer, media = family.tokenizer, MediaConfig()
    else:
        tokenizer = tokenizer_of(settings.tokenizer, settings.chat_template)
        base_media = family.media if family is not None else MediaConfig()
        media = replace(base_media, pixel_dtype=settings.pixel_dtype)
    if max_vision_tokens is None:
        max_vision_tokens = settings.vision.max_vision_tokens
    monitor = MonitorConfig(report_dir=str(report_dir), every_samples=4, every_seconds=0.25)
    encoder = PackingTaskEncoder(
        tokenizer,
        seq_length=settings.seq_length,
        pad_to_multiple_of=settings.pad_to_multiple_of,
        media=media,
        family=family,
        overlong=settings.overlong,
        buffer=BufferConfig(decode=decode, monitor=monitor, min_rows=settings.min_rows),
        vision=replace(settings.vision, max_vision_tokens=max_vision_tokens),
    )
    described = (
        {} if settings.dataset_config is None else {"dataset_config": settings.dataset_config}
    )
    try:
        dataset = get_train_dataset(
            settings.dataset,
            **described,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=settings.num_workers),
            batch_size=1,
            packing_buffer_size=buffer_size,
            shuffle_buffer_size=None,
            max_samples_per_sequence=None,
            task_encoder=encoder,
            repeat=not settings.one_epoch,
        )
    except Exception as error:  # Energon's errors opening the dataset: any type
        details = "".join(traceback.format_exception(error))
        line = f"cannot open the dataset {settings.dataset}: {error_line(error)}"
        raise TuneError(f"{decode} buffer {buffer_size}: {line}", details) from None
    samples = packs = used = real = 0
    worker_stats: dict[tuple[int, int], PackingStats] = {}
    interrupted = stopped = False
    start = time.perf_counter()
    first_pack = wall = 0.0
    loader: Any = None
    failure: TuneError | None = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'pin_memory' argument is set as true")
            loader = get_savable_loader(dataset)
            start_workers_whole(loader)
            for batch in loader:
                wall = time.perf_counter() - start
                if packs == 0:
                    first_pack = wall
                packs += 1
                samples += len(batch.__keys__)
                used += int(batch.cu_seqlens_padded[-1])
                real += int(batch.cu_seqlens[-1])
                stats = batch.packing_stats
                if stats is not None:
                    worker_stats[(stats.rank, stats.worker)] = stats
                on_pack()
                if settings.enough(samples, packs):
                    stopped = True
                    break
    except KeyboardInterrupt:
        interrupted = True
    except Exception as error:
        failure = run_error(f"{decode} buffer {buffer_size}", error)
    workers, came = wind_up(loader, failure, report_dir, packs)
    interrupted = interrupted or came
    skipped: dict[str, int] = {}
    for stats in worker_stats.values():
        for kind, count in stats.skipped.items():
            skipped[kind] = skipped.get(kind, 0) + count
    complete = settings.one_epoch and not (interrupted or stopped)
    timed = packs >= TIMED_PACKS and wall > 0
    worker_packs = sum(stats.packs for stats in worker_stats.values())
    vision_tokens = sum(s.vision_tokens_mean * s.packs for s in worker_stats.values())
    audio_tokens = sum(s.audio_tokens_mean * s.packs for s in worker_stats.values())
    buffer_full = sum(s.left_buffer_full for s in worker_stats.values())
    worker_samples = sum(s.samples for s in worker_stats.values())
    pack_us = sum(s.pack_us_per_sample * s.samples for s in worker_stats.values())
    capped = sum(s.left_capped for s in worker_stats.values())
    return TuneResult(
        buffer_size=buffer_size,
        decode=decode,
        max_vision_tokens=max_vision_tokens,
        samples=samples,
        packs=packs,
        bin_fill=used / (packs * settings.seq_length) if packs else 0.0,
        token_efficiency=real / used if used else 0.0,
        first_pack_seconds=first_pack,
        packs_per_second=packs / wall if timed else None,
        samples_per_second=samples / wall if timed else None,
        pack_us_per_sample=pack_us / worker_samples if worker_samples else 0.0,
        peak_worker_rss_mb=max((w.peak_rss for w in workers), default=0) / MB,
        steady_worker_rss_mb=max((w.steady_rss for w in workers), default=0) / MB,
        peak_buffer_mb=max((w.peak_buffer_bytes for w in workers), default=0) / MB,
        peak_decoder_rss_mb=max((w.peak_decoder_rss or 0 for w in workers), default=0) / MB,
        buffer_full_share=min(1.0, buffer_full / worker_packs) if worker_packs else 0.0,
        capped_share=min(1.0, capped / worker_packs) if worker_packs else 0.0,
        vision_tokens_mean=vision_tokens / worker_packs if worker_packs else 0.0,
        vision_tokens_max=max((s.vision_tokens_max for s in worker_stats.values()), default=0),
        vision_share=vision_tokens / real if real else 0.0,
        media_max=max((s.media_max for s in worker_stats.values()), default=0),
        audio_tokens_mean=audio_tokens / worker_packs if worker_packs else 0.0,
        audio_tokens_max=max((s.audio_tokens_max for s in worker_stats.values()), default=0),
        skipped=dict(sorted(skipped.items())),
        unaccounted=len(dataset) - samples - sum(skipped.values()) if complete else 0,
        interrupted=interrupted,
    )
