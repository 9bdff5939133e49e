"""``energon-pack tune``: measure packing and worker memory per buffer size on real data.

For each buffer size (and decode mode) the dataset streams through the real Energon loader with
real workers and a :class:`~energon_pack.memory.RSSMonitor` in each worker. A run records bin
fill, token efficiency, first-pack latency, throughput, worker RSS and the samples it skipped
(by kind); :func:`recommend` picks the largest buffer whose projected memory fits a budget.
Token counts come from the tokenizer the user trains with (``TuneSettings.tokenizer``).
"""

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from energon_pack.encoding.chatml import SPECIAL_TOKENS, ByteTokenizer, Tokenizer
from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.family import Family, model_family
from energon_pack.encoding.template import chat_template_of, template_sha256
from energon_pack.formats.dataset_trust import check_dataset_code
from energon_pack.media import MediaConfig, PixelDtype
from energon_pack.memory.monitor import MB, MonitorConfig
from energon_pack.memory.report import load_report, summarize
from energon_pack.packing.bins import Overlong
from energon_pack.packing.buffer import BufferConfig
from energon_pack.packing.packed import Decode
from energon_pack.packing.vision_budget import VisionBudget


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
    tokenizer: str | None = None
    """A transformers tokenizer directory, or a name in the local cache (None: ByteTokenizer)."""
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

    def record(self) -> dict[str, Any]:
        """The settings as the tune report writes them (the vision budget's ``max_media`` and
        ``vision_balance`` as keys of their own)."""
        out: dict[str, Any] = {}
        for name in (f.name for f in fields(self)):
            if name == "vision":
                out.update(max_media=self.vision.max_media, vision_balance=self.vision.balance)
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
    packs_per_second: float = 0.0
    """Packs after the first, over the time they took."""
    samples_per_second: float = 0.0
    """Samples over the time after the first pack."""
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
    vision_tokens_mean: float = 0.0
    """Vision tokens per pack, over all workers."""
    vision_tokens_max: int = 0
    """Most vision tokens in one pack."""
    media_max: int = 0
    """Most images and videos in one pack."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Skipped samples by kind (``overlong`` or a ``MediaError`` kind), over all workers."""
    unaccounted: int = 0
    """Samples of a full epoch neither packed nor in any worker's skip counts."""
    interrupted: bool = False


class TuneError(ValueError):
    """A run stopped on an error. ``str()`` is one line; ``details`` is the full traceback."""

    def __init__(self, message: str, details: str) -> None:
        super().__init__(message)
        self.details = details


class CtrlC:
    """Ctrl-C (SIGINT) in the main thread while active: the first one raises KeyboardInterrupt,
    unless :meth:`hold` was called; every later one, and any while held, is only counted, so
    stopping the workers and writing what was measured is never cut short (no traceback)."""

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


def stop_workers(loader: Any) -> None:
    """Stop the worker processes of a savable ``loader`` now (none started: nothing to do).

    Energon's loader keeps its torch iterator (persistent workers) in a reference cycle, so
    without this the workers live until gc finalizes it, at a random later point and about 5 s
    per worker; torch has no public call for it, so this is the one that finalizer makes.
    """
    iterator = getattr(loader, "_iterator", None)
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def _quiet_on_reset(hook: Callable[..., object], kind: type[BaseException], *rest: Any) -> None:
    """``sys.excepthook`` of a loader worker: a connection the main process dropped is no
    error of the worker's."""
    if not issubclass(kind, ConnectionError):
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
    return Path(__file__).resolve().parents[1] / "fixtures" / "vlm_demo"


@functools.cache
def load_tokenizer(name: str) -> Tokenizer:
    """A transformers tokenizer from a local directory or the local cache; never downloads.

    Raises ValueError when it cannot be loaded offline or lacks the Qwen2-VL special tokens
    that the conversation template uses.
    """
    try:
        from transformers import AutoTokenizer

        tokenizer: Any = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, ...
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"--tokenizer {name!r} cannot be loaded offline ({reason}); pass a directory written "
            "by tokenizer.save_pretrained(...) or the name of a tokenizer in the local Hugging "
            "Face cache"
        ) from None
    unknown = {None, tokenizer.unk_token_id}
    missing = [t for t in SPECIAL_TOKENS if tokenizer.convert_tokens_to_ids(t) in unknown]
    if missing:
        raise ValueError(
            f"--tokenizer {name!r} has no special tokens {missing}, which the ChatML / Qwen2-VL "
            "template uses; pass a Qwen2-VL tokenizer, or add them with "
            "tokenizer.add_special_tokens({'additional_special_tokens': [...]}) and save it"
        )
    loaded: Tokenizer = tokenizer
    return loaded


