"""Model directories of the processor families whose processors save and load only where
torchvision imports, and :func:`verify_families`, run there (:mod:`torchvision_child`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ENCODING_TESTS = Path(__file__).resolve().parent.parent / "encoding"


def _processor_and_config(name: str) -> tuple[Any, Any]:
    """The processor and model config the family tests of ``name`` build."""
    if str(ENCODING_TESTS) not in sys.path:
        sys.path.append(str(ENCODING_TESTS))
    if name == "gemma4":
        import test_family_gemma4 as gemma4

        processor = gemma4.build()
        return processor, gemma4.tiny_model(processor, "vision").config
    if name == "glm4v":
        import test_family_glm4v as glm4v

        return glm4v.make_processor(), glm4v.tiny_model().config
    if name == "internvl":
        import test_family_internvl as internvl

        return internvl.default()[0], internvl.tiny_model().config
    if name == "llava_onevision":
        import test_family_llava_onevision as llava

        return llava.small(), llava.tiny_model().config
    if name == "pixtral":
        import test_family_pixtral as pixtral

        return pixtral.processor(4, 2, 32), pixtral.tiny_model("mistral3").config
    if name == "smolvlm":
        import test_family_idefics3 as idefics3

        processor = idefics3.small("smolvlm")
        return processor, idefics3.tiny_model("smolvlm", processor).config
    if name == "kimi_k25":
        import test_family_kimi_k25 as kimi

        processor = kimi.build()
        return processor, kimi.tiny_model(processor.image_token_id, processor.video_token_id).config
    if name in ("qwen2_5_omni", "qwen3_omni"):
        import test_family_omni as omni
        from test_family_video import omni_processor
        from transformers import Qwen2_5OmniConfig, Qwen3OmniMoeConfig

        processor = omni_processor(name)
        whole = Qwen2_5OmniConfig if name == "qwen2_5_omni" else Qwen3OmniMoeConfig
        thinker = omni.tiny_model(name, processor).config
        return processor, whole(thinker_config=thinker.to_dict())  # as a checkpoint ships it
    raise KeyError(name)


NAMES = (
    "gemma4",
    "glm4v",
    "internvl",
    "llava_onevision",
    "pixtral",
    "smolvlm",
    "kimi_k25",
    "qwen2_5_omni",
    "qwen3_omni",
)
"""The families of docs/families.md whose processors save and load only with torchvision."""
AUDIO_NAMES = ("qwen2_5_omni", "qwen3_omni")
"""Those of :data:`NAMES` that take audio (checked on audio rows too: :func:`verify_audio`)."""


def model_dir(directory: Path, name: str) -> Path:
    """A checkpoint directory of family ``name`` (no weights): its family test's processor,
    saved as transformers' own class, and that test's tiny model config."""
    processor, config = _processor_and_config(name)
    _give_missing_video_processor(processor, config.model_type)
    processor.save_pretrained(directory)
    config.save_pretrained(directory)
    return directory


def _give_missing_video_processor(processor: Any, model_type: str) -> None:
    """A processor built without its video processor (the family tests build them, as
    ``ImageOnly*`` subclasses, where torchvision is absent) becomes transformers' own class
    with the default video processor of its model type, as a released checkpoint saves it
    (InternVL's at the image tile size: its model reads tiles and frames from one tensor, and a
    released checkpoint's two sizes are equal)."""
    from transformers.models.auto.video_processing_auto import (
        VIDEO_PROCESSOR_MAPPING_NAMES,
        video_processor_class_from_name,
    )

    if "video_processor" in processor.get_attributes() and processor.video_processor is None:
        name = VIDEO_PROCESSOR_MAPPING_NAMES[model_type]["torchvision"]
        settings: dict[str, Any] = {}
        if model_type == "internvl":
            size = processor.image_processor.size
            settings["size"] = {"height": int(size["height"]), "width": int(size["width"])}
        processor.video_processor = video_processor_class_from_name(name)(**settings)
    if type(processor).__name__.startswith("ImageOnly"):
        processor.__class__ = type(processor).__mro__[1]


def verify_families(job: dict[str, Any]) -> dict[str, Any]:
    """:func:`model_dirs.verify_runs` on the saved directory of each name in ``job["names"]``
    (of :data:`NAMES`), over the seeds ``job["seeds"]`` (default ``[0]``): name -> reports."""
    import tempfile

    from model_dirs import verify_runs

    out: dict[str, Any] = {}
    for name in job["names"]:
        with tempfile.TemporaryDirectory() as scratch:
            out[name] = verify_runs(model_dir(Path(scratch), name), job.get("seeds", [0]))
    return out


def verify_audio(job: dict[str, Any]) -> dict[str, Any]:
    """``verify_packing`` of the saved directory of each name in ``job["names"]`` (of
    :data:`AUDIO_NAMES`) on :func:`model_dirs.audio_rows`: name -> the report as JSON."""
    import tempfile

    from model_dirs import audio_rows

    from energon_pack import verify_packing

    out: dict[str, Any] = {}
    for name in job["names"]:
        with tempfile.TemporaryDirectory() as scratch:
            directory = model_dir(Path(scratch) / "model", name)
            rows = audio_rows(Path(scratch) / "rows.jsonl")
            out[name] = verify_packing(directory, data=rows).to_json()
    return out
