"""Ctrl-C as a terminal presses it: run the ``energon-pack`` command line in its own process
group, send SIGINT to the group once some output appears, and check what is left of it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
EXIT_SECONDS = 10.0
"""From Ctrl-C to the exit of a tune (it prints and writes what it measured): a few seconds, also
on a loaded machine; a run once hung for minutes."""


def _read(fd: int, into: list[bytes]) -> None:
    while chunk := os.read(fd, 65536):  # not by lines: a progress bar redraws with \r
        into.append(chunk)


def left_in_group(group: int, grace_s: float) -> list[str]:
    """The live processes of a process group (its loader workers, their decoder processes)
    that are still there after ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for proc in psutil.process_iter(["name", "status"]):
            with contextlib.suppress(OSError, psutil.Error):
                if os.getpgid(proc.pid) == group and proc.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.pid} {proc.info['name']}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def interrupt_cli(
    args: list[str],
    *,
    when: tuple[str, str],
    again: bool = False,
    path: tuple[Path, ...] = (),
) -> tuple[int | None, float, str, str]:
    """Run ``energon-pack ARGS`` in a child process and press Ctrl-C (SIGINT to its process
    group, as a terminal does) once its ``when = (stream, regex)`` output appears (``again``:
    once more 0.3 s later); ``path``: folders on its PYTHONPATH after the project's. Fails where
    a process of the group outlives it by 2 s. Returns the exit status (None: no exit within
    :data:`EXIT_SECONDS`), the seconds from the first Ctrl-C to the exit, stdout and stderr."""
    python_path = os.pathsep.join(map(str, (ROOT, *path)))
    env = {**os.environ, "PYTHONPATH": python_path, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "energon_pack.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, as in a terminal
    )
    assert process.stdout is not None
    assert process.stderr is not None
    streams: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    readers = [
        threading.Thread(target=_read, args=(pipe.fileno(), streams[name]), daemon=True)
        for name, pipe in (("stdout", process.stdout), ("stderr", process.stderr))
    ]
    for reader in readers:
        reader.start()

    def text(name: str) -> str:
        return b"".join(streams[name]).decode(errors="replace")

    stream, pattern = when
    deadline = time.monotonic() + 300
    try:
        while not re.search(pattern, text(stream)):
            assert process.poll() is None, text("stderr")
            assert time.monotonic() < deadline, f"no {pattern!r} in {stream}: {text(stream)}"
            time.sleep(0.05)
        interrupted = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        if again:
            time.sleep(0.3)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=EXIT_SECONDS)
        seconds = time.monotonic() - interrupted
        left = left_in_group(process.pid, grace_s=2.0)
        assert not left, f"processes outlived energon-pack {args[0]}: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):  # the workers too, if any is left
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for reader in readers:
        reader.join(timeout=10)
    print(f"exit {seconds:.2f} s after Ctrl-C")  # shown with -s
    return process.returncode if seconds < EXIT_SECONDS else None, seconds, *map(text, streams)


def assert_interrupted_exit(status: int | None, seconds: float, stderr: str) -> None:
    """Exit 130 within :data:`EXIT_SECONDS` of the Ctrl-C, and no traceback."""
    assert status is not None, f"no exit {seconds:.1f} s after Ctrl-C: {stderr}"
    assert status == 130, stderr
    assert "Traceback" not in stderr


LOST_CTRL_C = """
import signal
_install = signal.signal


def _swallowing(signum, handler):
    # The KeyboardInterrupt of tune's Ctrl-C handler is lost, as where it is raised inside the
    # module init of a C extension being imported (numpy.random), which clears it.
    if getattr(handler, "__name__", "") != "_on_sigint":
        return _install(signum, handler)

    def swallowed(signum, frame):
        try:
            handler(signum, frame)
        except KeyboardInterrupt:
            pass

    return _install(signum, swallowed)


signal.signal = _swallowing
"""


def losing(folder: Path) -> Path:
    """A folder that, on a child's PYTHONPATH, makes the KeyboardInterrupt of tune's Ctrl-C
    handler be lost (:data:`LOST_CTRL_C`, its ``sitecustomize.py``)."""
    lost = folder / "lost_ctrl_c"
    lost.mkdir(exist_ok=True)
    (lost / "sitecustomize.py").write_text(LOST_CTRL_C)
    return lost
