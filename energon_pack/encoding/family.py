"""Model family presets: one object per family of checkpoints that owns what its processor and
position code need, so no code elsewhere branches on a family name.

A :class:`ModelFamily` holds the media settings of the family's released checkpoints (geometry,
normalisation, resize budgets, the video rule: frame sampling, sizing and token layout) and the
name of its position rule (:attr:`ModelFamily.rope`). :func:`model_family` builds one by name,
from a transformers model or config (its ``model_type`` and vision geometry), or from a local
model directory (``config.json``, ``preprocessor_config.json``,
``video_preprocessor_config.json``, ``processor_config.json``: the checkpoint's own settings,
not class defaults).

A model directory is data from disk: each JSON is read only if it is a regular file of at most
:data:`MAX_JSON_BYTES` inside the directory (symlinks are resolved; one leading out of it is
refused), and every value used is checked (type, finite, in range), naming the file and key.
As in transformers 5.x, the image settings nested in ``processor_config.json``
(``"image_processor"``) win over ``preprocessor_config.json``, and its ``"video_processor"``
over ``video_preprocessor_config.json`` (then ``preprocessor_config.json``).
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from energon_pack.encoding.families import (
    ProcessorFamily,
    family_class,
    processor_family,
    served_processors,
)
from energon_pack.media.config import RESCALE_FACTOR, MediaConfig

__all__ = [
    "FAMILIES",
    "MAX_JSON_BYTES",
    "Family",
    "ModelFamily",
    "RopeRule",
    "family_media",
    "model_family",
]

MAX_JSON_BYTES = 4 * 2**20
"""Largest model-directory JSON read (the released processor/config files are a few KB)."""
_MAX_PIXELS = 1 << 26
"""Largest pixel budget (``min/max_pixels``, ``size`` edges) accepted from a model directory:
67,108,864, four times the largest released (Qwen3-VL video, 25,165,824)."""
_INT_RANGES = {
    "patch_size": 256,
    "temporal_patch_size": 16,
    "merge_size": 16,
    "spatial_merge_size": 16,
    "min_frames": 100_000,
    "max_frames": 100_000,
}
"""Upper bounds of the integer settings read from a model directory (each is >= 1)."""

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


Family = ModelFamily | ProcessorFamily
"""What :func:`model_family` gives: a Qwen preset or a processor-backed family."""

_QWEN_PROCESSORS = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
}
"""transformers processor classes of the Qwen presets."""


def model_family(source: Family | str | os.PathLike[str] | Any) -> Family:
    """The family of ``source``: a family object, a family name or model type (``"qwen3_vl"``,
    ``"qwen3_vl_moe"``), a local model directory (a checkpoint, or what
    ``processor.save_pretrained(dir)`` writes), a transformers processor instance, or a
    transformers model or config (``config.model_type``; the vision geometry of its
    ``vision_config``). A processor's family follows its own settings.

    Raises:
        ValueError: ``source`` is of no supported family (the message names it and the
            supported ones), or a model directory's files are invalid.
    """
    if isinstance(source, (ModelFamily, ProcessorFamily)):
        return source
    if _is_processor(source):
        return _from_processor(source)
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


def _is_processor(source: Any) -> bool:
    """A transformers processor instance (a ``ProcessorMixin``)."""
    return any(cls.__name__ == "ProcessorMixin" for cls in type(source).__mro__)


def _from_processor(processor: Any) -> Family:
    """The family of a processor instance: a served processor family, or a Qwen preset with
    the processor's image (and video) settings."""
    served = processor_family(processor)
    if served is not None:
        return served
    names = [cls.__name__ for cls in type(processor).__mro__]
    preset = next((_QWEN_PROCESSORS[n] for n in names if n in _QWEN_PROCESSORS), None)
    if preset is None:
        raise ValueError(
            f"{type(processor).__name__} is of no supported model family; supported "
            f"processors: {sorted([*served_processors(), *_QWEN_PROCESSORS])}"
        )
    label = type(processor).__name__
    family = FAMILIES[preset]
    sources: dict[str, Source | None] = {}
    for name in ("image_processor", "video_processor"):
        part = getattr(processor, name, None)
        values = None if part is None else json.loads(part.to_json_string())
        sources[name] = None if values is None else (values, f"{label}.{name}.")
    changes = _media_changes(
        family, sources["image_processor"], sources["video_processor"], None, label
    )
    return _with_media(family, changes, label)


