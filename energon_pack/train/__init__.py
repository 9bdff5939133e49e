"""Adapters at the trainer's border: transformers model inputs, packed losses, trainer checks and
the Megatron-Bridge batch.

* ``hf``: :func:`hf_model_inputs` (transformers' label convention, varlen kwargs, mRoPE rows);
* ``loss``: :func:`packed_loss`, :class:`PackedLoss` and the token counts behind them;
* ``trainers``: :func:`check_trainer` for ``Trainer`` / TRL ``SFTTrainer`` set-ups;
* ``bridge``: :func:`bridge_batch`, the dict Megatron-Bridge's VLM step reads.
"""

from typing import TYPE_CHECKING

from energon_pack._moved import renamed
from energon_pack.train.bridge import BridgeVisualInputs, bridge_batch
from energon_pack.train.hf import HFTarget, hf_model_inputs
from energon_pack.train.loss import PackedLoss, loss_normaliser, packed_loss
from energon_pack.train.trainers import check_trainer

if TYPE_CHECKING:  # the old name, for type checkers
    VisualInputs = BridgeVisualInputs
else:  # the old name, with a DeprecationWarning
    __getattr__ = renamed(__name__, "VisualInputs")

__all__ = [
    "BridgeVisualInputs",
    "HFTarget",
    "PackedLoss",
    "bridge_batch",
    "check_trainer",
    "hf_model_inputs",
    "loss_normaliser",
    "packed_loss",
]
