"""energon_pack: online sequence packing (THD, cu_seqlens) for text, image and video samples."""

from energon_pack.binpack import (
    Bin,
    OnlineBinPacker,
    PackerStats,
    best_fit_decreasing,
    first_fit_decreasing,
)
from energon_pack.collate import CollatedBatch, PackingWarning, VLMPackingCollator
from energon_pack.encode import ByteTokenizer, ConversationEncoder
from energon_pack.energon import PackedBatch, PackingStats, PackingTaskEncoder
from energon_pack.family import ModelFamily, model_family
from energon_pack.formats import ChatDataset, parse_any
from energon_pack.formats.native import parse_sample
from energon_pack.formats.raw import RawSample
from energon_pack.hf import HFTarget, hf_model_inputs
from energon_pack.layout import IGNORE_INDEX, PackedRow, build_packed_row, unpack
from energon_pack.media import MediaConfig, MediaError, normalize_pixels
from energon_pack.memory import BufferMemoryWarning, MonitorConfig, RSSMonitor
from energon_pack.offline import (
    OfflinePackResult,
    PackedDataset,
    PackingSpec,
    PackMetadata,
    pack_offline,
)
from energon_pack.packed import EncodedSample, PackedSample, mrope_for_packed, pack_samples
from energon_pack.rope import MRopeConfig, mrope_position_ids, packed_mrope_position_ids
from energon_pack.row_layout import RowLayout
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
    "BufferMemoryWarning",
    "ByteTokenizer",
    "ChatDataset",
    "CollatedBatch",
    "ConversationEncoder",
    "DerivedValues",
    "EncodedSample",
    "HFTarget",
    "MRopeConfig",
    "MediaConfig",
    "MediaError",
    "ModelFamily",
    "MonitorConfig",
    "OfflinePackResult",
    "OnlineBinPacker",
    "PackMetadata",
    "PackedBatch",
    "PackedDataset",
    "PackedRow",
    "PackedSample",
    "PackerStats",
    "PackingConfig",
    "PackingSpec",
    "PackingStats",
    "PackingTaskEncoder",
    "PackingWarning",
    "RSSMonitor",
    "RawSample",
    "RowLayout",
    "TokenSlotRow",
    "VLMPackingCollator",
    "best_fit_decreasing",
    "build_packed_row",
    "equal_token_slot_table",
    "first_fit_decreasing",
    "hf_model_inputs",
    "model_family",
    "mrope_for_packed",
    "mrope_position_ids",
    "normalize_pixels",
    "pack_offline",
    "pack_samples",
    "packed_mrope_position_ids",
    "pad_seq_to_mult",
    "parse_any",
    "parse_sample",
    "unpack",
]
__version__ = "0.1.0"
