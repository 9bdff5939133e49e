"""Media probing and preprocessing on the shipped fixtures: real pillow/decord decoding."""

from __future__ import annotations

import io
import json
import pickle
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import av
import decord
import numpy as np
import pytest
import torch
from helpers import Samples, read_samples
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from energon_pack import media
from energon_pack.formats.native import parse_sample
from energon_pack.media import MediaConfig, MediaError
from energon_pack.media.decode import to_rgb

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@cache
def fixture_samples(dataset: str) -> Samples:
    """The samples of a shipped fixture dataset (read once per test session)."""
    return read_samples(FIXTURES / dataset)


def demo_media(kind: str) -> Iterator[tuple[str, str, bytes]]:
    for key, sample in fixture_samples("vlm_demo").items():
        for member, member_kind, data in parse_sample(key, sample).media:
            if member_kind == kind:
                yield key, member, data


def test_demo_has_media() -> None:
    assert sum(1 for _ in demo_media("image")) > 200
    assert sum(1 for _ in demo_media("video")) > 20


# --- smart_resize -----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    height=st.integers(1, 5000),
    width=st.integers(1, 5000),
    min_pixels=st.sampled_from([56 * 56, 128 * 28 * 28, 4 * 28 * 28]),
    max_pixels=st.sampled_from([28 * 28 * 1280, 28 * 28 * 768, 16384 * 28 * 28, 256 * 28 * 28]),
)
def test_smart_resize_matches_transformers(
    height: int, width: int, min_pixels: int, max_pixels: int
) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    try:
        expected = smart_resize(height, width, 28, min_pixels, max_pixels)
    except ValueError:
        with pytest.raises(ValueError, match="aspect ratio"):
            media.smart_resize(height, width, 28, min_pixels, max_pixels)
        return
    got = media.smart_resize(height, width, 28, min_pixels, max_pixels)
    assert got == expected
    assert got[0] % 28 == 0
    assert got[1] % 28 == 0


def test_defaults_match_transformers_processor() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    hf = Qwen2VLImageProcessorPil()
    cfg = MediaConfig()
    assert hf.size["shortest_edge"] == cfg.min_pixels
    assert hf.size["longest_edge"] == cfg.max_pixels
    assert (hf.patch_size, hf.merge_size, hf.temporal_patch_size) == (
        cfg.patch_size,
        cfg.merge_size,
        cfg.temporal_patch_size,
    )
    assert tuple(hf.image_mean) == cfg.image_mean
    assert tuple(hf.image_std) == cfg.image_std


# --- images -----------------------------------------------------------------------------------


def test_images_match_transformers_and_probe() -> None:
    """Every fixture image: exact HF parity (pixel_values, grid) and probe == decode."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    cfg = MediaConfig()
    hf = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    checked = 0
    for key, member, data in demo_media("image"):
        probe = media.probe_image(data, key=key, member=member)
        pixels, grid = media.process_image(data, key=key, member=member)
        with Image.open(io.BytesIO(data)) as img:
            assert (probe.width, probe.height) == img.size
            expected = hf(img, return_tensors="np")
        assert grid.dtype == torch.long
        assert grid.shape == (1, 3)
        np.testing.assert_array_equal(grid.numpy(), expected["image_grid_thw"])
        assert pixels.dtype == torch.float32
        # Bit for bit: same resize, and the table rounds like transformers' rescale/normalise.
        np.testing.assert_array_equal(pixels.numpy(), expected["pixel_values"], err_msg=key)
        assert tuple(grid[0].tolist()) == probe.grid_thw
        assert probe.tokens == pixels.shape[0] // cfg.merge_size**2
        checked += 1
    assert checked > 200


@pytest.mark.parametrize(("width", "height"), [(112, 84), (448, 252), (100, 80)])
def test_images_at_their_grid_size_match_transformers(width: int, height: int) -> None:
    """112x84 and 448x252 need no resize (skipped), 100x80 does; all equal transformers."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    rows, cols = np.mgrid[0:height, 0:width]
    rgb = np.stack([rows * 3, cols * 5, rows + cols], axis=-1) % 256
    buffer = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buffer, format="PNG")
    cfg = MediaConfig()
    pixels, grid = media.process_image(buffer.getvalue(), cfg)
    hf = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    expected = hf(Image.fromarray(rgb.astype(np.uint8)), return_tensors="np")
    np.testing.assert_array_equal(grid.numpy(), expected["image_grid_thw"])
    np.testing.assert_array_equal(pixels.numpy(), expected["pixel_values"])


