"""Loss reductions over packed rows, each from one packed forward.

A packed micro-batch mixes samples of very different target counts ``n_s``. Each target token
``t`` of sample ``s`` gets a weight ``w_t`` and the loss is ``sum_t w_t * nll_t / sum_t w_t``
(InternVL's ``len2weight`` rule; samples without targets weigh nothing):

* ``"token"``: ``w = 1``, the mean over all target tokens (transformers' causal-LM loss): long
  answers weigh in proportion to their length;
* ``"sample"``: ``w = 1 / n_s``, the mean over samples of each sample's mean token loss: every
  sample counts the same, however long (short answers are not drowned by long ones);
* ``"sqrt"``: ``w = 1 / sqrt(n_s)``, InternVL's square-root weighting (``loss_reduction=
  "square"``): ``sum_s sqrt(n_s) * mean_s / sum_s sqrt(n_s)``, between the two.

The normaliser ``sum_t w_t`` is :func:`loss_normaliser`. Over several micro-batches (gradient
accumulation) and data-parallel ranks the loss of the whole step is ``sum_t w_t * nll_t`` over
all of them divided by the SUM of every micro-batch's :func:`loss_normaliser` on every rank:
all-reduce (sum) that count once per step and pass it as ``normaliser=``; with DDP, which
averages gradients over ranks, multiply the loss by the world size (as transformers does for
``num_items_in_batch`` with ``average_tokens_across_devices``). For ``"token"`` that count is
transformers' ``num_items_in_batch``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F

from energon_pack.checks import check_choice
from energon_pack.packing.row import IGNORE_INDEX

__all__ = ["LOSS_SEGMENTS", "PackedLoss", "Reduction", "loss_normaliser", "packed_loss"]

Reduction = Literal["token", "sample", "sqrt"]
REDUCTIONS: tuple[Reduction, ...] = ("token", "sample", "sqrt")
LOSS_SEGMENTS = "loss_segments"
"""Key of the per-token sample index in a collator's ``output="hf"`` dict (with
``loss_segments=True``), aligned with its unshifted ``labels``; ``-1`` where nothing is a target."""


class PackedTargets(Protocol):
    """The fields of a packed batch the loss reads: a
    :class:`~energon_pack.collate.CollatedBatch`, or the Energon loader's one-row
    :class:`~energon_pack.energon.PackedBatch` (no ``row_offsets``)."""

    @property
    def labels(self) -> torch.Tensor: ...
    @property
    def seq_idx(self) -> torch.Tensor: ...


def target_segments(batch: PackedTargets) -> torch.Tensor:
    """``[R, T]`` long: the flat segment index of each position's target (aligned with the
    batch's shifted ``labels``), ``-1`` where there is none."""
    offsets: torch.Tensor | None = getattr(batch, "row_offsets", None)
    flat = batch.seq_idx.long()
    if offsets is not None:
        flat = flat + offsets[:-1, None].long()
    elif flat.shape[0] != 1:
        raise ValueError(
            f"a batch of {flat.shape[0]} rows without row_offsets: its rows' segments cannot be "
            "told apart; pass the CollatedBatch (or one row)"
        )
    return torch.where(batch.labels != IGNORE_INDEX, flat, -1)


def hf_loss_segments(batch: PackedTargets, flatten: bool) -> torch.Tensor:
    """:data:`LOSS_SEGMENTS` for ``batch.hf_model_inputs()``: aligned with its unshifted
    labels (``[R, T]``, or ``[1, R*T]`` when ``flatten``, the flash-attention form)."""
    segments = F.pad(target_segments(batch)[:, :-1], (1, 0), value=-1)
    return segments.reshape(1, -1) if flatten else segments