def describe_tokenizer(name: str | None, family: Family | None = None) -> dict[str, object]:
    """Which tokenizer counts the tokens: ``name``, ``class``, ``vocab_size`` and the
    ``encoding`` the task encoder picks for it (``"template"`` with its chat template's
    ``chat_template_sha256``, else ``"chatml"``; ``"processor"`` for a processor ``family``,
    whose tokenizer it is; see :func:`~energon_pack.make_encoder`)."""
    if isinstance(family, ProcessorFamily):
        tokenizer: Any = family.tokenizer
        name, encoding = f"the {family.name} processor's", "processor"
    elif name is None:
        size = ByteTokenizer().vocab_size
        return {"name": "byte", "class": "ByteTokenizer", "vocab_size": size, "encoding": "chatml"}
    else:
        tokenizer = load_tokenizer(name)
        encoding = "template" if chat_template_of(tokenizer) is not None else "chatml"
    info: dict[str, object] = {
        "name": name,
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "encoding": encoding,
    }
    template = chat_template_of(tokenizer)
    if template is not None and encoding != "chatml":
        info["chat_template_sha256"] = template_sha256(template)
    return info


def tokenizer_label(name: str | None) -> str:
    """A short name for titles: the directory's name, the hub name, or ``byte``."""
    return "byte" if name is None else Path(name).name or name


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


def run_once(
    settings: TuneSettings,
    buffer_size: int,
    decode: Decode,
    report_dir: Path,
    on_samples: Callable[[int], object] = lambda count: None,
    max_vision_tokens: int | None = None,
) -> TuneResult:
    """Stream the dataset once with this buffer size; Ctrl-C ends the run early (marked).

    Raises :class:`TuneError` (one line, naming the run) when the run stops on an error, in the
    main process or in a loader worker.
    """
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    from energon_pack.energon import PackingStats, PackingTaskEncoder

    if not settings.trust_dataset_code:
        check_dataset_code(settings.dataset, settings.dataset_config)
    family = model_family(settings.family) if settings.family else None
    if isinstance(family, ProcessorFamily):  # its processor's tokenizer and pixels
        if settings.tokenizer:
            raise ValueError(
                f"--tokenizer with the {family.name!r} family: its processor brings its own "
                "tokenizer; drop --tokenizer"
            )
        if settings.pixel_dtype != "float32":
            raise ValueError(
                f"--pixel-dtype {settings.pixel_dtype} with the {family.name!r} family: its "
                "processor gives float32 pixels; drop --pixel-dtype"
            )
        tokenizer, media = family.tokenizer, MediaConfig()
    else:
        tokenizer = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
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
        buffer=BufferConfig(decode=decode, monitor=monitor),
        vision=replace(settings.vision, max_vision_tokens=max_vision_tokens),
    )
    one_epoch = settings.max_samples is None
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
            repeat=not one_epoch,
        )
    except Exception as error:  # Energon's errors opening the dataset: any type
        details = "".join(traceback.format_exception(error))
        line = f"cannot open the dataset {settings.dataset}: {error_line(error)}"
        raise TuneError(f"{decode} buffer {buffer_size}: {line}", details) from None
    samples = packs = used = real = 0
    worker_stats: dict[tuple[int, int], PackingStats] = {}
    interrupted = False
    start = time.perf_counter()
    first_pack = steady_start = 0.0
    loader: Any = None
    failure: TuneError | None = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'pin_memory' argument is set as true")
            loader = get_savable_loader(dataset)
            start_workers_whole(loader)
            for batch in loader:
                if packs == 0:
                    first_pack = steady_start = time.perf_counter() - start
                packs += 1
                samples += len(batch.__keys__)
                used += int(batch.cu_seqlens_padded[-1])
                real += int(batch.cu_seqlens[-1])
                stats = batch.packing_stats
                if stats is not None:
                    worker_stats[(stats.rank, stats.worker)] = stats
                on_samples(len(batch.__keys__))
                if settings.max_samples is not None and samples >= settings.max_samples:
                    break
    except KeyboardInterrupt:
        interrupted = True
    except Exception as error:
        details = "".join(traceback.format_exception(error))
        failure = TuneError(f"{decode} buffer {buffer_size}: {error_line(error)}", details)
    elapsed = time.perf_counter() - start - steady_start
    with sigint_held() as came:  # a second Ctrl-C must not leave workers running
        stop_workers(loader)
        if failure is not None:
            raise failure
        workers = summarize(load_report(report_dir)) if packs else []
    interrupted = interrupted or bool(came)
    skipped: dict[str, int] = {}
    for stats in worker_stats.values():
        for kind, count in stats.skipped.items():
            skipped[kind] = skipped.get(kind, 0) + count
    complete = one_epoch and not interrupted
    worker_packs = sum(stats.packs for stats in worker_stats.values())
    vision_tokens = sum(s.vision_tokens_mean * s.packs for s in worker_stats.values())
    buffer_full = sum(s.left_buffer_full for s in worker_stats.values())
    return TuneResult(
        buffer_size=buffer_size,
        decode=decode,
        max_vision_tokens=max_vision_tokens,
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
        peak_decoder_rss_mb=max((w.peak_decoder_rss or 0 for w in workers), default=0) / MB,
        buffer_full_share=min(1.0, buffer_full / worker_packs) if worker_packs else 0.0,
        vision_tokens_mean=vision_tokens / worker_packs if worker_packs else 0.0,
        vision_tokens_max=max((s.vision_tokens_max for s in worker_stats.values()), default=0),
        media_max=max((s.media_max for s in worker_stats.values()), default=0),
        skipped=dict(sorted(skipped.items())),
        unaccounted=len(dataset) - samples - sum(skipped.values()) if complete else 0,
        interrupted=interrupted,
    )


