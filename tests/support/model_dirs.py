"""Model directories as checkpoints ship them, minus the weights: ``config.json`` at the
released architecture's size (transformers' config defaults), the tokenizer, and the processor
files of a model that takes media. ``energon-pack verify`` reads nothing else.

The Qwen models get Qwen's real tokenizer (``real_qwen``) with the Qwen2-VL chat template of
``hf_qwen``; their processors a lower ``max_pixels`` than the released 12.8 M (so the demo
images stay under a thousand tokens). Gemma 3 and Idefics3 get the family tests' processors,
saved, and configs whose vision tower matches those processors' image sizes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from hf_qwen import CHAT_TEMPLATE
from real_qwen import qwen_tokenizer_dir
from transformers import (
    Gemma3Config,
    Idefics3Config,
    Qwen2_5_VLConfig,
    Qwen2AudioConfig,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen3_5Config,
    Qwen3VLConfig,
    Qwen3VLMoeConfig,
)

QWEN_TOKENS = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
}
"""The Qwen-VL special ids of the real tokenizer (Qwen3.5's released ids are elsewhere)."""
_QWEN2_GEOMETRY = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}
_QWEN3_GEOMETRY = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}
_QWEN3_SIZE = {"size": {"shortest_edge": 65536, "longest_edge": 401408}}


def _mrope(theta: float, sections: list[int], **more: Any) -> dict[str, Any]:
    return {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": theta,
            "mrope_section": sections,
            **more,
        }
    }


def _qwen_config(model_type: str) -> tuple[Any, dict[str, Any] | None]:
    """The model's config and its ``preprocessor_config.json`` (None for a text model)."""
    qwen2_media = {**_QWEN2_GEOMETRY, "min_pixels": 3136, "max_pixels": 401408}
    qwen3_media = {**_QWEN3_GEOMETRY, **_QWEN3_SIZE}
    if model_type == "qwen2":
        return Qwen2Config(), None
    if model_type == "qwen2_vl":
        return Qwen2VLConfig(text_config=_mrope(1e6, [16, 24, 24])), qwen2_media
    if model_type == "qwen2_5_vl":
        text = _mrope(1e6, [16, 24, 24])
        config = Qwen2_5_VLConfig(text_config=text, vision_config={"tokens_per_second": 2})
        return config, qwen2_media
    text = _mrope(5e6, [24, 20, 20], mrope_interleaved=True)
    if model_type == "qwen3_vl":
        return Qwen3VLConfig(text_config=text), qwen3_media
    if model_type == "qwen3_vl_moe":
        return Qwen3VLMoeConfig(text_config=text), qwen3_media
    if model_type == "qwen3_5":
        text = _mrope(1e7, [11, 11, 10], mrope_interleaved=True, partial_rotary_factor=0.25)
        return Qwen3_5Config(text_config=text, **QWEN_TOKENS), qwen3_media
    raise ValueError(model_type)


def qwen_model_dir(directory: Path, model_type: str) -> Path:
    """A ``model_type`` checkpoint directory (no weights) with Qwen's real tokenizer."""
    shutil.copytree(qwen_tokenizer_dir(), directory, dirs_exist_ok=True)
    config, media = _qwen_config(model_type)
    config.save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    if media is not None:
        (directory / "preprocessor_config.json").write_text(json.dumps(media), encoding="utf-8")
    return directory


def gemma3_model_dir(directory: Path) -> Path:
    """A Gemma 3 checkpoint directory: the family test's processor (32 px images, 4 tokens)
    saved, and Gemma 3's released text config with a SigLIP tower on those images."""
    import test_family_gemma3 as gemma3

    tokenizer = gemma3.TOKENIZER
    gemma3.make_processor().save_pretrained(directory)
    Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer),
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={"model_type": "siglip_vision_model", "image_size": 32, "patch_size": 8},
        mm_tokens_per_image=4,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        image_token_index=tokenizer.image_token_id,
    ).save_pretrained(directory)
    return directory


def idefics3_model_dir(directory: Path) -> Path:
    """An Idefics3 checkpoint directory: the family test's processor (28 px tiles of 7 px
    patches, 4 tokens per tile) saved, and Idefics3's released config with a tower on them."""
    import test_family_idefics3 as idefics3

    processor = idefics3.small("idefics3")
    processor.save_pretrained(directory)
    tokenizer = processor.tokenizer
    Idefics3Config(
        vision_config={"image_size": 28, "patch_size": 7},
        text_config={"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id},
        image_token_id=tokenizer.convert_tokens_to_ids(idefics3.IMAGE),
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(directory)
    return directory


def qwen2_audio_model_dir(directory: Path) -> Path:
    """A Qwen2-Audio checkpoint directory: the family test's processor (16 mel bins, 30 s
    windows) saved, and Qwen2-Audio's released config (a Whisper-large encoder, a Qwen2-7B text
    model) on those mel bins."""
    import test_family_qwen2_audio as qwen2_audio

    processor = qwen2_audio.processor()
    processor.save_pretrained(directory)
    Qwen2AudioConfig(
        audio_config={"num_mel_bins": processor.feature_extractor.feature_size},
        text_config={"vocab_size": len(processor.tokenizer)},
        audio_token_index=processor.audio_token_id,
    ).save_pretrained(directory)
    return directory


def audio_rows(path: Path, count: int = 4) -> Path:
    """A JSONL file at ``path`` of ``count`` chat rows, each one audio (a decoded array at
    16 kHz of 0.8 s and up) and a reply, for :func:`qwen2_audio_model_dir`."""
    import test_family_qwen2_audio as qwen2_audio

    rows = []
    for index in range(count):
        _, row = qwen2_audio.conversation(1, 1, index)
        wave = qwen2_audio.tone(int(16000 * (0.8 + 0.3 * index)), seed=index)
        rows.append({**row, "audios": [{"array": wave.tolist(), "sampling_rate": 16000}]})
    path.write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    return path


BUILDERS = {
    **{
        name: (lambda d, name=name: qwen_model_dir(d, name))
        for name in ("qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5")
    },
    "gemma3": gemma3_model_dir,
    "idefics3": idefics3_model_dir,
    "qwen2_audio": qwen2_audio_model_dir,
}
"""Model name -> the builder of its directory."""


def model_dir(directory: Path, name: str) -> Path:
    """The directory of model ``name`` (a key of :data:`BUILDERS`), built once."""
    if not (directory / "config.json").is_file():
        directory.mkdir(parents=True, exist_ok=True)
        BUILDERS[name](directory)
    return directory


def verify_runs(directory: Path, seeds: list[int]) -> list[dict[str, Any]]:
    """``verify_packing(directory, seed=s)`` (default implementations) for each seed: the
    reports as JSON, each with its wall time under ``"seconds"``."""
    import time

    from energon_pack import verify_packing

    reports = []
    for seed in seeds:
        started = time.perf_counter()
        report = verify_packing(directory, seed=seed)
        reports.append({**report.to_json(), "seconds": time.perf_counter() - started})
    return reports