def _with_vision_config(
    family: ModelFamily, vision: Mapping[str, Any], where: str = "vision_config."
) -> ModelFamily:
    """``family`` with the patch geometry and ``tokens_per_second`` of a model's
    ``vision_config``."""
    media = replace(family.media, **_geometry(vision, where, vision_config=True))
    rate = vision.get("tokens_per_second")
    if family.tokens_per_second is not None and rate is not None:
        rate = _number(rate, f"{where}tokens_per_second", high=1e4)
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


def _geometry(
    values: Mapping[str, Any], where: str, *, vision_config: bool = False
) -> dict[str, Any]:
    """Patch geometry from a processor JSON (``merge_size``) or a ``vision_config``
    (``spatial_merge_size``), each checked (``where`` prefixes the key in errors)."""
    names = {
        "patch_size": "patch_size",
        "temporal_patch_size": "temporal_patch_size",
        "spatial_merge_size" if vision_config else "merge_size": "merge_size",
    }
    return {
        ours: _integer(values[theirs], f"{where}{theirs}", _INT_RANGES[theirs])
        for theirs, ours in names.items()
        if theirs in values
    }


_FIX = "fix the file, or pass a MediaConfig of your own"


def _integer(value: Any, where: str, high: int) -> int:
    """``value`` as an int in ``[1, high]``, else a ValueError naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"{where}={value!r:.80}: expected an int from 1 to {high:,}; {_FIX}")
    return value


def _number(value: Any, where: str, *, low: float = 0.0, high: float, above: bool = True) -> float:
    """``value`` as a finite float in ``(low, high]`` (``[low, high]`` unless ``above``)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ((low < value if above else low <= value) and value <= high)
    ):
        bound = "(" if above else "["
        raise ValueError(
            f"{where}={value!r:.80}: expected a finite number in {bound}{low:g}, {high:g}]; {_FIX}"
        )
    return float(value)


def _read_json(directory: Path, name: str) -> dict[str, Any] | None:
    """The JSON object ``directory/name``, or None when there is none: a regular file inside
    the directory (symlinks resolved) of at most :data:`MAX_JSON_BYTES`."""
    path = directory / name
    if not os.path.lexists(path):
        return None
    try:
        real = path.resolve(strict=True)
        root = directory.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{path}: cannot be resolved ({exc}); fix or remove it") from exc
    if not real.is_relative_to(root):
        raise ValueError(
            f"{path}: a symlink to {real}, outside the model directory {root}; model files "
            "are read only inside it: copy the file into the directory"
        )
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO does not block the open
    except OSError as exc:
        raise ValueError(f"{path}: cannot be opened ({exc}); fix or remove it") from exc
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file; replace it with the JSON file")
        if info.st_size > MAX_JSON_BYTES:
            raise ValueError(
                f"{path}: {info.st_size:,} bytes, over the limit of {MAX_JSON_BYTES:,} for a "
                "model directory JSON (the released ones are a few KB); fix or remove it"
            )
        raw = handle.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise ValueError(f"{path}: grew over {MAX_JSON_BYTES:,} bytes while read; fix it")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc}); fix or remove it") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _nested(
    processor: dict[str, Any] | None, key: str, path: Path
) -> tuple[dict[str, Any], str] | None:
    """The settings transformers 5.x nests in ``processor_config.json`` under ``key``."""
    if processor is None or key not in processor:
        return None
    values = processor[key]
    if not isinstance(values, dict):
        raise ValueError(
            f"{path}: {key}={values!r:.80}; expected a JSON object of processor settings"
        )
    return values, f"{path}: {key}."


Source = tuple[dict[str, Any], str]
"""Settings read from a processor JSON (or a processor) and the prefix naming them in errors."""