def packed_loss(
    logits: torch.Tensor,
    batch: PackedTargets | Mapping[str, Any],
    reduction: Reduction = "token",
    normaliser: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """The ``reduction`` loss of one packed forward (see the module docstring).

    ``logits``: the model's ``[R, T, V]`` (or ``[1, R*T, V]``) logits for ``batch``, a
    :class:`~energon_pack.collate.CollatedBatch` (shifted ``labels``) or the collator's
    ``output="hf"`` dict (unshifted ``labels``; ``"sample"`` / ``"sqrt"`` need it built with
    ``loss_segments=True``). ``normaliser``: the step's summed :func:`loss_normaliser` over
    accumulation steps and ranks; default this micro-batch's own. Computed in at least float32.
    """
    check_choice("reduction", reduction, REDUCTIONS)
    flat_logits, targets, segments = _aligned(logits, batch, reduction)
    valid = targets != IGNORE_INDEX
    picked = targets[valid]
    _check_targets(picked, logits.shape[-1])
    dtype = torch.promote_types(logits.dtype, torch.float32)
    nll = F.cross_entropy(flat_logits[valid].to(dtype), picked, reduction="none")
    weights = _weights(segments[valid], reduction).to(dtype)
    if normaliser is not None:
        _check_normaliser(normaliser)
    total = torch.as_tensor(weights.sum() if normaliser is None else normaliser, dtype=dtype)
    # An empty micro-batch (all samples skipped) gives 0, not 0 / 0; any real one has total >= 1.
    return (nll * weights).sum() / total.to(nll.device).clamp(min=1)


def loss_normaliser(
    batch: PackedTargets | Mapping[str, Any], reduction: Reduction = "token"
) -> torch.Tensor:
    """``sum_t w_t`` of one micro-batch: its target tokens (``"token"``), its samples with
    targets (``"sample"``) or ``sum_s sqrt(n_s)`` (``"sqrt"``); float64, 0-d. Sum it over the
    micro-batches of a step and all-reduce it over ranks for ``packed_loss(normaliser=...)``."""
    check_choice("reduction", reduction, REDUCTIONS)
    _, targets, segments = _aligned(None, batch, reduction)
    return _weights(segments[targets != IGNORE_INDEX], reduction).double().sum()


def _aligned(
    logits: torch.Tensor | None, batch: PackedTargets | Mapping[str, Any], reduction: Reduction
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits ``[M, V]``, their targets ``[M]`` and the targets' segments ``[M]``."""
    vocab = 0 if logits is None else logits.shape[-1]
    if not isinstance(batch, Mapping):
        shifted = target_segments(batch)
        _check_logits(logits, batch.labels, flat_ok=True)
        return _rows(logits, vocab, 0), batch.labels.reshape(-1), shifted.reshape(-1)
    if "labels" not in batch:
        raise ValueError("packed_loss needs the batch's 'labels'; pass the collator's output")
    labels: torch.Tensor = batch["labels"]
    _check_logits(logits, labels, flat_ok=False)
    segments: torch.Tensor | None = batch.get(LOSS_SEGMENTS)
    if segments is None:
        if reduction != "token":
            raise ValueError(
                f"reduction={reduction!r} needs each token's sample: the batch has no "
                f"{LOSS_SEGMENTS!r}; build the collator with VLMPackingCollator(..., "
                "output='hf', loss_segments=True), or pass the CollatedBatch"
            )
        segments = torch.zeros_like(labels)
    elif segments.shape != labels.shape:
        raise ValueError(
            f"the batch's {LOSS_SEGMENTS!r} has shape {list(segments.shape)}, its labels "
            f"{list(labels.shape)}: pass the loss_segments and labels of the same batch"
        )
    # transformers' labels are unshifted: position t predicts labels[t + 1].
    targets, segments = labels[..., 1:].reshape(-1), segments[..., 1:].reshape(-1)
    return _rows(logits, vocab, 1), targets, segments


def _check_logits(logits: torch.Tensor | None, labels: torch.Tensor, *, flat_ok: bool) -> None:
    """``logits`` must be one ``[V]`` vector per label: ``labels.shape + (V,)`` (or, for a
    batch of shifted labels, its rows flattened: ``[1, R*T, V]``)."""
    if logits is None:
        return
    fits = [tuple(labels.shape)] + ([(1, labels.numel())] if flat_ok else [])
    if logits.dim() < 2 or tuple(logits.shape[:-1]) not in fits or logits.shape[-1] == 0:
        want = " or ".join(f"[{', '.join(map(str, shape))}, V]" for shape in fits)
        raise ValueError(
            f"logits of shape {list(logits.shape)} do not fit the batch's labels of shape "
            f"{list(labels.shape)}: packed_loss needs one row of V > 0 logits per token, {want}; "
            "pass the logits of the forward on exactly this batch's inputs"
        )


def _check_targets(targets: torch.Tensor, vocab: int) -> None:
    """Every target id must index the logits' ``vocab`` (cross_entropy would raise IndexError,
    or fail a device-side assertion on GPU)."""
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(
            f"the labels are {targets.dtype}, not token ids: pass the batch's integer labels "
            "(the collator's 'labels'), not its loss_mask or a float copy"
        )
    if not targets.numel():
        return
    low, high = torch.stack([targets.min(), targets.max()]).tolist()
    if low < 0 or high >= vocab:
        bad = high if high >= vocab else low
        raise ValueError(
            f"the labels hold the token id {bad} but the logits have a vocabulary of {vocab} "
            f"(ids 0..{vocab - 1}; {IGNORE_INDEX} marks no target): pass the logits of the model "
            "that matches the tokenizer that encoded the batch (model.resize_token_embeddings("
            "len(tokenizer)) after adding tokens)"
        )


def _check_normaliser(normaliser: object) -> None:
    """A finite count >= 0 (a tensor of one element, or a number)."""
    value: float | None = None
    if isinstance(normaliser, torch.Tensor):
        value = float(normaliser) if normaliser.numel() == 1 else None
    elif isinstance(normaliser, (int, float)) and not isinstance(normaliser, bool):
        value = float(normaliser)
    if value is None or not math.isfinite(value) or value < 0:
        shown = (
            f"a tensor of shape {list(normaliser.shape)}"
            if isinstance(normaliser, torch.Tensor) and normaliser.numel() != 1
            else repr(value if value is not None else normaliser)
        )
        raise ValueError(
            f"normaliser={shown} must be a finite count >= 0 (a number or a one-element "
            "tensor): pass the step's summed loss_normaliser(batch, reduction) over its "
            "micro-batches and ranks, or None for this micro-batch's own"
        )


def _rows(logits: torch.Tensor | None, vocab: int, shift: int) -> torch.Tensor:
    if logits is None:
        return torch.empty(0)
    if shift:
        logits = logits[..., :-shift, :]
    return logits.reshape(-1, vocab)


def _weights(segments: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    """``w_t`` of each target token from the segments of the targets."""
    if reduction == "token":
        return torch.ones(segments.shape, dtype=torch.float64, device=segments.device)
    if segments.numel() and int(segments.min()) < 0:
        raise ValueError(
            f"{LOSS_SEGMENTS!r} is -1 at a target token: the segments do not belong to these "
            "labels; pass the loss_segments and labels of the same batch"
        )
    counts = torch.bincount(segments).double()[segments]
    return 1.0 / counts if reduction == "sample" else counts.rsqrt()


class PackedLoss:
    """:func:`packed_loss` as the ``compute_loss_func`` of ``transformers.Trainer`` / TRL's
    ``SFTTrainer``: ``Trainer(..., compute_loss_func=PackedLoss("sample"))``.

    ``"token"`` needs nothing more: it divides by the trainer's ``num_items_in_batch``, so it
    equals the trainer's own loss. ``"sample"`` / ``"sqrt"`` read each token's sample from the
    collator (``VLMPackingCollator(..., output="hf", loss_segments=True)``) and need
    :meth:`attach` once the trainer is built: it takes :data:`LOSS_SEGMENTS` out of every
    micro-batch before the model sees it and sums :func:`loss_normaliser` over the step's
    micro-batches (and ranks, with ``average_tokens_across_devices``), the normaliser of the
    whole step. Training only: evaluation batches do not pass through :meth:`attach`.
    """

    def __init__(self, reduction: Reduction = "token") -> None:
        check_choice("reduction", reduction, REDUCTIONS)
        self.reduction: Reduction = reduction
        self._pending: deque[torch.Tensor] = deque()
        self._normaliser: torch.Tensor | None = None

    def attach(self, trainer: Any) -> None:
        """Wrap ``trainer.get_batch_samples`` (the step's micro-batches) as described above."""
        fetch = trainer.get_batch_samples

        def get_batch_samples(*args: Any, **kwargs: Any) -> tuple[list[Any], Any]:
            batches, num_items = fetch(*args, **kwargs)
            if any(LOSS_SEGMENTS not in b for b in batches):
                raise ValueError(
                    f"PackedLoss({self.reduction!r}) got a micro-batch without "
                    f"{LOSS_SEGMENTS!r}; build the collator with loss_segments=True"
                )
            segments = [b.pop(LOSS_SEGMENTS) for b in batches]
            local = sum(
                loss_normaliser({"labels": b["labels"], LOSS_SEGMENTS: s}, self.reduction)
                for b, s in zip(batches, segments, strict=True)
            )
            total = torch.as_tensor(local, dtype=torch.float64, device=trainer.args.device)
            if trainer.args.average_tokens_across_devices and trainer.accelerator.num_processes > 1:
                total = trainer.accelerator.gather(total).sum()
            self._pending.extend(segments)
            self._normaliser = total
            return batches, num_items

        trainer.get_batch_samples = get_batch_samples

    def __call__(
        self, outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs.logits
        if self.reduction == "token":
            return packed_loss(logits, {"labels": labels}, "token", num_items_in_batch)
        if not self._pending:
            raise ValueError(
                f"PackedLoss({self.reduction!r}) has no loss segments for this micro-batch: "
                "call loss.attach(trainer) after building the trainer (training only)"
            )
        batch = {"labels": labels, LOSS_SEGMENTS: self._pending.popleft().to(labels.device)}
        return packed_loss(logits, batch, self.reduction, self._normaliser)
