"""The collator's output: :class:`CollatedBatch`, ``R`` packed THD rows and their media, and
:func:`assemble_batch`, which stacks packed rows into one."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from energon_pack.encoding.families.materialise import FamilyInputs, model_built_inputs
from energon_pack.media import MediaConfig, MediaTensors
from energon_pack.packing.packed import (
    PackedSample,
)
from energon_pack.packing.row import (
    PackedRow,
    hf_varlen_kwargs,
    packed_seq_params_kwargs,
)
from energon_pack.train.bridge import bridge_batch
from energon_pack.train.hf import batch_model_inputs


@dataclass(frozen=True, eq=False)
class CollatedBatch:
    """``R`` packed THD rows of ``T`` tokens each (``R == 1`` unless a micro-batch was split).

    Per-row tensors are stacked ``[R, T]``. ``cu_seqlens[r]`` / ``cu_seqlens_padded[r]`` are row
    ``r``'s boundaries (see :class:`~energon_pack.PackedRow`). The ``*_flat`` forms index
    the flattened ``R*T`` token dimension (``input_ids.view(1, -1)``): the real segments of all
    rows one after another, so one THD call covers the whole batch; with ``pad_cu_seqlens`` they
    are padded to ``R * max_segments + 1`` entries by repeating the last boundary.
    """

    input_ids: torch.Tensor
    """``[R, T]`` long."""
    labels: torch.Tensor
    """``[R, T]`` long, shifted within each segment, ``-100`` where there is no target."""
    loss_mask: torch.Tensor
    """``[R, T]`` float32, aligned with ``labels``."""
    position_ids: torch.Tensor
    """``[R, T]`` long, restarting at 0 per segment."""
    seq_idx: torch.Tensor
    """``[R, T]`` int32 segment index of each position within its row."""
    cu_seqlens: tuple[torch.Tensor, ...]
    """Per row: ``[N_r + 1]`` int32 cumulative real lengths."""
    cu_seqlens_padded: tuple[torch.Tensor, ...]
    """Per row: ``[N_r + 1]`` int32 cumulative physical lengths (offsets in the row)."""
    cu_seqlens_flat: torch.Tensor
    """``[N + 1]`` int32 cumulative real lengths of all rows' segments, in row order."""
    cu_seqlens_padded_flat: torch.Tensor
    """``[N + 1]`` int32 offsets of all rows' segments in the flattened ``R*T`` dimension."""
    row_offsets: torch.Tensor
    """``[R + 1]`` int32: row ``r``'s segments are flat segments ``row_offsets[r]`` up to
    ``row_offsets[r+1]`` (row ``r`` itself starts at token ``r * T`` of the flattened batch)."""
    max_seqlen: int
    """Largest physical segment length over all rows (``seq_length`` with static metadata)."""
    vision: MediaTensors
    """Media of all rows, concatenated in row-then-segment order. With the encoder's
    ``MediaConfig(pixel_dtype="uint8")`` its pixel tensors are uint8 raw pixels: the training
    step calls :func:`~energon_pack.media.normalize_pixels` on them (same values as float32)."""
    mrope_position_ids: torch.Tensor | None
    """``[3, R, T]`` long Qwen-VL mRoPE ids (with ``position_ids="mrope"``)."""
    rope_deltas: torch.Tensor | None
    """``[N]`` long rope deltas of all rows' real segments, in flat order (with mRoPE): entry ``i``
    belongs to the segment that ``cu_seqlens_flat[i:i+2]`` bounds (static slots have none)."""
    target_counts: torch.Tensor
    """``[N]`` long: the training targets (``loss_mask`` ones) of each real segment, in flat order
    (the per-sample counts that :mod:`energon_pack.train.loss` weights samples by)."""
    keys: tuple[tuple[str, ...], ...]
    """Sample keys of each row, in segment order."""
    skipped_keys: tuple[str, ...] = ()
    """Keys of this micro-batch's samples that were skipped (``overlong`` / ``on_media_error``)."""
    truncated_keys: tuple[str, ...] = ()
    """Keys of samples cut to fit ``seq_length`` (``overlong="truncate"``)."""
    family_inputs: FamilyInputs | None = None
    """With a processor family: its processor's media outputs of all rows and its token-level
    inputs ``[R, T]`` (e.g. ``token_type_ids``); :meth:`hf_model_inputs` passes them on."""

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_real_tokens(self) -> int:
        """Tokens of the packed samples, padding excluded."""
        return int(self.cu_seqlens_flat[-1])

    def to_packed_seq_params_kwargs(self) -> dict[str, Any]:
        """Megatron Core ``PackedSeqParams`` kwargs (``qkv_format="thd"``), flattened batch."""
        return packed_seq_params_kwargs(
            self.cu_seqlens_flat, self.cu_seqlens_padded_flat, self.max_seqlen
        )

    def to_hf_varlen_kwargs(self) -> dict[str, Any]:
        """transformers varlen flash-attention kwargs for ``input_ids.view(1, -1)`` (1-D
        ``position_ids``; for a whole forward, mRoPE included, use :meth:`hf_model_inputs`)."""
        return hf_varlen_kwargs(self.position_ids, self.cu_seqlens_padded_flat, self.max_seqlen)

    def hf_model_inputs(self, model: Any = None, family: Any = None) -> dict[str, Any]:
        """Keyword arguments for ``model(**batch.hf_model_inputs(model))`` of a transformers
        causal LM or Qwen2-VL / Qwen2.5-VL model (``model``: the model, its config, an
        :class:`~energon_pack.HFTarget`, or None for sdpa/eager); see
        :func:`energon_pack.hf_model_inputs`. A processor family whose packed rows need inputs
        built by the model (4-D masks, per-segment positions) gets them from ``model`` (the
        model itself) and ``family`` (the collator's).

        Raises:
            ValueError: such a family's batch without the model or the family.
        """
        out = self.model_inputs(model)
        if self.family_inputs is not None:
            cu = list(self.cu_seqlens_padded)
            out.update(model_built_inputs(family, model, self.input_ids, cu, self.family_inputs))
        return out

    def model_inputs(self, model: Any = None) -> dict[str, Any]:
        """:meth:`hf_model_inputs` without the check for inputs built by the model (the
        collator adds those itself)."""
        out = batch_model_inputs(self, self.cu_seqlens_padded_flat, self.vision.tensors(), model)
        if self.family_inputs is not None:
            out.update(self.family_inputs.media)
            shape = out["input_ids"].shape
            out.update({k: v.reshape(shape) for k, v in self.family_inputs.tokens.items()})
        return out

    def row(self, index: int = 0) -> PackedRow:
        """Row ``index`` as a :class:`~energon_pack.PackedRow`."""
        return PackedRow(
            input_ids=self.input_ids[index],
            labels=self.labels[index],
            loss_mask=self.loss_mask[index],
            position_ids=self.position_ids[index],
            cu_seqlens=self.cu_seqlens[index],
            cu_seqlens_padded=self.cu_seqlens_padded[index],
            max_seqlen=self.max_seqlen,
            seq_idx=self.seq_idx[index],
        )

    def to_bridge_batch(self, media: MediaConfig | None = None) -> dict[str, Any]:
        """The dict Megatron-Bridge's ``vlm_step.get_batch`` reads for a batch of one row
        (micro-batch 1; see :func:`~energon_pack.bridge_batch`), with ``__keys__`` (the row's
        sample keys) alongside. uint8 pixels are normalised with ``media`` (the encoder's
        ``MediaConfig``), or refused without it; several rows or a processor family's inputs
        are a ValueError (Bridge's VLM step takes Qwen-VL media, one row at a time)."""
        if self.num_rows != 1 or self.family_inputs is not None:
            raise ValueError(
                f"to_bridge_batch takes a batch of one row with Qwen-VL media, got {self.num_rows} "
                f"row(s){' and processor-family inputs' if self.family_inputs else ''}; give "
                "Bridge one packed row per micro-batch"
            )
        row = self.row(0)
        visual: dict[str, torch.Tensor | None] = dict(self.vision.tensors())
        return bridge_batch(row, visual, config=media, metadata={"__keys__": self.keys[0]})

    def to_dict(self) -> dict[str, Any]:
        """Flat mapping: every field except ``vision``, plus the media tensors that are set."""
        skip = ("vision", "family_inputs")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        extra = self.family_inputs.tensors() if self.family_inputs is not None else {}
        return {**out, **self.vision.tensors(), **extra}


