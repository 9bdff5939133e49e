"""Assembly of one packed THD row (Megatron Core / Transformer Engine form) from encoded sequences.

Input sequence (a mapping or an object with these attributes):

* ``input_ids`` ``[L]`` integer token ids (torch tensor, numpy array or list);
* ``loss_mask`` ``[L]`` aligned with ``input_ids``: non-zero (normally 1) where the token is a
  training target. The first token of a sequence can never be a target (nothing before it in the
  segment predicts it), so its mask value is ignored;
* or, instead of ``loss_mask``, HF-style ``labels`` ``[L]``: **unshifted** labels as passed to a
  transformers model (``labels[t] == input_ids[t]`` where the token is a target, ``-100`` where it
  is ignored; the model shifts). They are read as ``loss_mask = labels != -100`` and must equal
  ``input_ids`` wherever they are not ``-100`` (pre-shifted labels are rejected). When both are
  given, ``loss_mask`` wins;
* optional ``position_ids`` ``[L]`` used for the real tokens of that sequence;
* optional ``key`` / ``__key__``, used in error messages.

The row builder does the shift: ``labels[t] = input_ids[t + 1]`` of the same segment where that
token is a target, else ``-100``; a target never crosses a segment boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from energon_pack.packing.row_layout import RowLayout

IGNORE_INDEX = -100
"""Label value of positions without a training target (PyTorch / HF convention)."""


@dataclass(frozen=True, eq=False)
class PackedRow:
    """One packed THD row of ``T`` tokens holding ``N`` segments.

    ``cu_seqlens`` holds cumulative real lengths, ``cu_seqlens_padded`` cumulative physical
    (aligned) lengths, i.e. segment offsets in the row. With static metadata both have a fixed
    length, filled by repeating the last boundary (empty slots).
    """

    input_ids: torch.Tensor
    """``[T]`` long."""
    labels: torch.Tensor
    """``[T]`` long, shifted inside each segment, ``-100`` where ``loss_mask`` is 0."""
    loss_mask: torch.Tensor
    """``[T]`` float32, aligned with ``labels``."""
    position_ids: torch.Tensor
    """``[T]`` long, restarting at 0 per segment; gap positions continue counting."""
    cu_seqlens: torch.Tensor
    """``[N+1]`` int32 cumulative real lengths."""
    cu_seqlens_padded: torch.Tensor
    """``[N+1]`` int32 cumulative physical lengths (offsets in the row)."""
    max_seqlen: int
    """Largest physical segment length (``seq_length`` with static metadata)."""
    seq_idx: torch.Tensor
    """``[T]`` int32 segment index of each position; gap positions belong to their segment."""

    @property
    def num_segments(self) -> int:
        """Number of real segments (empty static-metadata slots not counted)."""
        return int(torch.count_nonzero(self.cu_seqlens[1:] - self.cu_seqlens[:-1]))

    def to_packed_seq_params_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Megatron Core ``PackedSeqParams`` (``qkv_format="thd"``)."""
        return packed_seq_params_kwargs(self.cu_seqlens, self.cu_seqlens_padded, self.max_seqlen)

    def to_hf_varlen_kwargs(self) -> dict[str, Any]:
        """transformers varlen flash-attention kwargs (physical boundaries)."""
        return hf_varlen_kwargs(self.position_ids, self.cu_seqlens_padded, self.max_seqlen)


def packed_seq_params_kwargs(
    cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int
) -> dict[str, Any]:
    """Megatron Core ``PackedSeqParams`` fields for THD attention (no megatron-core import)."""
    return {
        "cu_seqlens_q": cu_seqlens,
        "cu_seqlens_kv": cu_seqlens,
        "cu_seqlens_q_padded": cu_seqlens_padded,
        "cu_seqlens_kv_padded": cu_seqlens_padded,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen,
        "qkv_format": "thd",
    }


