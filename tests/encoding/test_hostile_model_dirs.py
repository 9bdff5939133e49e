"""Model directories are data from disk (issue 35, item 2).

``model_family(dir)`` reads each JSON only as a regular file of at most ``MAX_JSON_BYTES``
inside the directory (a symlink out of it, a FIFO, a 2 GiB file are refused by name, without
reading them), checks every value it uses (type, finite, range) naming the file and key, and
follows transformers 5.x's precedence: the settings nested in ``processor_config.json`` win
over ``preprocessor_config.json`` / ``video_preprocessor_config.json``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from energon_pack import model_family
from energon_pack.encoding.family import MAX_JSON_BYTES

SEED = 20261202


def write_dir(
    root: Path, model_type: str, config: dict[str, Any] | None = None, **files: Any
) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"model_type": model_type, **(config or {})}))
    for name, content in files.items():
        (root / f"{name}.json").write_text(
            content if isinstance(content, str) else json.dumps(content)
        )
    return root


_BAD_VALUES = [
    # (file, settings, the key the error names)
    ("preprocessor_config", '{"rescale_factor": NaN}', "rescale_factor=nan"),
    ("preprocessor_config", {"rescale_factor": "1/255"}, "rescale_factor='1/255'"),
    ("preprocessor_config", {"image_mean": [0.5, None, 0.5]}, r"image_mean\[1\]=None"),
    ("preprocessor_config", {"image_std": [0.5, 0.0, 0.5]}, r"image_std\[1\]=0"),
    ("preprocessor_config", '{"image_mean": [0.5, Infinity, 0.5]}', r"image_mean\[1\]=inf"),
    ("video_preprocessor_config", '{"fps": NaN}', "fps=nan"),
    ("video_preprocessor_config", {"fps": "fast"}, "fps='fast'"),
    ("video_preprocessor_config", {"fps": -2}, "fps=-2"),
    ("video_preprocessor_config", {"max_frames": 2.5}, "max_frames=2.5"),
    (
        "preprocessor_config",
        {"size": {"shortest_edge": 1e15}},
        "size.shortest_edge=1000000000000000.0",
    ),
    ("preprocessor_config", {"size": {"shortest_edge": 10**15}}, "size.shortest_edge=1000"),
    ("preprocessor_config", {"size": {"longest_edge": -5}}, "size.longest_edge=-5"),
    ("preprocessor_config", {"max_pixels": 2**40}, "max_pixels=1099511627776"),
    ("preprocessor_config", {"patch_size": 1e6}, "patch_size=1000000.0"),
    ("preprocessor_config", {"patch_size": 10**6}, "patch_size=1000000"),
    ("preprocessor_config", {"patch_size": True}, "patch_size=True"),
    ("preprocessor_config", {"merge_size": -1}, "merge_size=-1"),
    ("preprocessor_config", {"temporal_patch_size": "2"}, "temporal_patch_size='2'"),
]


@pytest.mark.parametrize(("file", "settings", "key"), _BAD_VALUES)
def test_a_bad_value_is_a_value_error_naming_the_file_and_key(
    tmp_path: Path, file: str, settings: Any, key: str
) -> None:
    root = write_dir(tmp_path / "model", "qwen3_vl", **{file: settings})
    with pytest.raises(ValueError, match=rf"{file}\.json: {key}.*expected") as caught:
        model_family(root)
    assert "fix the file" in str(caught.value) or "3 numbers" in str(caught.value)


def test_seeded_garbage_in_every_numeric_key_is_refused_by_name(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    garbage = [float("nan"), "1", None, [], {}, True, -1, 10**18, 1e300]
    keys = ["patch_size", "merge_size", "temporal_patch_size", "rescale_factor", "min_pixels"]
    for index, key in enumerate(keys * 3):
        value = rng.choice(garbage)
        root = write_dir(tmp_path / f"m{index}", "qwen2_vl", preprocessor_config={key: value})
        if value is None and key == "min_pixels":
            model_family(root)  # a null budget keeps the preset, as in transformers
            continue
        with pytest.raises(ValueError, match=rf"preprocessor_config\.json: {key}="):
            model_family(root)


def test_vision_config_values_are_checked(tmp_path: Path) -> None:
    root = write_dir(
        tmp_path / "m", "qwen2_5_vl", {"vision_config": {"tokens_per_second": float("nan")}}
    )
    with pytest.raises(ValueError, match=r"config\.json: vision_config\.tokens_per_second=nan"):
        model_family(root)
    root = write_dir(tmp_path / "p", "qwen2_5_vl", {"vision_config": {"patch_size": 10**6}})
    with pytest.raises(ValueError, match=r"vision_config\.patch_size=1000000: expected an int"):
        model_family(root)


_CHILD = textwrap.dedent(
    """
    import sys
    from energon_pack import model_family
    try:
        model_family(sys.argv[1])
        print("ACCEPTED")
    except ValueError as error:
        print("ValueError:", error)
    # the peak RSS of this process's own memory (getrusage's ru_maxrss would also count the
    # parent's RSS when it was forked, and a test session's parent can be large)
    with open("/proc/self/status") as status:
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print("RSS_MB", peak_kb // 1024)
    """
)


def _child(root: Path) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root)], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text, rss = done.stdout.rsplit("RSS_MB", 1)
    return text.strip(), int(rss)


def test_a_symlink_out_of_the_directory_is_refused_unread(tmp_path: Path) -> None:
    outside = tmp_path / "secret.json"
    with outside.open("wb") as handle:  # sparse: 2 GiB without writing them
        handle.truncate(2 << 30)
    root = write_dir(tmp_path / "model", "qwen3_vl")
    (root / "preprocessor_config.json").symlink_to(outside)
    text, rss = _child(root)
    assert "a symlink to" in text, text
    assert "outside the model directory" in text
    assert rss < 1500, rss
    (root / "video_preprocessor_config.json").symlink_to("../model/../secret.json")
    (root / "preprocessor_config.json").unlink()
    assert "outside the model directory" in _child(root)[0]


def test_a_huge_file_inside_the_directory_is_refused_before_reading(tmp_path: Path) -> None:
    root = write_dir(tmp_path / "model", "qwen3_vl")
    with (root / "big.bin").open("wb") as handle:
        handle.truncate(2 << 30)
    (root / "preprocessor_config.json").symlink_to("big.bin")  # inside: allowed, but too big
    text, rss = _child(root)
    assert f"over the limit of {MAX_JSON_BYTES:,}" in text, text
    assert "2,147,483,648 bytes" in text
    assert rss < 1500, rss


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    root = write_dir(tmp_path / "model", "qwen3_vl")
    os.mkfifo(root / "preprocessor_config.json")
    text, _ = _child(root)
    assert "preprocessor_config.json: not a regular file" in text


def test_deeply_nested_json_is_a_value_error(tmp_path: Path) -> None:
    root = write_dir(tmp_path / "m", "qwen3_vl", preprocessor_config="[" * 200_000)
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: not a readable JSON"):
        model_family(root)


def _hf_image_dict(root: Path) -> dict[str, Any]:
    from transformers.image_processing_base import ImageProcessingMixin

    values, _ = ImageProcessingMixin.get_image_processor_dict(str(root), local_files_only=True)
    return values


def test_processor_config_nested_settings_follow_transformers_precedence(tmp_path: Path) -> None:
    nested = {"image_processor": {"size": {"shortest_edge": 3136, "longest_edge": 1003520}}}
    alone = write_dir(tmp_path / "alone", "qwen2_vl", processor_config=nested)
    assert model_family(alone).media.max_pixels == 1003520  # not the preset's 12,845,056
    both = write_dir(
        tmp_path / "both",
        "qwen2_vl",
        processor_config=nested,
        preprocessor_config={"size": {"shortest_edge": 3136, "longest_edge": 12845056}},
    )
    assert _hf_image_dict(both)["size"]["longest_edge"] == 1003520  # transformers' choice
    assert model_family(both).media.max_pixels == 1003520
    flat = write_dir(
        tmp_path / "flat",
        "qwen2_vl",
        processor_config={"processor_class": "Qwen2VLProcessor"},  # no nested settings
        preprocessor_config={"size": {"shortest_edge": 3136, "longest_edge": 12845056}},
    )
    assert _hf_image_dict(flat)["size"]["longest_edge"] == 12845056
    assert model_family(flat).media.max_pixels == 12845056


def test_processor_config_nested_video_and_bad_nested_values(tmp_path: Path) -> None:
    root = write_dir(
        tmp_path / "v",
        "qwen3_vl",
        processor_config={"video_processor": {"fps": 4, "max_frames": 64}},
        video_preprocessor_config={"fps": 1, "max_frames": 32},
    )
    media = model_family(root).media
    assert (media.video_fps, media.video_max_frames) == (4.0, 64)
    bad = write_dir(
        tmp_path / "b", "qwen3_vl", processor_config={"image_processor": {"patch_size": 1e6}}
    )
    with pytest.raises(ValueError, match=r"processor_config\.json: image_processor\.patch_size"):
        model_family(bad)
    wrong = write_dir(tmp_path / "w", "qwen3_vl", processor_config={"image_processor": [1]})
    with pytest.raises(ValueError, match=r"processor_config\.json: image_processor=\[1\]"):
        model_family(wrong)


def test_released_like_directories_still_load(tmp_path: Path) -> None:
    root = write_dir(
        tmp_path / "q3",
        "qwen3_vl",
        {"vision_config": {"patch_size": 16, "spatial_merge_size": 2}},
        preprocessor_config={
            "size": {"shortest_edge": 65536, "longest_edge": 16777216},
            "patch_size": 16,
            "rescale_factor": 0.00392156862745098,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        },
        video_preprocessor_config={"fps": 2, "min_frames": 4, "max_frames": 768},
    )
    assert model_family(root).media == model_family("qwen3_vl").media
