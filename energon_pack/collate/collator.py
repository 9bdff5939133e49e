"""Collate-time packing: a picklable ``collate_fn`` that packs each micro-batch into THD rows.

:class:`VLMPackingCollator` takes the items a ``torch.utils.data.DataLoader`` batches together
(encoded samples, raw WebDataset samples, chat rows as ``transformers`` / TRL trainers hand them
over, or an already padded HF batch dict) and returns a
:class:`CollatedBatch`: ``R`` rows of ``T`` tokens in the Megatron Core / Transformer Engine THD
form, with the media of all rows concatenated in row-then-segment order. Every row is built by
:func:`~energon_pack.pack_samples`.

* Default (``pad_to_max_length=False``): the whole micro-batch becomes one row (``R == 1``), the
  samples in micro-batch order (Megatron-Bridge's in-batch packing). If it does not fit
  ``seq_length`` that is an error.
* ``pad_to_max_length=True``: rows are exactly ``seq_length`` wide; a micro-batch that does not fit
  one row is split into the fewest rows (an exact search for small micro-batches, bounded by a
  fixed node budget, else best-fit decreasing). Within a row the samples keep their micro-batch
  order; rows are ordered by their first sample.

The collator keeps no state across batches (its output depends on the micro-batch alone), so
resuming a ``DataLoader`` is exact by construction. Nothing is dropped silently: samples skipped by
the ``overlong`` / ``on_media_error`` policies are listed in :attr:`CollatedBatch.skipped_keys` and
logged (``energon_pack.collate``) with their key.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, TypeAlias

import torch

from energon_pack.checks import check_choice, check_config, check_type
from energon_pack.encoding.chatml import ConversationEncoder, SampleEncoder
from energon_pack.encoding.family import ModelFamily, family_media, model_family
from energon_pack.formats.chat_rows import is_chat_row
from energon_pack.formats.trainer_rows import check_media_columns, row_key, unreadable_item
from energon_pack.media import MediaError, VisionInputs
from energon_pack.packing.bins import OVERLONG_FIX
from energon_pack.packing.micro_batch import Weight, row_groups
from energon_pack.packing.mrope import MRopeConfig, PositionIds, mrope_setting
from energon_pack.packing.packed import (
    EncodedSample,
    PackedSample,
    SkippedSample,
    decode_pixels,
    pack_dropping_failures,
    pack_samples,
    padding_pack,
)
from energon_pack.packing.row import (
    hf_varlen_kwargs,
    loss_mask_from_labels,
    packed_seq_params_kwargs,
)
from energon_pack.packing.row_layout import (
    OverlongPolicy,
    PackingWarning,
    RowLayout,
    default_pad_token_id,
)
from energon_pack.packing.vision_budget import VISION_FIX, VisionBudget
from energon_pack.train.hf import HFTarget, batch_model_inputs, check_position_ids
from energon_pack.train.loss import LOSS_SEGMENTS, hf_loss_segments

logger = logging.getLogger("energon_pack.collate")

OnMediaError = Literal["error", "skip"]
Output = Literal["batch", "hf"]
CollateItem: TypeAlias = "EncodedSample | Mapping[str, Any] | tuple[str, Mapping[str, Any]]"
"""A micro-batch item: an encoded sample, a raw sample dict with ``__key__``, a chat row (a dict
with ``messages`` or ``conversations``), or ``(key, raw)``."""

_PADDED_FIELDS = frozenset({"input_ids", "attention_mask", "labels"})


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
    vision: VisionInputs
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

    def hf_model_inputs(self, model: Any = None) -> dict[str, Any]:
        """Keyword arguments for ``model(**batch.hf_model_inputs(model))`` of a transformers
        causal LM or Qwen2-VL / Qwen2.5-VL model (``model``: the model, its config, an
        :class:`~energon_pack.HFTarget`, or None for sdpa/eager); see
        :func:`energon_pack.hf_model_inputs`."""
        return batch_model_inputs(self, self.cu_seqlens_padded_flat, self.vision.tensors(), model)

    def to_dict(self) -> dict[str, Any]:
        """Flat mapping: every field except ``vision``, plus the media tensors that are set."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "vision"}
        return {**out, **self.vision.tensors()}


