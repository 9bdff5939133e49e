"""``probe_audio``: the header of real WAV, FLAC, MP3, Ogg Opus and M4A files (written by FFmpeg
through PyAV) gives what FFmpeg decodes from them (sample rate, channels, frames), without
decoding; what it cannot read is a ``MediaError`` naming the sample, member and kind."""

from __future__ import annotations

import struct

import pytest
from audio_files import decoded, encode_audio

from energon_pack.media import MediaError
from energon_pack.media.audio import AudioProbe, probe_audio

GRID = [(16000, 1, 20800), (44100, 2, 88641), (8000, 1, 5000), (22050, 2, 30000)]
OPUS_GRID = [(16000, 1, 20800), (48000, 2, 48001), (8000, 1, 5000), (24000, 1, 12345)]


@pytest.mark.parametrize("kind", ["wav", "flac", "mp3"])
@pytest.mark.parametrize(("rate", "channels", "frames"), GRID)
def test_the_header_gives_what_ffmpeg_decodes(
    kind: str, rate: int, channels: int, frames: int
) -> None:
    data = encode_audio(kind, rate, channels, frames)
    assert probe_audio(data, "s1", f"a.{kind}") == AudioProbe(kind, rate, channels, frames)  # type: ignore[arg-type]
    assert decoded(data) == (rate, channels, frames)


@pytest.mark.parametrize(("rate", "channels", "frames"), OPUS_GRID)
def test_opus_plays_at_48_khz_without_its_pre_skip(rate: int, channels: int, frames: int) -> None:
    data = encode_audio("opus", rate, channels, frames)
    played = frames * 48000 // rate
    probe = probe_audio(data)
    assert (probe.format, probe.sample_rate, probe.channels, probe.frames) == (
        "opus",
        48000,
        channels,
        played,
    )
    assert probe.skip == 312  # libopus's pre-skip, which FFmpeg drops itself
    assert decoded(data) == (48000, channels, played)


@pytest.mark.parametrize(("rate", "channels", "frames"), GRID)
def test_an_mp3_without_a_frame_count_is_measured_frame_by_frame(
    rate: int, channels: int, frames: int
) -> None:
    data = encode_audio("mp3", rate, channels, frames, write_xing="0")
    probe = probe_audio(data)
    assert (probe.sample_rate, probe.channels) == (rate, channels)
    assert decoded(data) == (rate, channels, probe.frames)  # whole frames, no gapless tag
    assert frames <= probe.frames < frames + 3 * 1152


@pytest.mark.parametrize(("rate", "channels", "frames"), GRID)
def test_m4a_plays_its_edit_list(rate: int, channels: int, frames: int) -> None:
    """The edit list skips the AAC priming and keeps the input's length, to the movie time
    scale (milliseconds); FFmpeg decodes whole AAC frames past it."""
    data = encode_audio("m4a", rate, channels, frames)
    probe = probe_audio(data)
    assert (probe.format, probe.sample_rate, probe.channels) == ("m4a", rate, channels)
    assert abs(probe.frames - frames) <= rate // 1000
    got_rate, got_channels, got_frames = decoded(data)
    assert (got_rate, got_channels) == (rate, channels)
    assert probe.frames <= got_frames < probe.frames + 2 * 1024


def test_what_cannot_be_read_is_named_by_kind() -> None:
    wav = encode_audio("wav", 16000, 1, 1600)
    cases = {
        b"": "empty",
        b"not audio at all, just text": "unreadable",
        wav[:60]: "corrupt",  # the data chunk says more than the file holds
        wav[:4] + wav[4:8] + b"WAVE" + b"data" + struct.pack("<I", 4) + b"\0" * 4: "corrupt",
    }
    for data, kind in cases.items():
        with pytest.raises(MediaError) as caught:
            probe_audio(data, "s7", "speech.wav")
        assert caught.value.kind == kind, data[:20]
        assert caught.value.key == "s7"
        assert caught.value.member == "speech.wav"


def test_a_flac_without_its_length_and_an_ogg_of_another_codec_are_unsupported() -> None:
    flac = bytearray(encode_audio("flac", 16000, 1, 1600))
    at = flac.index(b"fLaC") + 4 + 4 + 10  # STREAMINFO's packed rate/channels/bits/total
    packed = int.from_bytes(flac[at : at + 8], "big") & ~((1 << 36) - 1)
    flac[at : at + 8] = packed.to_bytes(8, "big")
    with pytest.raises(MediaError, match=r"total samples 0.*\[unsupported\]"):
        probe_audio(bytes(flac))
    vorbis = b"\x01vorbis" + bytes(23)
    page = b"OggS\0\x02" + bytes(8) + struct.pack("<III", 1, 0, 0) + bytes([1, len(vorbis)])
    with pytest.raises(MediaError, match=r"Ogg stream of 'vorbis', not Opus.*\[unsupported\]"):
        probe_audio(page + vorbis)
