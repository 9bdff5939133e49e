"""Packing proven on the user's own model: :func:`verify_packing` trains a cut copy of the
model's architecture on a packed row and on each sample alone, per attention implementation,
and says whether packing is exact, leaks, or cannot run here (and why)."""

from energon_pack.verify.check import DEFAULT_ATTN, default_attn_implementations, verify_packing
from energon_pack.verify.report import TOLERANCES, BackendResult, Tolerance, VerifyReport

__all__ = [
    "DEFAULT_ATTN",
    "TOLERANCES",
    "BackendResult",
    "Tolerance",
    "VerifyReport",
    "default_attn_implementations",
    "verify_packing",
]
