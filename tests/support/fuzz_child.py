"""Run a seeded fuzzing script in a child process, so that a native crash or a hang is seen as
the child's death rather than taking the test process with it."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def fuzz_report(script: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    """``python -c script *args`` in a child: the JSON object its last printed line holds. The
    child must exit 0 (an assertion names its status and stderr's tail otherwise)."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"child died with {done.returncode}: {done.stderr[-2000:]}"
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report
