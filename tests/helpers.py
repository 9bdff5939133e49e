"""Reusable test helpers."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
Step = Callable[[T], Any]


def json_roundtrip(state: Any) -> Any:
    """The state as it comes back from a JSON file (and proof that it is JSON-able)."""
    return json.loads(json.dumps(state))


def assert_resume_equivalent(
    make: Callable[[], T],
    steps: Sequence[Step[T]],
    at: int,
    *,
    save: Callable[[T], Any],
    load: Callable[[T, Any], None],
    roundtrip: Callable[[Any], Any] = json_roundtrip,
) -> None:
    """Check that a stateful piece resumes exactly.

    Runs every step on a fresh object (the reference); runs the first ``at`` steps on another,
    saves its state, passes it through ``roundtrip``, loads it into a third fresh object and
    runs the remaining steps there. What each remaining step returns must equal the reference.
    """
    reference = make()
    expected = [step(reference) for step in steps]
    first = make()
    for step in steps[:at]:
        step(first)
    state = roundtrip(save(first))
    resumed = make()
    load(resumed, state)
    got = [step(resumed) for step in steps[at:]]
    assert got == expected[at:], f"resumed at step {at} of {len(steps)} diverged"
