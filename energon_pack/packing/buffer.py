"""The candidate buffer's behaviour as one settings object: when a pack may leave early, how long
a sample may wait, what bounds the buffer's memory, and (on the Energon path) when media are
decoded, what watches the worker and how many bad samples in a row stop the loader.

The buffer's *size* (``packing_buffer_size``) is not here: Energon passes it to the task encoder
with ``get_train_dataset``, and :class:`~energon_pack.OnlineBinPacker` takes it as
``buffer_size``. Here is how far the buffer may grow past it when its samples are too short to
fill a row (``min_rows``, ``max_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

from energon_pack.checks import check_choice, check_config, check_int, check_number
from energon_pack.memory.monitor import MonitorConfig
from energon_pack.packing.packed import Decode

__all__ = ["DEFAULT_MIN_ROWS", "BufferConfig"]

DEFAULT_MIN_ROWS = 2.0
"""Rows' worth of tokens a buffer of short samples grows to by default (``min_rows``)."""


@dataclass(frozen=True)
class BufferConfig:
    """How the per-worker candidate buffer lets packs leave; validated on construction.

    Args:
        max_wait: most packs a sample may wait in the buffer after it entered, so that no
            sample starves and data order stays close to the stream's (None: unbounded).
        min_fill: a pack leaves as soon as it can be filled to at least this fraction.
        max_bytes: also bound the buffer by the bytes its samples hold (None: by count only);
            Energon's ``packing_buffer_size`` bounds the count.
        decode: ``"lazy"`` decodes media once a sample is chosen for a pack; ``"eager"``
            decodes before the buffer (as Megatron-Bridge does), for comparison. Energon path.
        monitor: run an :class:`~energon_pack.memory.RSSMonitor` in every worker. Energon path.
        max_consecutive_skips: stop with an error (naming the failure kinds) after this many
            bad samples without a pack leaving in between (0: never stop). Energon path.
        min_rows: a full buffer (``packing_buffer_size`` samples) forces a pack out only once
            its samples hold at least this many rows' worth of tokens (``min_rows x
            seq_length``); until then it keeps taking samples, so that short samples still
            fill rows. None: ``packing_buffer_size`` alone bounds the buffer. With
            ``decode="eager"`` the buffer grows only where ``max_bytes`` bounds it.
        max_size: the most samples the buffer grows to under ``min_rows`` (``max_bytes``, where
            set, bounds it too).

    :class:`~energon_pack.OnlineBinPacker` reads ``max_wait``, ``min_fill``, ``max_bytes``,
    ``min_rows`` and ``max_size``; :class:`~energon_pack.PackingTaskEncoder` reads them all.
    """

    max_wait: int | None = 64
    min_fill: float = 0.999
    max_bytes: int | None = None
    decode: Decode = "lazy"
    monitor: MonitorConfig | None = None
    max_consecutive_skips: int = 100
    min_rows: float | None = DEFAULT_MIN_ROWS
    max_size: int = 1024

    def __post_init__(self) -> None:
        check_int("max_wait", self.max_wait, minimum=0, none_ok=True, fix="pass e.g. max_wait=64")
        check_number("min_fill", self.min_fill, at_most=1.0, fix="pass e.g. min_fill=0.999")
        check_int(
            "max_bytes (packing_buffer_bytes)",
            self.max_bytes,
            none_ok=True,
            fix="pass e.g. max_bytes=2**30, or None to bound the buffer by its count only",
        )
        check_choice("decode", self.decode, ("lazy", "eager"))
        check_config("monitor", self.monitor, MonitorConfig)
        check_int(
            "max_consecutive_skips",
            self.max_consecutive_skips,
            minimum=0,
            fix="pass e.g. max_consecutive_skips=100, or 0 to never stop",
        )
        check_number(
            "min_rows",
            self.min_rows,
            none_ok=True,
            fix="pass e.g. min_rows=2.0, or None to bound the buffer by packing_buffer_size alone",
        )
        check_int("max_size", self.max_size, minimum=1, fix="pass e.g. max_size=1024")