def test_probe_reads_only_the_header() -> None:
    """A truncated JPEG probes fine (header intact) and fails only when decoded."""
    samples = fixture_samples("broken")
    data = samples["bad_truncated_jpeg"]["0.jpg"]
    probe = media.probe_image(data)
    assert (probe.width, probe.height) == (320, 240)
    with pytest.raises(MediaError, match="bad_truncated_jpeg") as info:
        media.process_image(data, key="bad_truncated_jpeg", member="0.jpg")
    assert info.value.kind == "corrupt"


def test_720p_image_footprint() -> None:
    key, sample = "demo00000", fixture_samples("vlm_demo")["demo00000"]
    data = sample["0.jpg"]
    probe = media.probe_image(data, key=key, member="0.jpg")
    assert (probe.width, probe.height) == (1280, 720)
    pixels, grid = media.process_image(data)
    foot = media.footprint(data, pixels, grid)
    assert foot.compressed_bytes == len(data)
    assert foot.processed_bytes == pixels.numel() * 4 + grid.numel() * 8
    assert foot.processed_bytes > 20e6
    assert foot.ratio < 0.02


def test_image_pixel_limit_is_checked_before_decoding() -> None:
    data = fixture_samples("broken")["good_image"]["0.jpg"]
    with pytest.raises(MediaError, match=r"max_image_pixels=1000") as info:
        media.probe_image(data, MediaConfig(max_image_pixels=1000), key="k", member="0.jpg")
    assert info.value.kind == "too_large"
    assert info.value.key == "k"
    assert info.value.member == "0.jpg"


def test_extreme_aspect_ratio() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4020, 10)).save(buf, format="PNG")
    with pytest.raises(MediaError) as info:
        media.probe_image(buf.getvalue(), key="wide", member="0.png")
    assert info.value.kind == "aspect_ratio"


def test_transparent_and_palette_images_composite_on_white() -> None:
    img = Image.new("RGBA", (56, 56), (0, 0, 0, 0))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    pixels, _ = media.process_image(buf.getvalue())
    white = (1.0 - np.array(media.OPENAI_CLIP_MEAN)) / np.array(media.OPENAI_CLIP_STD)
    per_channel = pixels.reshape(-1, 3, 2 * 14 * 14)
    np.testing.assert_allclose(per_channel[0, :, 0].numpy(), white, rtol=1e-6)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA", "P-transparency", "RGB-transparency"])
def test_rgb_conversion_equals_transformers_for_every_value_and_alpha(mode: str) -> None:
    """Every (value, alpha) pair in every channel, against transformers' own convert_to_rgb."""
    from transformers.image_transforms import convert_to_rgb

    value, alpha = np.meshgrid(np.arange(256), np.arange(256), indexing="ij")
    rgba = np.stack([value, 255 - value, (value * 7) % 256, alpha], axis=-1).astype(np.uint8)
    img = Image.fromarray(rgba, "RGBA")
    if mode == "LA":
        img = img.convert("LA")
    elif mode == "PA":
        img = img.convert("PA")
    elif mode == "P-transparency":
        img = Image.fromarray(rgba[..., :3], "RGB").quantize(64)
        img.info["transparency"] = 5
    elif mode == "RGB-transparency":
        img = Image.fromarray(rgba[..., :3], "RGB")
        img.info["transparency"] = (0, 255, 0)
    expected = np.asarray(convert_to_rgb(img.copy()))
    assert np.array_equal(np.asarray(to_rgb(img)), expected)


