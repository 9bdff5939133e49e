"""A plan read by Megatron-Bridge 0.6.2's own training data path: its
``MegatronPretrainingSampler`` gives every rank, at the plan's data-parallel size (micro-batch
1), the packs ``PlanSampler`` gives it (the packs the plan assigned to the rank, in the same
order), and ``build_pretraining_data_loader`` (its sampler, a DataLoader with two workers and
the dataset's own ``collate_fn``) feeds ``vlm_step.get_batch`` the planned rows, from the start
and resumed from ``consumed_samples``. Runs in the Bridge test environment (``bash
scripts/test_bridge.sh``); skipped elsewhere; the plan is measured without Ray
(``engine="local"``). This machine has no CUDA: ``Tensor.cuda`` is a no-op here."""

from __future__ import annotations

import numpy as np
import pytest

from tests.bridge.shims import require_bridge

require_bridge()

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from helpers import SMALL_MEDIA  # noqa: E402
from megatron.bridge.data.samplers import (  # noqa: E402
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
)
from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params  # noqa: E402
from plan_rows import write_chat_rows  # noqa: E402

from energon_pack import PlannedDataset, RowLayout, VisionBudget, make_encoder  # noqa: E402
from energon_pack.plan import PlanOrder, PlanSampler, PlanSpec, plan_dataset  # noqa: E402
from energon_pack.plan.pack import lay_out_steps  # noqa: E402
from tests.bridge.test_bridge_online import bridge_step_inputs  # noqa: E402


@pytest.mark.parametrize(("ranks", "per_step", "packs"), [(2, 4, 40), (4, 8, 64), (3, 6, 36)])
def test_megatrons_sampler_trains_each_rank_its_planned_packs(
    ranks: int, per_step: int, packs: int
) -> None:
    random = np.random.default_rng(ranks)
    vision = random.integers(0, 4000, packs).tolist()
    spec = PlanSpec(
        RowLayout(8192),
        VisionBudget(balance=True),
        data_parallel_size=ranks,
        global_batch_size=per_step,
    )
    steps = lay_out_steps(vision, vision, spec)
    order = np.lexsort((steps.rank, steps.micro, steps.step))  # PlannedDataset's order
    plan = PlanOrder(
        steps.step[order],
        steps.rank[order],
        np.asarray(vision)[order],
        ranks,
        per_step,
        balance=True,
        seed=0,
    )
    for rank in range(ranks):
        theirs = list(MegatronPretrainingSampler(packs, 0, 1, rank, ranks))
        ours = list(PlanSampler(plan, rank, ranks))
        assert theirs == ours
        assert [int(plan.rank[i]) for batch in theirs for i in batch] == [rank] * len(theirs)


RANKS, PER_STEP = 2, 4


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bridge_plan")
    rows = write_chat_rows(root / "rows")
    spec = PlanSpec(
        RowLayout(2048, 8),
        VisionBudget(max_vision_tokens=1500, max_media=6, balance=True),
        data_parallel_size=RANKS,
        global_batch_size=PER_STEP,
        seed=3,
    )
    encoder = make_encoder(None, media=SMALL_MEDIA)
    plan_dataset(
        rows.path, root / "plan", spec, encoder, media_root=rows.media_root, engine="local"
    )
    return root / "plan"


@pytest.mark.parametrize("consumed", [0, 2 * PER_STEP])
def test_bridges_data_loader_feeds_vlm_step_the_planned_rows(
    plan_dir: Path, consumed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    encoder = make_encoder(None, media=SMALL_MEDIA)
    bridged = PlannedDataset(plan_dir, encoder, output="bridge")
    rows = PlannedDataset(plan_dir, encoder)
    with_media = 0
    for rank in range(RANKS):
        loader = build_pretraining_data_loader(
            bridged,
            consumed,
            "single",
            micro_batch_size=1,
            num_workers=2,
            data_sharding=False,
            collate_fn=bridged.collate_fn,  # what Bridge's setup passes: train_ds.collate_fn
            pin_memory=False,
            data_parallel_rank=rank,
            data_parallel_size=RANKS,
            global_batch_size=PER_STEP,
        )
        planned = list(PlanSampler(rows, rank, RANKS, consumed_samples=consumed))
        batches = list(loader)
        # Megatron drops an incomplete last global batch; the plan's sampler trains it
        assert 0 <= len(planned) - len(batches) <= 1
        for batch, (index,) in zip(batches, planned, strict=False):
            row = rows[index]
            tokens, labels, loss_mask, attention, positions, params, visual = bridge_step_inputs(
                batch
            )
            assert torch.equal(tokens, row.input_ids)
            assert torch.equal(labels, row.labels)
            assert torch.equal(loss_mask, row.loss_mask)
            assert torch.equal(positions, row.position_ids)
            assert attention is None
            got = get_packed_seq_params(params)
            assert torch.equal(got.cu_seqlens_q, row.cu_seqlens[0])
            assert torch.equal(got.cu_seqlens_q_padded, row.cu_seqlens_padded[0])
            media = {k: v for k, v in row.vision.tensors().items() if v is not None}
            kwargs = visual.normalized_for_model() if visual is not None else {}
            assert set(kwargs) == set(media)
            for name, value in kwargs.items():
                assert torch.equal(value, media[name]), name
            with_media += bool(media)
    assert with_media > 0  # images and videos went through the step
