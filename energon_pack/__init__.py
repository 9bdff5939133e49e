"""energon_pack: online sequence packing (THD, cu_seqlens) for text, image and video samples."""

import sys
from typing import TYPE_CHECKING

from energon_pack import _moved
from energon_pack.collate import CollatedBatch, VLMPackingCollator
from energon_pack.encoding import (
    ByteTokenizer,
    ConversationEncoder,
    ModelFamily,
    ProcessorEncoder,
    ProcessorFamily,
    SampleEncoder,
    TemplateEncoder,
    make_encoder,
    model_family,
)
from energon_pack.energon import PackedBatch, PackingStats, PackingTaskEncoder
from energon_pack.formats import ChatDataset, parse_any
from energon_pack.formats.native import parse_sample
from energon_pack.formats.raw import RawSample
from energon_pack.media import (
    MediaConfig,
    MediaError,
    normalize_pixels,
    vision_block,
    vision_tokens,
)
from energon_pack.memory import BufferMemoryWarning, MonitorConfig, ReportWriteWarning, RSSMonitor
from energon_pack.offline import (
    OfflinePackResult,
    PackedDataset,
    PackingSpec,
    PackMetadata,
    pack_offline,
)
from energon_pack.packing import (
    IGNORE_INDEX,
    Bin,
    DerivedValues,
    EncodedSample,
    MRopeConfig,
    OnlineBinPacker,
    PackedRow,
    PackedSample,
    PackerCounters,
    PackingWarning,
    RowLayout,
    TokenSlotRow,
    TrainingSetup,
    best_fit_decreasing,
    build_packed_row,
    equal_token_slot_table,
    first_fit_decreasing,
    mrope_for_packed,
    mrope_position_ids,
    pack_samples,
    packed_mrope_position_ids,
    pad_seq_to_mult,
    straggler_floor,
    straggler_ratio,
    unpack,
)
from energon_pack.train import (
    BridgeVisualInputs,
    HFTarget,
    PackedLoss,
    bridge_batch,
    check_trainer,
    hf_model_inputs,
    loss_normaliser,
    packed_loss,
)

__all__ = [
    "IGNORE_INDEX",
    "Bin",
    "BridgeVisualInputs",
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
    "PackerCounters",
    "PackingSpec",
    "PackingStats",
    "PackingTaskEncoder",
    "PackingWarning",
    "ProcessorEncoder",
    "ProcessorFamily",
    "RSSMonitor",
    "RawSample",
    "ReportWriteWarning",
    "RowLayout",
    "SampleEncoder",
    "TemplateEncoder",
    "TokenSlotRow",
    "TrainingSetup",
    "VLMPackingCollator",
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
    "straggler_floor",
    "straggler_ratio",
    "unpack",
    "vision_block",
    "vision_tokens",
]
__version__ = "0.1.0"

if TYPE_CHECKING:  # the old names, for type checkers
    PackerStats = PackerCounters
    PackingConfig = TrainingSetup
    VisualInputs = BridgeVisualInputs
    __all__ += ["PackerStats", "PackingConfig", "VisualInputs"]
else:  # the old names, with a DeprecationWarning
    __getattr__ = _moved.renamed(__name__, "PackerStats", "PackingConfig", "VisualInputs")

_moved.install(sys.modules[__name__])