class VLMPackingCollator:
    """Picklable ``collate_fn`` packing a micro-batch into THD rows; see the module docstring.

    The row settings (``seq_length`` ... ``pad_token_id``) build the collator's
    :class:`~energon_pack.RowLayout` (:attr:`layout`); or pass ``layout=`` instead.

    Args:
        seq_length: row capacity in tokens.
        pad_to_multiple_of: each segment's physical span is a multiple of this (e.g.
            :func:`~energon_pack.pad_seq_to_mult`).
        pad_to_max_length: fixed-width rows of ``seq_length``; a micro-batch that does not fit
            one row is split into several.
        pad_cu_seqlens: static-shape ``cu_seqlens`` (needs ``pad_to_max_length`` and
            ``max_segments``); rows then hold at most ``max_segments`` samples.
        max_segments: segment slots per row for ``pad_cu_seqlens``.
        pad_token_id: id written into padding positions (default: the tokenizer's
            ``pad_token_id``, else ``<|endoftext|>``, as the task encoder does).
        layout: the row layout as one object, instead of the settings above.
        encoder: encodes raw samples and gives the media preprocessing used to decode; it must be
            the encoder (tokenizer) that produced any :class:`EncodedSample` given directly.
            Default: ``ConversationEncoder()`` (with ``family``: with the family's media); for an
            HF tokenizer with a chat template pass ``make_encoder(tokenizer)``
            (:class:`~energon_pack.TemplateEncoder`).
        family: a model family preset, its name, a model directory or a transformers
            model/config (:func:`~energon_pack.model_family`); the encoder's media
            settings must fit it (:func:`~energon_pack.encoding.family.family_media`).
        overlong: a sample longer than ``seq_length`` (after alignment): ``"error"`` raises,
            ``"skip"`` skips it, ``"truncate"`` cuts text tokens after its last vision block
            (all media kept); if the cut would enter a vision block the sample is skipped.
        on_media_error: a sample whose media cannot be parsed, probed or decoded
            (:class:`~energon_pack.media.MediaError`): ``"error"`` re-raises, ``"skip"`` skips it.
        position_ids: ``"1d"`` (default) or ``"mrope"``: batches also carry Qwen-VL 3-D
            ``mrope_position_ids`` and ``rope_deltas``, computed per segment.
        mrope: the mRoPE settings (default: from the encoder's tokenizer, Qwen2-VL behaviour).
        output: ``"batch"`` (default): a :class:`CollatedBatch`; ``"hf"``: its
            :meth:`CollatedBatch.hf_model_inputs` dict, so the collator can be the
            ``data_collator`` of transformers' ``Trainer`` or TRL's ``SFTTrainer``.
        hf_model: with ``output="hf"``, the transformers model or config the inputs are for
            (its model type and attention implementation are kept, not the model); see
            :class:`~energon_pack.HFTarget`. Default: sdpa/eager form. A model that takes
            mRoPE positions with ``position_ids="1d"`` is a ValueError.
        max_vision_tokens: most image/video pad tokens per row (None: no cap). A sample
            over it alone follows ``overlong`` (``"skip"`` / ``"truncate"``: listed in
            ``skipped_keys``). With ``pad_to_max_length`` the micro-batch is split into rows
            within the caps; with one row, a micro-batch over a cap is a ValueError.
        max_media: most images plus videos per row (None: no cap); as ``max_vision_tokens``.
        vision_balance: with several rows, spread the vision tokens evenly over them (the
            fewest rows still).
        loss_segments: with ``output="hf"``, the dict also carries
            :data:`~energon_pack.train.loss.LOSS_SEGMENTS` (each target token's sample) for the
            ``"sample"`` / ``"sqrt"`` reductions of :mod:`energon_pack.train.loss`; it is not a
            model input (:meth:`~energon_pack.PackedLoss.attach` takes it out).
    """

    def __init__(
        self,
        seq_length: int | None = None,
        *,
        pad_to_multiple_of: int = 1,
        pad_to_max_length: bool = False,
        pad_cu_seqlens: bool = False,
        max_segments: int | None = None,
        pad_token_id: int | None = None,
        layout: RowLayout | None = None,
        encoder: SampleEncoder | None = None,
        family: ModelFamily | str | Any = None,
        overlong: OverlongPolicy = "error",
        on_media_error: OnMediaError = "error",
        position_ids: PositionIds = "1d",
        mrope: MRopeConfig | None = None,
        output: Output = "batch",
        hf_model: Any = None,
        max_vision_tokens: int | None = None,
        max_media: int | None = None,
        vision_balance: bool = False,
        loss_segments: bool = False,
    ) -> None:
        check_choice("overlong", overlong, ("error", "skip", "truncate"))
        check_choice("on_media_error", on_media_error, ("error", "skip"))
        check_choice("output", output, ("batch", "hf"))
        if not isinstance(loss_segments, bool):
            raise ValueError(f"loss_segments must be True or False, got {loss_segments!r}")
        if loss_segments and output != "hf":
            raise ValueError(
                "loss_segments=True needs output='hf' (it adds a key to the model-input dict); "
                "a CollatedBatch (output='batch') gives packed_loss its segments itself"
            )
        check_config("layout", layout, RowLayout)
        check_config("mrope", mrope, MRopeConfig)
        check_type(
            "encoder",
            encoder,
            SampleEncoder,
            "an encoder",
            fix="pass encoder=make_encoder(tokenizer) or ConversationEncoder(...)",
        )
        self.family = None if family is None else model_family(family)
        if encoder is None:
            encoder = ConversationEncoder(media=family_media(self.family, None))
        family_media(self.family, encoder.media)  # the encoder's media must fit the family
        self.encoder = encoder
        tokenizer = self.encoder.tokenizer
        if layout is None:
            if seq_length is None:
                raise ValueError("VLMPackingCollator needs seq_length (or layout=RowLayout(...))")
            layout = RowLayout(
                seq_length,
                pad_to_multiple_of,
                pad_to_max_length,
                pad_cu_seqlens,
                max_segments,
                default_pad_token_id(tokenizer) if pad_token_id is None else pad_token_id,
            )
        elif seq_length is not None:
            raise ValueError("pass seq_length and the other row settings, or layout=, not both")
        self.layout = layout
        self.budget = VisionBudget(max_vision_tokens, max_media, vision_balance)
        """The per-row vision caps and balance mode."""
        self.overlong: OverlongPolicy = overlong
        self.on_media_error: OnMediaError = on_media_error
        self.mrope = mrope_setting(position_ids, mrope, tokenizer, self.family)
        self._vision_end = tokenizer.convert_tokens_to_ids("<|vision_end|>")
        self.output: Output = output
        self.hf_target = HFTarget.of(hf_model)
        check_position_ids(self.hf_target, mrope=self.mrope is not None)
        if output == "hf" and self.family is not None and self.mrope is None:
            raise ValueError(
                f"output='hf' with family={self.family.name!r} and position_ids='1d': the "
                "family's transformers models take mRoPE positions, so 1-D ones train on "
                "wrong positions; pass position_ids='mrope'"
            )
        self.loss_segments = loss_segments
        self._warned_single = False

    def __call__(
        self, batch: Sequence[CollateItem] | Mapping[str, Any]
    ) -> CollatedBatch | dict[str, Any]:
        """Pack one micro-batch: :meth:`collate`, as the ``output`` setting asks."""
        collated = self.collate(batch)
        if self.output == "batch":
            return collated
        inputs = collated.hf_model_inputs(self.hf_target)
        if self.loss_segments:
            inputs[LOSS_SEGMENTS] = hf_loss_segments(collated, self.hf_target.flash)
        return inputs

    def collate(self, batch: Sequence[CollateItem] | Mapping[str, Any]) -> CollatedBatch:
        """Pack one micro-batch (a list of items, or a padded HF batch dict)."""
        if isinstance(batch, Mapping):
            return self.collate_padded(batch)
        if len(batch) == 0:
            raise ValueError("the micro-batch is empty; give the collator at least one sample")
        skipped: list[str] = []
        samples = []
        for index, item in enumerate(batch):
            sample = self._encode(item, index, skipped)
            if sample is not None:
                samples.append(sample)
        return self._pack(samples, skipped, single=len(batch) == 1)

    def collate_padded(self, batch: Mapping[str, Any]) -> CollatedBatch:
        """Pack a right-padded HF batch: ``input_ids [B, L]``, optional ``attention_mask [B, L]``
        (1 on real tokens; default all real) and optional unshifted ``labels [B, L]`` (``-100``
        where ignored; default every token is a target). Row ``b`` gets key ``"padded[b]"``."""
        unknown = sorted(set(batch) - _PADDED_FIELDS)
        if unknown:
            raise ValueError(
                f"padded batch has fields {unknown} besides input_ids/attention_mask/labels; "
                "media or extra fields cannot be re-packed from a padded batch. Give the "
                "collator EncodedSamples (or raw samples) for VLM data, or drop those fields"
            )
        if "input_ids" not in batch:
            raise ValueError("padded batch has no input_ids; pass input_ids [B, L]")
        ids = torch.as_tensor(batch["input_ids"])
        if ids.ndim != 2 or ids.shape[0] == 0:
            raise ValueError(
                f"padded batch input_ids must be [B, L] with B >= 1, got shape {tuple(ids.shape)}"
            )
        attention = torch.as_tensor(batch.get("attention_mask", torch.ones_like(ids)))
        labels = torch.as_tensor(batch.get("labels", ids))
        for name, tensor in (("attention_mask", attention), ("labels", labels)):
            if tensor.shape != ids.shape:
                raise ValueError(
                    f"padded batch {name} has shape {tuple(tensor.shape)} but input_ids has "
                    f"{tuple(ids.shape)}; they must match"
                )
        samples = []
        for row in range(ids.shape[0]):
            key = f"padded[{row}]"
            real = attention[row] != 0
            length = int(real.sum())
            if not bool(real[:length].all()):
                raise ValueError(
                    f"sample {key!r}: attention_mask is not right-padded (zeros before ones); "
                    "pad on the right (tokenizer.padding_side='right')"
                )
            row_ids, row_labels = ids[row, :length].long(), labels[row, :length].long()
            target = loss_mask_from_labels(row_labels, row_ids, repr(key))
            samples.append(EncodedSample(key, row_ids, target.long()))
        return self._pack(samples, [], single=ids.shape[0] == 1)

    def _encode(self, item: Any, index: int, skipped: list[str]) -> EncodedSample | None:
        if isinstance(item, EncodedSample):
            return item
        if (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], Mapping)
        ):
            key, raw = item
        elif isinstance(item, Mapping) and "__key__" in item:
            key, raw = str(item["__key__"]), item
        elif isinstance(item, Mapping) and is_chat_row(item):
            key, raw = row_key(item, index), item
            check_media_columns(key, item)
        else:
            raise ValueError(unreadable_item(item, index))
        try:
            return self.encoder.encode_sample(key, raw)
        except MediaError as error:
            self._media_failed(key, error, skipped)
            return None

    def _pack(
        self, samples: list[EncodedSample], skipped: list[str], single: bool
    ) -> CollatedBatch:
        if single and not self._warned_single:
            self._warned_single = True
            warnings.warn(
                "VLMPackingCollator got a micro-batch of 1 sample: nothing is packed. Raise the "
                "DataLoader batch_size, or use the Energon online packer for packing at "
                "micro-batch size 1",
                PackingWarning,
                stacklevel=3,
            )
        truncated: list[str] = []
        ready = [f for s in samples if (f := self._fit(s, skipped, truncated)) is not None]

        def dropped(sample: EncodedSample, failure: SkippedSample) -> None:
            self._media_failed(sample.key, failure.error, skipped)

        packed = pack_dropping_failures(ready, self._rows, dropped)
        if packed is None:
            return self._all_skipped(skipped, truncated)
        packs, vision = packed[0]
        return _assemble(packs, vision, self.layout.static_segments, skipped, truncated)

    def _all_skipped(self, skipped: list[str], truncated: list[str]) -> CollatedBatch:
        """Every sample was skipped: one padding row with an all-zero loss mask, and a warning."""
        warnings.warn(
            f"every sample of the micro-batch was skipped ({skipped}; see the "
            "energon_pack.collate log for why): it becomes one padding row that contributes "
            "nothing to the loss. Fix or filter those samples, or use overlong='truncate' / a "
            "larger seq_length",
            PackingWarning,
            stacklevel=4,
        )
        pack = padding_pack(self.layout, self.mrope)
        return _assemble([pack], pack.vision, self.layout.static_segments, skipped, truncated)

    def _rows(self, ready: list[EncodedSample]) -> tuple[list[PackedSample], VisionInputs]:
        """The rows of ``ready`` and their media, decoded once straight into the batch tensors
        (several rows: all rows' pixels in row order). A failing sample is raised as
        :class:`~energon_pack.packing.packed.SkippedSample` at its position in ``ready``."""
        groups = self._groups(ready)
        single_row = len(groups) == 1
        packs = [
            pack_samples(
                [ready[i] for i in group],
                self.layout,
                media=self.encoder.media,
                mrope=self.mrope,
                with_pixels=single_row,
            )
            for group in groups
        ]
        if single_row:
            return packs, packs[0].vision
        order = [i for group in groups for i in group]
        try:
            vision = decode_pixels([ready[i] for i in order], self.encoder.media)
        except SkippedSample as failure:
            raise SkippedSample(order[failure.position], failure.error) from failure.error
        return packs, vision

    def _fit(
        self, sample: EncodedSample, skipped: list[str], truncated: list[str]
    ) -> EncodedSample | None:
        """``sample`` as it goes into a row under the ``overlong`` policy, or None if skipped."""
        if sample.length == 0:
            raise ValueError(
                f"sample {sample.key!r} is empty (0 tokens); drop empty samples before the "
                "DataLoader"
            )
        excess = self.budget.excess(sample.key, sample.vision_tokens, len(sample.media))
        if excess is not None:
            self._over_vision_cap(sample.key, excess[1], skipped)
            return None
        reason = self.layout.overlong(sample.key, sample.length)
        if reason is None:
            return sample
        if self.overlong == "error":
            raise ValueError(f"{reason}; {OVERLONG_FIX} (or overlong='truncate' to cut them)")
        limit = self.layout.capacity
        if self.overlong == "truncate":
            media_end = self._media_end(sample)
            if media_end <= limit:
                truncated.append(sample.key)
                logger.warning("truncating to %d tokens: %s", limit, reason)
                return replace(
                    sample, input_ids=sample.input_ids[:limit], loss_mask=sample.loss_mask[:limit]
                )
            reason += f", and its last vision block ends at token {media_end}, past the cut"
        skipped.append(sample.key)
        logger.warning("skipping: %s", reason)
        return None

    def _over_vision_cap(self, key: str, reason: str, skipped: list[str]) -> None:
        """A sample alone over a vision cap: raised with ``overlong="error"``, else skipped
        (cutting its text would not lower its vision tokens)."""
        if self.overlong == "error":
            raise ValueError(f"{reason}; {VISION_FIX}")
        skipped.append(key)
        logger.warning("skipping: %s", reason)

    def _media_end(self, sample: EncodedSample) -> int:
        """Tokens up to the end of the sample's last vision block (0 without media)."""
        if not sample.media and sample.vision is None:
            return 0
        ends = (sample.input_ids == self._vision_end).nonzero()
        if ends.numel() == 0:
            raise ValueError(
                f"sample {sample.key!r} has media but no <|vision_end|> token (id "
                f"{self._vision_end}); pass the collator the encoder (tokenizer) that encoded it"
            )
        return int(ends[-1, 0]) + 1

    def _media_failed(self, key: str, error: MediaError, skipped: list[str]) -> None:
        if self.on_media_error == "error":
            raise error
        skipped.append(key)
        logger.warning("skipping sample %r: %s", key, error)

    def _groups(self, samples: list[EncodedSample]) -> list[list[int]]:
        """Indices of the samples of each row: rows by first sample, samples in batch order."""
        layout = self.layout
        align = layout.pad_to_multiple_of
        weights = [
            Weight(
                s.key, s.length, layout.aligned(s.length) // align, s.vision_tokens, len(s.media)
            )
            for s in samples
        ]
        return row_groups(
            weights,
            layout.seq_length // align,
            self.budget,
            several=layout.pad_to_max_length,
            max_items=layout.static_segments,
            align=align,
        )


def _assemble(
    packs: list[PackedSample],
    vision: VisionInputs,
    static_segments: int | None,
    skipped: list[str],
    truncated: list[str],
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
    )


def _stack_optional(tensors: list[torch.Tensor | None], dim: int) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.stack(present, dim=dim) if present else None


def _cat_optional(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None
