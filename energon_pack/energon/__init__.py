"""Megatron-Energon integration: the packing task encoder and its carry-over wrapper."""

from energon_pack.energon.carry_over import (
    CarryOverPackingDataset,
    PackingStats,
    RejectedSample,
    SkippedSample,
)
from energon_pack.energon.task_encoder import (
    ConversationSample,
    PackedBatch,
    PackingTaskEncoder,
    PreparedSample,
    cook_conversation,
)

__all__ = [
    "CarryOverPackingDataset",
    "ConversationSample",
    "PackedBatch",
    "PackingStats",
    "PackingTaskEncoder",
    "PreparedSample",
    "RejectedSample",
    "SkippedSample",
    "cook_conversation",
]