# --- videos -----------------------------------------------------------------------------------


def test_videos_probe_equals_decode() -> None:
    cfg = MediaConfig()
    checked = 0
    for key, member, data in demo_media("video"):
        probe = media.probe_video(data, key=key, member=member)
        reader = decord.VideoReader(io.BytesIO(data))
        height, width, _ = reader[0].shape
        assert (probe.width, probe.height) == (width, height), f"{key}: header size"
        assert probe.source_frames == len(reader)
        pixels, grid, second_per_grid = media.process_video(data, key=key, member=member)
        assert tuple(grid[0].tolist()) == probe.grid_thw
        assert grid.dtype == torch.long
        assert pixels.shape == (probe.grid_thw[0] * probe.grid_thw[1] * probe.grid_thw[2], 1176)
        assert probe.tokens == pixels.shape[0] // cfg.merge_size**2
        assert probe.frames % cfg.temporal_patch_size == 0
        assert cfg.video_min_frames <= probe.frames <= cfg.video_max_frames
        assert second_per_grid == pytest.approx(
            cfg.temporal_patch_size / (probe.frames / probe.duration)
        )
        assert second_per_grid == probe.second_per_grid_t
        checked += 1
    assert checked > 20


def test_video_sampling_follows_target_fps() -> None:
    # 4 s at >= 4 fps -> 8 frames at 2 fps.
    for key, member, data in demo_media("video"):
        probe = media.probe_video(data, key=key, member=member)
        if probe.duration == 4.0:
            assert probe.frames == 8
            assert probe.second_per_grid_t == pytest.approx(1.0)
            return
    pytest.fail("no 4 s fixture clip")


def test_video_limits() -> None:
    key, member, data = next(demo_media("video"))
    with pytest.raises(MediaError, match="max_video_seconds") as info:
        media.probe_video(data, MediaConfig(max_video_seconds=0.5), key=key, member=member)
    assert info.value.kind == "too_long"
    with pytest.raises(MediaError) as info:
        media.process_video(data, MediaConfig(max_video_source_frames=2), key=key, member=member)
    assert info.value.kind == "too_long"
    with pytest.raises(MediaError) as info:
        media.probe_video(data, MediaConfig(max_image_pixels=100), key=key, member=member)
    assert info.value.kind == "too_large"


def test_video_total_pixel_budget_caps_frame_size() -> None:
    key, member, data = next(demo_media("video"))
    small = MediaConfig(video_total_pixels=1, video_min_pixels=28 * 28 * 4)
    probe = media.probe_video(data, small, key=key, member=member)
    _, grid, _ = media.process_video(data, small, key=key, member=member)
    assert tuple(grid[0].tolist()) == probe.grid_thw
    _, gh, gw = probe.grid_thw
    assert gh * gw * 14 * 14 <= int(28 * 28 * 4 * 1.05)


def test_decord_bridge_left_alone() -> None:
    _, _, data = next(demo_media("video"))
    native, *_ = media.process_video(data)
    decord.bridge.set_bridge("torch")
    try:
        under_torch, *_ = media.process_video(data)
        frames = decord.VideoReader(io.BytesIO(data)).get_batch([0])
        assert isinstance(frames, torch.Tensor)  # still the caller's bridge
    finally:
        decord.bridge.set_bridge("native")
    torch.testing.assert_close(native, under_torch, rtol=0, atol=0)


# --- samples, counts and the broken fixtures -------------------------------------------------


def test_media_count_limit() -> None:
    media.check_media_count("k", 3, MediaConfig(max_images_per_sample=3))
    with pytest.raises(MediaError, match="max_images_per_sample=3") as info:
        media.check_media_count("k", 4, MediaConfig(max_images_per_sample=3))
    assert info.value.kind == "too_many"


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="patch_size"):
        MediaConfig(patch_size=0)
    with pytest.raises(ValueError, match="min_pixels"):
        MediaConfig(min_pixels=10, max_pixels=5)


