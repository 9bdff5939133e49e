"""Real audio files for the tests, encoded by FFmpeg through PyAV (a 440 Hz tone), and what
FFmpeg decodes from them."""

from __future__ import annotations

import io
from typing import Any

import av
import numpy as np

FORMATS: dict[str, tuple[str, str]] = {
    "wav": ("wav", "pcm_s16le"),
    "flac": ("flac", "flac"),
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "m4a": ("ipod", "aac"),
}
"""Each probed format: the PyAV container and encoder that write it."""


def signal(rate: int, frames: int, sweep: bool = False) -> np.ndarray:
    """A 440 Hz tone, or (``sweep``) a sweep from 200 Hz up to 6 kHz (a third of ``rate`` at
    most), whose every stretch is unlike any other (so that two decodes can be aligned)."""
    t = np.arange(frames) / rate
    if not sweep:
        return (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    top, seconds = min(rate / 3, 6000.0), max(t[-1], 1e-3)
    phase = 2 * np.pi * 200 * seconds / np.log(top / 200) * ((top / 200) ** (t / seconds) - 1)
    return (0.3 * np.sin(phase)).astype(np.float32)


def encode_audio(
    kind: str, rate: int, channels: int, frames: int, sweep: bool = False, **container_options: str
) -> bytes:
    """``frames`` frames of :func:`signal` at ``rate`` with ``channels`` channels, as a
    ``kind`` file (a key of :data:`FORMATS`)."""
    container, codec = FORMATS[kind]
    out_buffer = io.BytesIO()
    layout = "mono" if channels == 1 else "stereo"
    with av.open(out_buffer, "w", format=container, options=container_options) as out:
        stream: Any = out.add_stream(codec, rate=rate, layout=layout)
        context = stream.codec_context
        sample_format = context.format.name
        step = context.frame_size or 1024
        planes = np.tile(signal(rate, frames, sweep), (channels, 1))
        for start in range(0, frames, step):
            chunk = planes[:, start : start + step]
            if sample_format.startswith("s16"):
                chunk = (chunk * 32767).astype(np.int16)
            elif sample_format.startswith("s32"):
                chunk = (chunk * 2**31 * 0.99).astype(np.int32)
            if not sample_format.endswith("p"):  # interleaved: one plane of frames x channels
                chunk = chunk.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(chunk), format=sample_format, layout=layout
            )
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return out_buffer.getvalue()


def decoded(data: bytes) -> tuple[int, int, int]:
    """``(sample rate, channels, frames)`` FFmpeg decodes from ``data``."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = sum(frame.samples for frame in container.decode(stream))
        context = stream.codec_context
        return context.sample_rate, context.layout.nb_channels, frames
