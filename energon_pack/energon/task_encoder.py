"""Energon task encoder for online packing of conversation samples (text, images, video).

Data flow per worker::

    CrudeWebdataset sample --cook--> ConversationSample (json + compressed media members)
      --preencode_sample--> PreparedSample (token ids; media probed, still compressed)
      --CarryOverPackingDataset (OnlineBinPacker picks packs; nothing dropped)-->
      --pack_selected_samples--> PackedBatch (one THD row, micro-batch 1): the chosen
        samples' media are decoded now, straight into the row's pixel tensors
      --encode_batch--> the PackedBatch, or with output="bridge" the dict Megatron-Bridge's
        vlm_step reads (a subclass may override encode_batch, as with any Energon encoder)
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import numpy.random  # noqa: F401  (see below)
import torch
from megatron.energon import Cooker, DefaultTaskEncoder, basic_sample_keys, edataclass, stateless
from megatron.energon.flavors.base_dataset import Sample, SavableDataset
from megatron.energon.metadataset.loader_interface import LoadedDataset
from megatron.energon.task_encoder.base import get_failure_tolerance, get_stateless
from megatron.energon.worker import WorkerConfig
from megatron.energon.wrappers import MapDataset

from energon_pack.checks import check_choice, check_config
from energon_pack.encoding.chatml import SampleEncoder, Tokenizer
from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.families.materialise import (
    FamilyInputs,
    family_inputs,
    model_built_inputs,
)
from energon_pack.encoding.family import Family, ModelFamily, family_media, model_family
from energon_pack.encoding.fingerprint import family_identity, tokenizer_identity
from energon_pack.encoding.template import check_encoder, make_encoder
from energon_pack.energon.carry_over import CarryOverPackingDataset, RejectedSample, SampleSize
from energon_pack.energon.packing_stats import PackingStats
from energon_pack.formats.energon_types import (
    MediaKeepingDecoder,
    keep_media_compressed,
    typed_sample_row,
)
from energon_pack.media import MediaConfig, MediaError
from energon_pack.moved_keywords import Moved, regroup
from energon_pack.packing.bins import Overlong
from energon_pack.packing.buffer import BufferConfig
from energon_pack.packing.mrope import MRopeConfig, PositionIds, mrope_setting
from energon_pack.packing.online import OnlineBinPacker
from energon_pack.packing.packed import Decode, EncodedSample, pack_samples, padding_pack
from energon_pack.packing.row import PackedRow
from energon_pack.packing.row_layout import PackingWarning, RowLayout, loader_layout
from energon_pack.packing.vision_budget import VisionBudget
from energon_pack.train.bridge import bridge_batch
from energon_pack.train.hf import batch_model_inputs

# numpy.random is imported above, in the main process: torch's DataLoader worker seeds numpy's
# RNG first thing, and a first import of numpy.random in a freshly forked worker can fail under
# CPython 3.11 (a garbage collection during the import runs a finalizer that imports again, and
# importlib's lock bookkeeping raises KeyError: the worker dies at start).

MOVED = {
    "pad_to_max_length": Moved(
        "layout", "RowLayout", "pad_to_max_length", "seq_length, pad_to_multiple_of=..., "
    ),
    **{
        name: Moved("buffer", "BufferConfig", name)
        for name in ("max_wait", "min_fill", "decode", "monitor", "max_consecutive_skips")
    },
    "packing_buffer_bytes": Moved("buffer", "BufferConfig", "max_bytes"),
    "max_vision_tokens": Moved("vision", "VisionBudget", "max_vision_tokens"),
    "max_media": Moved("vision", "VisionBudget", "max_media"),
    "vision_balance": Moved("vision", "VisionBudget", "balance"),
    "mrope": Moved("position_ids", "MRopeConfig", None),
    **{
        name: Moved("encoder", "make_encoder", name, "tokenizer, media=..., family=..., ")
        for name in ("system_prompt", "loss_on", "encoding")
    },
}
"""The task encoder's keywords from before the settings objects were accepted whole."""

STARTING_BUFFER_SIZE = 16
"""The ``packing_buffer_size`` suggested to start with when none is given."""

Output = Literal["batch", "bridge"]
"""What the loader yields: a :class:`PackedBatch`, or the dict Megatron-Bridge's VLM step reads
(:meth:`PackedBatch.to_bridge_batch`)."""