TUNE_HEADERS = [
    "decode",
    "buffer",
    "vision cap",
    "samples",
    "bin fill",
    "buffer full",
    "token eff",
    "first pack s",
    "samples/s",
    "peak RSS MiB",
    "steady MiB",
    "buffer MiB",
    "decoder MiB",
    "vision/pack",
    "vision max",
    "skipped",
    "status",
]


def skipped_cell(result: TuneResult) -> str:
    """``overlong 3, corrupt 1`` (and any unaccounted samples), or ``0``."""
    parts = [f"{kind} {count}" for kind, count in result.skipped.items()]
    if result.unaccounted:
        parts.append(f"unaccounted {result.unaccounted}")
    return ", ".join(parts) or "0"


def tune_row(result: TuneResult) -> list[object]:
    """One table row (see :data:`TUNE_HEADERS`)."""
    return [
        result.decode,
        result.buffer_size,
        result.max_vision_tokens or "-",
        result.samples,
        result.bin_fill,
        f"{result.buffer_full_share:.0%}",
        result.token_efficiency,
        f"{result.first_pack_seconds:.2f}",
        f"{result.samples_per_second:.1f}",
        f"{result.peak_worker_rss_mb:.0f}",
        f"{result.steady_worker_rss_mb:.0f}",
        f"{result.peak_buffer_mb:.1f}",
        f"{result.peak_decoder_rss_mb:.0f}",
        f"{result.vision_tokens_mean:.0f}",
        result.vision_tokens_max,
        skipped_cell(result),
        "interrupted" if result.interrupted else "ok",
    ]


BUFFER_BOUND_SHARE = 0.5
"""A run is buffer-bound where more than this share of its packs left because the buffer was
full and its bin fill is below :data:`BUFFER_BOUND_FILL` (:func:`buffer_bound_note`)."""
BUFFER_BOUND_FILL = 0.95


def buffer_bound_note(result: TuneResult) -> str | None:
    """A line for a completed run whose buffer holds fewer samples than a row needs, else None."""
    if (
        result.interrupted
        or result.buffer_full_share <= BUFFER_BOUND_SHARE
        or result.bin_fill >= BUFFER_BOUND_FILL
    ):
        return None
    return (
        f"{result.decode} buffer {result.buffer_size}: bin fill {result.bin_fill:.3f} with "
        f"{result.buffer_full_share:.0%} of packs leaving because the buffer was full: it holds "
        "fewer samples than a row needs, so a larger packing_buffer_size fills more (and lets "
        "a vision budget hold samples back without costing fill)"
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