def _from_directory(directory: Path) -> Family:
    """The family of a model directory, its media settings read from the processor JSONs
    (transformers 5.x's precedence: see the module docstring); a directory without a
    ``config.json`` model type is a saved processor, its family by ``processor_class``."""
    config = _read_json(directory, "config.json")
    processor_path = directory / "processor_config.json"
    processor = _read_json(directory, "processor_config.json")
    image_path = directory / "preprocessor_config.json"
    image_file = _read_json(directory, "preprocessor_config.json")
    model_type = None if config is None else config.get("model_type")
    saved_processor = _processor_class_or_none(processor, image_file)
    if not isinstance(model_type, str) or (
        model_type not in _BY_MODEL_TYPE and saved_processor not in (None, *_QWEN_PROCESSORS)
    ):
        # A saved processor, or a checkpoint of a processor family (its config.json names a
        # model type without a preset, its processor files the processor class).
        name = saved_processor or _processor_class(directory, processor, image_file)
        if name not in _QWEN_PROCESSORS:
            return _saved_processor(directory, name)
        family = FAMILIES[_QWEN_PROCESSORS[name]]
        config = {}
    else:
        family = _family_of(model_type, f"{directory / 'config.json'} model_type")
    file_source = None if image_file is None else (image_file, f"{image_path}: ")
    image = _nested(processor, "image_processor", processor_path) or file_source
    video_path = directory / "video_preprocessor_config.json"
    video_file = _read_json(directory, "video_preprocessor_config.json")
    video = _nested(processor, "video_processor", processor_path) or (
        None if video_file is None else (video_file, f"{video_path}: ")
    )
    changes = _media_changes(family, image, video, file_source, str(directory))
    vision = (config or {}).get("vision_config")
    vision = vision if isinstance(vision, dict) else {}
    where = f"{directory / 'config.json'}: vision_config."
    geometry = _geometry(vision, where, vision_config=True)
    clash = {k: (v, changes[k]) for k, v in geometry.items() if changes.get(k, v) != v}
    if clash:
        raise ValueError(
            f"{directory}: config.json's vision_config and the processor JSONs disagree on "
            f"{clash} (model, processor); fix the checkpoint's files"
        )
    return _with_vision_config(_with_media(family, changes, str(directory)), vision, where)


def _media_changes(
    family: ModelFamily,
    image: Source | None,
    video: Source | None,
    fallback: Source | None,
    label: str,
) -> dict[str, Any]:
    """The media settings of the image and video processor settings (``fallback``: the image
    file transformers reads video settings from when there is no video file)."""
    changes = _processor_settings(*image) if image is not None else {}
    if video is not None:
        video_changes = (
            _video_settings(*video)
            if family.media.video_rule == "qwen3_vl"
            else _qwen2_video_settings(*video)
        )
        clash = {k: (changes[k], v) for k, v in video_changes.items() if changes.get(k, v) != v}
        if clash:
            raise ValueError(
                f"{label}: the image and video processor settings disagree on {clash} (image, "
                "video); energon_pack uses one geometry and normalisation for both"
            )
        changes.update(video_changes)
    elif fallback is not None and family.media.video_rule == "qwen3_vl":
        changes.update(_video_settings(*fallback))  # transformers' fallback file
    return changes


def _with_media(family: ModelFamily, changes: Mapping[str, Any], label: str) -> ModelFamily:
    try:
        media = replace(family.media, **changes)
    except ValueError as exc:  # e.g. min_pixels over max_pixels
        raise ValueError(f"{label}: the processor settings are invalid: {exc}") from None
    return replace(family, media=media)


def _processor_class_or_none(
    processor: dict[str, Any] | None, image: dict[str, Any] | None
) -> str | None:
    """The ``processor_class`` the processor JSONs name, if any."""
    for values in (processor, image):
        name = None if values is None else values.get("processor_class")
        if isinstance(name, str):
            return name
    return None


def _processor_class(
    directory: Path, processor: dict[str, Any] | None, image: dict[str, Any] | None
) -> str:
    """The ``processor_class`` a saved processor directory names."""
    name = _processor_class_or_none(processor, image)
    if name is not None:
        return name
    raise ValueError(
        f"{directory}: no config.json with a model_type and no processor_config.json with a "
        "processor_class; pass the directory of a transformers checkpoint or of "
        "processor.save_pretrained(), or a family name"
    )


