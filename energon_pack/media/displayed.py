"""Images and videos as displayed, for families whose processor does its own resizing: the
upright size (and a video's frame count and rate) from the header, no pixel decoded, and the
upright RGB pixels (a video's sampled frames), decoded in the guarded helper process.

Upright means turned by the EXIF orientation as transformers' ``load_image`` (Pillow's
``exif_transpose``) turns it; RGB as transformers' ``convert_to_rgb`` makes it (transparency
composited onto white).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from energon_pack.media.config import DEFAULT_CONFIG, MediaConfig
from energon_pack.media.decode import (
    VideoHeader,
    decode_video_frames,
    displayed_size,
    exif_transpose_method,
    open_image,
    read_video_header,
    upright_rgb,
)
from energon_pack.media.errors import MediaError, MediaFailure, media_errors
from energon_pack.media.guard import (
    Alloc,
    FramesJob,
    UInt8Array,
    guarded_decode_each,
    guarded_read,
)

__all__ = [
    "VideoHeader",
    "displayed_image_size",
    "displayed_images",
    "displayed_video_header",
    "displayed_videos",
]


def displayed_image_size(
    data: bytes, config: MediaConfig | None = None, *, key: str = "?", member: str = "?"
) -> tuple[int, int]:
    """``(height, width)`` of the image as displayed, from its header."""
    cfg = config or DEFAULT_CONFIG
    with media_errors(key, member, "unreadable"), open_image(data, cfg) as img:
        width, height = displayed_size(img, exif_transpose_method(img))
    return height, width


def displayed_images(
    images: Sequence[tuple[str, str, bytes, tuple[int, int], int]],
    config: MediaConfig | None = None,
) -> list[UInt8Array]:
    """The upright RGB pixels (``[height, width, 3]`` uint8) of ``images``, each given as
    ``(key, member, data, (height, width) from its header, position)``, decoded one after the
    other in the helper process (unless ``decode_isolation="off"``) straight into shared
    memory, the next decoded while the last is copied out.

    Raises :class:`~energon_pack.media.MediaError` (with the image's ``position``) for the
    first image that cannot be decoded or decodes to another size than its header gave.
    """
    cfg = config or DEFAULT_CONFIG
    jobs = [
        FramesJob((data, cfg), key, member, nbytes=height * width * 3, position=position)
        for key, member, data, (height, width), position in images
    ]
    out: list[UInt8Array] = []

    def keep(index: int, pixels: UInt8Array, _: object) -> None:
        key, member, _, size, position = images[index]
        if tuple(pixels.shape[:2]) != size:
            raise MediaError(
                key,
                member,
                "corrupt",
                f"decoded to {pixels.shape[0]}x{pixels.shape[1]} but its header gave "
                f"{size[0]}x{size[1]}, which its tokens were counted for",
                position=position,
            )
        out.append(pixels.copy())

    guarded_decode_each(decode_displayed_into, jobs, cfg, use=keep)
    return out


def decode_displayed_into(data: bytes, cfg: MediaConfig, alloc: Alloc) -> tuple[UInt8Array, None]:
    """Upright RGB pixels of ``data``, written into ``alloc(shape)`` (runs in the decoder
    process)."""
    with open_image(data, cfg) as img:
        method = exif_transpose_method(img)
        try:
            pixels = np.asarray(upright_rgb(img, method), dtype=np.uint8)
        except (OSError, ValueError, SyntaxError) as exc:
            raise MediaFailure("corrupt", f"cannot decode image: {exc}") from exc
    if pixels.ndim != 3 or pixels.shape[2] != 3:
        raise MediaFailure("corrupt", f"decoded to shape {pixels.shape}, not [height, width, 3]")
    block = alloc(pixels.shape)
    block[...] = pixels
    return block, None


def displayed_video_header(
    data: bytes, config: MediaConfig | None = None, *, key: str = "?", member: str = "?"
) -> VideoHeader:
    """A video's frame count, rate and upright size, read in the helper process; a
    :class:`~energon_pack.media.MediaError` outside the config's limits."""
    return guarded_read(read_video_header, data, config or DEFAULT_CONFIG, key=key, member=member)


def displayed_videos(
    videos: Sequence[tuple[str, str, bytes, tuple[int, ...], tuple[int, int], int]],
    config: MediaConfig | None = None,
) -> list[UInt8Array]:
    """The sampled frames (``[T, height, width, 3]`` uint8) of ``videos``, each given as
    ``(key, member, data, frame indices, (height, width) from its header, position)``,
    decoded as :func:`displayed_images` decodes images.

    Raises :class:`~energon_pack.media.MediaError` (with the video's ``position``) for the
    first video whose frames cannot be decoded or decode to another size than its header gave.
    """
    cfg = config or DEFAULT_CONFIG
    jobs = [
        FramesJob(
            (data, indices, size, cfg),
            key,
            member,
            nbytes=len(indices) * size[0] * size[1] * 3,
            position=position,
        )
        for key, member, data, indices, size, position in videos
    ]
    out: list[UInt8Array] = []
    guarded_decode_each(
        decode_video_frames, jobs, cfg, use=lambda _, frames, __: out.append(frames.copy())
    )
    return out