# How media are decoded, not what they decode to: free to change between save and restore.
# Media settings added after states were first saved, with the behaviour before them: recorded
# only when they differ from it, so that a state saved before them still restores.
_ADDED_LATER: dict[str, object] = {
    "video_rule": "qwen2_vl",
    "video_outer_block": False,
    "video_frames_fps": None,
}
_RECORD = object()


@edataclass
class ConversationSample(Sample):
    """A cooked sample: the WebDataset members (``json``, ``0.jpg``, ...) as raw bytes."""

    members: dict[str, Any]


@edataclass
class PreparedSample(Sample):
    """A pre-encoded sample waiting in the packing buffer (media still compressed)."""

    encoded: EncodedSample


@edataclass
class PackedBatch(Sample):
    """One packed row (physical micro-batch 1) with its segments' media.

    Token-level tensors have shape ``[1, T]``; ``cu_seqlens`` / ``cu_seqlens_padded`` are
    ``[N+1]`` int32 (real / physical boundaries); media are concatenated in segment order.
    """

    __keys__: list[str]
    """Source sample keys in segment order."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor
    max_seqlen: int
    seq_idx: torch.Tensor
    pixel_values: torch.Tensor | None = None
    """``[P, patch_dim]`` float32, normalised; uint8 raw pixels with
    ``MediaConfig(pixel_dtype="uint8")``: the training step turns them into the same float
    values with :func:`~energon_pack.media.normalize_pixels` (on its device)."""
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    """Like ``pixel_values``, for the videos."""
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    mrope_position_ids: torch.Tensor | None = None
    """``[3, 1, T]`` mRoPE ids (with ``position_ids="mrope"``); ``position_ids`` stays 1-D."""
    rope_deltas: torch.Tensor | None = None
    """``[N]`` per-segment rope deltas (with ``position_ids="mrope"``)."""
    packing_stats: PackingStats | None = None
    """This worker's packing figures when the batch left it."""
    family_inputs: FamilyInputs | None = None
    """With a processor family: its processor's media outputs and token-level inputs
    ``[1, T]`` (:meth:`hf_model_inputs` passes them on)."""

    def row(self) -> PackedRow:
        """The packed row without the micro-batch dimension (shares the tensors)."""
        return PackedRow(
            input_ids=self.input_ids[0],
            labels=self.labels[0],
            loss_mask=self.loss_mask[0],
            position_ids=self.position_ids[0],
            cu_seqlens=self.cu_seqlens,
            cu_seqlens_padded=self.cu_seqlens_padded,
            max_seqlen=self.max_seqlen,
            seq_idx=self.seq_idx[0],
        )

    def media(self) -> dict[str, torch.Tensor | None]:
        """The row's media tensors by name (None where the row has none)."""
        return {
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "pixel_values_videos": self.pixel_values_videos,
            "video_grid_thw": self.video_grid_thw,
            "second_per_grid_ts": self.second_per_grid_ts,
        }

    def hf_model_inputs(self, model: Any = None, family: Any = None) -> dict[str, Any]:
        """Keyword arguments for ``model(**batch.hf_model_inputs(model))`` of a transformers
        model; see :meth:`energon_pack.collate.CollatedBatch.hf_model_inputs` (``family``:
        the task encoder's, ``task_encoder.family``, where its rows need inputs built by the
        model)."""
        out = batch_model_inputs(self, self.cu_seqlens_padded, self.media(), model)
        if self.family_inputs is not None:
            out.update(self.family_inputs.tensors())
            inputs, bounds = self.family_inputs, [self.cu_seqlens_padded]
            out.update(model_built_inputs(family, model, self.input_ids, bounds, inputs))
        return out

    def to_bridge_batch(self, media: MediaConfig | None = None) -> dict[str, Any]:
        """The dict Megatron-Bridge's ``vlm_step.get_batch`` reads (see
        :func:`~energon_pack.bridge_batch`), with ``__key__``, ``__keys__``,
        ``__restore_key__`` and ``packing_stats`` alongside. uint8 pixels are normalised with
        ``media`` (the encoder's ``MediaConfig``), or refused without it."""
        metadata = {
            "__key__": self.__key__,
            "__keys__": self.__keys__,
            "__restore_key__": self.__restore_key__,
            "packing_stats": self.packing_stats,
        }
        return bridge_batch(self.row(), self.media(), config=media, metadata=metadata)


