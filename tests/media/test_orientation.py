"""Media orientation: the probe sizes what the decode turns out, by the same rule.

Images follow transformers' ``load_image`` (Pillow's ``exif_transpose``, then the processor).
MP4 display matrices follow what decord 0.6.0 does with them, measured here on real files: it
turns frames by 90, 180 and 270 degrees (FFmpeg's ``rotate`` tag cut to an integer), so the
probe swaps the sample entry's size for 90 and 270. A file with two video tracks is refused.
"""

from __future__ import annotations

import io
import struct
from fractions import Fraction

import av
import decord
import numpy as np
import pytest
from PIL import Image, ImageOps

from energon_pack import media
from energon_pack.media import MediaConfig, MediaError
from energon_pack.media.config import Isolation

ISOLATIONS: tuple[Isolation, ...] = ("process", "off")
ONE = 1 << 16  # 1.0 in the 16.16 fixed point of an MP4 matrix
W = 1 << 30  # 1.0 in 2.30


def pattern(width: int, height: int) -> np.ndarray:
    """An RGB image that no flip or turn maps onto itself."""
    rows, cols = np.mgrid[0:height, 0:width]
    rgb = np.stack([rows * 255 // height, cols * 255 // width, (rows * 7 + cols * 3) % 256], -1)
    return rgb.astype(np.uint8)


def exif_image(orientation: int, fmt: str = "JPEG", size: tuple[int, int] = (130, 70)) -> bytes:
    """An image stored ``size`` (width, height) with EXIF Orientation ``orientation``."""
    img = Image.fromarray(pattern(*size))
    exif = img.getexif()
    exif[0x0112] = orientation
    out = io.BytesIO()
    img.save(out, format=fmt, exif=exif.tobytes(), quality=95)
    return out.getvalue()


def hf_reference(data: bytes, cfg: MediaConfig) -> dict[str, np.ndarray]:
    """transformers' pipeline: ``load_image`` on the opened file, then the Qwen2-VL processor."""
    from transformers.image_utils import load_image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    hf = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels)
    with Image.open(io.BytesIO(data)) as img:
        result: dict[str, np.ndarray] = hf(load_image(img), return_tensors="np")
    return result


# --- images: EXIF orientation -------------------------------------------------------------------


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_jpeg_matches_transformers_and_probe(orientation: int, isolation: Isolation) -> None:
    cfg = MediaConfig(decode_isolation=isolation)
    data = exif_image(orientation)
    probe = media.probe_image(data, cfg)
    pixels, grid = media.process_image(data, cfg, key="k", member="0.jpg")
    expected = hf_reference(data, cfg)
    swapped = orientation >= 5
    assert (probe.width, probe.height) == ((70, 130) if swapped else (130, 70))
    np.testing.assert_array_equal(grid.numpy(), expected["image_grid_thw"])
    np.testing.assert_array_equal(pixels.numpy(), expected["pixel_values"])
    assert tuple(grid[0].tolist()) == probe.grid_thw
    _, gh, gw = probe.grid_thw
    assert (gh < gw) != swapped  # a real swap, not a square grid


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_png_and_webp_match_transformers(orientation: int, fmt: str) -> None:
    cfg = MediaConfig(decode_isolation="off")
    data = exif_image(orientation, fmt)
    pixels, grid = media.process_image(data, cfg)
    expected = hf_reference(data, cfg)
    np.testing.assert_array_equal(grid.numpy(), expected["image_grid_thw"])
    np.testing.assert_array_equal(pixels.numpy(), expected["pixel_values"])
    assert tuple(grid[0].tolist()) == media.probe_image(data, cfg).grid_thw


def test_exif_orientation_is_read_from_the_header_only() -> None:
    """A truncated JPEG still probes upright: the tag comes from the header, not the pixels."""
    data = exif_image(6, size=(400, 200))
    probe = media.probe_image(data[: len(data) // 3])
    assert (probe.width, probe.height) == (200, 400)


def test_decoded_pil_images_are_turned_like_their_file() -> None:
    """``image_frames`` turns an opened image by its tag, and an already turned one not again."""
    from transformers.image_utils import load_image

    data = exif_image(8)
    upright = np.rot90(pattern(130, 70))  # orientation 8: ROTATE_90, counter-clockwise
    with Image.open(io.BytesIO(data)) as img:
        frames = media.image_frames(img)
        turned = media.image_frames(ImageOps.exif_transpose(img))
        expected = np.asarray(load_image(img))
    assert frames.shape == turned.shape == (1, 130, 70, 3)
    np.testing.assert_array_equal(frames.array()[0], expected)
    np.testing.assert_array_equal(turned.array(), frames.array())
    assert np.abs(frames.array()[0].astype(int) - upright).mean() < 8  # JPEG noise only


# --- videos: display matrix --------------------------------------------------------------------


def clip(
    width: int = 96, height: int = 64, frames: int = 8, fps: int = 4, rotation: int = 0
) -> bytes:
    """An MP4 of ``width`` x ``height`` frames, a white top-left corner, display matrix of a
    counter-clockwise ``rotation`` (PyAV's convention)."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        if rotation:
            stream.set_display_rotation(rotation)
        for index in range(frames):
            rgb = np.full((height, width, 3), index * 10, dtype=np.uint8)
            rgb[: height // 4, : width // 4] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return out.getvalue()


def with_matrix(data: bytes, box: bytes, matrix: tuple[int, ...]) -> bytes:
    """``data`` with the display matrix of its first ``mvhd`` or ``tkhd`` box replaced."""
    start = data.index(box) + 4  # the payload: version(1) flags(3) times ...
    times = {b"mvhd": 16, b"tkhd": 20}[box] + (12 if data[start] == 1 else 0)
    at = start + 4 + times + 16
    return data[:at] + struct.pack(">9i", *matrix) + data[at + 36 :]


def turn(b: int, a: int = 0) -> tuple[int, ...]:
    """The matrix ``[a b 0; -b a 0; 0 0 1]`` (``b=ONE``: decord turns frames clockwise)."""
    return (a, b, 0, -b, a, 0, 0, 0, W)


def decord_frame(data: bytes) -> np.ndarray:
    """What decord itself decodes first (the reference the probe must agree with)."""
    frame: np.ndarray = decord.VideoReader(io.BytesIO(data))[0].asnumpy()
    return frame


def white_corner(frame: np.ndarray) -> str:
    corners = {"TL": frame[0, 0], "TR": frame[0, -1], "BL": frame[-1, 0], "BR": frame[-1, -1]}
    [name] = [name for name, rgb in corners.items() if rgb.min() > 200]
    return name


def assert_probe_equals_decode(data: bytes, isolation: Isolation) -> tuple[int, int]:
    cfg = MediaConfig(decode_isolation=isolation)
    probe = media.probe_video(data, cfg, key="k", member="0.mp4")
    height, width, _ = decord_frame(data).shape
    assert (probe.width, probe.height) == (width, height)
    pixels, grid, _ = media.process_video(data, cfg, key="k", member="0.mp4")
    assert tuple(grid[0].tolist()) == probe.grid_thw
    assert pixels.shape[0] == np.prod(probe.grid_thw)
    return width, height


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize(
    ("rotation", "size", "corner"),
    [(0, (96, 64), "TL"), (-90, (64, 96), "TR"), (90, (64, 96), "BL"), (180, (96, 64), "BR")],
)
def test_rotated_mp4_probe_equals_decode(
    rotation: int, size: tuple[int, int], corner: str, isolation: Isolation
) -> None:
    """Measured: decord turns frames upright by the display matrix; the probe swaps to match."""
    data = clip(rotation=rotation)
    assert white_corner(decord_frame(data)) == corner
    assert assert_probe_equals_decode(data, isolation) == size


@pytest.mark.parametrize(
    ("name", "matrices", "size"),
    [
        # FFmpeg's rotate tag 89.9991 ("%g") is cut to 89: not turned; 90.0009 -> 90: turned.
        ("89.9991", {b"tkhd": turn(ONE, 1)}, (96, 64)),
        ("90.0009", {b"tkhd": turn(ONE, -1)}, (64, 96)),
        ("89.99999997 prints as 90", {b"tkhd": turn(2**31 - 1, 1)}, (64, 96)),
        ("45", {b"tkhd": turn(46341, 46341)}, (96, 64)),
        ("mirror = 180", {b"tkhd": (-ONE, 0, 0, 0, ONE, 0, 0, 0, W)}, (96, 64)),
        ("transpose = 90", {b"tkhd": (0, ONE, 0, ONE, 0, 0, 0, 0, W)}, (64, 96)),
        ("movie matrix", {b"mvhd": turn(ONE)}, (64, 96)),
        ("movie undoes track", {b"mvhd": turn(ONE), b"tkhd": turn(-ONE)}, (96, 64)),
        ("zero matrix", {b"tkhd": (0,) * 9}, (96, 64)),
    ],
)
def test_display_matrix_rule_follows_decord(
    name: str, matrices: dict[bytes, tuple[int, ...]], size: tuple[int, int]
) -> None:
    data = clip()
    for box, matrix in matrices.items():
        data = with_matrix(data, box, matrix)
    assert assert_probe_equals_decode(data, "off") == size, name


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_frames_of_another_size_than_probed_are_corrupt(isolation: Isolation) -> None:
    """A sample entry claiming 112x64 for 96x64 frames: an error, never a stretch."""
    data = clip()
    entry = data.index(b"stsd") + 4 + 8  # the first sample entry
    data = data[: entry + 32] + struct.pack(">H", 112) + data[entry + 34 :]
    cfg = MediaConfig(decode_isolation=isolation)
    assert media.probe_video(data, cfg).width == 112
    with pytest.raises(MediaError, match="decoded frames are 96x64") as info:
        media.process_video(data, cfg, key="k", member="0.mp4")
    assert (info.value.key, info.value.member, info.value.kind) == ("k", "0.mp4", "corrupt")


# --- videos: two video tracks ------------------------------------------------------------------


def two_tracks(first: tuple[int, int], second: tuple[int, int], fps: tuple[int, int]) -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        streams = []
        for (width, height), rate in zip((first, second), fps, strict=True):
            stream = container.add_stream("libx264", rate=rate)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            streams.append(stream)
        for index in range(8):
            for stream in streams:
                rgb = np.full((stream.height, stream.width, 3), index * 20, dtype=np.uint8)
                container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        for stream in streams:
            container.mux(stream.encode())
    return out.getvalue()


def test_decord_picks_neither_the_first_nor_the_largest_video_track() -> None:
    """Measured: FFmpeg's choice (by bitrate) decides, which the header does not tell."""
    small, large = (96, 64), (160, 128)
    assert decord_frame(two_tracks(small, large, (4, 4))).shape[:2] == (128, 160)
    assert decord_frame(two_tracks(large, small, (4, 4))).shape[:2] == (128, 160)
    assert decord_frame(two_tracks(small, large, (4, 8))).shape[:2] == (64, 96)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_two_video_tracks_are_unsupported(isolation: Isolation) -> None:
    data = two_tracks((96, 64), (160, 128), (4, 4))
    cfg = MediaConfig(decode_isolation=isolation)
    for run in (media.probe_video, media.process_video):
        with pytest.raises(MediaError, match="2 video tracks") as info:
            run(data, cfg, key="k", member="0.mp4")
        assert (info.value.key, info.value.kind) == ("k", "unsupported")