def _run_stage(stage: str, key: str, sample: dict[str, bytes]) -> None:
    raw = parse_sample(key, sample)
    media.check_media_count(key, len(raw.media))
    if stage == "sample":
        return
    for member, kind, data in raw.media:
        if kind == "image":
            media.probe_image(data, key=key, member=member)
            if stage == "process":
                media.process_image(data, key=key, member=member)
        else:
            media.probe_video(data, key=key, member=member)
            if stage == "process":
                media.process_video(data, key=key, member=member)


def test_broken_fixtures_give_documented_errors() -> None:
    manifest = json.loads((FIXTURES / "broken" / "expected.json").read_text())
    samples = fixture_samples("broken")
    assert set(samples) == set(manifest["samples"])
    stages = ["sample", "probe", "process"]
    for key, expected in manifest["samples"].items():
        if expected["ok"]:
            _run_stage("process", key, samples[key])
            continue
        stage = expected["stage"]
        # Every stage before the documented one passes.
        for earlier in stages[: stages.index(stage)]:
            _run_stage(earlier, key, samples[key])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no DecompressionBombWarning leaks either
            with pytest.raises(MediaError) as info:
                _run_stage(stage, key, samples[key])
        err = info.value
        assert isinstance(err, ValueError)
        assert (err.kind, err.key, err.member) == (expected["kind"], key, expected["member"]), key
        assert key in str(err)
        assert expected["member"] in str(err)
        assert str(pickle.loads(pickle.dumps(err))) == str(err)  # crosses worker processes


# --- a pack's media: decode_vision names the failing sample by position -----------------------


@dataclass(frozen=True)
class PackSample:
    """What decode_vision reads of a sample."""

    key: str
    media: tuple[media.MediaItem, ...]
    vision: media.MediaTensors | None = None


def good_video() -> bytes:
    return fixture_samples("broken")["good_video"]["0.mp4"]


def file_item(member: str, data: bytes, probed: bytes, cfg: MediaConfig) -> media.MediaItem:
    """A media item of ``data`` with the grid that probing ``probed`` gives."""
    if member.endswith(".mp4"):
        video = media.probe_video(probed, cfg)
        return media.MediaItem(
            member, "video", data, video.grid_thw, video.tokens, video.second_per_grid_t
        )
    image = media.probe_image(probed, cfg)
    return media.MediaItem(member, "image", data, image.grid_thw, image.tokens)


def bad_item(medium: str, cfg: MediaConfig) -> media.MediaItem:
    broken = fixture_samples("broken")
    if medium == "image":  # the header probes fine, the pixels do not decode
        truncated = broken["bad_truncated_jpeg"]["0.jpg"]
        return file_item("0.jpg", truncated, truncated, cfg)
    if medium == "video":  # random bytes where the probed clip was
        return file_item("0.mp4", broken["bad_random_mp4"]["0.mp4"], good_video(), cfg)
    if medium == "grid":  # a good image whose probed grid is not what it decodes to
        image = broken["good_image"]["0.jpg"]
        return media.MediaItem("0.jpg", "image", image, (1, 2, 2), 1)
    frames = media.Frames(b"\0" * 10, (1, 4, 4, 3))  # fewer bytes than the shape says
    return media.MediaItem("0.png", "image", frames, (1, 2, 2), 1)


