"""The collate-time packer :class:`VLMPackingCollator` (see :mod:`energon_pack.collate`)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal, TypeAlias

import torch

from energon_pack.checks import check_choice, check_config, check_type
from energon_pack.collate.batch import CollatedBatch, assemble_batch
from energon_pack.encoding.chatml import ConversationEncoder, SampleEncoder
from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.families.materialise import (
    FamilyInputs,
    family_inputs,
    model_side_inputs,
)
from energon_pack.encoding.family import Family, ModelFamily, family_media, model_family
from energon_pack.encoding.family_encoder import FamilyEncoder
from energon_pack.encoding.template import check_encoder, make_encoder
from energon_pack.formats.chat_rows import is_chat_row
from energon_pack.formats.trainer_rows import check_media_columns, row_key, unreadable_item
from energon_pack.media import MediaError, MediaTensors
from energon_pack.moved_keywords import Moved, regroup
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
from energon_pack.packing.row import loss_mask_from_labels
from energon_pack.packing.row_layout import (
    OverlongPolicy,
    PackingWarning,
    RowLayout,
    loader_layout,
)
from energon_pack.packing.vision_budget import VISION_FIX, VisionBudget
from energon_pack.train.hf import HFTarget, check_position_ids
from energon_pack.train.loss import LOSS_SEGMENTS, hf_loss_segments

logger = logging.getLogger("energon_pack.collate")

MOVED = {
    **{
        name: Moved("layout", "RowLayout", name, "seq_length, pad_to_multiple_of=..., ")
        for name in ("pad_to_max_length", "pad_cu_seqlens", "max_segments", "pad_token_id")
    },
    "max_vision_tokens": Moved("vision", "VisionBudget", "max_vision_tokens"),
    "max_media": Moved("vision", "VisionBudget", "max_media"),
    "vision_balance": Moved("vision", "VisionBudget", "balance"),
    "mrope": Moved("position_ids", "MRopeConfig", None),
}
"""The collator's keywords from before :class:`RowLayout`, :class:`VisionBudget` and
``position_ids=MRopeConfig(...)`` were accepted whole."""

OnMediaError = Literal["error", "skip"]
Output = Literal["batch", "hf"]
CollateItem: TypeAlias = "EncodedSample | Mapping[str, Any] | tuple[str, Mapping[str, Any]]"
"""A micro-batch item: an encoded sample, a raw sample dict with ``__key__``, a chat row (a dict
with ``messages`` or ``conversations``), or ``(key, raw)``."""

_PADDED_FIELDS = frozenset({"input_ids", "attention_mask", "labels"})


class VLMPackingCollator:
    """Picklable ``collate_fn`` packing a micro-batch into THD rows; see the module docstring.

    Args:
        seq_length: row capacity in tokens (with ``pad_to_multiple_of``, a shortcut for
            ``layout=RowLayout(seq_length, pad_to_multiple_of, pad_token_id=<the tokenizer's>)``).
        pad_to_multiple_of: each segment's physical span is a multiple of this (e.g.
            :func:`~energon_pack.pad_seq_to_mult`).
        layout: the row layout as one object (:class:`~energon_pack.RowLayout`: fixed-width
            rows with ``pad_to_max_length``, static ``cu_seqlens`` with ``pad_cu_seqlens`` and
            ``max_segments``, the ``pad_token_id``), instead of the two settings above. A
            micro-batch that does not fit one row is split into the fewest rows; without
            ``pad_to_max_length`` they are as wide as the widest.
        encoder: encodes raw samples and gives the media preprocessing used to decode; it must be
            the encoder (tokenizer) that produced any :class:`EncodedSample` given directly.
            Default: ``ConversationEncoder()`` (with ``family``: with the family's media); for an
            HF tokenizer with a chat template pass ``make_encoder(tokenizer)``
            (:class:`~energon_pack.TemplateEncoder`).
        family: a model family preset, its name, a model directory, a transformers
            processor, model or config (:func:`~energon_pack.model_family`); the encoder's
            media settings must fit a Qwen preset
            (:func:`~energon_pack.encoding.family.family_media`). With a processor family the
            default encoder is ``make_encoder(family=family)``, and the rows carry the
            processor's media outputs and token-level inputs
            (:attr:`CollatedBatch.family_inputs`). Without ``family``, a processor family's
            encoder brings its own.
        overlong: a sample longer than ``seq_length`` (after alignment): ``"skip"`` (default)
            skips it, listed in ``skipped_keys`` and logged; ``"error"`` raises;
            ``"truncate"`` cuts text tokens after its last vision block (all media kept); if
            the cut would enter a vision block the sample is skipped.
        on_media_error: a sample whose media cannot be parsed, probed or decoded
            (:class:`~energon_pack.media.MediaError`): ``"error"`` re-raises, ``"skip"`` skips it.
        position_ids: ``"1d"`` (default); ``"mrope"``: batches also carry Qwen-VL 3-D
            ``mrope_position_ids`` and ``rope_deltas``, computed per segment (settings from the
            encoder's tokenizer and the family, Qwen2-VL behaviour by default); or an
            :class:`~energon_pack.MRopeConfig` for mRoPE with those settings.
        output: ``"batch"`` (default): a :class:`CollatedBatch`; ``"hf"``: its
            :meth:`CollatedBatch.hf_model_inputs` dict, so the collator can be the
            ``data_collator`` of transformers' ``Trainer`` or TRL's ``SFTTrainer``.
        hf_model: with ``output="hf"``, the transformers model or config the inputs are for
            (its model type and attention implementation are kept, not the model); see
            :class:`~energon_pack.HFTarget`. Default: sdpa/eager form. A model that takes
            mRoPE positions with ``position_ids="1d"`` is a ValueError. A processor family
            whose rows need inputs its model builds (Gemma's 4-D masks, GLM-4V's rope
            positions) keeps the model itself, so the collator then pickles with it.
        vision: caps on the image/video pad tokens and media per row and the balance mode
            (:class:`~energon_pack.VisionBudget`). A sample alone over a cap follows
            ``vision.over_cap`` (by default ``overlong``; ``"truncate"`` skips it, listed in
            ``skipped_keys``). A micro-batch over a cap is split into rows within the caps.
            Balance spreads the vision tokens evenly over several rows (the fewest rows still).
        loss_segments: with ``output="hf"``, the dict also carries
            :data:`~energon_pack.train.loss.LOSS_SEGMENTS` (each target token's sample) for the
            ``"sample"`` / ``"sqrt"`` reductions of :mod:`energon_pack.train.loss`; it is not a
            model input (:meth:`~energon_pack.PackedLoss.attach` takes it out).

    The keywords ``pad_to_max_length``, ``pad_cu_seqlens``, ``max_segments``,
    ``pad_token_id`` (now in ``layout``), ``max_vision_tokens``, ``max_media``,
    ``vision_balance`` (now in ``vision``) and ``mrope`` (now ``position_ids``) of earlier
    releases still work, with a ``DeprecationWarning`` naming the new spelling.
    """

    def __init__(
        self,
        seq_length: int | None = None,
        *,
        pad_to_multiple_of: int = 1,
        layout: RowLayout | None = None,
        encoder: SampleEncoder | None = None,
        family: Family | str | Any = None,
        overlong: OverlongPolicy = "skip",
        on_media_error: OnMediaError = "error",
        position_ids: PositionIds | MRopeConfig = "1d",
        output: Output = "batch",
        hf_model: Any = None,
        vision: VisionBudget | None = None,
        loss_segments: bool = False,
        **moved: Any,
    ) -> None:
        mrope_given = position_ids if isinstance(position_ids, MRopeConfig) else None
        groups = {"layout": layout, "vision": vision, "position_ids": mrope_given}
        old = regroup("VLMPackingCollator", moved, MOVED, groups)
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
        check_config("vision", vision, VisionBudget)
        check_type(
            "encoder",
            encoder,
            SampleEncoder,
            "an encoder",
            fix="pass encoder=make_encoder(tokenizer) or ConversationEncoder(...)",
        )
        self.family = None if family is None else model_family(family)
        if self.family is None and isinstance(encoder, FamilyEncoder):
            self.family = encoder.family  # a processor family's encoder brings its family
        self.encoder = self._encoder_for(encoder)
        tokenizer = self.encoder.tokenizer
        shortcut = seq_length, pad_to_multiple_of, old.get("layout", {})
        self.layout = loader_layout("VLMPackingCollator", layout, *shortcut, tokenizer)
        self.budget = replace(vision or VisionBudget(), **old.get("vision", {}))
        """The per-row vision caps and balance mode."""
        self.overlong: OverlongPolicy = overlong
        self.on_media_error: OnMediaError = on_media_error
        mrope = old.get("position_ids", {}).get("mrope")
        self.mrope = mrope_setting(position_ids, mrope, tokenizer, self._preset)
        self.output: Output = output
        self.hf_target = HFTarget.of(hf_model)
        layout = self.layout
        served = self.family if isinstance(self.family, ProcessorFamily) else None
        if served is not None and served.packing == "refused" and layout.static_segments != 1:
            raise ValueError(
                f"family={served.name!r} cannot be packed exactly: {served.refusal}; pack one "
                "sample per row: layout=RowLayout(seq_length, pad_to_max_length=True, "
                "pad_cu_seqlens=True, max_segments=1)"
            )
        needs_model = served is not None and served.packing in ("block_mask", "mrope")
        self.hf_model = hf_model if needs_model else None
        """The model whose rules build the rows' model-side inputs (processor families)."""
        if (
            served is not None
            and output == "hf"
            and needs_model
            and not hasattr(hf_model, "config")
        ):
            raise ValueError(
                f"output='hf' with family={served.name!r} needs hf_model=the transformers "
                f"model: its packed rows take {served.packing} inputs built by the model's "
                "own rules"
            )
        check_position_ids(self.hf_target, mrope=self.mrope is not None)
        if output == "hf" and self._preset is not None and self.mrope is None:
            raise ValueError(
                f"output='hf' with family={self._preset.name!r} and position_ids='1d': the "
                "family's transformers models take mRoPE positions, so 1-D ones train on "
                "wrong positions; pass position_ids='mrope'"
            )
        self.loss_segments = loss_segments
        self._warned_single = False

    @property
    def _preset(self) -> ModelFamily | None:
        """The family when it is a Qwen preset."""
        return self.family if isinstance(self.family, ModelFamily) else None

    def _encoder_for(self, encoder: SampleEncoder | None) -> SampleEncoder:
        """``encoder``, checked against the family, or the family's default encoder."""
        family = self.family
        if encoder is not None:
            return check_encoder(encoder, family)
        if isinstance(family, ProcessorFamily):
            return make_encoder(family=family)
        return ConversationEncoder(media=family_media(family, None))

    def __call__(
        self, batch: Sequence[CollateItem] | Mapping[str, Any]
    ) -> CollatedBatch | dict[str, Any]:
        """Pack one micro-batch: :meth:`collate`, as the ``output`` setting asks."""
        collated = self.collate(batch)
        if self.output == "batch":
            return collated
        inputs = collated.model_inputs(self.hf_target)
        if isinstance(self.family, ProcessorFamily) and collated.family_inputs is not None:
            inputs.update(
                model_side_inputs(
                    self.family,
                    self.hf_model,
                    collated.input_ids,
                    collated.cu_seqlens_padded,
                    collated.family_inputs,
                )
            )
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
        packs, vision, extra = packed[0]
        return assemble_batch(packs, vision, self.layout.static_segments, skipped, truncated, extra)

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
        return assemble_batch([pack], pack.vision, self.layout.static_segments, skipped, truncated)

    def _rows(
        self, ready: list[EncodedSample]
    ) -> tuple[list[PackedSample], MediaTensors, FamilyInputs | None]:
        """The rows of ``ready`` and their media, decoded once straight into the batch tensors
        (several rows: all rows' pixels in row order), or with a processor family its inputs.
        A failing sample is raised as :class:`~energon_pack.packing.packed.SkippedSample` at
        its position in ``ready``."""
        groups = self._groups(ready)
        layout = self._split_layout(ready, groups)
        if isinstance(self.family, ProcessorFamily):
            packs = [
                pack_samples([ready[i] for i in group], layout, with_pixels=False)
                for group in groups
            ]
            rows = [[(i, ready[i]) for i in group] for group in groups]
            inputs = family_inputs(self.family, packs, rows, self.encoder.media)
            return packs, MediaTensors(), inputs
        single_row = len(groups) == 1
        packs = [
            pack_samples(
                [ready[i] for i in group],
                layout,
                media=self.encoder.media,
                mrope=self.mrope,
                with_pixels=single_row,
            )
            for group in groups
        ]
        if single_row:
            return packs, packs[0].vision, None
        order = [i for group in groups for i in group]
        try:
            vision = decode_pixels([ready[i] for i in order], self.encoder.media)
        except SkippedSample as failure:
            raise SkippedSample(order[failure.position], failure.error) from failure.error
        return packs, vision, None

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
        """A sample alone over a vision cap: raised or skipped as the budget's ``over_cap``
        says (by default as ``overlong``; ``"truncate"`` skips, since cutting its text would
        not lower its vision tokens)."""
        if self.budget.over_cap_policy(self.overlong) == "error":
            raise ValueError(f"{reason}; {VISION_FIX}")
        skipped.append(key)
        logger.warning("skipping: %s", reason)

    def _media_end(self, sample: EncodedSample) -> int:
        """Tokens up to the end of the sample's last media block (0 without media)."""
        if not sample.media and sample.vision is None:
            return 0
        if isinstance(self.encoder, FamilyEncoder):
            found = torch.isin(sample.input_ids, self.encoder.media_ids_tensor).nonzero()
            return int(found[-1, 0]) + 1
        vision_end = self.encoder.vision_ids.end
        ends = (sample.input_ids == vision_end).nonzero()
        if ends.numel() == 0:
            raise ValueError(
                f"sample {sample.key!r} has media but no <|vision_end|> token (id "
                f"{vision_end}); pass the collator the encoder (tokenizer) that encoded it"
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
            max_items=layout.static_segments,
        )

    def _split_layout(self, ready: list[EncodedSample], groups: list[list[int]]) -> RowLayout:
        """The layout the rows are built with: the collator's, or, where a micro-batch of
        variable-width rows was split, rows as wide as the widest (its padding absorbed in
        each row's last segment, as with ``pad_to_max_length``)."""
        layout = self.layout
        if len(groups) == 1 or layout.pad_to_max_length:
            return layout
        width = max(sum(layout.aligned(ready[i].length) for i in group) for group in groups)
        return replace(layout, seq_length=width, pad_to_max_length=True)
