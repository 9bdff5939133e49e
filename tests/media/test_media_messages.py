"""A bad medium's error names its sample and member, never a Python object (``<_io.BytesIO
object at 0x...>``), and what decord and FFmpeg print while they fail (``moov atom not found``)
is in that error, not on the terminal; with the decoder in a helper process and without."""

from __future__ import annotations

import pytest

from energon_pack.media import MediaConfig, MediaError, probe_image, probe_video

NOT_AN_MP4 = b"\x00\x00\x00\x18ftypmp42" + b"x" * 100
"""An MP4 file type box and no movie box: FFmpeg's ``moov atom not found``."""


@pytest.mark.parametrize("isolation", ["process", "off"])
def test_an_unreadable_image_is_named_by_its_sample_not_a_bytesio(isolation: str) -> None:
    config = MediaConfig(decode_isolation=isolation)  # type: ignore[arg-type]
    with pytest.raises(MediaError) as caught:
        probe_image(b"not an image", config, key="shard-0/42", member="photo.jpg")
    message = str(caught.value)
    assert "BytesIO" not in message, message
    assert " at 0x" not in message, message
    assert message.startswith("sample 'shard-0/42', member 'photo.jpg': not a readable image")
    assert "none of JPEG, PNG" in message


@pytest.mark.parametrize("isolation", ["process", "off"])
def test_the_decoder_s_own_output_goes_into_the_error(
    isolation: str, capfd: pytest.CaptureFixture[str]
) -> None:
    config = MediaConfig(decode_isolation=isolation)  # type: ignore[arg-type]
    with pytest.raises(MediaError) as caught:
        probe_video(NOT_AN_MP4, config, key="shard-0/7", member="clip.mp4")
    message = str(caught.value)
    assert message.startswith("sample 'shard-0/7', member 'clip.mp4': not a readable video")
    assert "moov atom not found" in message
    assert " @ 0x" not in message, "FFmpeg's prefix (a pointer) is left out"
    err = capfd.readouterr().err
    assert "moov atom" not in err, err
    assert "ERROR opening" not in err, err
