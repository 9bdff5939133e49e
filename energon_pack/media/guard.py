"""Crash-proof media decoding: native decoder calls run in a persistent helper process.

decord (FFmpeg) can segfault, abort or hang on a corrupt MP4, and Pillow's decoders are C code
too. :func:`guarded` runs such a call in a small helper process, one per calling process,
started on first use and restarted after it dies; the helper loads only the torch-free decoding
modules (it maps ``energon_pack`` and ``energon_pack.media`` without running their
``__init__``, so the module of a function it runs must import their submodules). The request
carries the compressed bytes; :func:`guarded_frames_each` has the decoder write its uint8
frames straight into a shared memory block the helper reuses, and the caller consumes them
there (no copy on either side), for a batch (a pack's files) the next file decoded while the
caller consumes the last. A helper that dies becomes a
:class:`~energon_pack.media.MediaError` of kind ``crashed``, one that does not answer within
the timeout is killed and becomes kind ``timeout``; either way the caller's process goes on
with the next sample.

The helper knows no sample names: it answers with the decoder's
:class:`~energon_pack.media.errors.MediaFailure` (an unexpected exception made one of the
caller's kind, :func:`~energon_pack.media.errors.failures`), and the calls here are the boundary
that names the sample (:func:`~energon_pack.media.errors.media_errors`): a ``MediaError`` of
the job's key and member, ``MemoryError`` and ``KeyboardInterrupt`` re-raised as the same type
with the sample named.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from typing import Any, NamedTuple, TypeVar

import numpy as np

from energon_pack.media.config import Isolation, MediaConfig
from energon_pack.media.errors import (
    FallbackKind,
    MediaError,
    MediaFailure,
    failures,
    labelled,
    media_errors,
    naming,
)

__all__ = [
    "Alloc",
    "FramesJob",
    "UInt8Array",
    "alloc_in_process",
    "guarded",
    "guarded_decode_each",
    "guarded_frames_each",
    "guarded_read",
    "helper_pid",
    "shutdown_helper",
]


R = TypeVar("R")
UInt8Array = np.ndarray[Any, np.dtype[np.uint8]]
Alloc = Callable[[tuple[int, ...]], UInt8Array]
"""Gives the uint8 array a :func:`guarded_frames_each` decoder writes its frames into."""


class _Region(NamedTuple):
    """Where in the helper's block a call writes its frames."""

    offset: int
    limit: int | None  # bytes the frames may take (None: grow the block as needed)
    reserve: int  # block size to make room for when it grows


class _Request(NamedTuple):
    """What the helper runs: ``module.qualname(*args)``, with an alloc into ``region`` (None: a
    plain call whose result is the reply)."""

    module: str
    qualname: str
    args: tuple[Any, ...]
    label: str  # the medium, for the helper's log lines
    kind: FallbackKind  # what an unexpected exception becomes
    region: _Region | None


@dataclass(frozen=True)
class FramesJob:
    """One call of a :func:`guarded_frames_each` batch: ``fn(*args, alloc)`` for sample
    ``key``, member ``member``, whose frames take ``nbytes`` (known from its probe; ``None``:
    unknown, the block grows to fit, only in a batch of one). Its failures are named with
    ``position`` (:attr:`~energon_pack.media.MediaError.position`)."""

    args: tuple[Any, ...]
    key: str
    member: str
    nbytes: int | None = None
    position: int | None = None

    def errors(self, kind: FallbackKind) -> contextlib.AbstractContextManager[None]:
        """The boundary of this job's decoding (:func:`media_errors`)."""
        return media_errors(self.key, self.member, kind, position=self.position)

    def named(self) -> contextlib.AbstractContextManager[None]:
        """The boundary of this job's ``use`` (:func:`naming`: only failures are named)."""
        return naming(self.key, self.member, position=self.position)


_START_TIMEOUT_S = 120.0  # starting Python, numpy, Pillow and decord on a loaded machine
# The helper maps both packages as bare modules, without running energon_pack/__init__.py or
# energon_pack/media/__init__.py (which import torch and everything else): it loads only the
# modules its requests name, which keeps it small.
_ENTRY = (
    "import sys, types\n"
    "for name, path in zip(('energon_pack', 'energon_pack.media'), sys.argv[3:5]):\n"
    "    sys.modules[name] = types.ModuleType(name); sys.modules[name].__path__ = [path]\n"
    "from energon_pack.media.guard import _main; _main()"
)
_PILLOW_BLOCKS_MAX = 8  # memory blocks Pillow keeps in the helper (each at most 16 MiB)


