"""Run a seeded fuzzing script in a child process, so that a native crash or a hang is seen as
the child's death rather than taking the test process with it; and the seeded byte mutator
those scripts share (import it in the child: ``from fuzz_child import mutated``)."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

Field = Callable[[random.Random, bytearray, int], None]
"""Overwrites a header field of ``data`` in place (or leaves it, where none fits), drawing from
``rng``; called as ``field(rng, data, how)`` with the draw ``how`` (2 or 3) that chose it."""


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


def mutated(rng: random.Random, seed: bytes, field: Field, *, min_length: int = 0) -> bytes:
    """``seed`` after 1 to 3 mutations drawn from ``rng``, each (by a draw of 0 to 3) a byte set
    to a random value, the tail cut off, or a header field overwritten by ``field``; it stops
    early at a draw that finds the data shorter than ``min_length``."""
    data = bytearray(seed)
    for _ in range(rng.randint(1, 3)):
        how = rng.randrange(4)
        if len(data) < min_length:
            break
        if how == 0:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == 1:
            del data[rng.randrange(1, len(data)) :]
        else:
            field(rng, data, how)
    return bytes(data)


def marker_field(
    markers: Sequence[bytes], values: Sequence[int], *, shift: int, span: int, orders: str = ">"
) -> Field:
    """A :data:`Field` that sets the 4 bytes ``shift`` plus a draw below ``span`` after the
    first place of a drawn one of ``markers`` (none found, or past either end: nothing) to one
    of ``values`` (``how`` 2) or any 32-bit value (3), in a byte order drawn from ``orders``
    (no draw for one)."""

    def field(rng: random.Random, data: bytearray, how: int) -> None:
        found = [i for m in markers for i in [data.find(m)] if i >= 0]
        if not found:
            return
        at = rng.choice(found) + shift + rng.randrange(0, span)
        if at < 0 or at + 4 > len(data):
            return
        value = rng.choice(values) if how == 2 else rng.randrange(2**32)
        order = rng.choice(orders) if len(orders) > 1 else orders
        data[at : at + 4] = struct.pack(order + "I", value)

    return field
