"""energon_pack: online sequence packing (THD, cu_seqlens) for text, image and video samples."""

from energon_pack.binpack import (
    Bin,
    OnlineBinPacker,
    PackerStats,
    best_fit_decreasing,
    first_fit_decreasing,
)
from energon_pack.bridge_batch import VisualInputs, bridge_batch
from energon_pack.collate import CollatedBatch, PackingWarning, VLMPackingCollator
from energon_pack.encode import ByteTokenizer, ConversationEncoder, SampleEncoder
from energon_pack.energon import PackedBatch, PackingStats, PackingTaskEncoder
from energon_pack.family import ModelFamily, model_family
from energon_pack.formats import ChatDataset, parse_any
from energon_pack.formats.native import parse_sample
from energon_pack.formats.raw import RawSample
from energon_pack.hf import HFTarget, hf_model_inputs
from energon_pack.layout import IGNORE_INDEX, PackedRow, build_packed_row, unpack
from energon_pack.loss import PackedLoss, loss_normaliser, packed_loss
from energon_pack.media import (
    MediaConfig,
    MediaError,
    normalize_pixels,
    vision_block,
    vision_tokens,
)
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
from energon_pack.template_encoder import TemplateEncoder, make_encoder
from energon_pack.topology import (
    DerivedValues,
    PackingConfig,
    TokenSlotRow,
    equal_token_slot_table,
    pad_seq_to_mult,
)
from energon_pack.trainers import check_trainer

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
    "PackedLoss",
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
    "SampleEncoder",
    "TemplateEncoder",
    "TokenSlotRow",
    "VLMPackingCollator",
    "VisualInputs",
    "best_fit_decreasing",
    "bridge_batch",
    "build_packed_row",
    "check_trainer",
    "equal_token_slot_table",
    "first_fit_decreasing",
    "hf_model_inputs",
    "loss_normaliser",
    "make_encoder",
    "model_family",
    "mrope_for_packed",
    "mrope_position_ids",
    "normalize_pixels",
    "pack_offline",
    "pack_samples",
    "packed_loss",
    "packed_mrope_position_ids",
    "pad_seq_to_mult",
    "parse_any",
    "parse_sample",
    "unpack",
    "vision_block",
    "vision_tokens",
]
__version__ = "0.1.0"