def guarded(
    fn: Callable[..., R],
    *args: Any,
    key: str,
    member: str,
    kind: FallbackKind,
    isolation: Isolation,
    timeout_s: float,
) -> R:
    """``fn(*args)``, run in the helper process unless ``isolation == "off"``.

    ``fn`` must be a module-level function whose arguments and result pickle. Failures become
    ``MediaError(key, member, ...)``: ``crashed`` when the helper dies, ``timeout`` after
    ``timeout_s`` seconds, else ``kind`` for an unexpected exception (see :func:`media_errors`).
    """
    with media_errors(key, member, kind):
        if isolation == "off":
            return fn(*args)
        request = _Request(fn.__module__, fn.__qualname__, args, f"{key}/{member}", kind, None)
        result: R = _helper().call(request, timeout_s)
        return result


def guarded_read(
    fn: Callable[[bytes, MediaConfig], R], data: bytes, cfg: MediaConfig, *, key: str, member: str
) -> R:
    """:func:`guarded` for a header reader ``fn(data, cfg)``, with ``cfg``'s decode isolation
    and timeout, an unexpected failure being kind ``unreadable``."""
    return guarded(
        fn,
        data,
        cfg,
        key=key,
        member=member,
        kind="unreadable",
        isolation=cfg.decode_isolation,
        timeout_s=cfg.decode_timeout_s,
    )


def guarded_frames_each(
    fn: Callable[..., tuple[UInt8Array, Any]],
    jobs: Sequence[FramesJob],
    *,
    use: Callable[[int, UInt8Array, Any], None],
    kind: FallbackKind,
    isolation: Isolation,
    timeout_s: float,
) -> None:
    """``use(i, *fn(*job.args, alloc))`` for each job ``i``, in order, with ``fn`` in the helper
    process unless ``isolation == "off"``.

    ``fn`` writes its frames into ``alloc(shape)`` (in the helper: the shared block) and
    returns ``(frames, extra)``, ``extra`` picklable. ``use`` runs in this process on a view of
    the frames that is valid only during the call (the block is reused), so it must copy what
    it keeps. In the helper, job ``i + 1`` is decoded while ``use`` runs on job ``i`` (each into
    its own half of the shared block, sized from the largest ``nbytes``), so the calling
    process waits less.

    The first failure is raised, and the jobs after it are not run: a decoder's failure as
    :func:`guarded` raises it, named with its job's key, member and position; frames larger
    than their job's ``nbytes`` are a ``MediaError``. A ``MediaFailure`` from ``use`` is named
    too, other exceptions from ``use`` propagate unchanged.
    """
    if not jobs:
        return
    if isolation == "off":
        for index, job in enumerate(jobs):
            with job.errors(kind):
                frames, extra = fn(*job.args, alloc_in_process)
            with job.named():
                use(index, frames, extra)
        return
    if len(jobs) > 1 and any(job.nbytes is None for job in jobs):
        raise ValueError("every job of a batch needs its nbytes: two jobs share the block")
    _helper().call_each(fn, jobs, kind, timeout_s, use)


def guarded_decode_each(
    fn: Callable[..., tuple[UInt8Array, Any]],
    jobs: Sequence[FramesJob],
    cfg: MediaConfig,
    *,
    use: Callable[[int, UInt8Array, Any], None],
) -> None:
    """:func:`guarded_frames_each` with ``cfg``'s decode isolation and timeout, an unexpected
    failure of the decoder being kind ``corrupt``."""
    guarded_frames_each(
        fn,
        jobs,
        use=use,
        kind="corrupt",
        isolation=cfg.decode_isolation,
        timeout_s=cfg.decode_timeout_s,
    )


def alloc_in_process(shape: tuple[int, ...]) -> UInt8Array:
    """The :data:`Alloc` of in-process decoding: a new array."""
    return np.empty(shape, dtype=np.uint8)


def helper_pid() -> int | None:
    """The process id of this process's helper, ``None`` before it starts (e.g. to watch its
    memory or CPU time)."""
    helper = _HELPER.get(os.getpid())
    return helper.pid if helper is not None else None


def shutdown_helper() -> None:
    """Stop this process's helper (it is also stopped at exit, or when its parent goes away)."""
    helper = _HELPER.get(os.getpid())
    if helper is not None:
        helper.close()


