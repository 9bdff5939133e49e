"""Forward and backward passes of the cut model, and what they are compared by: the summed
target loss, each segment's logits, every parameter's gradient, and each decoder layer's output
per segment (to name the first layer where packed and alone part, or where one segment moves
another).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from energon_pack.packing.row import IGNORE_INDEX
from energon_pack.verify.inputs import Inputs, Segment

GRADIENT_FLOOR = 1e-3
"""The smallest gradient scale a parameter is compared at, as a share of the model's largest
gradient entry."""


@dataclass(frozen=True)
class Pass:
    """One forward (and backward): ``loss * targets``, the row's logits ``[T, V]``, each
    decoder layer's output ``[T, H]`` and the gradients (empty without backward)."""

    loss: float
    logits: torch.Tensor
    layers: tuple[torch.Tensor, ...]
    gradients: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Difference:
    """The largest relative difference of one comparison, and the first decoder layer (by
    index) whose output differs by more than the tolerance (None: none does)."""

    error: float
    layer: int | None = None


def run(model: Any, inputs: Inputs, *, backward: bool = True) -> Pass:
    """``model(**inputs)`` (and its backward of ``loss * targets``)."""
    model.zero_grad(set_to_none=True)
    targets = int((inputs["labels"][..., 1:] != IGNORE_INDEX).sum())
    with _layer_outputs(model) as layers, torch.set_grad_enabled(backward):
        out = model(**inputs)
        loss = out.loss * targets
        if backward:
            loss.backward()
    gradients = {
        name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None
    }
    logits = out.logits.detach().reshape(-1, out.logits.shape[-1])
    return Pass(float(loss.detach().double()), logits, tuple(layers), gradients)


def loss_error(packed: Pass, alone: Sequence[Pass]) -> float:
    want = sum(one.loss for one in alone)
    return abs(packed.loss - want) / max(abs(want), 1e-30)


def gradient_error(packed: Pass, alone: Sequence[Pass]) -> tuple[float, str]:
    """The worst relative gradient difference and the parameter it is in. Each parameter's
    difference is relative to its largest gradient entry, but never to less than
    :data:`GRADIENT_FLOOR` of the model's largest: a gradient that is zero in exact arithmetic
    (a key bias, which softmax cancels) is rounding noise, not a signal."""
    want: dict[str, torch.Tensor] = {}
    for one in alone:
        for name, grad in one.gradients.items():
            want[name] = want[name] + grad if name in want else grad
    largest = max((float(grad.abs().max()) for grad in want.values() if grad.numel()), default=0)
    worst, where = 0.0, ""
    for name in sorted(set(want) | set(packed.gradients)):
        expected = want.get(name)
        got = packed.gradients.get(name)
        if expected is None or got is None:
            return float("inf"), name  # a parameter gets a gradient only one way
        error = _relative(got, expected, floor=GRADIENT_FLOOR * largest)
        if error > worst:
            worst, where = error, name
    return worst, where


def segments_error(
    packed: Pass, alone: Sequence[Pass], segments: Sequence[Segment], tolerance: float
) -> Difference:
    """Each segment's logits and layer outputs in the row against the sample alone."""
    pairs = [
        (segment.start, segment.length, one, 0)
        for segment, one in zip(segments, alone, strict=True)
    ]
    return _compare(packed, pairs, tolerance)


def moved(
    packed: Pass, other: Pass, segments: Sequence[Segment], changed: int, tolerance: float
) -> Difference:
    """How far the segments other than ``changed`` moved between two forwards of the row."""
    pairs = [
        (segment.start, segment.length, other, segment.start)
        for index, segment in enumerate(segments)
        if index != changed
    ]
    return _compare(packed, pairs, tolerance)


def _compare(
    packed: Pass, pairs: Sequence[tuple[int, int, Pass, int]], tolerance: float
) -> Difference:
    error = 0.0
    first: int | None = None
    for start, length, other, other_start in pairs:
        mine = slice(start, start + length)
        theirs = slice(other_start, other_start + length)
        error = max(error, _relative(packed.logits[mine], other.logits[theirs]))
        for index, (got, want) in enumerate(zip(packed.layers, other.layers, strict=True)):
            if _relative(got[mine], want[theirs]) > tolerance:
                first = index if first is None else min(first, index)
                break
    return Difference(error, first)


def _relative(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    scale = max(float(want.abs().max()) if want.numel() else 0.0, floor)
    difference = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    return difference / scale if scale > 0 else difference


@contextmanager
def _layer_outputs(model: Any) -> Iterator[list[torch.Tensor]]:
    """Collects each decoder layer's output hidden states (row 0 flattened to ``[T, H]``)."""
    outputs: list[torch.Tensor] = []

    def keep(module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        outputs.append(hidden.detach().reshape(-1, hidden.shape[-1]))

    hooks = [layer.register_forward_hook(keep) for layer in decoder_layers(model)]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


def decoder_layers(model: Any) -> list[Any]:
    """The text decoder's layers: the longest ``layers`` list outside the vision tower."""
    found: list[Any] = []
    for name, module in model.named_modules():
        if not name.endswith("layers") or not isinstance(module, torch.nn.ModuleList):
            continue
        if any(part in name for part in ("vision", "visual", "audio")):
            continue
        if len(module) > len(found):
            found = list(module)
    return found
