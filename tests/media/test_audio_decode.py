"""``decode_audio``: real WAV, FLAC, MP3, Ogg Opus and M4A files (written by FFmpeg through
PyAV) decode to mono float32 at 16 kHz, exactly as long as their header says
(``played_frames``), neither lagging nor leading the signal they were made from; a cut file is
a ``corrupt`` ``MediaError`` naming the member. ``resample`` keeps a constant and a tone."""

from __future__ import annotations

import io
import sys
import wave

import numpy as np
import pytest
from audio_files import encode_audio
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack.media import MediaConfig, MediaError
from energon_pack.media.audio_decode import decode_audio, played_frames, resample

RATES = {"wav": (8000, 22050, 44100, 48000), "flac": (16000, 44100), "mp3": (16000, 44100)}
RATES |= {"opus": (8000, 16000, 48000), "m4a": (16000, 44100)}
LOSSLESS = ("wav", "flac")


def ideal(source_rate: int, frames: int, rate: int = 16000) -> np.ndarray:
    """The sweep ``audio_files.signal`` writes, at ``rate`` over the same seconds."""
    t = np.arange(round(frames * rate / source_rate)) / rate
    top, seconds = min(source_rate / 3, 6000.0), (frames - 1) / source_rate
    phase = 2 * np.pi * 200 * seconds / np.log(top / 200) * ((top / 200) ** (t / seconds) - 1)
    return 0.3 * np.sin(phase)


def correlation(a: np.ndarray, b: np.ndarray, lag: int) -> float:
    a, b = a[300:-300], np.roll(b, lag)[300:-300]
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize(("kind", "rate"), [(k, r) for k, rates in RATES.items() for r in rates])
def test_a_file_decodes_as_long_as_its_header_says_and_in_time(kind: str, rate: int) -> None:
    frames = rate * 2 + 17
    waveform, probe = decode_audio(encode_audio(kind, rate, 2, frames, sweep=True), key="s")
    assert waveform.dtype == np.float32
    assert len(waveform) == played_frames(probe, 16000)
    want = ideal(rate, frames)
    if kind == "m4a":  # its edit list keeps the length to a millisecond
        assert abs(len(waveform) - len(want)) <= 16
        want = want[: len(waveform)]
    else:
        assert len(waveform) == len(want)
    if kind in LOSSLESS:
        assert np.abs(waveform - want)[300:-300].max() < 2e-3
    at_zero = correlation(want, waveform, 0)
    assert at_zero > 0.99
    assert all(correlation(want, waveform, lag) < at_zero for lag in (-16, -2, -1, 1, 2, 16))


def test_a_cut_file_is_corrupt_and_named() -> None:
    data = encode_audio("flac", 16000, 1, 32000)
    with pytest.raises(MediaError, match=r"header says 32000 frames .* decoder yields") as caught:
        decode_audio(data[: len(data) // 2], key="s3", member="talk.flac")
    assert (caught.value.kind, caught.value.key, caught.value.member) == (
        "corrupt",
        "s3",
        "talk.flac",
    )


def test_decoding_in_this_process_gives_the_helpers_waveform() -> None:
    data = encode_audio("opus", 48000, 1, 30000)
    guarded, _ = decode_audio(data)
    direct, _ = decode_audio(data, config=MediaConfig(decode_isolation="off"))
    assert np.array_equal(guarded, direct)


@settings(max_examples=40, deadline=None)
@given(
    source=st.sampled_from([8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000]),
    rate=st.sampled_from([8000, 16000, 24000]),
    frames=st.integers(1, 3000),
    level=st.floats(-1, 1),
)
def test_resampling_keeps_a_constant_and_rounds_the_length(
    source: int, rate: int, frames: int, level: float
) -> None:
    out = resample(np.full(frames, level, np.float32), source, rate)
    assert len(out) == (2 * frames * rate + source) // (2 * source)
    margin = 24 * max(1, -(-rate // source)) + 2  # the filter's reach past both ends
    inner = out[margin:-margin]
    assert np.allclose(inner, level, atol=1e-5)


def test_resampling_keeps_a_tone_below_the_lower_nyquist_frequency() -> None:
    t = np.arange(44100) / 44100
    out = resample(np.sin(2 * np.pi * 1000 * t).astype(np.float32), 44100, 16000)
    want = np.sin(2 * np.pi * 1000 * np.arange(16000) / 16000)
    assert np.abs(out - want)[100:-100].max() < 1e-3
    high = resample(np.sin(2 * np.pi * 10000 * t).astype(np.float32), 44100, 16000)
    assert np.abs(high)[100:-100].max() < 0.02  # above 8 kHz: filtered out, not aliased


def wav_of(channels: np.ndarray, rate: int = 16000) -> bytes:
    """A 16-bit WAV of ``channels`` (``[channels, frames]``, within -1..1)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(len(channels))
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes((channels.T * 32767).round().astype("<i2").tobytes())
    return out.getvalue()


def test_the_channels_become_their_mean() -> None:
    frames = np.arange(8000)
    left, right = 0.3 * np.sin(frames * 0.05), 0.2 * np.cos(frames * 0.13)
    waveform, _ = decode_audio(wav_of(np.stack([left, right])))
    assert np.abs(waveform - (left + right) / 2).max() < 1e-4
    third = 0.25 * np.sin(frames * 0.011)
    waveform, probe = decode_audio(wav_of(np.stack([left, right, third])))
    assert probe.channels == 3
    assert np.abs(waveform - (left + right + third) / 3).max() < 1e-4


def test_without_pyav_an_audio_is_unsupported_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``audio`` extra missing: import of ``av`` fails, the sample is named, not lost."""
    monkeypatch.setitem(sys.modules, "av", None)
    data = encode_audio("wav", 16000, 1, 1600)
    with pytest.raises(MediaError, match=r"energon_pack\[audio\]") as caught:
        decode_audio(data, key="s", member="a.wav", config=MediaConfig(decode_isolation="off"))
    assert (caught.value.kind, caught.value.key) == ("unsupported", "s")
