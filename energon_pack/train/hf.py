"""Model-ready inputs for transformers: the dict a user passes as ``model(**inputs)``.

A packed batch keeps the Megatron conventions (labels shifted by the row builder, 1-D
``position_ids`` plus separate ``[3, R, T]`` mRoPE ids). A transformers causal LM or Qwen-VL
model (Qwen2-VL to Qwen3.5) trains on exactly the right signal only when three things hold, and
each one silently trains on wrong data when it does not:

1. ``use_cache=False``: with a cache, transformers skips the per-segment attention mask it derives
   from ``position_ids``, so attention crosses segments;
2. Qwen-VL mRoPE ids go in as ``position_ids [4, R, T]``, the text positions first: with only the
   three mRoPE rows the model has no text positions and builds no per-segment mask;
3. ``labels`` unshifted (the target token at its own position), since the model shifts them
   itself; ``-100`` on the first token of every segment so that shift never crosses a boundary.

Two more ways to train silently on wrong data are refused by name: 1-D positions for a model
that rotates with mRoPE, and packed rows for a model with linear-attention layers (Qwen3.5's
Gated DeltaNet), whose state transformers carries from one segment into the next.

:func:`hf_model_inputs` builds that dict; ``CollatedBatch.hf_model_inputs()`` and
``PackedBatch.hf_model_inputs()`` call it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from energon_pack.packing.row import IGNORE_INDEX

MIN_TRANSFORMERS = (5, 0)
"""Oldest transformers whose packed-input rules :func:`hf_model_inputs` follows: per-segment
masks derived from ``position_ids`` for eager/sdpa, and ``[4, B, T]`` packed Qwen-VL positions."""

_MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
_TAKES_SECOND_PER_GRID_TS = frozenset({"qwen2_5_vl"})
"""Model types whose forward takes ``second_per_grid_ts``."""
_MROPE_MODEL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}
)
"""Model types whose text positions are 3-D mRoPE ids: they need ``position_ids="mrope"``."""
_LINEAR_ATTENTION_MODEL_TYPES = frozenset(
    {"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"}
)
"""Model types with Gated DeltaNet layers, for an :class:`HFTarget` built by hand."""


@dataclass(frozen=True)
class HFTarget:
    """What the inputs are shaped for: the model type, its attention implementation and whether
    it has linear-attention layers.

    ``attn_implementation`` naming flash attention (``"flash_attention_2"``, ``"..._3"``) gives
    one flattened row ``[1, R*T]`` with the varlen kwargs; anything else (``"sdpa"``,
    ``"eager"``, ``"flex_attention"``) gives ``[R, T]`` rows, segmented by ``position_ids``.
    A model with linear-attention layers keeps ``[R, T]`` rows of one segment each.
    """

    model_type: str | None = None
    """``config.model_type`` (e.g. ``"qwen2"``, ``"qwen2_vl"``, ``"qwen3_vl"``); None: unknown."""
    attn_implementation: str = "sdpa"
    linear_attention: bool = False
    """The model has linear-attention layers (``"linear_attention"`` in the text config's
    ``layer_types``, e.g. Qwen3.5's Gated DeltaNet); also assumed for the model types that
    have them (Qwen3.5, Qwen3.5-MoE, Qwen3-Next)."""

    @property
    def flash(self) -> bool:
        return "flash" in self.attn_implementation

    @property
    def mrope(self) -> bool:
        """The model rotates its text with 3-D mRoPE positions (Qwen2-VL to Qwen3.5)."""
        return self.model_type in _MROPE_MODEL_TYPES

    @property
    def segment_blind(self) -> bool:
        """Some layers carry state along the whole row, across packed segment boundaries."""
        return self.linear_attention or self.model_type in _LINEAR_ATTENTION_MODEL_TYPES

    @classmethod
    def of(cls, model: Any) -> HFTarget:
        """The target of a transformers model, its config, an :class:`HFTarget`, or None."""
        if model is None:
            return cls()
        if isinstance(model, HFTarget):
            return model
        config = getattr(model, "config", model)
        model_type = getattr(config, "model_type", None)
        attn = getattr(config, "_attn_implementation", None)
        if not isinstance(model_type, str):
            raise ValueError(
                f"hf_model_inputs(model=...) got a {type(model).__name__} without "
                "config.model_type; pass a transformers model, its config, or an HFTarget"
            )
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        layer_types = getattr(text, "layer_types", None) or ()
        return cls(
            model_type,
            attn if isinstance(attn, str) else "sdpa",
            linear_attention="linear_attention" in layer_types,
        )


class PackedTokens(Protocol):
    """The token fields of a packed batch (``R`` rows of ``T`` tokens) a forward reads."""

    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def labels(self) -> torch.Tensor: ...
    @property
    def position_ids(self) -> torch.Tensor: ...
    @property
    def mrope_position_ids(self) -> torch.Tensor | None: ...
    @property
    def max_seqlen(self) -> int: ...


def batch_model_inputs(
    batch: PackedTokens,
    cu_seqlens_padded_flat: torch.Tensor,
    media: Mapping[str, torch.Tensor | None],
    model: Any,
) -> dict[str, Any]:
    """:func:`hf_model_inputs` of a packed batch's token fields, for ``model`` (a transformers
    model, its config, an :class:`HFTarget`, or None for sdpa/eager)."""
    return hf_model_inputs(
        input_ids=batch.input_ids,
        labels=batch.labels,
        position_ids=batch.position_ids,
        mrope_position_ids=batch.mrope_position_ids,
        cu_seqlens_padded_flat=cu_seqlens_padded_flat,
        max_seqlen=batch.max_seqlen,
        media=media,
        target=HFTarget.of(model),
    )


def hf_model_inputs(
    *,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    mrope_position_ids: torch.Tensor | None,
    cu_seqlens_padded_flat: torch.Tensor,
    max_seqlen: int,
    media: Mapping[str, torch.Tensor | None],
    target: HFTarget,
) -> dict[str, Any]:
    """Keyword arguments of a transformers forward for ``R`` packed rows of ``T`` tokens.

    ``labels`` are the batch's shifted labels ``[R, T]`` (``-100`` where nothing is predicted);
    ``position_ids`` ``[R, T]`` restart at 0 per segment; ``mrope_position_ids`` ``[3, R, T]``
    or None; ``cu_seqlens_padded_flat`` indexes the flattened ``R*T`` tokens. Returns
    ``input_ids``, unshifted ``labels``, ``position_ids`` (``[4, R, T]`` with mRoPE),
    ``use_cache=False``, the media that are set, and for flash attention the flattened row
    with ``cu_seq_lens_q/k`` and ``max_length_q/k`` (rows stay rows for a model with
    linear-attention layers). Raises RuntimeError for transformers older than
    :data:`MIN_TRANSFORMERS`; ValueError (see :func:`check_position_ids` and
    :func:`check_segments`) where the model would silently train on other data than the
    samples one at a time.
    """
    check_transformers_version()
    check_position_ids(target, mrope=mrope_position_ids is not None)
    rows, width = input_ids.shape
    check_segments(target, cu_seqlens_padded_flat, width)
    # Unshifted: the target of position t is the token at t + 1, so it moves one to the right.
    # Position 0 of a row, and the first token of every segment, get -100: the token before a
    # segment start is its predecessor's last token or a gap, which never has a target.
    hf_labels = F.pad(labels[:, :-1], (1, 0), value=IGNORE_INDEX)
    positions = position_ids.long()
    if mrope_position_ids is not None:
        positions = torch.cat((positions.unsqueeze(0), mrope_position_ids.long()))
    out: dict[str, Any] = {
        "input_ids": input_ids,
        "labels": hf_labels,
        "position_ids": positions,
        "use_cache": False,
    }
    out.update({name: media[name] for name in _MEDIA if media.get(name) is not None})
    seconds = media.get("second_per_grid_ts")
    if seconds is not None and target.model_type in _TAKES_SECOND_PER_GRID_TS:
        out["second_per_grid_ts"] = seconds
    if not target.flash or target.segment_blind:
        return out
    # Flash attention finds segments only in a single row: flatten the rows into one.
    flat = rows * width
    out["input_ids"] = input_ids.reshape(1, flat)
    out["labels"] = hf_labels.reshape(1, flat)
    out["position_ids"] = positions.reshape(*positions.shape[:-2], 1, flat)
    if "pixel_values" in out or "pixel_values_videos" in out:
        # transformers hands the forward's extra kwargs to the vision encoder too, whose flash
        # attention sets its own cu_seq_lens: the model derives the same boundaries from the
        # text position row of the single flattened row instead.
        return out
    # Static-shape slots (a repeated last boundary) would be empty sequences: drop them.
    boundaries = torch.unique_consecutive(cu_seqlens_padded_flat).to(torch.int32)
    out.update(
        cu_seq_lens_q=boundaries,
        cu_seq_lens_k=boundaries,
        max_length_q=max_seqlen,
        max_length_k=max_seqlen,
    )
    return out


def check_position_ids(target: HFTarget, *, mrope: bool) -> None:
    """Raise ValueError if ``target`` takes 3-D mRoPE positions and the batch has none."""
    if target.mrope and not mrope:
        raise ValueError(
            f"a {target.model_type} model takes 3-D mRoPE position ids, but the batch was packed "
            "with position_ids='1d': the model would train on text positions where its images "
            "and videos need grid positions. Pack with position_ids='mrope' and the model's "
            "MRopeConfig (rule='qwen3_vl' for Qwen3-VL, Qwen3-VL-MoE and Qwen3.5)"
        )


def check_segments(target: HFTarget, cu_seqlens_padded_flat: torch.Tensor, width: int) -> None:
    """Raise ValueError if ``target`` has layers that carry state across segment boundaries
    and a row (of ``width`` tokens) holds more than one segment."""
    if not target.segment_blind:
        return
    starts = torch.unique_consecutive(cu_seqlens_padded_flat.long())[:-1]
    per_row = torch.bincount(starts // width)
    if not bool((per_row > 1).any()):
        return
    row = int((per_row > 1).nonzero()[0, 0])
    raise ValueError(
        f"a {target.model_type} model has linear-attention layers (Gated DeltaNet, "
        "'linear_attention' in its layer_types) whose recurrent state and short convolution "
        "transformers runs along the whole row, across packed segment boundaries, so packed "
        f"training differs from training the samples one at a time; row {row} holds "
        f"{int(per_row[row])} segments. Pack one sample per row (VLMPackingCollator("
        "max_segments=1, pad_cu_seqlens=True, pad_to_max_length=True)), or train this model "
        "without packing"
    )


def check_transformers_version() -> None:
    """Raise RuntimeError if transformers is missing or older than :data:`MIN_TRANSFORMERS`."""
    installed = _installed_transformers()
    needed = ".".join(map(str, MIN_TRANSFORMERS))
    if installed is None:
        raise RuntimeError(
            f"hf_model_inputs() builds inputs for transformers >= {needed}, which is not "
            f"installed; pip install 'transformers>={needed}'"
        )
    if _release(installed) < MIN_TRANSFORMERS:
        raise RuntimeError(
            f"hf_model_inputs() needs transformers >= {needed}, found {installed}: older "
            "versions take packed Qwen-VL position_ids in another form and do not derive "
            "per-segment attention masks from position_ids for eager/sdpa, so packed samples "
            f"would attend to each other. Upgrade with pip install 'transformers>={needed}'"
        )


@functools.lru_cache(maxsize=1)
def _installed_transformers() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version such as ``"5.2.0.dev0"``; ``(0, 0)`` if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)
