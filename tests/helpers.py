"""Reusable test helpers."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, TypeVar

import av
import numpy as np
from PIL import Image

from energon_pack.media import MediaConfig

# Small vision budgets keep decoding cheap; the token layout rules are the same.
SMALL_MEDIA = MediaConfig(
    max_pixels=28 * 28 * 64,
    video_min_pixels=28 * 28 * 4,
    video_max_pixels=28 * 28 * 16,
    video_total_pixels=28 * 28 * 256,
    video_fps=1.0,
)

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


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def video_bytes(width: int = 96, height: int = 64, frames: int = 8, fps: int = 4) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        for index in range(frames):
            array = np.full((height, width, 3), index * 20, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(array, format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()