class _Helper:
    """Client side of one helper process: a request pipe, a reply pipe, the shared block."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._requests: Connection | None = None
        self._replies: Connection | None = None
        self._block: shared_memory.SharedMemory | None = None
        self._retired: list[shared_memory.SharedMemory] = []

    @property
    def pid(self) -> int | None:
        """The helper's process id while it runs."""
        return self._proc.pid if self._proc is not None else None

    def call(self, request: _Request, timeout_s: float) -> Any:
        """The result of a plain ``request``; failures are not named."""
        with self._lock:
            self._send(request)
            return self._receive(timeout_s)

    def call_each(
        self,
        fn: Callable[..., Any],
        jobs: Sequence[FramesJob],
        kind: FallbackKind,
        timeout_s: float,
        use: Callable[[int, UInt8Array, Any], None],
    ) -> None:
        """:func:`guarded_frames_each`: job ``i + 1`` is sent before ``use`` runs on job ``i``,
        into the other half of the shared block; each job's failures are named by its own
        boundary."""
        size = max(job.nbytes or 0 for job in jobs)
        with self._lock:

            def send(index: int) -> None:
                job = jobs[index]
                region = _Region((index % 2) * size, job.nbytes, 2 * size)
                label = f"{job.key}/{job.member}"
                self._send(_Request(fn.__module__, fn.__qualname__, job.args, label, kind, region))

            send(0)
            for index, job in enumerate(jobs):
                with job.errors(kind):
                    name, offset, shape, extra = self._receive(timeout_s)
                ahead = index + 1 < len(jobs)
                if ahead:
                    send(index + 1)
                try:
                    with job.named():
                        use(index, self._frames(name, offset, shape), extra)
                except BaseException:
                    if ahead:  # leave nothing in flight for the next call
                        with contextlib.suppress(MediaError), jobs[index + 1].errors(kind):
                            self._receive(timeout_s)
                    raise

    def _send(self, request: _Request) -> None:
        requests, _ = self._started()
        with contextlib.suppress(OSError):  # the helper is gone: the reply tells how it ended
            requests.send(request)

    def _receive(self, timeout_s: float) -> Any:
        """The next reply's payload; a :class:`MediaFailure` (``crashed``, ``timeout``, or the
        decoder's own) or ``MemoryError`` when there is none."""
        replies = self._replies
        assert replies is not None  # a request was sent
        try:
            reply: tuple[str, Any] | None = replies.recv() if replies.poll(timeout_s) else None
        except (EOFError, OSError):
            raise MediaFailure("crashed", self._died()) from None
        if reply is None:
            self._kill()
            raise MediaFailure(
                "timeout",
                f"decoding took longer than decode_timeout_s={timeout_s}; the decoder "
                "process was stopped (raise MediaConfig.decode_timeout_s for huge media)",
            )
        status, payload = reply
        if status == "memory":
            raise MemoryError(f"(decoder process) {payload}")
        if status == "error":
            raise payload  # the decoder's failure, made in the helper
        return payload

    def _frames(self, name: str, offset: int, shape: tuple[int, ...]) -> UInt8Array:
        """A view of the frames at ``offset`` in the helper's block ``name``."""
        if self._block is None or self._block.name != name:
            self._unmap()
            self._block = shared_memory.SharedMemory(name=name)
            # The helper owns (and unlinks) the block; this process only maps it.
            resource_tracker.unregister(self._block._name, "shared_memory")  # type: ignore[attr-defined]
        buffer = self._block.buf
        assert buffer is not None  # an attached block is mapped
        count = math.prod(shape)
        return np.frombuffer(buffer, dtype=np.uint8, count=count, offset=offset).reshape(shape)

    def _started(self) -> tuple[Connection, Connection]:
        if self._proc is not None and self._requests is not None and self._replies is not None:
            return self._requests, self._replies
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        media_dir = os.path.dirname(os.path.abspath(__file__))
        package_dir = os.path.dirname(media_dir)
        package_root = os.path.dirname(package_dir)
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
        # The helper decodes file after file, so freed memory is worth keeping for the next one
        # (fewer page faults; measured in benchmarks/media.py): Pillow keeps a few memory blocks
        # (it frees every image's by default), and glibc starts from the thresholds its own
        # adaptation reaches in a long-lived process (32 MiB mmap, 64 MiB trim) instead of
        # mapping and unmapping every large buffer until then. Settings in the caller's
        # environment win.
        env.setdefault("PILLOW_BLOCKS_MAX", str(_PILLOW_BLOCKS_MAX))
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(64 << 20))
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _ENTRY,
                str(request_read),
                str(reply_write),
                package_dir,
                media_dir,
            ],
            pass_fds=(request_read, reply_write),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(request_read)
        os.close(reply_write)
        self._requests = Connection(request_write, readable=False)
        self._replies = Connection(reply_read, writable=False)
        if not self._replies.poll(_START_TIMEOUT_S):
            self._kill()
            raise RuntimeError(
                f"the media decoder process did not start within {_START_TIMEOUT_S} s"
            )
        self._replies.recv()  # "ready"
        return self._requests, self._replies

    def _died(self) -> str:
        proc = self._proc
        code = proc.wait() if proc is not None else None
        self._reset()
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the decoder crashed ({name}); the decoder process was restarted"
        return f"the decoder process exited with status {code}; it was restarted"

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
        self._reset()

    def _reset(self) -> None:
        connections = (self._requests, self._replies)
        self._proc = self._requests = self._replies = None
        for conn in connections:
            if conn is not None:
                conn.close()
        self._unmap()

    def _unmap(self) -> None:
        """Drop the mapping of the helper's block. A view may still be alive in an exception's
        traceback (one raised by ``use``): such a block is kept and closed on a later call."""
        if self._block is not None:
            self._retired.append(self._block)
            self._block = None
        still_viewed = []
        for block in self._retired:
            try:
                block.close()
            except BufferError:
                still_viewed.append(block)
        self._retired = still_viewed

    def close(self) -> None:
        with self._lock:
            if self._requests is not None:
                self._requests.close()  # the helper exits on end of input
                self._requests = None
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._reset()


