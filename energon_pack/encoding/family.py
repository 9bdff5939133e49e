"""Model family presets: one object per family of checkpoints that owns what its processor and
position code need, so no code elsewhere branches on a family name.

A :class:`ModelFamily` holds the media settings of the family's released checkpoints (geometry,
normalisation, resize budgets, the video rule: frame sampling, sizing and token layout) and the
name of its position rule (:attr:`ModelFamily.rope`). :func:`model_family` builds one by name,
from a transformers model or config (its ``model_type`` and vision geometry), or from a local
model directory (``config.json``, ``preprocessor_config.json``,
``video_preprocessor_config.json``: the checkpoint's own settings, not class defaults).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from energon_pack.media.config import RESCALE_FACTOR, MediaConfig

__all__ = ["FAMILIES", "ModelFamily", "RopeRule", "family_media", "model_family"]

RopeRule = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
"""A family's mRoPE position rule: ``"qwen2_vl"`` (a video's temporal index per patch),
``"qwen2_5_vl"`` (temporal positions ``second_per_grid_t * tokens_per_second`` apart) or
``"qwen3_vl"`` (each temporal patch its own grid with ``t = 1``; time is in the timestamp
text)."""


@dataclass(frozen=True)
class ModelFamily:
    """A family of checkpoints: their media settings and position rule.

    Dense and MoE variants share a family. Attributes other code reads: :attr:`media` (give it
    to encoders and packers), :attr:`rope` (the position rule; position code picks it by this
    name), :attr:`tokens_per_second` (the ``"qwen2_5_vl"`` rule's scale) and
    :attr:`model_types` (transformers ``config.model_type`` values of the family).
    """

    name: str
    model_types: tuple[str, ...]
    rope: RopeRule
    media: MediaConfig
    tokens_per_second: float | None = None

    def media_config(self, **changes: Any) -> MediaConfig:
        """:attr:`media` with ``changes`` (e.g. ``pixel_dtype="uint8"``, other limits)."""
        return replace(self.media, **changes)


_QWEN2_MEDIA = MediaConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 16384)
"""Released Qwen2-VL / Qwen2.5-VL ``preprocessor_config.json``: ``max_pixels`` 12,845,056."""
_QWEN3_MEDIA = MediaConfig(
    patch_size=16,
    min_pixels=65536,
    max_pixels=16777216,
    image_mean=(0.5, 0.5, 0.5),
    image_std=(0.5, 0.5, 0.5),
    video_fps=2.0,
    video_min_frames=4,
    video_max_frames=768,
    video_min_pixels=4096,
    video_max_pixels=25165824,
    video_total_pixels=25165824,
    video_rule="qwen3_vl",
)
"""Released Qwen3-VL ``preprocessor_config.json`` (``size`` 65,536 - 16,777,216) and
``video_preprocessor_config.json`` (``size`` 4,096 - 25,165,824 over ``t*h*w``)."""

FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        ModelFamily("qwen2_vl", ("qwen2_vl",), "qwen2_vl", _QWEN2_MEDIA),
        ModelFamily("qwen2_5_vl", ("qwen2_5_vl",), "qwen2_5_vl", _QWEN2_MEDIA, 2.0),
        ModelFamily("qwen3_vl", ("qwen3_vl", "qwen3_vl_moe"), "qwen3_vl", _QWEN3_MEDIA),
        ModelFamily("qwen3_5", ("qwen3_5", "qwen3_5_moe"), "qwen3_vl", _QWEN3_MEDIA),
    )
}
"""The presets by name; :func:`model_family` also takes any of their model types."""

_BY_MODEL_TYPE = {model_type: f for f in FAMILIES.values() for model_type in f.model_types}


def model_family(source: ModelFamily | str | os.PathLike[str] | Any) -> ModelFamily:
    """The family of ``source``: a :class:`ModelFamily`, a family name or model type
    (``"qwen3_vl"``, ``"qwen3_vl_moe"``), a local model directory, or a transformers model or
    config (``config.model_type``; the vision geometry of its ``vision_config``)."""
    if isinstance(source, ModelFamily):
        return source
    if isinstance(source, os.PathLike) or (isinstance(source, str) and os.sep in source):
        return _from_directory(Path(source))
    if isinstance(source, str):
        if source in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[source]
        if Path(source).is_dir():
            return _from_directory(Path(source))
        raise ValueError(
            f"unknown model family {source!r}; use one of {sorted(_BY_MODEL_TYPE)}, a model "
            "directory, or a transformers model/config"
        )
    config = getattr(source, "config", source)
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(
            f"model_family() got a {type(source).__name__} without config.model_type; pass a "
            f"family name ({sorted(FAMILIES)}), a model directory, or a transformers "
            "model/config"
        )
    family = _family_of(model_type, "config.model_type")
    vision = getattr(config, "vision_config", None)
    return _with_vision_config(family, vars(vision) if vision is not None else {})


def _with_vision_config(family: ModelFamily, vision: Mapping[str, Any]) -> ModelFamily:
    """``family`` with the patch geometry and ``tokens_per_second`` of a model's
    ``vision_config``."""
    media = replace(family.media, **_geometry(vision, vision_config=True))
    rate = vision.get("tokens_per_second")
    if family.tokens_per_second is not None and isinstance(rate, (int, float)):
        return replace(family, media=media, tokens_per_second=float(rate))
    return replace(family, media=media)


_MODEL_BOUND = (
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "image_mean",
    "image_std",
    "video_rule",
)
"""Media settings a model is trained with: a ``media`` given with a family must keep them."""


def family_media(family: ModelFamily | None, media: MediaConfig | None) -> MediaConfig | None:
    """The media settings of a packer given ``family`` and/or ``media``: the family's, or
    ``media`` where given, which must then keep the family's geometry, normalisation and video
    rule (its budgets, limits and pixel dtype are free)."""
    if family is None or media is None:
        return media if family is None else family.media
    clash = {
        name: (getattr(media, name), getattr(family.media, name))
        for name in _MODEL_BOUND
        if getattr(media, name) != getattr(family.media, name)
    }
    if clash:
        details = ", ".join(
            f"{k}={ours!r} (the family's: {theirs!r})" for k, (ours, theirs) in clash.items()
        )
        raise ValueError(
            f"media= does not fit family {family.name!r}: {details}; pass "
            f"media=model_family({family.name!r}).media_config(...) to change other settings"
        )
    return media


def _family_of(model_type: str, where: str) -> ModelFamily:
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise ValueError(
            f"{where}={model_type!r} has no model family preset; known model types: "
            f"{sorted(_BY_MODEL_TYPE)}. For another model, pass MediaConfig(...) with its "
            "processor's settings instead"
        ) from None


def _geometry(values: Mapping[str, Any], *, vision_config: bool = False) -> dict[str, Any]:
    """Patch geometry from a processor JSON (``merge_size``) or a ``vision_config``
    (``spatial_merge_size``)."""
    names = {
        "patch_size": "patch_size",
        "temporal_patch_size": "temporal_patch_size",
        "spatial_merge_size" if vision_config else "merge_size": "merge_size",
    }
    return {ours: values[theirs] for theirs, ours in names.items() if theirs in values}


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _from_directory(directory: Path) -> ModelFamily:
    """The family of a model directory, its media settings read from the processor JSONs."""
    config = _read_json(directory / "config.json")
    if config is None or not isinstance(config.get("model_type"), str):
        raise ValueError(
            f"{directory}: no config.json with a model_type; pass the directory of a "
            "transformers checkpoint (config.json, preprocessor_config.json, "
            "video_preprocessor_config.json) or a family name"
        )
    family = _family_of(config["model_type"], f"{directory / 'config.json'} model_type")
    image_path = directory / "preprocessor_config.json"
    video_path = directory / "video_preprocessor_config.json"
    image = _read_json(image_path)
    video = _read_json(video_path)
    changes = _processor_settings(image, image_path) if image is not None else {}
    if video is not None:
        video_changes = (
            _video_settings(video, video_path)
            if family.media.video_rule == "qwen3_vl"
            else _qwen2_video_settings(video, video_path)
        )
        clash = {k: (changes[k], v) for k, v in video_changes.items() if changes.get(k, v) != v}
        if clash:
            raise ValueError(
                f"{directory}: the image and video processor JSONs disagree on {clash} (image, "
                "video); energon_pack uses one geometry and normalisation for both"
            )
        changes.update(video_changes)
    elif image is not None and family.media.video_rule == "qwen3_vl":
        changes.update(_video_settings(image, image_path))  # transformers' fallback file
    vision = config.get("vision_config")
    vision = vision if isinstance(vision, dict) else {}
    geometry = _geometry(vision, vision_config=True)
    clash = {k: (v, changes[k]) for k, v in geometry.items() if changes.get(k, v) != v}
    if clash:
        raise ValueError(
            f"{directory}: config.json's vision_config and the processor JSONs disagree on "
            f"{clash} (model, processor); fix the checkpoint's files"
        )
    return _with_vision_config(replace(family, media=replace(family.media, **changes)), vision)


_UNSUPPORTED = {
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,
    "do_sample_frames": True,
    "cap_pixels_per_frame": None,
    "num_frames": None,
}
"""Processor settings energon_pack follows only at these values (the released checkpoints')."""


def _check_supported(values: Mapping[str, Any], path: Path) -> None:
    for name, supported in _UNSUPPORTED.items():
        if name in values and values[name] != supported and values[name] is not None:
            raise ValueError(
                f"{path}: {name}={values[name]!r} is not supported (energon_pack processes "
                f"media as with {name}={supported!r}); remove the setting or pass a "
                "MediaConfig of your own"
            )
    factor = values.get("rescale_factor", RESCALE_FACTOR)
    if abs(factor - RESCALE_FACTOR) > 1e-12:
        raise ValueError(
            f"{path}: rescale_factor={factor!r} is not supported (only 1/255); remove it"
        )


def _size(values: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(min, max)`` pixels: ``size`` (shortest/longest edge) or legacy min/max_pixels."""
    size = values.get("size")
    low = values.get("min_pixels")
    high = values.get("max_pixels")
    if isinstance(size, dict):
        low = size.get("shortest_edge", low)
        high = size.get("longest_edge", high)
    return low, high


def _processor_settings(values: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Image settings of a ``preprocessor_config.json``."""
    _check_supported(values, path)
    out: dict[str, Any] = dict(_geometry(values))
    low, high = _size(values)
    if low is not None:
        out["min_pixels"] = low
    if high is not None:
        out["max_pixels"] = high
    for name in ("image_mean", "image_std"):
        if name in values:
            out[name] = _triple(values[name], name, path)
    return out


def _video_settings(values: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Settings of a Qwen3-VL ``video_preprocessor_config.json`` (``size`` over ``t*h*w``)."""
    out = _processor_settings(values, path)
    out.pop("min_pixels", None)
    out.pop("max_pixels", None)
    low, high = _size(values)
    if low is not None:
        out["video_min_pixels"] = low
    if high is not None:
        out["video_max_pixels"] = out["video_total_pixels"] = high
    if "fps" in values:
        out["video_fps"] = float(values["fps"])
    for theirs, ours in (("min_frames", "video_min_frames"), ("max_frames", "video_max_frames")):
        if theirs in values:
            out[ours] = values[theirs]
    return out


def _qwen2_video_settings(values: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """Settings of a Qwen2-VL ``video_preprocessor_config.json`` (``size`` per frame)."""
    out = _video_settings(values, path)
    out.pop("video_total_pixels", None)
    return out


def _triple(value: Any, name: str, path: Path) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    if isinstance(value, list) and len(value) == 3:
        return (float(value[0]), float(value[1]), float(value[2]))
    raise ValueError(f"{path}: {name}={value!r}; expected 3 numbers (R, G, B)")