def _saved_processor(directory: Path, name: str) -> ProcessorFamily:
    """The family of a directory written by ``processor.save_pretrained``, loaded by
    transformers' own class of that name."""
    if family_class(name) is None:
        raise ValueError(
            f"{directory}: processor_class {name!r} is of no supported model family; "
            f"supported processors: {sorted([*served_processors(), *_QWEN_PROCESSORS])}"
        )
    import transformers

    try:
        processor = getattr(transformers, name).from_pretrained(directory)
    except ImportError as error:  # e.g. SmolVLM's processor needs num2words
        raise ValueError(
            f"{directory}: transformers' {name} does not load here: {error}"
        ) from error
    family = processor_family(processor)
    assert family is not None  # family_class(name) serves it
    return family


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


def _check_supported(values: Mapping[str, Any], where: str) -> None:
    for name, supported in _UNSUPPORTED.items():
        if name in values and values[name] != supported and values[name] is not None:
            raise ValueError(
                f"{where}{name}={values[name]!r:.80} is not supported (energon_pack processes "
                f"media as with {name}={supported!r}); remove the setting or pass a "
                "MediaConfig of your own"
            )
    if "rescale_factor" not in values:
        return
    factor = _number(values["rescale_factor"], f"{where}rescale_factor", high=1.0)
    if abs(factor - RESCALE_FACTOR) > 1e-12:
        raise ValueError(
            f"{where}rescale_factor={factor!r} is not supported (only 1/255); remove it"
        )


def _size(values: Mapping[str, Any], where: str) -> tuple[int | None, int | None]:
    """``(min, max)`` pixels: ``size`` (shortest/longest edge) or legacy min/max_pixels."""
    size = values.get("size")
    bounds: dict[str, int | None] = {}
    for ours, legacy, edge in (
        ("low", "min_pixels", "shortest_edge"),
        ("high", "max_pixels", "longest_edge"),
    ):
        value, key = values.get(legacy), legacy
        if isinstance(size, dict) and edge in size:
            value, key = size[edge], f"size.{edge}"
        bounds[ours] = None if value is None else _integer(value, f"{where}{key}", _MAX_PIXELS)
    return bounds["low"], bounds["high"]


def _processor_settings(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Image settings of a ``preprocessor_config.json`` (``where`` prefixes keys in errors)."""
    _check_supported(values, where)
    out: dict[str, Any] = dict(_geometry(values, where))
    low, high = _size(values, where)
    if low is not None:
        out["min_pixels"] = low
    if high is not None:
        out["max_pixels"] = high
    for name in ("image_mean", "image_std"):
        if name in values:
            out[name] = _triple(values[name], name, where)
    return out


def _video_settings(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Settings of a Qwen3-VL ``video_preprocessor_config.json`` (``size`` over ``t*h*w``)."""
    out = _processor_settings(values, where)
    out.pop("min_pixels", None)
    out.pop("max_pixels", None)
    low, high = _size(values, where)
    if low is not None:
        out["video_min_pixels"] = low
    if high is not None:
        out["video_max_pixels"] = out["video_total_pixels"] = high
    if "fps" in values:
        out["video_fps"] = _number(values["fps"], f"{where}fps", high=1000.0)
    for theirs, ours in (("min_frames", "video_min_frames"), ("max_frames", "video_max_frames")):
        if theirs in values:
            out[ours] = _integer(values[theirs], f"{where}{theirs}", _INT_RANGES[theirs])
    return out


def _qwen2_video_settings(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Settings of a Qwen2-VL ``video_preprocessor_config.json`` (``size`` per frame)."""
    out = _video_settings(values, where)
    out.pop("video_total_pixels", None)
    return out


def _triple(value: Any, name: str, where: str) -> tuple[float, float, float]:
    """3 finite numbers (R, G, B); a standard deviation > 0."""
    items = (
        [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    )
    if not isinstance(items, list) or len(items) != 3:
        raise ValueError(f"{where}{name}={value!r:.80}; expected 3 numbers (R, G, B)")
    std = name == "image_std"
    a, b, c = (
        _number(item, f"{where}{name}[{i}]", low=0.0 if std else -1e3, high=1e3, above=std)
        for i, item in enumerate(items)
    )
    return (a, b, c)