def hf_varlen_kwargs(
    position_ids: torch.Tensor, cu_seqlens_padded: torch.Tensor, max_seqlen: int
) -> dict[str, Any]:
    """transformers varlen flash-attention kwargs. The boundaries are the physical (padded) ones,
    since they index the physical tokens; ``position_ids`` gets a leading batch dim of 1."""
    return {
        "position_ids": position_ids.reshape(1, -1),
        "cu_seq_lens_q": cu_seqlens_padded,
        "cu_seq_lens_k": cu_seqlens_padded,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }


def build_packed_row(
    sequences: Sequence[Any], layout: RowLayout | None = None, /, **settings: Any
) -> PackedRow:
    """Pack ``sequences`` (in order) into one THD row; see the module docstring for the input.

    ``layout`` is the :class:`~energon_pack.RowLayout` (or give its fields as
    keywords: ``seq_length=...``). Each segment's physical span is its length rounded up to
    ``pad_to_multiple_of``; with ``pad_to_max_length`` the row has exactly ``seq_length``
    tokens, the trailing padding absorbed in the last segment; ``pad_cu_seqlens`` gives
    ``cu_seqlens*`` a fixed length ``max_segments + 1`` and fixes ``max_seqlen`` to
    ``seq_length``. Raises ``ValueError`` on bad input or an overlong group.
    """
    layout = RowLayout.of(layout, settings)
    if len(sequences) == 0:
        raise ValueError("build_packed_row got an empty group; pass at least one sequence")
    slots = layout.static_segments
    if slots is not None and len(sequences) > slots:
        raise ValueError(
            f"group has {len(sequences)} segments (keys {_keys(sequences)}) but "
            f"max_segments={slots} with pad_cu_seqlens=True; raise max_segments or "
            "limit the packer to that many samples per row"
        )

    ids_parts, mask_parts, pos_parts, lengths = _read_sequences(sequences)
    aligned = [layout.aligned(n) for n in lengths]
    used = sum(aligned)
    seq_length, pad_token_id = layout.seq_length, layout.pad_token_id
    if used > seq_length:
        listing = ", ".join(f"{k}={n}" for k, n in zip(_keys(sequences), lengths, strict=True))
        raise ValueError(
            f"group needs {used} tokens after padding each segment to a multiple of "
            f"{layout.pad_to_multiple_of} (lengths: {listing}) but seq_length={seq_length}; "
            "pack fewer or shorter samples per row, or raise seq_length"
        )
    if layout.pad_to_max_length:
        aligned[-1] += seq_length - used

    n_seg = len(lengths)
    total = sum(aligned)
    offsets = list(itertools.accumulate(aligned, initial=0))
    ends = list(itertools.accumulate(lengths, initial=0))
    gaps = [a - n for a, n in zip(aligned, lengths, strict=True)]
    seq_idx = torch.repeat_interleave(
        torch.arange(n_seg, dtype=torch.int32), torch.tensor(aligned), output_size=total
    )
    # One concatenation per field: segment tokens interleaved with views of a filler tensor.
    pad_ids = torch.full((max(gaps),), pad_token_id, dtype=torch.long)
    input_ids = torch.cat(_with_gaps(ids_parts, pad_ids, gaps)).long()
    mask_in = torch.cat(_with_gaps(mask_parts, torch.zeros(max(gaps)), gaps)).float()
    # The first token of a segment is never a target: this also stops targets crossing a boundary.
    mask_in[offsets[:-1]] = 0.0
    loss_mask = torch.cat((mask_in[1:], torch.zeros(1)))
    next_ids = torch.cat((input_ids[1:], pad_ids.new_full((1,), pad_token_id)))
    labels = torch.where(loss_mask != 0, next_ids, IGNORE_INDEX)
    position_ids = _position_ids(pos_parts, lengths, aligned)

    cu_real, cu_phys = ends, offsets
    max_seqlen = max(aligned)
    if slots is not None:
        fill = slots - n_seg
        cu_real = cu_real + [cu_real[-1]] * fill
        cu_phys = cu_phys + [cu_phys[-1]] * fill
        max_seqlen = seq_length
    return PackedRow(
        input_ids=input_ids,
        labels=labels,
        loss_mask=loss_mask,
        position_ids=position_ids,
        cu_seqlens=torch.tensor(cu_real, dtype=torch.int32),
        cu_seqlens_padded=torch.tensor(cu_phys, dtype=torch.int32),
        max_seqlen=max_seqlen,
        seq_idx=seq_idx.to(torch.int32),
    )


