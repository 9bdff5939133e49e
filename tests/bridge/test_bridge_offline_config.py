"""``check-config`` against Megatron-Bridge 0.6.2's own ``ConfigContainer.validate()``.

Each case is one training setup written twice: as Bridge's config (GPT model provider, an
offline GPT SFT dataset or an in-batch-packing dataset) and as a
:class:`~energon_pack.TrainingSetup`. Both accept it, both refuse it, or Bridge accepts
and check-config refuses with a message that says why it is stricter. Runs in the Bridge test
environment (``bash scripts/test_bridge.sh``); skipped elsewhere.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.bridge.shims import require_bridge

require_bridge()

from megatron.bridge.data.builders.gpt_sft import GPTSFTDatasetConfig  # noqa: E402
from megatron.bridge.data.builders.mock_vlm_sft import MockVLMSFTDatasetConfig  # noqa: E402
from megatron.bridge.data.packing.config import PackedSequenceSpecs  # noqa: E402
from megatron.bridge.models.gpt_provider import GPTModelProvider  # noqa: E402
from megatron.bridge.training.config import (  # noqa: E402
    CheckpointConfig,
    ConfigContainer,
    DistributedInitConfig,
    LoggerConfig,
    OptimizerConfig,
    RerunStateMachineConfig,
    RNGConfig,
    SchedulerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron.bridge.training.tokenizers.config import TokenizerConfig  # noqa: E402
from megatron.core.distributed import DistributedDataParallelConfig  # noqa: E402

from energon_pack.packing import TrainingSetup  # noqa: E402

STRICTER = "Megatron-Bridge 0.6.2"
"""What a stricter check-config message names."""


@dataclass(frozen=True)
class Setup:
    """One training setup; ``model`` holds Megatron Core names (tp, cp, sp, graphs)."""

    mode: str
    seq_length: int
    tp: int = 1
    cp: int = 1
    sp: bool = False
    mbs: int = 1
    gbs: int = 8
    dp: int = 1
    pad_to_max_length: bool = False
    pad_cu_seqlens: bool = False
    graph: str | None = None  # None, "full_iteration" or per-layer modules "attn,mlp"
    per_token_loss: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def packing_config(self) -> TrainingSetup:
        modules = None if self.graph in (None, "full_iteration") else self.graph
        return TrainingSetup(
            seq_length=self.seq_length,
            mode=self.mode,  # type: ignore[arg-type]
            micro_batch_size=self.mbs,
            global_batch_size=self.gbs,
            data_parallel_size=self.dp,
            tp=self.tp,
            cp=self.cp,
            sp=self.sp,
            cuda_graphs=self.graph is not None,
            cuda_graph_scope=modules or "full",
            calculate_per_token_loss=self.per_token_loss,
            pad_to_max_length=self.pad_to_max_length,
            pad_cu_seqlens=self.pad_cu_seqlens,
            finetuning=True,
        )

    def bridge_problem(self, monkeypatch: pytest.MonkeyPatch) -> str | None:
        """What Bridge's ``ConfigContainer.validate()`` raises, or None."""
        monkeypatch.setenv("WORLD_SIZE", str(self.tp * self.cp * self.dp))
        graphs: dict[str, Any] = {}
        if self.graph == "full_iteration":
            graphs = {"cuda_graph_impl": "full_iteration", "cuda_graph_modules": []}
        elif self.graph is not None:
            graphs = {
                "cuda_graph_impl": "transformer_engine",
                "cuda_graph_modules": self.graph.split(","),
            }
        model = GPTModelProvider(
            num_layers=1,
            hidden_size=128,
            num_attention_heads=4,
            apply_rope_fusion=False,
            seq_length=self.seq_length,
            tensor_model_parallel_size=self.tp,
            context_parallel_size=self.cp,
            sequence_parallel=self.sp,
            calculate_per_token_loss=self.per_token_loss,
            **graphs,
        )
        container = ConfigContainer(
            train=TrainingConfig(
                train_iters=10, global_batch_size=self.gbs, micro_batch_size=self.mbs
            ),
            model=model,
            optimizer=OptimizerConfig(lr=1e-4, use_distributed_optimizer=False),
            scheduler=SchedulerConfig(lr_decay_style="linear", lr_warmup_iters=0),
            dataset=self._dataset(),
            logger=LoggerConfig(),
            tokenizer=TokenizerConfig(),
            checkpoint=CheckpointConfig(),
            dist=DistributedInitConfig(),
            ddp=DistributedDataParallelConfig(),
            rng=RNGConfig(),
            rerun_state_machine=RerunStateMachineConfig(
                check_for_nan_in_loss=self.graph != "full_iteration"
            ),
            validation=ValidationConfig(),
        )
        try:
            container.validate()
        except (ValueError, AssertionError) as error:
            return f"{type(error).__name__}: {error}"
        return None

    def _dataset(self) -> Any:
        if self.mode == "offline":
            return GPTSFTDatasetConfig(
                seq_length=self.seq_length,
                dataset_root="/nonexistent/sft",
                enable_offline_packing=True,
                offline_packing_specs=PackedSequenceSpecs(
                    packed_sequence_size=self.seq_length,
                    pad_seq_to_mult=TrainingSetup(
                        seq_length=self.seq_length, tp=self.tp, cp=self.cp, sp=self.sp
                    ).pad_seq_to_mult(),
                    pad_cu_seqlens=self.pad_cu_seqlens,
                ),
                dataset_kwargs={"pad_to_max_length": self.pad_to_max_length},
            )
        return MockVLMSFTDatasetConfig(
            seq_length=self.seq_length,
            hf_processor_path="org/model",
            num_images=0,
            enable_in_batch_packing=True,
            pad_to_max_length=self.pad_to_max_length,
        )


