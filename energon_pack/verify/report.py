"""What a verification found: a verdict per attention implementation, its measured errors, and
when packing is not exact, where it parts and what fixes it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

Verdict = Literal["exact", "leaks", "cannot_run"]


@dataclass(frozen=True)
class Tolerance:
    """Relative errors allowed for one dtype: the summed loss, each segment's logits, each
    parameter's gradient, and how far one segment may move another."""

    loss: float
    logits: float
    gradient: float
    leak: float


TOLERANCES = {
    torch.float64: Tolerance(loss=1e-6, logits=1e-6, gradient=1e-5, leak=1e-9),
    torch.float32: Tolerance(loss=1e-4, logits=1e-4, gradient=1e-3, leak=1e-5),
    torch.bfloat16: Tolerance(loss=2e-2, logits=5e-2, gradient=2e-1, leak=2e-2),
    torch.float16: Tolerance(loss=5e-3, logits=1e-2, gradient=5e-2, leak=5e-3),
}
"""Per dtype; float64 on CPU is the default (its model layers that run in float32 stay inside
the float64 gradient bound)."""


@dataclass(frozen=True)
class BackendResult:
    """One attention implementation's verdict, errors and reason."""

    attn_implementation: str
    verdict: Verdict
    loss_error: float | None = None
    logits_error: float | None = None
    gradient_error: float | None = None
    worst_parameter: str | None = None
    leak: float | None = None
    """How far the other segments' logits moved when one segment's tokens and images changed
    (relative to their largest logit)."""
    layer: str | None = None
    """The first decoder layer where packed and alone part (``"3 (linear_attention)"``)."""
    reason: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class VerifyReport:
    """A verification of packing on one model: what was checked and each backend's result."""

    model_dir: str
    model_type: str
    family: str | None
    model_class: str
    dtype: str
    device: str
    samples: tuple[str, ...]
    segment_tokens: tuple[int, ...]
    skipped: dict[str, int]
    layer_types: tuple[str, ...]
    """The cut model's type of each decoder layer (what the ``layer`` of a result indexes)."""
    results: tuple[BackendResult, ...]
    refusal: str | None = None
    """Why the library refuses to pack this model (its leak is still measured)."""
    tolerance: dict[str, float] = field(default_factory=dict)

    @property
    def exit_status(self) -> int:
        """0: every backend that ran is exact; 1: one leaks (or nothing could run)."""
        ran = [r for r in self.results if r.verdict != "cannot_run"]
        return 0 if ran and all(r.verdict == "exact" for r in ran) else 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def table(self) -> str:
        """The terminal table: one line per attention implementation, then each reason."""
        head = (
            f"{self.model_type} ({self.model_class}), {self.dtype} on {self.device}; "
            f"{len(self.samples)} samples packed in one row ({sum(self.segment_tokens)} "
            f"tokens); layer types: {', '.join(dict.fromkeys(self.layer_types))}"
        )
        lines = [head]
        if self.skipped:
            lines.append(f"skipped samples: {self.skipped}")
        if self.refusal:
            lines.append(f"refused for packing: {self.refusal}")
        columns = ("attention", "verdict", "loss", "logits", "gradient", "leak", "first layer")
        rows = [columns] + [
            (
                r.attn_implementation,
                r.verdict,
                _number(r.loss_error),
                _number(r.logits_error),
                _number(r.gradient_error),
                _number(r.leak),
                r.layer or "-",
            )
            for r in self.results
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        lines += [f"{r.attn_implementation}: {r.reason}" for r in self.results if r.reason]
        return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"
