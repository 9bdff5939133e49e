"""Every setting is checked for type and range when its object is built: a bad value is a
ValueError naming the setting and the value, never a failure deep in a worker or an empty
epoch."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from energon_pack import (
    BufferConfig,
    ByteTokenizer,
    ConversationEncoder,
    MediaConfig,
    MonitorConfig,
    MRopeConfig,
    PackingTaskEncoder,
    RowLayout,
    VLMPackingCollator,
    pad_seq_to_mult,
)

NAN, INF = math.nan, math.inf
MROPE_IDS = {"vision_start_token_id": 1, "image_token_id": 2, "video_token_id": 3}
BUILDERS: dict[str, Callable[..., object]] = {
    "MediaConfig": MediaConfig,
    "MonitorConfig": MonitorConfig,
    "MRopeConfig": lambda **kw: MRopeConfig(**{**MROPE_IDS, **kw}),
    "ConversationEncoder": ConversationEncoder,
    "PackingTaskEncoder": lambda **kw: PackingTaskEncoder(**{"seq_length": 64, **kw}),
    "VLMPackingCollator": lambda **kw: VLMPackingCollator(**{"seq_length": 64, **kw}),
    "RowLayout": lambda **kw: RowLayout(**{"seq_length": 64, **kw}),
}

POSITIVE_INT = [0, -5, True, 14.0, 0.5, "14", None]
INT_OR_NONE = [-1, True, 1.5, "64", INF]
POSITIVE_NUMBER = [0, -1.0, NAN, INF, -INF, True, "2.0", None]
NUMBER_OR_NONE = [0, -1.0, NAN, INF, True, "2.0"]
A_DICT = {"patch_size": 14}

SETTINGS: list[tuple[str, str, list[Any]]] = [
    *(
        ("MediaConfig", name, POSITIVE_INT)
        for name in (
            "patch_size",
            "merge_size",
            "temporal_patch_size",
            "min_pixels",
            "max_pixels",
            "video_min_frames",
            "video_max_frames",
            "video_min_pixels",
            "video_max_pixels",
            "video_total_pixels",
            "max_image_pixels",
            "max_images_per_sample",
            "max_video_source_frames",
            "max_json_bytes",
            "max_json_depth",
        )
    ),
    *(
        ("MediaConfig", name, POSITIVE_NUMBER)
        for name in ("video_fps", "max_video_seconds", "decode_timeout_s")
    ),
    ("MediaConfig", "image_mean", [(0.5, 0.5), (0.5,) * 4, [0.5] * 3, (0.5, NAN, 0.5), 0.5]),
    ("MediaConfig", "image_std", [(0.5, 0.0, 0.5), (0.5, -1.0, 0.5), (INF,) * 3, (0.5, 0.5)]),
    ("MediaConfig", "pixel_dtype", ["float16", None]),
    ("MediaConfig", "decode_isolation", ["thread", True]),
    ("MonitorConfig", "report_dir", [5, b"dir"]),
    ("MonitorConfig", "every_samples", POSITIVE_INT),
    ("MonitorConfig", "every_seconds", POSITIVE_NUMBER),
    ("MonitorConfig", "warn_rss_mb", NUMBER_OR_NONE),
    ("MonitorConfig", "warn_buffer_mb", NUMBER_OR_NONE),
    ("MonitorConfig", "warn_growth", [1.0, 0.5, NAN, INF, True, "1.5"]),
    *(
        ("MRopeConfig", name, [-1, None, True, 2.0, "2"])
        for name in ("vision_start_token_id", "image_token_id", "video_token_id")
    ),
    ("MRopeConfig", "spatial_merge_size", POSITIVE_INT),
    ("MRopeConfig", "tokens_per_second", NUMBER_OR_NONE),
    ("MRopeConfig", "text_after_vision", ["min", None]),
    ("MRopeConfig", "rule", ["qwen4_vl", None, 3]),
    ("ConversationEncoder", "system_prompt", [5, b"prompt", ["a"]]),
    ("ConversationEncoder", "loss_on", ["assistants", None]),
    ("ConversationEncoder", "template_system", ["yes", 1, None]),
    ("ConversationEncoder", "media", [A_DICT, {}, 5]),
    ("PackingTaskEncoder", "max_wait", INT_OR_NONE),
    ("PackingTaskEncoder", "packing_buffer_bytes", [0, *INT_OR_NONE]),
    ("PackingTaskEncoder", "min_fill", [0, 1.5, NAN, INF, True, "0.9", None]),
    ("PackingTaskEncoder", "max_consecutive_skips", [-5, "100", True, 10.0, None]),
    ("PackingTaskEncoder", "decode", ["later", None]),
    ("PackingTaskEncoder", "monitor", [{"every_samples": 4}, {}, "rss"]),
    ("PackingTaskEncoder", "position_ids", ["3d", None]),
    ("PackingTaskEncoder", "mrope", [MROPE_IDS, {}, 5]),
    ("PackingTaskEncoder", "media", [A_DICT, {}, 5]),
    ("PackingTaskEncoder", "system_prompt", [5, b"prompt"]),
    ("PackingTaskEncoder", "loss_on", ["assistants"]),
    ("PackingTaskEncoder", "overlong", ["truncate", None]),
    ("PackingTaskEncoder", "seq_length", [0, True, 64.0, "64"]),
    ("PackingTaskEncoder", "pad_to_multiple_of", [0, True, 2.0]),
    ("VLMPackingCollator", "encoder", [{"system_prompt": "hi"}, "encoder"]),
    ("VLMPackingCollator", "overlong", ["drop", None]),
    ("VLMPackingCollator", "on_media_error", ["ignore", None]),
    ("VLMPackingCollator", "position_ids", ["3d"]),
    ("VLMPackingCollator", "mrope", [MROPE_IDS, {}, 5]),
    ("VLMPackingCollator", "output", ["dict", None]),
    ("VLMPackingCollator", "layout", [{"seq_length": 64}, 64]),
    ("VLMPackingCollator", "pad_token_id", [-1, True, 1.5, "0"]),
    ("RowLayout", "pad_token_id", [-1, True, 1.5, "0", None]),
]


def _cases() -> list[Any]:
    return [
        pytest.param(owner, name, value, id=f"{owner}.{name}={value!r}")
        for owner, name, values in SETTINGS
        for value in values
    ]


@pytest.mark.parametrize(("owner", "name", "value"), _cases())
def test_a_bad_setting_is_refused_by_name(owner: str, name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(name)) as info:
        BUILDERS[owner](**{name: value})
    assert repr(value)[:40] in str(info.value)


def test_messages_give_the_rule_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"decode_timeout_s must be > 0 \(a finite number\), got"):
        MediaConfig(decode_timeout_s=INF)
    with pytest.raises(ValueError, match=r"got 14\.0 \(float\); pass an int >= 1, e\.g\. patch"):
        MediaConfig(patch_size=14.0)
    with pytest.raises(ValueError, match=r"media=MediaConfig\(\*\*settings\)"):
        PackingTaskEncoder(seq_length=64, media={"patch_size": 14})
    with pytest.raises(ValueError, match=r"monitor=MonitorConfig\(\*\*settings\)"):
        PackingTaskEncoder(seq_length=64, buffer=BufferConfig(monitor={"every_samples": 4}))
    with pytest.raises(ValueError, match=r"mrope=MRopeConfig\(\*\*settings\)"):
        VLMPackingCollator(64, mrope=MROPE_IDS)
    with pytest.raises(ValueError, match=r"or 0 to never stop"):
        PackingTaskEncoder(seq_length=64, buffer=BufferConfig(max_consecutive_skips=-5))


def test_a_bad_system_prompt_fails_at_construction_not_as_an_empty_epoch() -> None:
    with pytest.raises(ValueError, match=r"system_prompt must be None or a str, got 5 \(int\)"):
        PackingTaskEncoder(system_prompt=5, seq_length=64)  # type: ignore[arg-type]


def test_defaults_and_documented_examples_construct(tmp_path: Path) -> None:
    tokenizer = ByteTokenizer()
    MediaConfig()
    MonitorConfig()
    ConversationEncoder()
    RowLayout(8192)
    PackingTaskEncoder(seq_length=8192)
    VLMPackingCollator(8192)
    # README examples
    multiple = pad_seq_to_mult(tp=4, cp=2, sp=True)
    PackingTaskEncoder(tokenizer=None, seq_length=8192, pad_to_multiple_of=multiple)
    VLMPackingCollator(seq_length=8192, pad_to_multiple_of=multiple)
    VLMPackingCollator(
        8192,
        pad_to_max_length=True,
        encoder=ConversationEncoder(tokenizer),
        output="hf",
        position_ids=MRopeConfig.from_tokenizer(tokenizer, tokens_per_second=2),
    )
    PackingTaskEncoder(
        seq_length=8192,
        buffer=BufferConfig(
            monitor=MonitorConfig(
                report_dir="rss-report", warn_rss_mb=12000, warn_growth=1.5, warn_buffer_mb=2000
            )
        ),
    )
    PackingTaskEncoder(tokenizer=tokenizer, seq_length=8192)
    VLMPackingCollator(8192, encoder=ConversationEncoder(tokenizer, template_system=False))
    MediaConfig(pixel_dtype="uint8", decode_isolation="off")
    # ints where a float is meant, numpy ints, paths, the "off" values of optional settings
    MediaConfig(video_fps=2, decode_timeout_s=5, max_video_seconds=0.5, patch_size=np.int64(14))
    MediaConfig(image_mean=(0, 0, 0), image_std=(1, 1, 1))
    MonitorConfig(report_dir=tmp_path, every_seconds=1, warn_growth=None, warn_rss_mb=1)
    MRopeConfig(**MROPE_IDS, tokens_per_second=25, text_after_vision="spatial")
    MRopeConfig(vision_start_token_id=0, image_token_id=1, video_token_id=2)
    PackingTaskEncoder(
        seq_length=64,
        overlong="skip",
        system_prompt="Be brief.",
        loss_on="all",
        position_ids="mrope",
        buffer=BufferConfig(
            max_wait=None, max_bytes=2**30, min_fill=1, max_consecutive_skips=0, decode="eager"
        ),
    )
    VLMPackingCollator(layout=RowLayout(64, pad_token_id=0), overlong="truncate")