# (setup, None: both agree; a pattern: Bridge accepts, check-config refuses saying why)
CASES: list[tuple[str, Setup, str | None]] = [
    ("offline-plain", Setup("offline", 4096), None),
    ("offline-tp4-sp-4098", Setup("offline", 4098, tp=4, sp=True), None),
    (
        "offline-tp4-sp-4098-fixed-width",
        Setup("offline", 4098, tp=4, sp=True, pad_to_max_length=True),
        r"seq_length=4098 is not a multiple of pad_seq_to_mult=4 .*Megatron-Bridge 0.6.2 does "
        r"not check this",
    ),
    ("offline-tp2-cp2-sp", Setup("offline", 8192, tp=2, cp=2, sp=True), None),
    ("offline-mbs2", Setup("offline", 4096, mbs=2), None),
    ("offline-cu-without-fixed-width", Setup("offline", 4096, pad_cu_seqlens=True), None),
    ("offline-cp2-odd-length", Setup("offline", 4098, cp=2), None),
    ("offline-cp2-no-per-token-loss", Setup("offline", 8192, cp=2, per_token_loss=False), None),
    ("offline-mlp-graph-fixed", Setup("offline", 4096, pad_to_max_length=True, graph="mlp"), None),
    ("offline-mlp-graph-ragged", Setup("offline", 4096, graph="mlp"), None),
    (
        "offline-attn-graph-no-cu",
        Setup("offline", 4096, pad_to_max_length=True, graph="attn"),
        None,
    ),
    (
        "offline-attn-graph-static",
        Setup("offline", 4096, pad_to_max_length=True, pad_cu_seqlens=True, graph="attn,mlp"),
        None,
    ),
    (
        "offline-full-iteration-static",
        Setup("offline", 4096, pad_to_max_length=True, pad_cu_seqlens=True, graph="full_iteration"),
        None,
    ),
    (
        "offline-full-iteration-no-cu",
        Setup("offline", 4096, pad_to_max_length=True, graph="full_iteration"),
        None,
    ),
    ("collate-plain", Setup("collate", 4096, mbs=2), None),
    ("collate-mbs1", Setup("collate", 4096, mbs=1), None),
    (
        "collate-attn-graph",
        Setup("collate", 4096, mbs=2, pad_to_max_length=True, graph="attn"),
        r"captures attention, which reads cu_seqlens: .*Megatron-Bridge 0.6.2 checks this for "
        r"offline packs only",
    ),
    (
        "collate-mlp-graph-ragged",
        Setup("collate", 4096, mbs=2, graph="mlp"),
        r"rows must be fixed-width \(Megatron-Bridge 0.6.2 checks this for offline packs only",
    ),
    (
        "collate-mlp-graph-fixed",
        Setup("collate", 4096, mbs=2, pad_to_max_length=True, graph="mlp"),
        None,
    ),
    ("collate-tp4-sp-4098", Setup("collate", 4098, mbs=2, tp=4, sp=True), None),
]


@pytest.mark.parametrize(("setup", "stricter"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_check_config_agrees_with_bridge_or_says_why_not(
    monkeypatch: pytest.MonkeyPatch, setup: Setup, stricter: str | None
) -> None:
    bridge = setup.bridge_problem(monkeypatch)
    ours = setup.packing_config().validate()
    if stricter is None:
        assert (bridge is None) == (not ours), f"Bridge: {bridge!r}; check-config: {ours}"
        return
    assert bridge is None, bridge
    assert any(re.search(stricter, problem) for problem in ours), ours
    assert all(STRICTER in problem for problem in ours), ours
