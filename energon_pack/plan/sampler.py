"""Which packs of a plan each data-parallel rank trains: :class:`PlanSampler`, with the contract
of Megatron's samplers (one list of dataset indices per micro-batch; ``consumed_samples``
counts packs over all ranks).

An epoch is a fixed order of the packs: the plan's steps (epoch 0), or its full steps shuffled
from the plan's seed and the epoch (later epochs; the last, short step stays last). The packs
consumed are always the first ``consumed_samples`` of that order, whatever the sizes they were
trained at, so one number is the whole data state. Each step takes the next
``global_batch_size`` packs of the order and deals them over the ranks: as the plan dealt them
at the plan's size, else heaviest first to the least loaded rank (with the plan's balance; in
turn without), the same on every rank.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np

from energon_pack.checks import check_int
from energon_pack.plan.dataset import PlannedDataset, PlanOrder
from energon_pack.plan.pack import deal_packs


class PlanSampler:
    """The micro-batches of ``data_parallel_rank`` out of ``data_parallel_size`` over a
    :class:`PlannedDataset` (or its :class:`PlanOrder`), from ``consumed_samples`` packs on.

    Iterating yields lists of ``micro_batch_size`` dataset indices (fewer at the end of an
    epoch) up to the end of the current epoch, and counts what all ranks consumed; iterating
    again goes on with the next epoch. ``global_batch_size`` (default: the plan's) must be a
    multiple of ``micro_batch_size * data_parallel_size``. At the plan's sizes each rank
    trains the packs the plan assigned to it; at others each step is dealt again (balanced
    for the vision encoder when the plan is), and every pack is still trained once per epoch.
    """

    def __init__(
        self,
        dataset: PlannedDataset | PlanOrder,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        consumed_samples: int = 0,
        micro_batch_size: int = 1,
        global_batch_size: int | None = None,
    ) -> None:
        self.order = dataset.order if isinstance(dataset, PlannedDataset) else dataset
        check_int("data_parallel_size", data_parallel_size)
        check_int("data_parallel_rank", data_parallel_rank, minimum=0)
        check_int("consumed_samples", consumed_samples, minimum=0)
        check_int("micro_batch_size", micro_batch_size)
        check_int("global_batch_size", global_batch_size, none_ok=True)
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(
                f"data_parallel_rank={data_parallel_rank} is not below data_parallel_size="
                f"{data_parallel_size}; pass a rank in 0..{data_parallel_size - 1}"
            )
        self.rank, self.ranks = data_parallel_rank, data_parallel_size
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size or self.order.global_batch_size
        if self.global_batch_size % (micro_batch_size * data_parallel_size):
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size * data_parallel_size = {micro_batch_size * data_parallel_size}"
                "; every rank trains the same number of micro-batches per step: pass a multiple"
            )
        self.consumed_samples = consumed_samples
        self._step_sizes = np.bincount(self.order.step).tolist()
        self._vision = self.order.vision.tolist()

    def __len__(self) -> int:
        """Micro-batches this rank has left in the current epoch."""
        return sum(1 for _ in self._micro_batches(self.consumed_samples))

    def __iter__(self) -> Iterator[list[int]]:
        packs = len(self.order)
        end = (self.consumed_samples // packs + 1) * packs
        for batch, consumed in self._micro_batches(self.consumed_samples):
            yield batch
            self.consumed_samples = consumed
        self.consumed_samples = end

    def epoch_order(self, epoch: int) -> list[int]:
        """The dataset indices of epoch ``epoch`` in training order."""
        steps = self.order.steps()
        if epoch == 0:
            return [index for step in steps for index in step]
        per_step = self.order.global_batch_size
        full = [step for step in steps if len(step) == per_step]
        random.Random(f"energon_pack plan {self.order.seed} epoch {epoch}").shuffle(full)
        rest = [step for step in steps if len(step) < per_step]
        return [index for step in full + rest for index in step]

    def step_packs(self, window: list[int]) -> list[list[int]]:
        """Each rank's packs of a step (``window``: its packs), in micro-batch order."""
        order = self.order
        steps = {int(order.step[i]) for i in window}
        planned = (
            self.ranks == order.data_parallel_size
            and self.global_batch_size == order.global_batch_size
            and len(steps) == 1
            and len(window) == self._step_sizes[steps.pop()]
        )
        if planned:
            return [[i for i in window if order.rank[i] == rank] for rank in range(self.ranks)]
        return deal_packs(window, self._vision, self.ranks, balance=order.balance)

    def _micro_batches(self, consumed: int) -> Iterator[tuple[list[int], int]]:
        """This rank's micro-batches from ``consumed`` to the end of its epoch, each with the
        packs all ranks have consumed once its step is done."""
        packs = len(self.order)
        epoch, position = divmod(consumed, packs)
        order = self.epoch_order(epoch)
        start = epoch * packs
        while position < packs:
            window = order[position : position + self.global_batch_size]
            before, position = position, position + len(window)
            mine = self.step_packs(window)[self.rank]
            size = self.micro_batch_size
            for first in range(0, len(mine), size):
                done = position if first + size >= len(mine) else before
                yield mine[first : first + size], start + done
