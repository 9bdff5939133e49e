"""Run one test-side function in a child process that can import torchvision.

Some transformers processors exist only with torchvision (e.g. ``Kimi_K25ImageProcessor``),
which this test process must never import (the CPU torch pin). :func:`run_in_child` starts
``python tests/support/torchvision_child.py`` with the reference torchvision of
``scripts/venv.sh`` on its path; the child defines the torchvision operator schemas and imports
it as :mod:`qwen3_reference` does (its :func:`~qwen3_reference._import_torchvision`), imports the
target ``"module:function"`` (a module of ``tests/support/`` or a test module this process has
imported, e.g. ``test_family_kimi_k25``), calls it on the unpickled payload and
pickles the result to a file: send and return plain values (lists, numbers, strings, numpy
arrays), so the asserting stays in the test process.
"""

from __future__ import annotations

import functools
import importlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qwen3_reference import REFERENCE_DIR, available

__all__ = ["MISTRAL_DIR", "available", "reported", "run_in_child"]

MISTRAL_DIR = Path(sys.prefix) / "mistral"
"""Where ``scripts/venv.sh`` installs mistral-common and the audio readers its processor path
needs."""


def reported(check: Callable[[Any], dict[str, Any]]) -> Callable[[Any], dict[str, Any]]:
    """``check`` for :func:`run_in_child`: its result, or an exception's traceback under
    ``"error"`` (sent back whole: the test process asserts on it)."""

    @functools.wraps(check)
    def run(payload: Any) -> dict[str, Any]:
        try:
            return check(payload)
        except Exception:
            return {"error": traceback.format_exc()}

    return run


def run_in_child(
    target: str, payload: Any = None, timeout: float = 600, *, mistral: bool = False
) -> Any:
    """``module.function(payload)`` (``target`` is ``"module:function"``, ``module`` a module
    of ``tests/support/`` or an imported test module) run in a child process that has imported
    torchvision (and can import mistral-common, Voxtral's tokenizer backend, with ``mistral``);
    its result, with the child's wall time in seconds under ``"child_seconds"`` when the result
    is a dict."""
    if not available():
        raise RuntimeError(f"the reference torchvision is not installed in {REFERENCE_DIR}")
    path = [REFERENCE_DIR, Path(__file__).resolve().parent]
    if mistral:
        if not MISTRAL_DIR.is_dir():
            raise RuntimeError(f"the reference mistral-common is not installed in {MISTRAL_DIR}")
        path.insert(1, MISTRAL_DIR)
    module = sys.modules.get(target.split(":")[0])
    if getattr(module, "__file__", None):  # a test module: its stage folder, e.g. tests/encoding
        path.append(Path(str(module.__file__)).resolve().parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(map(str, path)),
        "OMP_NUM_THREADS": "1",
    }
    with tempfile.TemporaryDirectory(prefix="torchvision-child-") as scratch:
        result_path = Path(scratch) / "result.pickle"
        done = subprocess.run(
            [sys.executable, __file__, target, str(result_path)],
            input=pickle.dumps(payload),
            capture_output=True,
            env=env,
            timeout=timeout,
            check=False,
            cwd=scratch,
        )
        if done.returncode != 0 or not result_path.exists():
            raise RuntimeError(
                f"torchvision child {target} failed:\n{done.stderr.decode()[-6000:]}"
            )
        result: Any = pickle.loads(result_path.read_bytes())
    return result


def _main() -> None:
    start = time.perf_counter()
    from qwen3_reference import _import_torchvision

    _import_torchvision()
    target, result_path = sys.argv[1], Path(sys.argv[2])
    module_name, function_name = target.split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    result = function(pickle.loads(sys.stdin.buffer.read()))
    if isinstance(result, dict):
        result["child_seconds"] = time.perf_counter() - start
    result_path.write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    _main()