@pytest.mark.parametrize("isolation", ["process", "off"])
@pytest.mark.parametrize(
    ("medium", "kind"),
    [("image", "corrupt"), ("video", "unreadable"), ("grid", "corrupt"), ("frames", "bad_sample")],
)
def test_decode_vision_names_the_failing_sample_by_position(
    medium: str, kind: str, isolation: str
) -> None:
    """Keys repeat (across shards, in a micro-batch): the error names the real key and gives
    the index of the sample in the list, not of the medium in the decode batch (the first
    sample's two media are jobs 0 and 1, the second sample's is job 2)."""
    cfg = MediaConfig(decode_isolation=isolation)  # type: ignore[arg-type]
    good = fixture_samples("broken")["good_image"]["0.jpg"]
    first = PackSample(
        "dup",
        (file_item("0.jpg", good, good, cfg), file_item("1.mp4", good_video(), good_video(), cfg)),
    )
    second = PackSample("dup", (bad_item(medium, cfg),))
    assert media.decode_vision([first], cfg).pixel_values is not None
    with pytest.raises(MediaError) as info:
        media.decode_vision([first, second], cfg)
    error = info.value
    assert (error.key, error.member, error.kind, error.position) == (
        "dup",
        second.media[0].member,
        kind,
        1,
    )
    unplaced = MediaError(error.key, error.member, error.kind, error.cause)
    assert str(error) == str(unplaced)  # the message does not change
    again = pickle.loads(pickle.dumps(error))
    assert (again.position, str(again)) == (1, str(error))
    with pytest.raises(MediaError) as info:
        media.decode_vision([second, first], cfg)
    assert info.value.position == 0


def test_media_errors_of_single_calls_have_no_position() -> None:
    data = fixture_samples("broken")["bad_truncated_jpeg"]["0.jpg"]
    with pytest.raises(MediaError) as info:
        media.process_image(data, key="k", member="0.jpg")
    assert info.value.position is None


# --- normalisation table, uint8 transport --------------------------------------------------


def _hf_normalized(planes: np.ndarray, cfg: MediaConfig) -> np.ndarray:
    """transformers' own numpy rescale + normalise of uint8 ``[..., C, H, W]`` planes."""
    from transformers.image_transforms import normalize, rescale
    from transformers.image_utils import ChannelDimension

    first = ChannelDimension.FIRST
    flat = planes.reshape(-1, *planes.shape[-3:])
    out = [
        normalize(
            rescale(p, 1 / 255, input_data_format=first),
            cfg.image_mean,
            cfg.image_std,
            input_data_format=first,
        )
        for p in flat
    ]
    return np.stack(out).reshape(planes.shape)


def test_every_level_normalises_like_transformers() -> None:
    """All 256 levels of every channel, through process_image and normalize_pixels."""
    cfg = MediaConfig(min_pixels=16 * 28 * 28)
    levels = np.arange(256, dtype=np.uint8).reshape(16, 16)
    rgb = np.stack([levels, levels.T, 255 - levels], axis=-1).repeat(28, 0).repeat(28, 1)
    data = io.BytesIO()
    Image.fromarray(rgb).save(data, format="PNG")
    pixels, _ = media.process_image(data.getvalue(), cfg)
    raw, _ = media.process_image(data.getvalue(), replace(cfg, pixel_dtype="uint8"))
    assert raw.dtype == torch.uint8
    expected = _hf_normalized(raw.numpy().reshape(-1, 3, 2 * 14, 14), cfg).reshape(raw.shape)
    np.testing.assert_array_equal(pixels.numpy(), expected)
    assert len(np.unique(raw.numpy())) == 256
    np.testing.assert_array_equal(media.normalize_pixels(raw, cfg).numpy(), expected)


def test_a_slot_that_does_not_fit_the_decoded_patches_is_refused() -> None:
    """``out`` must hold exactly the decoded patches in the configured dtype; anything else is a
    MediaError naming the sample (a probe and a decode that disagree), not a silent reshape."""
    key, member, data = next(demo_media("image"))
    pixels, _ = media.process_image(data)
    rows, width = pixels.shape
    for wrong in (torch.empty(rows + 1, width), torch.empty(rows, width, dtype=torch.uint8)):
        with pytest.raises(MediaError, match="its slot holds") as info:
            media.process_image(data, key=key, member=member, out=wrong)
        assert (info.value.key, info.value.kind) == (key, "corrupt")
    out = torch.empty(rows, width)
    assert media.process_image(data, out=out)[0] is out
    assert torch.equal(out, pixels)


