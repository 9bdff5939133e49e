"""energon_pack: online sequence packing (THD, cu_seqlens) for text, image and video samples."""

from energon_pack.binpack import (
    Bin,
    OnlineBinPacker,
    PackerStats,
    best_fit_decreasing,
    first_fit_decreasing,
)

__all__ = [
    "Bin",
    "OnlineBinPacker",
    "PackerStats",
    "best_fit_decreasing",
    "first_fit_decreasing",
]
__version__ = "0.1.0"