def unpack(row: PackedRow, *, position_ids: bool = False) -> list[dict[str, torch.Tensor]]:
    """The sequences packed in ``row``: ``input_ids`` (long) and ``loss_mask`` (float) each.

    ``loss_mask`` is the input-aligned mask (its first entry is 0, see the module docstring).
    With ``position_ids=True`` each sequence also gets the position ids of its real tokens.
    Empty static-metadata slots are skipped.
    """
    mask_in = torch.cat((torch.zeros(1), row.loss_mask[:-1]))
    cu = row.cu_seqlens.tolist()
    cu_pad = row.cu_seqlens_padded.tolist()
    out: list[dict[str, torch.Tensor]] = []
    for i in range(len(cu) - 1):
        length = cu[i + 1] - cu[i]
        if length == 0:
            continue
        span = slice(cu_pad[i], cu_pad[i] + length)
        item = {"input_ids": row.input_ids[span], "loss_mask": mask_in[span]}
        if position_ids:
            item["position_ids"] = row.position_ids[span]
        out.append(item)
    return out


def _field(sequence: Any, name: str) -> Any:
    if isinstance(sequence, Mapping):
        return sequence.get(name)
    return getattr(sequence, name, None)


def _key(sequence: Any, index: int) -> str:
    for name in ("key", "__key__"):
        value = _field(sequence, name)
        if value is not None:
            return repr(value)
    return f"#{index}"


def _keys(sequences: Sequence[Any]) -> list[str]:
    return [_key(s, i) for i, s in enumerate(sequences)]


def _bad(sequence: Any, index: int, problem: str) -> ValueError:
    """The error for one input sequence, naming it."""
    return ValueError(f"sample {_key(sequence, index)}: {problem}")


def _as_1d(value: Any, name: str, sequence: Any, index: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value
    else:
        try:
            tensor = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError) as error:
            raise _bad(
                sequence,
                index,
                f"{name} must be a 1-D numeric tensor, array "
                f"or list, got {type(value).__name__} ({error})",
            ) from None
    if tensor.ndim != 1:
        raise _bad(
            sequence,
            index,
            f"{name} must be 1-D [L], got shape "
            f"{tuple(tensor.shape)}; pass one 1-D sequence per entry",
        )
    # An empty list has no dtype to check; the caller rejects empty sequences.
    if (
        name != "loss_mask"
        and tensor.numel()
        and (tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex())
    ):
        raise _bad(sequence, index, f"{name} must hold integers, got dtype {tensor.dtype}")
    return tensor


