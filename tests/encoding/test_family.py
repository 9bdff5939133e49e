"""Model family presets: built by name, from transformers configs and from model directories
(the checkpoint's own settings), checked against given media settings, and taken by both
packing paths (recorded in the Energon path's saved settings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import batches, read_samples, train_dataset
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig

from energon_pack import ConversationEncoder, PackingTaskEncoder, VLMPackingCollator, model_family
from energon_pack.cli import main
from energon_pack.encoding.family import FAMILIES, family_media
from energon_pack.media import MediaConfig

QWEN2_PREPROCESSOR = {  # the released Qwen2-VL-7B-Instruct preprocessor_config.json
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}


def write_dir(root: Path, model_type: str, **files: dict[str, Any]) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name, content in files.items():
        (root / f"{name}.json").write_text(json.dumps(content))
    return root


@pytest.mark.parametrize(
    ("source", "name", "rope"),
    [
        ("qwen2_vl", "qwen2_vl", "qwen2_vl"),
        ("qwen2_5_vl", "qwen2_5_vl", "qwen2_5_vl"),
        ("qwen3_vl", "qwen3_vl", "qwen3_vl"),
        ("qwen3_vl_moe", "qwen3_vl", "qwen3_vl"),
        ("qwen3_5_moe", "qwen3_5", "qwen3_vl"),
    ],
)
def test_by_name_and_model_type(source: str, name: str, rope: str) -> None:
    family = model_family(source)
    assert (family.name, family.rope) == (name, rope)
    assert model_family(family) is family


def test_released_checkpoint_values() -> None:
    """Not the image processor's class defaults (max_pixels 1,003,520)."""
    for name in ("qwen2_vl", "qwen2_5_vl"):
        media = FAMILIES[name].media
        assert (media.patch_size, media.min_pixels, media.max_pixels) == (14, 3136, 12845056)
        assert media.video_rule == "qwen2_vl"
    media = FAMILIES["qwen3_vl"].media
    assert (media.patch_size, media.min_pixels, media.max_pixels) == (16, 65536, 16777216)
    assert (media.image_mean, media.image_std) == ((0.5,) * 3, (0.5,) * 3)
    assert (media.video_min_pixels, media.video_total_pixels) == (4096, 25165824)
    assert media.video_rule == "qwen3_vl"
    assert FAMILIES["qwen2_5_vl"].tokens_per_second == 2.0
    assert FAMILIES["qwen3_vl"].tokens_per_second is None


def test_from_transformers_configs() -> None:
    assert model_family(Qwen2VLConfig()).name == "qwen2_vl"
    assert model_family(Qwen3VLMoeConfig()).name == "qwen3_vl"
    # the config's own vision geometry and time scale
    family = model_family(Qwen2_5_VLConfig(vision_config={"tokens_per_second": 4}))
    assert family.tokens_per_second == 4.0
    family = model_family(Qwen3VLConfig(vision_config={"patch_size": 14}))
    assert family.media.patch_size == 14
    with pytest.raises(ValueError, match=r"config.model_type='llama' has no model family preset"):
        model_family(type("Config", (), {"model_type": "llama"})())


def test_from_a_model_directory(tmp_path: Path) -> None:
    """The checkpoint's files decide, including the video file and transformers' fallback
    to the image file for video settings."""
    qwen2 = model_family(
        write_dir(tmp_path / "q2", "qwen2_vl", preprocessor_config=QWEN2_PREPROCESSOR)
    )
    assert qwen2.media == FAMILIES["qwen2_vl"].media
    custom = {**QWEN2_PREPROCESSOR, "max_pixels": 1003520, "image_mean": [0.5, 0.5, 0.5]}
    qwen2 = model_family(write_dir(tmp_path / "q2c", "qwen2_vl", preprocessor_config=custom))
    assert (qwen2.media.max_pixels, qwen2.media.image_mean) == (1003520, (0.5, 0.5, 0.5))
    video = {"size": {"shortest_edge": 1024, "longest_edge": 99 * 32 * 32}, "fps": 4}
    video.update(max_frames=64, min_frames=2)
    qwen3 = model_family(
        write_dir(tmp_path / "q3", "qwen3_vl_moe", video_preprocessor_config=video)
    )
    media = qwen3.media
    assert (media.video_min_pixels, media.video_total_pixels) == (1024, 99 * 32 * 32)
    assert (media.video_fps, media.video_min_frames, media.video_max_frames) == (4.0, 2, 64)
    assert media.max_pixels == 16777216  # no image file: the preset's
    fallback = {"size": {"shortest_edge": 2048, "longest_edge": 4096 * 64}}
    qwen3 = model_family(write_dir(tmp_path / "q3f", "qwen3_vl", preprocessor_config=fallback))
    assert (qwen3.media.min_pixels, qwen3.media.video_min_pixels) == (2048, 2048)


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"video_preprocessor_config": {"cap_pixels_per_frame": True}}, "cap_pixels_per_frame"),
        ({"preprocessor_config": {"resample": 2}}, r"resample=2 is not supported"),
        ({"preprocessor_config": {"rescale_factor": 1.0}}, "rescale_factor=1.0"),
        (
            {
                "preprocessor_config": {"patch_size": 14},
                "video_preprocessor_config": {"patch_size": 16},
            },
            r"disagree on \{'patch_size': \(14, 16\)\}",
        ),
        ({"preprocessor_config": {"image_mean": [0.5]}}, r"image_mean=\[0.5\]; expected 3"),
    ],
)
def test_directory_errors_name_the_file_and_setting(
    tmp_path: Path, files: dict[str, Any], message: str
) -> None:
    root = write_dir(tmp_path / "model", "qwen3_vl", **files)
    with pytest.raises(ValueError, match=message):
        model_family(root)