@stateless
def cook_conversation(raw: dict[str, Any]) -> ConversationSample:
    """Cooker for the sample format in the README: keep every member as raw bytes."""
    members = {name: value for name, value in raw.items() if not name.startswith("__")}
    return ConversationSample(**basic_sample_keys(raw), members=members)


def _size(sample: PreparedSample) -> SampleSize:
    encoded = sample.encoded
    decoded = 0 if encoded.vision is None else encoded.vision.nbytes
    return SampleSize(
        encoded.length,
        encoded.nbytes,
        decoded,
        encoded.vision_tokens,
        len(encoded.media),
        encoded.audio_tokens,
    )


class PackingTaskEncoder(DefaultTaskEncoder):
    """Energon task encoder that packs conversation samples online into THD rows.

    Use it with ``get_train_dataset(..., batch_size=1, packing_buffer_size=N,
    task_encoder=PackingTaskEncoder(...))``. Samples the packer does not place yet are carried
    to later packs (never dropped); media are decoded only for samples in a chosen pack. Without
    ``packing_buffer_size`` each row holds one sample, and a :class:`~energon_pack.PackingWarning`
    says so (once per encoder).

    Args:
        tokenizer: an HF-style tokenizer, or None for the built-in ByteTokenizer; encoded with
            ``make_encoder(tokenizer, media=..., family=...)`` (the chat template when it has
            one). Or pass ``encoder=`` instead.
        seq_length: tokens per packed row (the packer's capacity).
        pad_to_multiple_of: each segment is padded to this multiple (``pad_seq_to_mult``).
        layout: the row layout as one object (:class:`~energon_pack.RowLayout`, e.g. with
            ``pad_to_max_length=True`` for rows of exactly ``seq_length`` tokens), instead of
            the two settings above (which pad with the tokenizer's pad id).
        encoder: the sample encoder (:func:`~energon_pack.make_encoder`: its tokenizer,
            ``encoding``, ``system_prompt``, ``loss_on``), instead of ``tokenizer``; its media
            settings are the encoder's (``media``, if given, must equal them).
        media: image/video preprocessing and limits.
        family: a model family preset, its name, a model directory or a transformers
            model/config (:func:`~energon_pack.model_family`): its media settings are
            used (or checked against ``media``) and it is recorded in the saved state.
        overlong: a sample longer than ``seq_length``: ``"skip"`` (default) counts it in
            ``packing_stats.skipped["overlong"]`` and logs a warning naming its key and
            length; ``"error"`` raises.
        buffer: the candidate buffer's behaviour (:class:`~energon_pack.BufferConfig`):
            ``max_wait``, ``min_fill``, ``max_bytes``, ``decode`` (``"lazy"``: media decoded
            after a sample is chosen; ``"eager"``: before the buffer, for comparison),
            ``monitor`` (an RSS monitor in every worker), ``max_consecutive_skips``, and how
            far the buffer grows past ``packing_buffer_size`` to fill rows of short samples
            (``min_rows``, ``max_size``).
        vision: caps on the image/video pad tokens and media per pack, counted from the media
            probe before any decode, and the balance mode (:class:`~energon_pack.VisionBudget`;
            see :mod:`~energon_pack.packing.vision_budget`). A sample alone over a cap follows
            ``vision.over_cap`` (by default ``overlong``), counted as
            ``packing_stats.skipped["over_max_vision_tokens"]`` / ``["over_max_media"]``.
        position_ids: ``"1d"`` (default); ``"mrope"``: batches also carry Qwen-VL 3-D
            ``mrope_position_ids`` and ``rope_deltas``, computed per segment (settings from the
            tokenizer and the family, Qwen2-VL behaviour by default); or an
            :class:`~energon_pack.MRopeConfig` for mRoPE with those settings (e.g.
            ``MRopeConfig.from_tokenizer(tokenizer, tokens_per_second=2)`` for Qwen2.5-VL).
        output: ``"batch"`` (default) yields :class:`PackedBatch`; ``"bridge"`` yields the dict
            Megatron-Bridge's ``vlm_step`` reads (:meth:`PackedBatch.to_bridge_batch`). It needs
            float32 pixels, since Bridge's step does not normalise uint8 ones.

    The keywords ``pad_to_max_length`` (now in ``layout``); ``max_wait``, ``min_fill``,
    ``packing_buffer_bytes``, ``decode``, ``monitor``, ``max_consecutive_skips`` (now in
    ``buffer``); ``max_vision_tokens``, ``max_media``, ``vision_balance`` (now in ``vision``);
    ``mrope`` (now ``position_ids``) and ``system_prompt``, ``loss_on``, ``encoding`` (now
    ``encoder=make_encoder(...)``) of earlier releases still work, with a
    ``DeprecationWarning`` naming the new spelling.

    Overriding ``encode_batch`` in a subclass works as with any Energon task encoder: it gets
    each :class:`PackedBatch` (``super().encode_batch(batch)`` gives the ``output`` form).
    """

    cookers = (Cooker(cook_conversation),)

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        *,
        seq_length: int | None = None,
        pad_to_multiple_of: int = 1,
        layout: RowLayout | None = None,
        encoder: SampleEncoder | None = None,
        media: MediaConfig | None = None,
        family: Family | str | Any = None,
        overlong: Overlong = "skip",
        buffer: BufferConfig | None = None,
        vision: VisionBudget | None = None,
        position_ids: PositionIds | MRopeConfig = "1d",
        output: Output = "batch",
        **moved: Any,
    ) -> None:
        super().__init__()
        mrope_given = position_ids if isinstance(position_ids, MRopeConfig) else None
        groups = {
            "layout": layout,
            "buffer": buffer,
            "vision": vision,
            "position_ids": mrope_given,
            "encoder": encoder,
        }
        old = regroup("PackingTaskEncoder", moved, MOVED, groups)
        check_choice("output", output, ("batch", "bridge"))
        check_choice("overlong", overlong, ("error", "skip"))
        check_config("media", media, MediaConfig)
        check_config("layout", layout, RowLayout)
        check_config("buffer", buffer, BufferConfig)
        check_config("vision", vision, VisionBudget)
        self.buffer = replace(buffer or BufferConfig(), **old.get("buffer", {}))
        """The candidate buffer's behaviour."""
        self.vision = replace(vision or VisionBudget(), **old.get("vision", {}))
        """The per-pack vision caps and balance mode."""
        self.family = None if family is None else model_family(family)
        if isinstance(self.family, ProcessorFamily):
            _check_processor_family(self.family, output, self.buffer.decode, position_ids)
        self.encoder = self._encoder_for(tokenizer, encoder, media, old.get("encoder", {}))
        self.media = self.encoder.media
        if output == "bridge" and self.media.pixel_dtype == "uint8":
            raise ValueError(
                "output='bridge' with MediaConfig(pixel_dtype='uint8'): Megatron-Bridge's "
                "vlm_step passes pixel_values to the model unchanged, so they must be "
                "normalised float32; use pixel_dtype='float32', or output='batch' and "
                "batch.to_bridge_batch(media=config) in your own step"
            )
        self.output: Output = output
        # JSON/text parsed; media stay compressed, decoded late
        self.decoder = MediaKeepingDecoder(self.media.max_json_bytes)
        shortcut = seq_length, pad_to_multiple_of, old.get("layout", {})
        self.layout = loader_layout("PackingTaskEncoder", layout, *shortcut, self.encoder.tokenizer)
        self.overlong: Overlong = overlong
        mrope = old.get("position_ids", {}).get("mrope")
        self.mrope = mrope_setting(position_ids, mrope, self.encoder.tokenizer, self._preset)
        self._make_packer(1)  # checks the packer settings now, not in a worker
        self._warned_unbuffered = False

    def _encoder_for(
        self,
        tokenizer: Tokenizer | None,
        encoder: SampleEncoder | None,
        media: MediaConfig | None,
        options: dict[str, Any],
    ) -> SampleEncoder:
        """``encoder`` (checked against the family and ``media``), or the one ``make_encoder``
        builds for ``tokenizer`` with the family's media and the deprecated encoder keywords
        (``options``)."""
        if encoder is None:
            media = family_media(self._preset, media) or MediaConfig()
            return make_encoder(tokenizer, media=media, family=self.family, **options)
        if tokenizer is not None:
            raise ValueError(
                "PackingTaskEncoder got tokenizer= and encoder=; pass one: the encoder carries "
                "its tokenizer (make_encoder(tokenizer, ...))"
            )
        check_config("encoder", encoder, SampleEncoder)
        if media is not None and media != encoder.media:
            raise ValueError(
                "PackingTaskEncoder got media= that differs from encoder.media; build the "
                "encoder with those settings (make_encoder(tokenizer, media=media)) and leave "
                "media= out"
            )
        return check_encoder(encoder, self.family)

    @property
    def decode(self) -> Decode:
        """When media are decoded (``buffer.decode``)."""
        return self.buffer.decode

    @property
    def _preset(self) -> ModelFamily | None:
        """The family when it is a Qwen preset."""
        return self.family if isinstance(self.family, ModelFamily) else None

    def _make_packer(self, buffer_size: int) -> functools.partial[OnlineBinPacker]:
        buffer = self.buffer
        if buffer.decode == "eager" and buffer.max_bytes is None:  # decoded samples weigh MBs
            buffer = dataclasses.replace(buffer, min_rows=None)
        make = functools.partial(
            OnlineBinPacker,
            self.layout.seq_length,
            buffer_size,
            align=self.layout.pad_to_multiple_of,
            buffer=buffer,
            vision=self.vision,
        )
        make()
        return make

    def packing_settings(self, packing_buffer_size: int | None) -> dict[str, Any]:
        """Everything that decides which packs are formed and what they hold; saved with the
        loader state, so that a restore under other settings is refused by name."""
        return {
            **self.layout.fingerprint(),
            "packing_buffer_size": packing_buffer_size,
            "packing_buffer_bytes": self.buffer.max_bytes,
            "min_fill": self.buffer.min_fill,
            "max_wait": self.buffer.max_wait,
            "overlong": self.overlong,
            "decode": self.decode,
            "media": {
                name: value
                for name, value in self.media.settings().items()
                if _ADDED_LATER.get(name, _RECORD) != value
            },
            **({} if self._preset is None else {"family": family_identity(self._preset)}),
            "tokenizer": tokenizer_identity(self.encoder.tokenizer),
            **self.encoder.settings(),
            "position_ids": "1d" if self.mrope is None else "mrope",
            "mrope": self.mrope,
        }

    @stateless
    def preencode_sample(self, sample: Sample) -> PreparedSample | RejectedSample:
        """Tokenise and probe the media (header only); bad samples become RejectedSample.

        Takes cooked WebDataset samples (native or Megatron-Bridge layouts), Bridge's
        ``ChatMLSample`` and Energon's ``VQASample`` / ``CaptioningSample`` (see
        :mod:`energon_pack.formats.energon_types`).
        """
        try:
            row = (
                sample.members
                if isinstance(sample, ConversationSample)
                else typed_sample_row(sample)
            )
            if row is None:
                raise ValueError(
                    f"sample {sample.__key__!r} is a {type(sample).__name__}; PackingTaskEncoder "
                    "reads CrudeWebdataset samples (native or Megatron-Bridge layouts), "
                    "Megatron-Bridge's ChatMLWebdataset, VQAWebdataset and CaptioningWebdataset"
                )
            encoded = self.encoder.encode_sample(sample.__key__, row)
            if self.decode == "eager":
                encoded = encoded.materialize(self.media)
        except MediaError as error:
            rejected: RejectedSample = RejectedSample.derive_from(
                sample, reason=error.kind, message=str(error)
            )
            return rejected
        prepared: PreparedSample = PreparedSample.derive_from(sample, encoded=encoded)
        return prepared

    def pack_selected_samples(self, samples: Sequence[PreparedSample]) -> PackedBatch:
        """The THD row of the chosen samples; their media are decoded only now, straight into
        the row's pixel tensors, in segment order. A sample whose media fail raises
        :class:`~energon_pack.packing.packed.SkippedSample` (the wrapper then packs the others). No
        samples give a padding row with an all-zero loss mask (it carries the stats of samples
        skipped at the end)."""
        extra = None
        if samples:
            encoded = [s.encoded for s in samples]
            if isinstance(self.family, ProcessorFamily):
                packed = pack_samples(encoded, self.layout, with_pixels=False)
                rows = [list(enumerate(encoded))]
                extra = family_inputs(self.family, [packed], rows, self.media)
            else:
                packed = pack_samples(encoded, self.layout, media=self.media, mrope=self.mrope)
        else:
            packed = padding_pack(self.layout, self.mrope)
        row = packed.row
        mrope = packed.mrope_position_ids
        return PackedBatch(
            __key__="+".join(packed.keys),
            __restore_key__=(),
            __keys__=list(packed.keys),
            input_ids=row.input_ids.unsqueeze(0),
            labels=row.labels.unsqueeze(0),
            loss_mask=row.loss_mask.unsqueeze(0),
            position_ids=row.position_ids.unsqueeze(0),
            cu_seqlens=row.cu_seqlens,
            cu_seqlens_padded=row.cu_seqlens_padded,
            max_seqlen=row.max_seqlen,
            seq_idx=row.seq_idx.unsqueeze(0),
            mrope_position_ids=None if mrope is None else mrope.unsqueeze(1),
            rope_deltas=packed.rope_deltas,
            family_inputs=extra,
            **({} if extra is not None else packed.vision.tensors()),
        )

    @stateless(failure_tolerance=1)  # a failure here is a bug, not bad data: stop at once
    def encode_batch(self, batch: PackedBatch) -> PackedBatch | dict[str, Any]:
        """The loader's output form of a pack: ``batch`` itself, or with ``output="bridge"``
        the dict Megatron-Bridge's ``vlm_step`` reads."""
        return batch.to_bridge_batch(self.media) if self.output == "bridge" else batch

    def build_train_datasets(self, *, datasets: list[LoadedDataset], **kwargs: Any) -> Any:
        """Energon's, after :func:`~energon_pack.formats.energon_types.keep_media_compressed`
        (Bridge ``ChatMLWebdataset`` datasets keep their media compressed)."""
        keep_media_compressed(datasets, self.media.max_json_bytes)
        return super().build_train_datasets(datasets=datasets, **kwargs)

    def build_val_datasets(self, *, datasets: list[LoadedDataset], **kwargs: Any) -> Any:
        """Energon's, after :func:`~energon_pack.formats.energon_types.keep_media_compressed`."""
        keep_media_compressed(datasets, self.media.max_json_bytes)
        return super().build_val_datasets(datasets=datasets, **kwargs)

    def build_batch(
        self,
        dataset: SavableDataset[PreparedSample],
        *,
        batch_size: int | None,
        batch_drop_last: bool = False,
        packing_buffer_size: int | None = None,
        worker_config: WorkerConfig,
    ) -> SavableDataset[PackedBatch]:
        """Pack with :class:`CarryOverPackingDataset` instead of Energon's PackingDataset."""
        if batch_size != 1:
            raise ValueError(
                f"PackingTaskEncoder emits one packed row per batch, so batch_size must be 1, "
                f"got batch_size={batch_size}. A packed row already holds several samples; use "
                "seq_length (and packing_buffer_size) to control how many."
            )
        if not packing_buffer_size and not self._warned_unbuffered:
            self._warned_unbuffered = True
            warnings.warn(
                "PackingTaskEncoder got no packing_buffer_size, so every row holds one sample "
                "(nothing is packed). Pass packing_buffer_size to get_train_dataset, e.g. "
                f"{STARTING_BUFFER_SIZE} to start with; energon-pack tune measures the bin fill "
                "and worker memory of each size",
                PackingWarning,
                stacklevel=2,
            )
        packed = CarryOverPackingDataset(
            dataset,
            make_packer=self._make_packer(packing_buffer_size or 1),
            size=_size,
            pack=self.pack_selected_samples,
            overlong=self.overlong,
            buffer=self.buffer,
            settings=self.packing_settings(packing_buffer_size),
            worker_config=worker_config,
        )
        if self.output == "batch" and type(self).encode_batch is PackingTaskEncoder.encode_batch:
            return packed
        return MapDataset(
            packed,
            self.encode_batch,
            worker_config=worker_config,
            stateless_map_fn=get_stateless(self.encode_batch),
            failure_tolerance=get_failure_tolerance(
                self.encode_batch, self.__default_failure_tolerance__
            ),
        )


def _check_processor_family(
    family: ProcessorFamily, output: str, decode: str, position_ids: object
) -> None:
    """The settings a processor family takes: lazy decoding, ``"batch"`` output and 1-D
    positions (its tokenizer is checked by :func:`~energon_pack.make_encoder`)."""
    if family.packing == "refused":
        raise ValueError(
            f"family={family.name!r} cannot be packed exactly: {family.refusal}; train it one "
            "sample per row with VLMPackingCollator(family=..., layout=RowLayout(seq_length, "
            "pad_to_max_length=True, pad_cu_seqlens=True, max_segments=1))"
        )
    for name, value, supported in (
        ("output", output, "batch"),
        ("decode", decode, "lazy"),
        ("position_ids", position_ids, "1d"),
    ):
        if value != supported:
            raise ValueError(
                f"family={family.name!r} takes {name}={supported!r}, got {value!r} (the "
                f"processor families are served with lazy decoding into transformers inputs)"
            )
