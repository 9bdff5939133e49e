"""energon_pack: online sequence packing (THD, cu_seqlens) for text, image and video samples.

Every public name is importable from here. ``__all__`` lists them group by group, by stage of
the data flow with the entry points first, and :data:`API_GROUPS` maps each group's title (a
section of the API reference, in the same order) to its names.
"""

import sys
from typing import TYPE_CHECKING

from energon_pack import _moved

if TYPE_CHECKING:  # the public names, for type checkers (read lazily below)
    from energon_pack.collate import CollatedBatch, VLMPackingCollator
    from energon_pack.encoding import (
        ByteTokenizer,
        ConversationEncoder,
        ModelFamily,
        ProcessorEncoder,
        ProcessorFamily,
        RequestEncoder,
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
    from energon_pack.memory import (
        BufferMemoryWarning,
        MonitorConfig,
        ReportWriteWarning,
        RSSMonitor,
    )
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
        BufferConfig,
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
        VisionBudget,
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
    from energon_pack.plan import Plan, PlannedDataset, PlanSampler, PlanSpec, plan_dataset
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
    from energon_pack.verify import BackendResult, VerifyReport, verify_packing

_HOMES: dict[str, str] = {
    name: module
    for module, names in {
        "energon_pack.collate": ("CollatedBatch", "VLMPackingCollator"),
        "energon_pack.encoding": (
            "ByteTokenizer",
            "ConversationEncoder",
            "ModelFamily",
            "ProcessorEncoder",
            "ProcessorFamily",
            "RequestEncoder",
            "SampleEncoder",
            "TemplateEncoder",
            "make_encoder",
            "model_family",
        ),
        "energon_pack.energon": ("PackedBatch", "PackingStats", "PackingTaskEncoder"),
        "energon_pack.formats": ("ChatDataset", "parse_any"),
        "energon_pack.plan": (
            "Plan",
            "PlanSpec",
            "PlannedDataset",
            "PlanSampler",
            "plan_dataset",
        ),
        "energon_pack.formats.native": ("parse_sample",),
        "energon_pack.formats.raw": ("RawSample",),
        "energon_pack.media": (
            "MediaConfig",
            "MediaError",
            "normalize_pixels",
            "vision_block",
            "vision_tokens",
        ),
        "energon_pack.memory": (
            "BufferMemoryWarning",
            "MonitorConfig",
            "ReportWriteWarning",
            "RSSMonitor",
        ),
        "energon_pack.offline": (
            "OfflinePackResult",
            "PackedDataset",
            "PackingSpec",
            "PackMetadata",
            "pack_offline",
        ),
        "energon_pack.packing": (
            "IGNORE_INDEX",
            "Bin",
            "BufferConfig",
            "DerivedValues",
            "EncodedSample",
            "MRopeConfig",
            "OnlineBinPacker",
            "PackedRow",
            "PackedSample",
            "PackerCounters",
            "PackingWarning",
            "RowLayout",
            "TokenSlotRow",
            "TrainingSetup",
            "VisionBudget",
            "best_fit_decreasing",
            "build_packed_row",
            "equal_token_slot_table",
            "first_fit_decreasing",
            "mrope_for_packed",
            "mrope_position_ids",
            "pack_samples",
            "packed_mrope_position_ids",
            "pad_seq_to_mult",
            "straggler_floor",
            "straggler_ratio",
            "unpack",
        ),
        "energon_pack.train": (
            "BridgeVisualInputs",
            "HFTarget",
            "PackedLoss",
            "bridge_batch",
            "check_trainer",
            "hf_model_inputs",
            "loss_normaliser",
            "packed_loss",
        ),
        "energon_pack.verify": ("BackendResult", "VerifyReport", "verify_packing"),
    }.items()
    for name in names
}
"""Public name -> the module it is imported from on its first read (PEP 562), so that
``import energon_pack`` and the ``energon-pack`` command import torch, transformers and
Megatron-Energon only where a name needs them."""

__version__ = "0.1.0"

API_GROUPS: dict[str, tuple[str, ...]] = {}
"""Group title -> its public names, in the order of ``__all__`` and of the API reference."""
__all__: list[str] = []  # each group's names as a literal list, so type checkers read it too


def _group(title: str) -> None:
    """File the names added to ``__all__`` since the previous group under ``title``."""
    API_GROUPS[title] = tuple(__all__[sum(map(len, API_GROUPS.values())) :])


# What a training script builds first: the loader of each path (Megatron-Energon, a PyTorch
# DataLoader, packs written ahead of training), the encoder and model family they share, and
# the plan of a whole dataset.
__all__ += [
    "PackingTaskEncoder",
    "VLMPackingCollator",
    "make_encoder",
    "model_family",
    "pack_offline",
    "plan_dataset",
]
_group("Entry points")

# The settings objects the entry points take, each validated on construction.
__all__ += [
    "BufferConfig",
    "MRopeConfig",
    "MediaConfig",
    "MonitorConfig",
    "PackingSpec",
    "PlanSpec",
    "RowLayout",
    "VisionBudget",
]
_group("Settings")

# What the loaders yield: the batch of each path, its THD rows and the packing figures.
__all__ += ["CollatedBatch", "PackedBatch", "PackedRow", "PackingStats"]
_group("Outputs")

# Reading samples: the formats a conversation arrives in.
__all__ += ["ChatDataset", "RawSample", "parse_any", "parse_sample"]
_group("Sample formats")

# Conversations to token ids, labels and loss mask with vision placeholders; model families.
__all__ += [
    "ByteTokenizer",
    "ConversationEncoder",
    "EncodedSample",
    "ModelFamily",
    "ProcessorEncoder",
    "ProcessorFamily",
    "RequestEncoder",
    "SampleEncoder",
    "TemplateEncoder",
]
_group("Encoding")

# A medium's vision tokens and pixels.
__all__ += ["normalize_pixels", "vision_block", "vision_tokens"]
_group("Media")

# Bin packing: the online packer and its counters, the offline packers, the vision balance ...
__all__ += ["Bin", "OnlineBinPacker", "PackerCounters"]
__all__ += ["best_fit_decreasing", "first_fit_decreasing", "straggler_floor", "straggler_ratio"]
# ... and THD row assembly.
__all__ += ["IGNORE_INDEX", "PackedSample", "build_packed_row", "pack_samples", "unpack"]
_group("Packing core")

# Qwen-VL multimodal rotary position ids, per segment of a row.
__all__ += ["mrope_for_packed", "mrope_position_ids", "packed_mrope_position_ids"]
_group("Positions (mRoPE)")

# The training run's parallel topology and batch settings, checked against packing.
__all__ += [
    "DerivedValues",
    "TokenSlotRow",
    "TrainingSetup",
    "equal_token_slot_table",
    "pad_seq_to_mult",
]
_group("Topology")

# What crosses the border to the trainer: transformers inputs, losses and trainer checks ...
__all__ += [
    "HFTarget",
    "PackedLoss",
    "check_trainer",
    "hf_model_inputs",
    "loss_normaliser",
    "packed_loss",
]
# ... and the batch of Megatron-Bridge's VLM step.
__all__ += ["BridgeVisualInputs", "bridge_batch"]
_group("Training adapters")

# Packs written ahead of training, and reading them back.
__all__ += ["OfflinePackResult", "PackMetadata", "PackedDataset"]
_group("Offline")

# Every pack of a dataset planned before training, and training from it.
__all__ += ["Plan", "PlanSampler", "PlannedDataset"]
_group("Plans")

# Packing proven on the user's own model and attention implementations.
__all__ += ["BackendResult", "VerifyReport", "verify_packing"]
_group("Verification")

# The per-worker RSS monitor.
__all__ += ["RSSMonitor"]
_group("Memory")

# What a sample or a loader raises or warns with.
__all__ += ["BufferMemoryWarning", "MediaError", "PackingWarning", "ReportWriteWarning"]
_group("Warnings and errors")

del _group

if TYPE_CHECKING:  # the old names, for type checkers
    PackerStats = PackerCounters
    PackingConfig = TrainingSetup
    VisualInputs = BridgeVisualInputs
    __all__ += ["PackerStats", "PackingConfig", "VisualInputs"]
else:  # every public name on its first read, and the old names with a DeprecationWarning
    __getattr__, __dir__ = _moved.lazy(
        __name__, _HOMES, "PackerStats", "PackingConfig", "VisualInputs"
    )

_moved.install(sys.modules[__name__])