def test_directory_and_name_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config.json with a model_type"):
        model_family(tmp_path)
    with pytest.raises(ValueError, match=r"unknown model family 'qwen4'.*qwen3_vl"):
        model_family("qwen4")
    root = tmp_path / "m"
    root.mkdir()
    config = {"model_type": "qwen3_vl", "vision_config": {"patch_size": 14}}
    (root / "config.json").write_text(json.dumps(config))
    (root / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16}))
    with pytest.raises(ValueError, match=r"vision_config and the processor JSONs disagree"):
        model_family(root)


def test_media_must_fit_the_family() -> None:
    family = model_family("qwen3_vl")
    assert family_media(family, None) is family.media
    uint8 = family.media_config(pixel_dtype="uint8", max_pixels=1 << 20)
    assert family_media(family, uint8) is uint8
    with pytest.raises(ValueError, match=r"patch_size=14 \(the family's: 16\).*media_config"):
        family_media(family, MediaConfig())


def test_both_packing_paths_take_a_family() -> None:
    family = model_family("qwen3_vl")
    encoder = PackingTaskEncoder(seq_length=4096, family="qwen3_vl_moe")
    assert encoder.media == family.media
    assert encoder.encoder.media == family.media
    settings = encoder.packing_settings(16)
    assert settings["family"] == {"name": "qwen3_vl", "rope": "qwen3_vl", "tokens_per_second": None}
    assert settings["media"]["video_rule"] == "qwen3_vl"
    # without a family, the settings read as before the family existed (old states restore)
    plain = PackingTaskEncoder(seq_length=4096).packing_settings(16)
    assert "family" not in plain
    assert "video_rule" not in plain["media"]
    with pytest.raises(ValueError, match=r"does not fit family 'qwen3_vl'"):
        PackingTaskEncoder(seq_length=4096, family="qwen3_vl", media=MediaConfig())

    collator = VLMPackingCollator(seq_length=4096, family=family)
    assert collator.encoder.media == family.media
    assert collator.family is family
    with pytest.raises(ValueError, match=r"does not fit family 'qwen3_vl'"):
        VLMPackingCollator(seq_length=4096, family=family, encoder=ConversationEncoder())


def test_check_config_prints_the_family(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", "--seq-length", "8192", "--family", "qwen3_vl_moe"]) == 0
    out = capsys.readouterr().out
    assert "qwen3_vl (rope rule qwen3_vl)" in out
    assert "65,536 - 16,777,216" in out
    root = write_dir(tmp_path / "q2", "qwen2_vl", preprocessor_config=QWEN2_PREPROCESSOR)
    assert main(["check-config", "--seq-length", "8192", "--family", str(root)]) == 0
    assert "3,136 - 12,845,056" in capsys.readouterr().out
    assert main(["check-config", "--seq-length", "8192", "--family", str(tmp_path)]) == 2
    assert "no config.json with a model_type" in capsys.readouterr().err


def _vision_starts_expected(grids: Any, images: Any) -> int:
    """One block per image, one per temporal patch of a timestamped video."""
    videos = 0 if grids is None else int(grids[:, 0].sum())
    return videos + (0 if images is None else len(images))


def test_qwen3_family_end_to_end(vlm_demo_path: Path) -> None:
    """Both paths with the Qwen3-VL preset: one vision block per temporal patch after its
    timestamp text, pixels for exactly the probed grids (patch 16 rows)."""
    encoder = ConversationEncoder(media=model_family("qwen3_vl").media)
    start = encoder.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    samples = [
        (key, members)
        for key, members in read_samples(vlm_demo_path).items()
        if any(name.endswith(".mp4") for name in members)
    ][:4]
    collator = VLMPackingCollator(seq_length=32768, encoder=encoder, family="qwen3_vl")
    batch = collator([encoder.encode_sample(key, members) for key, members in samples])
    vision = batch.vision
    assert vision.video_grid_thw is not None
    assert vision.pixel_values_videos is not None
    assert vision.pixel_values_videos.shape == (int(vision.video_grid_thw.prod(1).sum()), 1536)
    starts = int((batch.input_ids == start).sum())
    assert starts == _vision_starts_expected(vision.video_grid_thw, vision.image_grid_thw)
    assert b"seconds>" in bytes(t for t in batch.input_ids.flatten().tolist() if t < 256)

    dataset = train_dataset(vlm_demo_path, 8, family="qwen3_vl", media=None)
    seen = 0
    for packed in batches(dataset):
        if packed.video_grid_thw is None:
            continue
        starts = int((packed.input_ids == start).sum())
        assert starts == _vision_starts_expected(packed.video_grid_thw, packed.image_grid_thw)
        assert packed.pixel_values_videos is not None
        assert packed.pixel_values_videos.shape[1] == 1536
        seen += 1
        if seen == 3:
            break
    assert seen == 3
