"""Megatron-Energon integration: the packing task encoder and its carry-over wrapper."""

from energon_pack.energon.carry_over import CarryOverPackingDataset, RejectedSample
from energon_pack.energon.dataset_path import check_dataset_path
from energon_pack.energon.packing_stats import PackingStats
from energon_pack.energon.redist import redistribute
from energon_pack.energon.resume import check_loader_state, restore_state_rank
from energon_pack.energon.task_encoder import (
    ConversationSample,
    PackedBatch,
    PackingTaskEncoder,
    PreparedSample,
    cook_conversation,
)
from energon_pack.packing.packed import SkippedSample

__all__ = [
    "CarryOverPackingDataset",
    "ConversationSample",
    "PackedBatch",
    "PackingStats",
    "PackingTaskEncoder",
    "PreparedSample",
    "RejectedSample",
    "SkippedSample",
    "check_dataset_path",
    "check_loader_state",
    "cook_conversation",
    "redistribute",
    "restore_state_rank",
]
