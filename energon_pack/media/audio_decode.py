"""Decoding audio after selection: :func:`decode_audio` probes the header
(:func:`~energon_pack.media.audio.probe_audio`), decodes at the stream's own rate with decord's
``AudioReader`` (FFmpeg) in the guarded decoder process, keeps exactly the frames the header
says the stream plays (an Opus pre-skip dropped), and resamples them with :func:`resample`, a
windowed-sinc filter centred on each output frame, so the waveform neither lags nor leads and
its length is known before decoding. A decoder that yields fewer frames has met a lying or cut
header: a ``corrupt`` :class:`~energon_pack.media.MediaError`. No torch here.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import decord
import numpy as np
import numpy.typing as npt

from energon_pack.media.audio import AudioProbe, probe_audio
from energon_pack.media.config import DEFAULT_CONFIG, MediaConfig
from energon_pack.media.decode import _native_messages, _said
from energon_pack.media.errors import MediaFailure, naming
from energon_pack.media.guard import guarded

__all__ = [
    "Waveform",
    "audio_probe",
    "audio_samples",
    "decode_audio",
    "played_frames",
    "resample",
    "resampled_length",
]

MAX_WAVEFORM_RATE = 768_000
"""The highest sample rate a :class:`Waveform` may state (as for a file's header)."""


@dataclass(frozen=True)
class Waveform:
    """Decoded mono audio a dataset holds (a ``datasets`` ``Audio`` column's ``{"array",
    "sampling_rate"}``): float32 samples as raw bytes at ``sample_rate``. Kept as bytes until a
    pack is chosen, like a compressed member; its probe is its length."""

    data: bytes
    sample_rate: int

    @classmethod
    def from_array(
        cls, array: Any, sample_rate: Any, *, key: str = "?", member: str = "audio"
    ) -> Waveform:
        """From a 1-D array of samples (or ``[1, N]`` / ``[N, 1]``) at ``sample_rate``; a
        ``bad_sample`` :class:`~energon_pack.media.MediaError` names ``key`` and ``member`` for
        more channels, no samples, values that are not finite or a rate out of range."""
        with naming(key, member):
            if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)):
                raise MediaFailure(
                    "bad_sample", f"sampling_rate must be an int, not {sample_rate!r}"
                )
            if not 1 <= int(sample_rate) <= MAX_WAVEFORM_RATE:
                raise MediaFailure(
                    "bad_sample",
                    f"sampling_rate {int(sample_rate)} is outside 1..{MAX_WAVEFORM_RATE}",
                )
            try:
                samples = np.asarray(array, dtype=np.float32)
            except (TypeError, ValueError) as error:
                raise MediaFailure("bad_sample", f"audio array is not numbers: {error}") from None
            if samples.ndim == 2 and 1 in samples.shape:
                samples = samples.reshape(-1)
            if samples.ndim != 1 or samples.size == 0:
                raise MediaFailure(
                    "bad_sample",
                    f"audio array of shape {list(samples.shape)}: give mono samples, one "
                    "dimension (datasets' Audio(mono=True) decodes so)",
                )
            if not np.isfinite(samples).all():
                raise MediaFailure("bad_sample", "audio array holds NaN or infinite samples")
        return cls(np.ascontiguousarray(samples).tobytes(), int(sample_rate))

    @property
    def frames(self) -> int:
        return len(self.data) // 4

    def array(self) -> npt.NDArray[np.float32]:
        """The samples, a read-only float32 view of :attr:`data`."""
        return np.frombuffer(self.data, dtype=np.float32)


def audio_probe(payload: bytes | Waveform, key: str = "?", member: str = "audio") -> AudioProbe:
    """The probe of an audio payload: a file's header, or a :class:`Waveform`'s length."""
    if isinstance(payload, Waveform):
        return AudioProbe("array", payload.sample_rate, 1, payload.frames)
    return probe_audio(payload, key, member)


def audio_samples(
    payload: bytes | Waveform,
    sample_rate: int,
    *,
    key: str = "?",
    member: str = "audio",
    config: MediaConfig | None = None,
) -> npt.NDArray[np.float32]:
    """Mono float32 samples of ``payload`` at ``sample_rate``: a file through
    :func:`decode_audio`, a :class:`Waveform` resampled; :func:`played_frames` of its probe
    long either way."""
    if isinstance(payload, Waveform):
        return resample(payload.array(), payload.sample_rate, sample_rate)
    return decode_audio(payload, sample_rate=sample_rate, key=key, member=member, config=config)[0]


def played_frames(probe: AudioProbe, sample_rate: int) -> int:
    """Frames of ``probe``'s stream resampled to ``sample_rate``, rounded half up: the length
    :func:`decode_audio` gives."""
    return resampled_length(probe.frames, probe.sample_rate, sample_rate)


def resampled_length(frames: int, source_rate: int, rate: int) -> int:
    """``frames`` at ``source_rate`` counted at ``rate``, rounded half up."""
    return (2 * frames * rate + source_rate) // (2 * source_rate)