def assemble_batch(
    packs: list[PackedSample],
    vision: MediaTensors,
    static_segments: int | None,
    skipped: list[str],
    truncated: list[str],
    family_inputs: FamilyInputs | None = None,
) -> CollatedBatch:
    """Stack the rows and build the flattened boundaries (real segments only, then padding)."""
    width = int(packs[0].row.input_ids.shape[0])
    real: list[torch.Tensor] = [torch.zeros(1, dtype=torch.int32)]
    physical: list[torch.Tensor] = [torch.zeros(1, dtype=torch.int32)]
    row_offsets = [0]
    real_total = 0
    targets: list[torch.Tensor] = []
    for index, pack in enumerate(packs):
        count = len(pack.keys) or 1  # a padding row has one segment and no keys
        on_target = pack.row.loss_mask != 0
        targets.append(torch.bincount(pack.row.seq_idx[on_target].long(), minlength=count))
        real.append(pack.row.cu_seqlens[1 : count + 1] + real_total)
        physical.append(pack.row.cu_seqlens_padded[1 : count + 1] + index * width)
        real_total += int(pack.row.cu_seqlens[count])
        row_offsets.append(row_offsets[-1] + count)
    cu_flat, cu_padded_flat = torch.cat(real), torch.cat(physical)
    if static_segments is not None:
        fill = len(packs) * static_segments + 1 - cu_flat.numel()
        cu_flat = torch.cat((cu_flat, cu_flat[-1:].expand(fill)))
        cu_padded_flat = torch.cat((cu_padded_flat, cu_padded_flat[-1:].expand(fill)))
    rows = [pack.row for pack in packs]
    return CollatedBatch(
        input_ids=torch.stack([r.input_ids for r in rows]),
        labels=torch.stack([r.labels for r in rows]),
        loss_mask=torch.stack([r.loss_mask for r in rows]),
        position_ids=torch.stack([r.position_ids for r in rows]),
        seq_idx=torch.stack([r.seq_idx for r in rows]),
        cu_seqlens=tuple(r.cu_seqlens for r in rows),
        cu_seqlens_padded=tuple(r.cu_seqlens_padded for r in rows),
        cu_seqlens_flat=cu_flat,
        cu_seqlens_padded_flat=cu_padded_flat,
        row_offsets=torch.tensor(row_offsets, dtype=torch.int32),
        max_seqlen=max(r.max_seqlen for r in rows),
        vision=vision,
        mrope_position_ids=_stack_optional([p.mrope_position_ids for p in packs], dim=1),
        rope_deltas=_cat_optional(
            [None if p.rope_deltas is None else p.rope_deltas[: len(p.keys)] for p in packs]
        ),
        target_counts=torch.cat(targets),
        keys=tuple(pack.keys for pack in packs),
        skipped_keys=tuple(skipped),
        truncated_keys=tuple(truncated),
        family_inputs=family_inputs,
    )


def _stack_optional(tensors: list[torch.Tensor | None], dim: int) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.stack(present, dim=dim) if present else None


def _cat_optional(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None
