"""energon_pack: online sequence packing (THD, cu_seqlens) for text, image and video samples."""

from energon_pack.binpack import (
    Bin,
    OnlineBinPacker,
    PackerStats,
    best_fit_decreasing,
    first_fit_decreasing,
)
from energon_pack.encode import ByteTokenizer, ConversationEncoder, EncodedSample
from energon_pack.layout import IGNORE_INDEX, PackedRow, build_packed_row, unpack
from energon_pack.media import MediaConfig, MediaError
from energon_pack.offline import (
    OfflinePackResult,
    PackedDataset,
    PackingSpec,
    PackMetadata,
    pack_offline,
)
from energon_pack.sample import RawSample, parse_sample
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
    "ByteTokenizer",
    "ConversationEncoder",
    "DerivedValues",
    "EncodedSample",
    "MediaConfig",
    "MediaError",
    "OfflinePackResult",
    "OnlineBinPacker",
    "PackMetadata",
    "PackedDataset",
    "PackedRow",
    "PackerStats",
    "PackingConfig",
    "PackingSpec",
    "RawSample",
    "TokenSlotRow",
    "best_fit_decreasing",
    "build_packed_row",
    "equal_token_slot_table",
    "first_fit_decreasing",
    "pack_offline",
    "pad_seq_to_mult",
    "parse_sample",
    "unpack",
]
__version__ = "0.1.0"