def decode_audio(
    data: bytes,
    *,
    sample_rate: int = 16_000,
    key: str = "?",
    member: str = "audio",
    config: MediaConfig | None = None,
) -> tuple[npt.NDArray[np.float32], AudioProbe]:
    """``(waveform, probe)``: ``data`` decoded to mono float32 at ``sample_rate`` (the mean of
    a stereo pair; more channels are ``unsupported``), exactly :func:`played_frames` long, and
    its header's probe. Runs in the guarded decoder process of ``config``
    (``decode_isolation``, ``decode_timeout_s``); any failure is a
    :class:`~energon_pack.media.MediaError` naming ``key`` and ``member``."""
    cfg = config or DEFAULT_CONFIG
    probe = probe_audio(data, key, member)
    if probe.channels > 2:
        with naming(key, member):
            raise MediaFailure(
                "unsupported",
                f"{probe.format} audio with {probe.channels} channels: decoding takes mono or "
                "stereo; mix it down first (ffmpeg -ac 1)",
            )
    waveform: npt.NDArray[np.float32] = guarded(
        _decoded,
        data,
        key=key,
        member=member,
        kind="corrupt",
        isolation=cfg.decode_isolation,
        timeout_s=cfg.decode_timeout_s,
    )
    got = len(waveform) - probe.skip
    with naming(key, member):
        if got < probe.frames:
            raise MediaFailure(
                "corrupt",
                f"the {probe.format} header says {probe.frames} frames at {probe.sample_rate} "
                f"Hz but the decoder yields {max(0, got)} (a cut file or a lying header)",
            )
    played = waveform[probe.skip : probe.skip + probe.frames]
    if probe.channels == 2:  # FFmpeg's downmix to the channels' mean
        played = played * np.float32(math.sqrt(0.5))
    return resample(played, probe.sample_rate, sample_rate), probe


_HALF_WIDTH = 24
"""Zero crossings of the sinc on each side of an output frame (at the lower of the rates)."""
_CUTOFF = 0.94
"""The pass band, as a share of the lower rate's Nyquist frequency."""
_KAISER_BETA = 8.0
_CHUNK = 1 << 14
"""Output frames filtered at once (bounds the gathered taps' memory)."""


def resample(
    samples: npt.NDArray[np.float32], source_rate: int, rate: int
) -> npt.NDArray[np.float32]:
    """``samples`` at ``source_rate`` as :func:`resampled_length` frames at ``rate``: each output
    frame is the Kaiser-windowed sinc interpolation of the input around the same instant (no
    delay), low-passed below the lower rate's Nyquist frequency, each phase's taps summing to 1
    (a constant stays constant)."""
    if source_rate == rate:
        return np.ascontiguousarray(samples, dtype=np.float32)
    step = math.gcd(source_rate, rate)
    up, down = rate // step, source_rate // step
    scale = min(1.0, rate / source_rate)  # < 1 when downsampling: a wider, lower filter
    half = math.ceil(_HALF_WIDTH / scale)
    offsets = np.arange(-half + 1, half + 1)
    phases = np.arange(up) * down % up / up  # fraction of an input frame past the floor
    distance = phases[:, None] - offsets[None, :]
    window = np.i0(_KAISER_BETA * np.sqrt(np.clip(1 - (distance / half) ** 2, 0, 1)))
    taps = np.sinc(_CUTOFF * scale * distance) * window
    taps = (taps / taps.sum(axis=1, keepdims=True)).astype(np.float32)
    padded = np.pad(samples.astype(np.float32), half)
    length = resampled_length(len(samples), source_rate, rate)
    out = np.empty(length, dtype=np.float32)
    for first in range(0, length, _CHUNK):
        frames = np.arange(first, min(first + _CHUNK, length))
        base = frames * down // up + half  # the input frame at or before each output instant
        gathered = padded[np.clip(base[:, None] + offsets[None, :], 0, len(padded) - 1)]
        out[frames] = np.einsum("ij,ij->i", gathered, taps[frames % up])
    return out


def _decoded(data: bytes) -> npt.NDArray[np.float32]:
    """Every frame decord decodes from ``data``, at the stream's own rate, mono: FFmpeg's
    downmix, ``(left + right) / sqrt(2)`` for a stereo pair (:func:`decode_audio` scales it to
    the channels' mean)."""
    native: list[str] = []
    try:
        with _native_messages(native):
            reader: Any = decord.AudioReader(io.BytesIO(data), sample_rate=-1, mono=True)
            samples = reader[:].asnumpy()
    except MemoryError:
        raise
    except Exception as exc:  # decord raises DECORDError / RuntimeError / AssertionError
        raise MediaFailure("corrupt", f"audio that does not decode: {exc}{_said(native)}") from exc
    return np.ascontiguousarray(samples.reshape(-1), dtype=np.float32)
