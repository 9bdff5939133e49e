"""A packed row as the batch dict Megatron-Bridge's VLM step reads (``vlm_step.get_batch``).

Bridge 0.6's ``vlm_step`` takes a dict per micro-batch: ``input_ids`` (or ``tokens``),
``labels``, ``loss_mask``, ``position_ids`` (moved to the device), the THD metadata
``cu_seqlens_q`` / ``cu_seqlens_kv`` / ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded``
(device) and ``max_seqlen_q`` / ``max_seqlen_kv`` (0-d int32 tensors, read on the host), and the
media in one ``visual_inputs`` object whose ``normalized_for_model()`` gives the model's vision
kwargs. Keys it does not read it sets to None, so the Energon metadata (``__key__``, ...) and
``packing_stats`` ride along.

``visual_inputs`` is Bridge's own ``GenericVisualInputs`` when Bridge is importable, else
:class:`BridgeVisualInputs` with the same Qwen-VL fields and methods. The model gets the pixels
as they are, so uint8 patches (``MediaConfig(pixel_dtype="uint8")``) are normalised here with the
``MediaConfig`` that made them, or refused when none is given.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from energon_pack._moved import renamed
from energon_pack.media import MediaConfig, normalize_pixels
from energon_pack.packing.row import PackedRow

__all__ = ["BRIDGE_BATCH_KEYS", "BridgeVisualInputs", "bridge_batch", "visual_inputs_type"]

BRIDGE_BATCH_KEYS: tuple[str, ...] = (
    "input_ids",
    "labels",
    "loss_mask",
    "position_ids",
    "attention_mask",
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
    "visual_inputs",
)
"""The keys of :func:`bridge_batch` that Bridge's ``vlm_step.get_batch`` reads."""

_PIXELS = ("pixel_values", "pixel_values_videos")


@dataclass
class BridgeVisualInputs:
    """The fields of Megatron-Bridge 0.6.2's ``GenericVisualInputs`` (used when Bridge is not
    importable). Packed rows set the Qwen-VL ones: pixel patches ``[P, patch_dim]``, ``[N, 3]``
    grids and ``second_per_grid_ts``, in segment order."""

    pixel_values: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    second_per_grid_ts: torch.Tensor | None = None
    image_sizes: torch.Tensor | None = None
    image_position_ids: torch.Tensor | None = None
    mm_token_type_ids: torch.Tensor | None = None

    def as_model_kwargs(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: value for name, value in values.items() if value is not None}

    def normalized_for_model(self) -> dict[str, torch.Tensor]:
        """:meth:`as_model_kwargs` with batched ``[B, N, ...]`` pixels and ``[B, N, 3]`` grids
        flattened to ``[B*N, ...]`` (rows built here are flat already)."""
        kwargs = self.as_model_kwargs()
        for name, batched_ndim in (
            ("pixel_values", 5),
            ("pixel_values_videos", 5),
            ("image_grid_thw", 3),
            ("video_grid_thw", 3),
        ):
            value = kwargs.get(name)
            if value is not None and value.dim() == batched_ndim:
                kwargs[name] = value.flatten(0, 1)
        return kwargs


if TYPE_CHECKING:  # the old name, for type checkers
    VisualInputs = BridgeVisualInputs
    __all__ += ["VisualInputs"]
else:  # the old name, with a DeprecationWarning
    __getattr__ = renamed(__name__, "VisualInputs")


@functools.cache
def visual_inputs_type() -> type[Any]:
    """Bridge's ``GenericVisualInputs`` when ``megatron.bridge`` imports, else
    :class:`BridgeVisualInputs`."""
    try:
        from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs
    except ImportError:
        return BridgeVisualInputs
    return GenericVisualInputs  # type: ignore[no-any-return]


def bridge_batch(
    row: PackedRow,
    media: Mapping[str, torch.Tensor | None],
    *,
    config: MediaConfig | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The dict Bridge's ``vlm_step.get_batch`` reads for one packed ``row`` (micro-batch 1).

    ``media`` holds the row's ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
    ``video_grid_thw`` and ``second_per_grid_ts`` (any may be None). uint8 pixels are
    normalised with ``config`` (the ``MediaConfig`` that produced them); without it they are
    a ``ValueError``, since Bridge hands pixels to the model unchanged. ``metadata`` (e.g.
    ``__key__``) is added as is.
    """
    visual = dict(media)
    for name in _PIXELS:
        pixels = visual.get(name)
        if pixels is None or pixels.dtype != torch.uint8:
            continue
        if config is None:
            raise ValueError(
                f"{name} are uint8 (MediaConfig(pixel_dtype='uint8')) and Megatron-Bridge's "
                "vlm_step passes pixels to the model unchanged; pass the MediaConfig that made "
                "them (to_bridge_batch(media=config)) to normalise them, or use "
                "pixel_dtype='float32'"
            )
        visual[name] = normalize_pixels(pixels, config)
    inputs_type = visual_inputs_type()
    accepted = {f.name for f in fields(inputs_type)}
    unknown = sorted(n for n, v in visual.items() if v is not None and n not in accepted)
    if unknown:
        raise ValueError(
            f"{inputs_type.__name__} has no field(s) {unknown}; this Megatron-Bridge version "
            "cannot take these media"
        )
    max_seqlen = torch.tensor(row.max_seqlen, dtype=torch.int32)
    return {
        **(metadata or {}),
        "input_ids": row.input_ids.unsqueeze(0),
        "labels": row.labels.unsqueeze(0),
        "loss_mask": row.loss_mask.unsqueeze(0),
        "position_ids": row.position_ids.unsqueeze(0),
        "attention_mask": None,
        "cu_seqlens_q": row.cu_seqlens,
        "cu_seqlens_kv": row.cu_seqlens,
        "cu_seqlens_q_padded": row.cu_seqlens_padded,
        "cu_seqlens_kv_padded": row.cu_seqlens_padded,
        "max_seqlen_q": max_seqlen,
        "max_seqlen_kv": max_seqlen.clone(),
        "visual_inputs": inputs_type(**{n: v for n, v in visual.items() if n in accepted}),
    }
