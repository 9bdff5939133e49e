"""Decoding audio after selection: :func:`decode_audio` probes the header
(:func:`~energon_pack.media.audio.probe_audio`), decodes at the stream's own rate with FFmpeg
(PyAV, the ``audio`` extra) in the guarded decoder process, keeps exactly the frames the header
says the stream plays (FFmpeg's decoders trim an MP3's delay, an M4A's priming and an Opus
pre-skip), mixes the channels to their mean, and resamples with :func:`resample`, a
windowed-sinc filter centred on each output frame, so the waveform neither lags nor leads and
its length is known before decoding. A decoder that yields fewer frames has met a lying or cut
header: a ``corrupt`` :class:`~energon_pack.media.MediaError`. No torch here.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from energon_pack.media.audio import AudioProbe, probe_audio
from energon_pack.media.config import DEFAULT_CONFIG, MediaConfig
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
    its channels, as ``librosa.load(mono=True)`` and ``datasets``' ``Audio(mono=True)`` mix
    them), exactly :func:`played_frames` long, and its header's probe. Runs in the guarded
    decoder process of ``config`` (``decode_isolation``, ``decode_timeout_s``); any failure is
    a :class:`~energon_pack.media.MediaError` naming ``key`` and ``member``."""
    cfg = config or DEFAULT_CONFIG
    probe = probe_audio(data, key, member)
    waveform: npt.NDArray[np.float32] = guarded(
        _played,
        data,
        probe,
        sample_rate,
        key=key,
        member=member,
        kind="corrupt",
        isolation=cfg.decode_isolation,
        timeout_s=cfg.decode_timeout_s,
    )
    return waveform, probe


def _played(data: bytes, probe: AudioProbe, sample_rate: int) -> npt.NDArray[np.float32]:
    """The frames of ``data`` its header ``probe`` says it plays, at ``sample_rate`` (runs in
    the decoder process, so that only the resampled waveform comes back)."""
    waveform = _decoded(data)
    if len(waveform) < probe.frames:
        raise MediaFailure(
            "corrupt",
            f"the {probe.format} header says {probe.frames} frames at {probe.sample_rate} Hz "
            f"but the decoder yields {len(waveform)} (a cut file or a lying header)",
        )
    return resample(waveform[: probe.frames], probe.sample_rate, sample_rate)


_HALF_WIDTH = 24
"""Zero crossings of the sinc on each side of an output frame (at the lower of the rates)."""
_CUTOFF = 0.94
"""The pass band, as a share of the lower rate's Nyquist frequency."""
_KAISER_BETA = 8.0
_PER_PHASE = 32
"""Output frames per filter phase from which the phases are filtered one at a time."""
_CHUNK = 1 << 14
"""Output frames gathered at once otherwise (bounds the gathered taps' memory)."""


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
    length = resampled_length(len(samples), source_rate, rate)
    # output frame k reads the input from k * down // up - half + 1 on, through 2 * half taps
    padded = np.pad(samples.astype(np.float32), (half, half + down + 1))
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half)
    out = np.empty(length, dtype=np.float32)
    if length >= _PER_PHASE * up:  # frames phase, phase + up, ...: every down-th window
        for phase in range(up):
            first = phase * down // up + 1
            count = len(range(phase, length, up))
            out[phase::up] = windows[first : first + count * down : down] @ taps[phase]
        return out
    for start in range(0, length, _CHUNK):  # few frames per phase: gather each frame's taps
        frames = np.arange(start, min(start + _CHUNK, length))
        chosen = windows[frames * down // up + 1]
        out[frames] = np.einsum("ij,ij->i", chosen, taps[frames % up])
    return out


def _decoded(data: bytes) -> npt.NDArray[np.float32]:
    """Every frame FFmpeg (PyAV) decodes from ``data``'s first audio stream, at the stream's
    own rate, as the mean of its channels (integer samples scaled to [-1, 1)); decoding stops
    at a damaged packet after the first frame (the caller checks the length against the
    header)."""
    try:
        import av
    except ImportError:
        raise MediaFailure(
            "unsupported", "decoding audio needs PyAV: pip install 'energon_pack[audio]'"
        ) from None
    chunks: list[npt.NDArray[Any]] = []
    layouts: set[tuple[str, int]] = set()
    try:
        with av.open(io.BytesIO(data), metadata_errors="ignore", options=_OPEN) as container:
            if not container.streams.audio:
                raise MediaFailure("corrupt", "the file holds no audio stream")
            frames = container.decode(container.streams.audio[0])
            while True:
                try:
                    frame = next(frames)
                except StopIteration:
                    break
                except Exception:  # a damaged packet: what decoded before it is the audio
                    if not chunks:
                        raise
                    break
                layouts.add((frame.format.name, len(frame.layout.channels)))
                chunks.append(frame.to_ndarray())
    except av.error.FFmpegError as exc:  # FFmpeg's own ENOMEM too: a size no file can have
        raise MediaFailure("corrupt", f"audio that does not decode: {exc}") from exc
    except (MemoryError, MediaFailure):
        raise
    except Exception as exc:  # the other errors of a damaged stream
        raise MediaFailure("corrupt", f"audio that does not decode: {exc}") from exc
    if not chunks:
        return np.zeros(0, dtype=np.float32)
    if len(layouts) > 1:
        raise MediaFailure("corrupt", f"the audio's sample layout changes: {sorted(layouts)}")
    ((name, channels),) = layouts
    return _mono(np.concatenate(chunks, axis=1), name, channels)


_OPEN = {"probesize": "32768"}
"""FFmpeg's container options: the stream's settings are read from the first 32 KiB. FFmpeg's
default (5 MB) has the WAV reader scan through the whole file before decoding it (23 ms against
2 ms for 8 s at 44.1 kHz stereo, the same samples); FLAC, MP3 and M4A read the same either way."""

_SCALES = {
    "u8": (128.0, 128.0),
    "s16": (0.0, 32768.0),
    "s32": (0.0, 2.0**31),
    "s64": (0.0, 2.0**63),
}
"""Offset and full scale of each integer sample format (FFmpeg's conversion to float); float
samples are kept as they are."""
_WIDE = frozenset({"s32", "s64", "dbl"})
"""Sample formats summed in float64 (float32 would round their values)."""


def _mono(values: npt.NDArray[Any], sample_format: str, channels: int) -> npt.NDArray[np.float32]:
    """The channels' mean of decoded samples (``[channels, frames]`` of a planar
    ``sample_format``, else one plane of interleaved samples), float32 in [-1, 1)."""
    base = sample_format.removesuffix("p")
    wide = np.float64 if base in _WIDE else np.float32
    planes = values if sample_format.endswith("p") else values.reshape(-1, channels).T
    mixed = np.full(channels, 1.0 / channels, dtype=wide) @ planes.astype(wide)
    offset, scale = _SCALES.get(base, (0.0, 1.0))
    mono: npt.NDArray[np.float32] = ((mixed - offset) / scale).astype(np.float32)
    return mono