@pytest.mark.parametrize("kind", ["image", "video"])
def test_uint8_transport_normalises_to_the_float_path(kind: str) -> None:
    """uint8 patches + normalize_pixels == the float32 path, bit for bit, on real media."""
    floats, raws = MediaConfig(), MediaConfig(pixel_dtype="uint8")
    items = list(demo_media(kind))[:: 40 if kind == "image" else 8]
    assert len(items) >= 4
    for key, member, data in items:
        if kind == "image":
            expected, grid = media.process_image(data, floats)
            raw, raw_grid = media.process_image(data, raws)
        else:
            expected, grid, _ = media.process_video(data, floats)
            raw, raw_grid, _ = media.process_video(data, raws)
        assert raw.dtype == torch.uint8
        assert raw.nbytes * 4 == expected.nbytes
        assert torch.equal(grid, raw_grid)
        torch.testing.assert_close(media.normalize_pixels(raw, raws), expected, rtol=0, atol=0)
        halves = media.normalize_pixels(raw, raws, device="cpu", dtype=torch.bfloat16)
        assert torch.equal(halves, expected.to(torch.bfloat16)), f"{key}/{member}"


def grid_sized_clip() -> bytes:
    """448x252 frames (multiples of 28, inside the pixel bounds): no resize is needed."""
    out = io.BytesIO()
    rows, cols = np.mgrid[0:252, 0:448]
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 448, 252, "yuv444p"
        for index in range(8):
            rgb = np.stack([rows + index * 9, cols // 2, (rows + cols) // 3], axis=-1) % 256
            frame = av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


@pytest.mark.parametrize("clip", ["fixture", "grid-sized"])
def test_video_frames_normalise_like_transformers(clip: str) -> None:
    """Video frames: decord decode + PIL resize + transformers' numpy rescale/normalise.

    (transformers' video processor itself needs torchvision, which has no CPU build here.) A
    clip already at its grid size skips the resize, which must change nothing.
    """
    cfg = MediaConfig()
    if clip == "fixture":
        key, member, data = next(demo_media("video"))
    else:
        key, member, data = "grid", "0.mp4", grid_sized_clip()
        probe = media.probe_video(data, cfg)
        assert (probe.width, probe.height) == (448, 252)
        assert probe.grid_thw[1:] == (252 // 14, 448 // 14)
    pixels, grid, _ = media.process_video(data, cfg, key=key, member=member)
    probe = media.probe_video(data, cfg)
    reader = decord.VideoReader(io.BytesIO(data))
    indices = [i * probe.source_frames // probe.frames for i in range(probe.frames)]
    t, h, w = (int(v) for v in grid[0])
    size = (w * cfg.patch_size, h * cfg.patch_size)
    frames = np.stack(
        [
            np.asarray(Image.fromarray(f).resize(size, Image.Resampling.BICUBIC))
            for f in reader.get_batch(indices).asnumpy()
        ]
    ).transpose(0, 3, 1, 2)
    planes = _hf_normalized(frames, cfg)
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    patches = planes.reshape(t, tp, 3, h // m, m, p, w // m, m, p)
    expected = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, -1)
    np.testing.assert_array_equal(pixels.numpy(), expected)


def test_normalize_pixels_rejects_floats_and_other_configs() -> None:
    cfg = MediaConfig(pixel_dtype="uint8")
    with pytest.raises(ValueError, match=r"uint8 patches \[P, 1176\].*pixel_dtype='uint8'"):
        media.normalize_pixels(torch.zeros((4, 1176)), cfg)
    with pytest.raises(ValueError, match=r"\[P, 1176\].*\(4, 588\)"):
        media.normalize_pixels(torch.zeros((4, 588), dtype=torch.uint8), cfg)
    with pytest.raises(ValueError, match=r"pixel_dtype must be one of.*'float16'"):
        MediaConfig(pixel_dtype="float16")  # type: ignore[arg-type]
