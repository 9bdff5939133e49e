"""Seeded mutations of PNG, JPEG and WebP images through the processor families' media path
(the header's displayed size, then the upright decode in the guarded helper process): every
file gives its pixels or a :class:`~energon_pack.media.MediaError` naming it, never another
exception or a dead process, and a decode that disagrees with its header is refused."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
from family_kit import test_images as make_images
from PIL import Image

from energon_pack.media import MediaConfig, MediaError
from energon_pack.media.displayed import displayed_image_size, displayed_images

FORMATS = ("PNG", "JPEG", "WEBP")
PER_FORMAT = 300


def seed(fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(make_images(7, [(48, 64)])[0]).save(buffer, format=fmt)
    return buffer.getvalue()


def mutated(data: bytes, fmt: str, index: int) -> bytes:
    """File ``index``'s mutation of ``data``, from its own generator: bytes flipped, a cut,
    header bytes overwritten, or a run of bytes duplicated."""
    rng = np.random.default_rng([FORMATS.index(fmt), index])
    out = bytearray(data)
    kind = index % 4
    if kind == 0:
        for at in rng.integers(0, len(out), rng.integers(1, 12)):
            out[at] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:
        out = out[: int(rng.integers(1, len(out)))]
    elif kind == 2:
        at = int(rng.integers(0, min(64, len(out))))
        out[at : at + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
    else:
        at, length = int(rng.integers(0, len(out))), int(rng.integers(1, 64))
        out[at:at] = out[at : at + length]
    return bytes(out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mutated_images_give_pixels_or_a_named_media_error(fmt: str) -> None:
    config = MediaConfig()
    outcomes: Counter[str] = Counter()
    for index in range(PER_FORMAT):
        data, member = mutated(seed(fmt), fmt, index), f"{index}.{fmt.lower()}"
        try:
            size = displayed_image_size(data, config, key="fuzz", member=member)
            (pixels,) = displayed_images([("fuzz", member, data, size, 0)], config)
        except MediaError as error:
            named = (error.key, error.member)
            outcomes[error.kind if named == ("fuzz", member) else f"unnamed {named}"] += 1
            continue
        assert pixels.shape == (*size, 3)
        outcomes["ok"] += 1
    assert sum(outcomes.values()) == PER_FORMAT
    assert outcomes["ok"] > 0  # flipped bytes in pixel data still decode
    assert len(outcomes) > 1, outcomes
    assert not [kind for kind in outcomes if kind.startswith("unnamed")], outcomes


@pytest.mark.parametrize(
    ("claimed", "message"),
    [((64, 64), "header gave 64x64"), ((40, 64), "the probe and the decode disagree")],
)
def test_a_decode_of_another_size_than_its_header_is_refused(
    claimed: tuple[int, int], message: str
) -> None:
    """The image is 48x64: a header size it does not fill, or one it overflows."""
    with pytest.raises(MediaError, match=message) as caught:
        displayed_images([("k", "0.png", seed("PNG"), claimed, 3)], MediaConfig())
    assert caught.value.position == 3