_HELPER: dict[int, _Helper] = {}


def _helper() -> _Helper:
    """This process's helper client (a forked DataLoader worker gets its own)."""
    pid = os.getpid()
    helper = _HELPER.get(pid)
    if helper is None:
        helper = _HELPER[pid] = _Helper()
    return helper


atexit.register(shutdown_helper)  # runs in the process that exits: it stops only its own helper


# --- helper process -------------------------------------------------------------------------


class _Block:
    """The helper's reusable shared block, replaced by a larger one when frames do not fit."""

    def __init__(self) -> None:
        self.shm: shared_memory.SharedMemory | None = None
        self.last: UInt8Array | None = None  # what alloc gave last

    def alloc(self, shape: tuple[int, ...], region: _Region) -> UInt8Array:
        """A uint8 array of ``shape`` at the region's offset (valid until the next call)."""
        need = math.prod(shape)
        if region.limit is not None and need > region.limit:
            raise MediaFailure(
                "corrupt",
                f"decodes to {need} bytes of patches where its probe planned {region.limit}; "
                "the probe and the decode disagree (same MediaConfig?)",
            )
        self.last = None
        end = region.offset + need
        if self.shm is None or self.shm.size < end:
            self.close()
            size = max(end, region.reserve, 1 << 20)
            self.shm = shared_memory.SharedMemory(create=True, size=size)
        assert self.shm.buf is not None  # a created block is mapped
        flat = np.frombuffer(self.shm.buf, dtype=np.uint8, count=need, offset=region.offset)
        self.last = flat.reshape(shape)
        return self.last

    def close(self) -> None:
        self.last = None
        if self.shm is None:
            return
        self.shm.unlink()
        try:
            self.shm.close()
        except BufferError:  # a failed call's traceback still holds a view
            gc.collect()
            self.shm.close()
        self.shm = None


def _serve(requests: Connection, replies: Connection) -> None:
    """Answer requests until the client closes its end."""
    block = _Block()
    replies.send("ready")
    try:
        while True:
            try:
                request = requests.recv()
            except EOFError:
                return
            replies.send(_answer(block, request))
    finally:
        block.close()


def _answer(block: _Block, request: _Request) -> tuple[str, Any]:
    module, qualname, args, label, kind, region = request
    try:
        fn = getattr(importlib.import_module(module), qualname)
        with labelled(label), failures(kind):
            if region is None:
                return "ok", fn(*args)
            array, extra = fn(*args, functools.partial(block.alloc, region=region))
            if block.last is None or array is not block.last:
                raise TypeError(f"{qualname} must return the array its alloc gave")
    except MemoryError as exc:
        return "memory", str(exc) or "out of memory"
    except (MediaFailure, MediaError) as exc:
        return "error", exc
    assert block.shm is not None  # alloc made it
    return "frames", (block.shm.name, region.offset, array.shape, extra)


def _main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the client's to handle
    requests = Connection(int(sys.argv[1]), writable=False)
    replies = Connection(int(sys.argv[2]), readable=False)
    _serve(requests, replies)
