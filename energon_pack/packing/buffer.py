"""The candidate buffer's behaviour as one settings object: when a pack may leave early, how long
a sample may wait, what bounds the buffer's memory, and (on the Energon path) when media are
decoded, what watches the worker and how many bad samples in a row stop the loader.

The buffer's *size* (``packing_buffer_size``) is not here: Energon passes it to the task encoder
with ``get_train_dataset``, and :class:`~energon_pack.OnlineBinPacker` takes it as
``buffer_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

from energon_pack.checks import check_choice, check_config, check_int, check_number
from energon_pack.memory.monitor import MonitorConfig
from energon_pack.packing.packed import Decode

__all__ = ["BufferConfig"]


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

    :class:`~energon_pack.OnlineBinPacker` reads ``max_wait``, ``min_fill`` and ``max_bytes``;
    :class:`~energon_pack.PackingTaskEncoder` reads them all.
    """

    max_wait: int | None = 64
    min_fill: float = 0.999
    max_bytes: int | None = None
    decode: Decode = "lazy"
    monitor: MonitorConfig | None = None
    max_consecutive_skips: int = 100

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
