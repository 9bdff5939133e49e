"""The layout of a packed THD row as one settings object, with every row rule checked once.

:class:`RowLayout` is what the packing core (:func:`~energon_pack.build_packed_row`,
:func:`~energon_pack.pack_samples`), both loaders, the offline packer and the settings
fingerprint take. The rules that other settings objects share (the offline
:class:`~energon_pack.offline.PackingSpec`, the topology check
:class:`~energon_pack.TrainingSetup`) are the functions below, written once.
No torch: the topology check and the CLI use this without loading it. :meth:`RowLayout.bridge_row`
lays a row out in Megatron-Bridge's packed parquet form (the offline ``format="bridge"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from energon_pack.packing.bins import aligned_length, overlong_refusal

__all__ = [
    "OverlongPolicy",
    "PackingWarning",
    "RowLayout",
    "default_pad_token_id",
    "fixed_width_problem",
    "multiple_problem",
]


class PackingWarning(UserWarning):
    """A packing setting that works but probably does not do what was meant."""


OverlongPolicy = Literal["error", "skip", "truncate"]
"""What a loader does with a sample longer than a row: raise, count and skip it, or cut it
(where the loader can cut; see each loader's ``overlong``)."""


@dataclass(frozen=True)
class RowLayout:
    """How segments are laid out in one packed row; validated on construction.

    Args:
        seq_length: row capacity in tokens.
        pad_to_multiple_of: each segment's physical span is its length rounded up to this
            (e.g. :func:`~energon_pack.pad_seq_to_mult`).
        pad_to_max_length: rows are exactly ``seq_length`` wide, the trailing padding absorbed
            in the last segment (needs ``seq_length`` to be a multiple of
            ``pad_to_multiple_of``).
        pad_cu_seqlens: static-shape metadata: ``cu_seqlens*`` get ``max_segments + 1``
            entries (the last boundary repeated) and ``max_seqlen`` is ``seq_length``; needs
            ``pad_to_max_length`` and ``max_segments``.
        max_segments: most segments per row (the slot count with ``pad_cu_seqlens``).
        pad_token_id: the id written into padding positions.
    """

    seq_length: int
    pad_to_multiple_of: int = 1
    pad_to_max_length: bool = False
    pad_cu_seqlens: bool = False
    max_segments: int | None = None
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def of(cls, layout: RowLayout | None, settings: Mapping[str, Any]) -> RowLayout:
        """``layout``, or one built from its fields given as keywords (``seq_length=...``), for
        the functions that take either."""
        if layout is not None and settings:
            raise ValueError(
                f"got a RowLayout and row settings {sorted(settings)} too; pass one of them "
                "(dataclasses.replace(layout, ...) changes a layout)"
            )
        if layout is not None:
            return layout
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"unknown row setting(s) {unknown}; the settings are {sorted(names)}")
        if "seq_length" not in settings:
            raise ValueError("no row layout: pass a RowLayout, or at least seq_length=<tokens>")
        return cls(**settings)

    @property
    def capacity(self) -> int:
        """The longest sequence that fits a row after padding to ``pad_to_multiple_of``."""
        return self.seq_length // self.pad_to_multiple_of * self.pad_to_multiple_of

    def aligned(self, length: int) -> int:
        """A segment's physical span: ``length`` rounded up to ``pad_to_multiple_of``."""
        return aligned_length(length, self.pad_to_multiple_of)

    def overlong(self, key: object, length: int) -> str | None:
        """Why a sample of ``length`` tokens cannot fit a row, or None when it fits."""
        return overlong_refusal(key, length, self.pad_to_multiple_of, self.seq_length)

    @property
    def static_segments(self) -> int | None:
        """The fixed number of segment slots (``max_segments`` with ``pad_cu_seqlens``)."""
        return self.max_segments if self.pad_cu_seqlens else None

    def bridge_span(self, length: int) -> int:
        """The tokens Megatron-Bridge feeds of a stored sequence of ``length`` tokens: the
        last one is only a label, so ``length - 1``, rounded up to ``pad_to_multiple_of``."""
        return self.aligned(length - 1)

    def bridge_row(
        self,
        input_ids: Sequence[npt.NDArray[np.integer[Any]]],
        loss_masks: Sequence[npt.NDArray[np.integer[Any]]],
        pad_id: int,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int8], list[int]]:
        """One packed row of Megatron-Bridge's packed parquet: ``input_ids``, the
        label-aligned ``loss_mask`` and ``seq_start_id``.

        ``loss_masks`` are aligned with ``input_ids`` (1 = the token is a target). Each
        sequence is padded with ``pad_id`` (Bridge pads and strips its tokenizer's eos) until
        :meth:`bridge_span` tokens precede its last one, and its mask is rolled by one as
        Bridge's ``fill_packing_strategy`` does: entry ``t`` weights the label ``t + 1``.
        """
        ids_out: list[npt.NDArray[np.int64]] = []
        masks_out: list[npt.NDArray[np.int8]] = []
        starts: list[int] = []
        offset = 0
        for ids, mask in zip(input_ids, loss_masks, strict=True):
            pad = self.bridge_span(len(ids)) + 1 - len(ids)
            ids_out.append(np.concatenate([ids, np.full(pad, pad_id)]).astype(np.int64))
            rolled = np.concatenate([mask[1:], np.zeros(pad + 1)]).astype(np.int8)
            masks_out.append(rolled)
            starts.append(offset)
            offset += len(ids) + pad
        return np.concatenate(ids_out), np.concatenate(masks_out), starts

    def fingerprint(self) -> dict[str, Any]:
        """The settings a saved state depends on: the fields that differ from the defaults
        beyond the four every loader has, so states saved before static metadata existed
        keep their fingerprint."""
        out: dict[str, Any] = {
            "seq_length": self.seq_length,
            "pad_to_multiple_of": self.pad_to_multiple_of,
            "pad_to_max_length": self.pad_to_max_length,
            "pad_token_id": self.pad_token_id,
        }
        if self.pad_cu_seqlens:
            out.update(pad_cu_seqlens=True, max_segments=self.max_segments)
        return out

    def _problems(self) -> list[str]:
        out = [
            f"{name} must be a positive int, got {value!r}"
            for name, value in (
                ("seq_length", self.seq_length),
                ("pad_to_multiple_of", self.pad_to_multiple_of),
            )
            if not _positive_int(value)
        ]
        if self.max_segments is not None and not _positive_int(self.max_segments):
            out.append(f"max_segments must be a positive int or None, got {self.max_segments!r}")
        if isinstance(self.pad_token_id, bool) or not isinstance(self.pad_token_id, int):
            out.append(f"pad_token_id must be an int token id, got {self.pad_token_id!r}")
        elif self.pad_token_id < 0:
            out.append(
                f"pad_token_id must be an int token id >= 0, got {self.pad_token_id}; pass the "
                "tokenizer's pad id (or the id of <|endoftext|>)"
            )
        for name in ("pad_to_max_length", "pad_cu_seqlens"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be True or False, got {getattr(self, name)!r}")
        if out:
            return out
        if self.pad_to_multiple_of > self.seq_length:
            out.append(
                f"pad_to_multiple_of={self.pad_to_multiple_of} is larger than seq_length="
                f"{self.seq_length}; no sample would fit. Use a seq_length that is a multiple "
                "of pad_to_multiple_of"
            )
        elif self.pad_to_max_length:
            problem = multiple_problem(
                "seq_length",
                self.seq_length,
                "pad_to_multiple_of",
                self.pad_to_multiple_of,
                because="pad_to_max_length=True aligns the last segment's span to the row end",
            )
            out += [problem] if problem else []
        problem = fixed_width_problem(self.pad_cu_seqlens, self.pad_to_max_length)
        out += [problem] if problem else []
        if self.pad_cu_seqlens and self.max_segments is None:
            out.append(
                "pad_cu_seqlens=True requires max_segments (the fixed number of segment slots); "
                "pass max_segments=<most samples per row>"
            )
        return out


def multiple_problem(
    length_name: str, length: int, multiple_name: str, multiple: int, *, because: str = ""
) -> str | None:
    """The rule "a row length is a multiple of the padding multiple", with the settings' own
    names; None when it holds."""
    if length % multiple == 0:
        return None
    why = f" ({because})" if because else ""
    return (
        f"{length_name}={length} is not a multiple of {multiple_name}={multiple}{why}; round "
        f"{length_name} to a multiple of {multiple} (e.g. {aligned_length(length, multiple)})"
    )


def fixed_width_problem(static_metadata: bool, fixed_width: bool) -> str | None:
    """The rule "static cu_seqlens shapes (``pad_cu_seqlens``) need fixed-width rows
    (``pad_to_max_length``)"; None when it holds."""
    if not static_metadata or fixed_width:
        return None
    return (
        "pad_cu_seqlens=True (static cu_seqlens shapes) requires fixed-width rows; set "
        "pad_to_max_length=True"
    )


def default_pad_token_id(tokenizer: object) -> int:
    """The one padding-id rule of every loader: the tokenizer's ``pad_token_id``, else the id
    of ``<|endoftext|>`` (Qwen's padding token)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        raise ValueError(
            f"cannot tell the padding id of {type(tokenizer).__name__}: it has no pad_token_id "
            "and no convert_tokens_to_ids; pass pad_token_id=<id>"
        )
    return int(convert("<|endoftext|>"))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def loader_layout(
    owner: str,
    layout: RowLayout | None,
    seq_length: int | None,
    pad_to_multiple_of: int,
    fields: dict[str, Any],
    tokenizer: object,
) -> RowLayout:
    """A loader's row layout: ``layout`` as given, or the one its ``seq_length`` /
    ``pad_to_multiple_of`` shortcut and the row keywords of earlier releases (``fields``) give,
    padding with the tokenizer's pad id (:func:`default_pad_token_id`) unless one is given."""
    if layout is not None:
        if seq_length is not None or pad_to_multiple_of != 1:
            raise ValueError(
                f"{owner}: pass seq_length and pad_to_multiple_of, or layout=RowLayout(...) with "
                "them, not both"
            )
        return layout
    if seq_length is None:
        raise ValueError(f"{owner} needs seq_length (or layout=RowLayout(...))")
    pad_token_id = fields.pop("pad_token_id", None)
    return RowLayout(
        seq_length,
        pad_to_multiple_of,
        **fields,
        pad_token_id=default_pad_token_id(tokenizer) if pad_token_id is None else pad_token_id,
    )