def _read_sequences(
    sequences: Sequence[Any],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor | None], list[int]]:
    ids_parts: list[torch.Tensor] = []
    mask_parts: list[torch.Tensor] = []
    pos_parts: list[torch.Tensor | None] = []
    lengths: list[int] = []
    for index, sequence in enumerate(sequences):
        raw_ids = _field(sequence, "input_ids")
        if raw_ids is None:
            raise _bad(
                sequence,
                index,
                "no input_ids; each sequence needs input_ids and loss_mask (or HF labels)",
            )
        ids = _as_1d(raw_ids, "input_ids", sequence, index)
        length = ids.shape[0]
        if length == 0:
            raise _bad(
                sequence, index, "input_ids is empty (length 0); drop empty samples before packing"
            )
        raw_mask = _field(sequence, "loss_mask")
        if raw_mask is not None:
            mask = _as_1d(raw_mask, "loss_mask", sequence, index)
            _check_length(sequence, index, "loss_mask", mask, length)
        else:
            raw_labels = _field(sequence, "labels")
            if raw_labels is None:
                raise _bad(
                    sequence,
                    index,
                    "neither loss_mask nor labels given; pass "
                    "loss_mask [L] aligned with input_ids (1 = target) or unshifted HF labels",
                )
            hf_labels = _as_1d(raw_labels, "labels", sequence, index)
            _check_length(sequence, index, "labels", hf_labels, length)
            mask = loss_mask_from_labels(hf_labels, ids, _key(sequence, index))
        raw_pos = _field(sequence, "position_ids")
        pos = None
        if raw_pos is not None:
            pos = _as_1d(raw_pos, "position_ids", sequence, index)
            _check_length(sequence, index, "position_ids", pos, length)
        ids_parts.append(ids)
        mask_parts.append(mask)
        pos_parts.append(pos)
        lengths.append(length)
    _check_mask_values(mask_parts, sequences)
    return ids_parts, mask_parts, pos_parts, lengths


def _check_length(
    sequence: Any, index: int, name: str, tensor: torch.Tensor, expected: int
) -> None:
    if tensor.shape[0] != expected:
        raise _bad(
            sequence,
            index,
            f"{name} has length {tensor.shape[0]} but "
            f"input_ids has length {expected}; they must be aligned position by position",
        )


def first_true(mask: torch.Tensor) -> int | None:
    """Index of the first True of a 1-D bool ``mask`` (a row for 2-D), or None if none is."""
    return int(mask.nonzero()[0, 0]) if bool(mask.any()) else None


def loss_mask_from_labels(labels: torch.Tensor, input_ids: torch.Tensor, key: str) -> torch.Tensor:
    """Input-aligned loss mask (bool) of unshifted HF ``labels``; rejects pre-shifted labels."""
    target = labels != IGNORE_INDEX
    if (t := first_true(target & (labels != input_ids))) is not None:
        raise ValueError(
            f"sample {key}: labels[{t}]={int(labels[t])} differs from input_ids[{t}]="
            f"{int(input_ids[t])}; labels must be unshifted HF labels (input_ids with -100 where "
            "ignored). Pass loss_mask instead, or do not pre-shift the labels"
        )
    return target


def _check_mask_values(mask_parts: list[torch.Tensor], sequences: Sequence[Any]) -> None:
    masks = torch.cat(mask_parts).float()
    if bool(((masks >= 0) & torch.isfinite(masks)).all()):
        return
    for index, mask in enumerate(mask_parts):
        values = mask.float()
        if (t := first_true((values < 0) | ~torch.isfinite(values))) is not None:
            raise _bad(
                sequences[index],
                index,
                f"loss_mask[{t}]={float(values[t])}; "
                "loss_mask values must be finite and >= 0 (1 = target, 0 = ignored)",
            )


def _with_gaps(
    parts: list[torch.Tensor], filler: torch.Tensor, gaps: list[int]
) -> list[torch.Tensor]:
    pieces: list[torch.Tensor] = []
    for part, gap in zip(parts, gaps, strict=True):
        pieces.append(part)
        if gap:
            pieces.append(filler[:gap])
    return pieces


def _position_ids(
    pos_parts: list[torch.Tensor | None], lengths: list[int], aligned: list[int]
) -> torch.Tensor:
    """Per-segment positions; gap positions continue counting from the segment's last position."""
    counter = torch.arange(max(aligned))
    pieces: list[torch.Tensor] = []
    for given, length, span in zip(pos_parts, lengths, aligned, strict=True):
        if given is None:
            pieces.append(counter[:span])
            continue
        pieces.append(given)
        if span > length:
            pieces.append(counter[1 : span - length + 1] + given[-1])
    return torch.cat(pieces).long()
