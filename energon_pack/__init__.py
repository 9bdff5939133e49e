"""energon_pack: online sequence packing (THD, cu_seqlens) for text, image and video samples."""

from energon_pack.binpack import (
    Bin,
    OnlineBinPacker,
    PackerStats,
    best_fit_decreasing,
    first_fit_decreasing,
)
from energon_pack.layout import IGNORE_INDEX, PackedRow, build_packed_row, unpack
from energon_pack.topology import (
    DerivedValues,
    PackingConfig,
    TokenSlotRow,
    equal_token_slot_table,
    pad_seq_to_mult,
)

__all__ = [
    "IGNORE_INDEX",
    "Bin",
    "DerivedValues",
    "OnlineBinPacker",
    "PackedRow",
    "PackerStats",
    "PackingConfig",
    "TokenSlotRow",
    "best_fit_decreasing",
    "build_packed_row",
    "equal_token_slot_table",
    "first_fit_decreasing",
    "pad_seq_to_mult",
    "unpack",
]
__version__ = "0.1.0"
