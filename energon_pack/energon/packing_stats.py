"""The per-worker packing figures every pack of the Energon loader carries
(:class:`PackingStats`), and the clock that times the worker's packer (:class:`PackClock`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PackingStats:
    """Per-worker packing figures, attached to every emitted pack as ``packing_stats``."""

    rank: int
    worker: int
    packs: int = 0
    samples: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    """Skipped samples by reason: ``overlong``, ``over_max_vision_tokens``,
    ``over_max_media`` or the :class:`MediaError` kind."""
    bin_fill: float = 0.0
    token_efficiency: float = 0.0
    buffer_count: int = 0
    buffer_bytes: int = 0
    mean_wait: float = 0.0
    max_wait: int = 0
    left_buffer_full: int = 0
    """Packs that left because the buffer was full, not because they were full enough. Most of
    them with a low ``bin_fill``: the buffer holds fewer samples than a row needs."""
    left_capped: int = 0
    """Of those, packs that left under 0.9 of the row while the vision caps kept out a held
    sample that fit by tokens: the caps, not the buffer, held their fill down (counted since
    the worker's packer started or was restored)."""
    vision_tokens_mean: float = 0.0
    """Vision tokens per pack so far (as chosen, before any media failure)."""
    vision_tokens_max: int = 0
    media_mean: float = 0.0
    """Images, videos and audios per pack so far."""
    media_max: int = 0
    audio_tokens_mean: float = 0.0
    """Audio encoder tokens per emitted pack so far (part of ``vision_tokens_mean``, the budget
    every non-text encoder shares)."""
    audio_tokens_max: int = 0
    pack_us_per_sample: float = field(default=0.0, compare=False)
    """Microseconds this worker's packer took per sample to choose packs (its pushes, and the
    flush at the end of the data), since the worker started iterating or was restored: the pack
    step's own cost, beside reading, encoding and decoding. Not saved, and left out of ``==``
    (stats of the same packs compare equal however long they took); balance at a large buffer
    costs the most (the vision budget's limits)."""


@dataclass
class PackClock:
    """Time the packer took choosing packs, over the samples pushed, in this worker's pass (not
    saved: a restored worker counts from its restore)."""

    seconds: float = 0.0
    samples: int = 0

    def took(self, start: float, samples: int) -> None:
        """Count the time since ``start`` (a ``time.perf_counter()``) over ``samples`` more."""
        self.seconds += time.perf_counter() - start
        self.samples += samples

    def us_per_sample(self) -> float:
        return self.seconds / self.samples * 1e6 if self.samples else 0.0
