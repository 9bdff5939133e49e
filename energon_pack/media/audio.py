"""Header-only probing of audio: format, sample rate, channels and length (frames per channel)
of WAV, FLAC, MP3, Ogg Opus and M4A (AAC) from their headers, without decoding a sample.

Every read is bounded by the bytes given and by fixed counts (chunks, boxes, pages); an MP3
without a Xing/Info frame count is measured by hopping from frame header to frame header (4
bytes read per frame). The length is what the stream is meant to play: for MP3 the LAME tag's
encoder delay and padding are taken off, for Opus the pre-skip, for M4A the edit list's
priming and duration are applied (a decoder that yields fewer frames has a lying header, caught
at decode). What cannot be read is a :class:`~energon_pack.media.MediaError` naming the sample
and member: ``unreadable`` (no audio header this module knows), ``corrupt`` (a header whose
values are impossible or that runs past the data), ``unsupported`` (a known container with
another codec, or a stream that does not state its length).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

from energon_pack.media.errors import MediaFailure, naming

__all__ = ["AUDIO_EXTENSIONS", "AudioFormat", "AudioProbe", "probe_audio", "probe_video_audio"]

AudioFormat = Literal["wav", "flac", "mp3", "opus", "m4a", "array"]
"""A file format probed from its header, or ``"array"``: decoded samples a dataset holds."""
AUDIO_EXTENSIONS: frozenset[str] = frozenset({"wav", "flac", "mp3", "ogg", "opus", "m4a"})
"""Member extensions read as audio."""

MAX_SAMPLE_RATE = 768_000
MAX_CHANNELS = 64
_MAX_CHUNKS = 4096
"""Most RIFF chunks, FLAC metadata blocks or MP4 boxes read before giving up on a header."""
_OPUS_RATE = 48_000
"""Opus always decodes at 48 kHz (its header's input rate is informative only)."""
_MAX_OGG_PAGE = 65_307
"""The largest Ogg page: 27 header bytes, 255 lacing values, 255 segments of 255 bytes."""


@dataclass(frozen=True)
class AudioProbe:
    """What an audio member's header says."""

    format: AudioFormat
    sample_rate: int
    """Frames per second as decoded (Opus: 48,000)."""
    channels: int
    frames: int
    """Frames per channel the stream plays (encoder delay and padding taken off)."""
    skip: int = 0
    """Frames before the played ones that a decoder yields when it does not trim the stream's
    start itself (an Opus stream's pre-skip; FFmpeg trims an MP3's delay and an M4A's priming)."""

    @property
    def seconds(self) -> float:
        return self.frames / self.sample_rate


def probe_audio(data: bytes, key: str = "?", member: str = "audio") -> AudioProbe:
    """The :class:`AudioProbe` of ``data`` (a whole audio file), from its headers alone; a
    :class:`~energon_pack.media.MediaError` names ``key`` and ``member`` when it cannot be
    read."""
    with naming(key, member):
        if not data:
            raise MediaFailure("empty", "zero-byte audio member")
        try:
            probe = _probe(memoryview(data))
        except (struct.error, IndexError, ValueError) as error:  # a read past the data
            raise MediaFailure("corrupt", f"audio header cut short or damaged ({error})") from None
        _check(probe)
        return probe


def probe_video_audio(data: bytes, key: str = "?", member: str = "video") -> AudioProbe | None:
    """The :class:`AudioProbe` of the audio track of ``data`` (a whole MP4 or QuickTime video),
    from its headers alone; None where the video has no audio track. A
    :class:`~energon_pack.media.MediaError` names ``key`` and ``member`` where the track cannot
    be read, and is ``unsupported`` for another container (only MP4/MOV audio tracks are
    read)."""
    with naming(key, member):
        if bytes(data[4:8]) != b"ftyp":
            raise MediaFailure(
                "unsupported",
                "the audio of a video is read from MP4 or QuickTime (MOV) files only; remux "
                "the video to MP4, or take its audio as a separate audio member",
            )
        try:
            probe = _m4a_or_none(memoryview(data))
        except (struct.error, IndexError, ValueError) as error:
            raise MediaFailure("corrupt", f"MP4 header cut short or damaged ({error})") from None
        if probe is not None:
            _check(probe)
        return probe


def _probe(data: memoryview) -> AudioProbe:
    head = bytes(data[:12])
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return _wav(data)
    start = _id3_end(data)
    if bytes(data[start : start + 4]) == b"fLaC":
        return _flac(data, start + 4)
    if head[:4] == b"OggS":
        return _ogg(data)
    if head[4:8] == b"ftyp":
        return _m4a(data)
    if start + 2 <= len(data) and data[start] == 0xFF and data[start + 1] & 0xE0 == 0xE0:
        return _mp3(data, start)
    raise MediaFailure(
        "unreadable", "not a WAV, FLAC, MP3, Ogg Opus or M4A file (no header of those)"
    )


def _check(probe: AudioProbe) -> None:
    if not 1 <= probe.sample_rate <= MAX_SAMPLE_RATE:
        raise MediaFailure("corrupt", f"{probe.format} header: sample rate {probe.sample_rate}")
    if not 1 <= probe.channels <= MAX_CHANNELS:
        raise MediaFailure("corrupt", f"{probe.format} header: {probe.channels} channels")
    if probe.frames <= 0:
        raise MediaFailure("corrupt", f"{probe.format} header: {probe.frames} frames")


# ---------------------------------------------------------------------------------------- WAV
_WAV_CODECS = {1: "PCM", 3: "IEEE float", 0xFFFE: "extensible"}


def _wav(data: memoryview) -> AudioProbe:
    at, fmt = 12, None
    for _ in range(_MAX_CHUNKS):
        if at + 8 > len(data):
            break
        name, size = struct.unpack_from("<4sI", data, at)
        body = at + 8
        if name == b"fmt ":
            fmt = struct.unpack_from("<HHIIHH", data, body)
        elif name == b"data":
            if fmt is None:
                raise MediaFailure("corrupt", "WAV data chunk before its fmt chunk")
            codec, channels, rate, _, block, _ = fmt
            if codec not in _WAV_CODECS:
                raise MediaFailure("unsupported", f"WAV format tag {codec:#x} (not PCM or float)")
            if block == 0:
                raise MediaFailure("corrupt", "WAV fmt chunk: block align 0")
            held = len(data) - body
            if size > held:
                raise MediaFailure(
                    "corrupt", f"WAV data chunk says {size} bytes but the file holds {held}"
                )
            return AudioProbe("wav", rate, channels, size // block)
        at = body + size + (size & 1)
    raise MediaFailure("corrupt", "WAV file without a data chunk")


# --------------------------------------------------------------------------------------- FLAC
def _flac(data: memoryview, at: int) -> AudioProbe:
    kind, size = data[at] & 0x7F, int.from_bytes(data[at + 1 : at + 4], "big")
    if kind != 0 or size < 34 or at + 4 + 34 > len(data):
        raise MediaFailure("corrupt", "FLAC stream without its STREAMINFO block first")
    packed = int.from_bytes(data[at + 14 : at + 22], "big")
    rate = packed >> 44
    channels = ((packed >> 41) & 0x7) + 1
    frames = packed & ((1 << 36) - 1)
    if frames == 0:
        raise MediaFailure(
            "unsupported", "FLAC STREAMINFO does not state the length (total samples 0)"
        )
    return AudioProbe("flac", rate, channels, frames)


# ---------------------------------------------------------------------------------------- MP3
def _id3_end(data: memoryview) -> int:
    """Where the audio starts after an ID3v2 tag (0 without one)."""
    if bytes(data[:3]) != b"ID3" or len(data) < 10:
        return 0
    size = 0
    for byte in data[6:10]:
        size = (size << 7) | (byte & 0x7F)
    footer = 10 if data[5] & 0x10 else 0
    return 10 + size + footer


_MP3_BITRATES = {  # kbit/s by (MPEG-1?, layer), index 1..14
    (True, 1): (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 3): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
_GAPLESS_TAGS = (b"LAME", b"Lavf", b"Lavc")
"""Encoders whose Xing/Info frame carries the LAME tag's delay and padding (as FFmpeg reads)."""


@dataclass(frozen=True)
class _Mp3Frame:
    mpeg1: bool
    layer: int
    rate: int
    channels: int
    samples: int
    length: int


def _mp3_frame(data: memoryview, at: int) -> _Mp3Frame | None:
    """The MPEG audio frame header at ``at``, or None where there is none."""
    if at + 4 > len(data) or data[at] != 0xFF or data[at + 1] & 0xE0 != 0xE0:
        return None
    version, layer_bits = (data[at + 1] >> 3) & 3, (data[at + 1] >> 1) & 3
    bitrate_index, rate_index = data[at + 2] >> 4, (data[at + 2] >> 2) & 3
    if version == 1 or layer_bits == 0 or bitrate_index in (0, 15) or rate_index == 3:
        return None
    mpeg1, layer = version == 3, 4 - layer_bits
    bitrate = _MP3_BITRATES[(mpeg1, layer)][bitrate_index - 1] * 1000
    rate = _MP3_RATES[version][rate_index]
    padding = (data[at + 2] >> 1) & 1
    channels = 1 if data[at + 3] >> 6 == 3 else 2
    if layer == 1:
        return _Mp3Frame(mpeg1, 1, rate, channels, 384, (12 * bitrate // rate + padding) * 4)
    samples = 1152 if mpeg1 or layer == 2 else 576
    return _Mp3Frame(
        mpeg1, layer, rate, channels, samples, samples // 8 * bitrate // rate + padding
    )


def _mp3(data: memoryview, start: int) -> AudioProbe:
    first = _mp3_frame(data, start)
    if first is None:
        raise MediaFailure("unreadable", "MP3 file without a valid first frame header")
    side = (
        (32 if first.channels == 2 else 17) if first.mpeg1 else (17 if first.channels == 2 else 9)
    )
    xing = start + 4 + side
    if bytes(data[xing : xing + 4]) in (b"Xing", b"Info"):
        flags = struct.unpack_from(">I", data, xing + 4)[0]
        if flags & 1:
            count = struct.unpack_from(">I", data, xing + 8)[0]
            delay = padding = 0
            lame = xing + 8 + 4 * bool(flags & 1) + 4 * bool(flags & 2) + 100 * bool(flags & 4)
            lame += 4 * bool(flags & 8)
            if bytes(data[lame : lame + 4]) in _GAPLESS_TAGS and lame + 24 <= len(data):
                packed = int.from_bytes(data[lame + 21 : lame + 24], "big")
                delay, padding = packed >> 12, packed & 0xFFF
            frames = count * first.samples - delay - padding
            return AudioProbe("mp3", first.rate, first.channels, frames)
    count, at = 0, start
    while (frame := _mp3_frame(data, at)) is not None:
        if frame.rate != first.rate or frame.layer != first.layer or frame.length < 4:
            break
        count += 1
        at += frame.length
    if at > len(data):  # the last frame runs past the data
        count -= 1
    return AudioProbe("mp3", first.rate, first.channels, count * first.samples)


# ---------------------------------------------------------------------------------------- Ogg
def _ogg_page(data: memoryview, at: int) -> tuple[int, int, int, int]:
    """``(granule, serial, start of the page's data, end of the page)`` of the page at ``at``."""
    if bytes(data[at : at + 4]) != b"OggS" or data[at + 4] != 0:
        raise MediaFailure("corrupt", f"Ogg page at byte {at} has no OggS version-0 header")
    granule, serial = struct.unpack_from("<qI", data, at + 6)
    segments = data[at + 26]
    body = at + 27 + segments
    end = body + sum(data[at + 27 : body])
    if end > len(data):
        raise MediaFailure("corrupt", f"Ogg page at byte {at} runs past the end of the file")
    return granule, serial, body, end


def _ogg(data: memoryview) -> AudioProbe:
    _, serial, body, _ = _ogg_page(data, 0)
    head = bytes(data[body : body + 19])
    if head[:8] != b"OpusHead":
        codec = head[1:7].decode("latin-1") if head[:1] == b"\x01" else head[:8].hex()
        raise MediaFailure("unsupported", f"Ogg stream of {codec!r}, not Opus")
    channels, pre_skip = head[9], struct.unpack_from("<H", head, 10)[0]
    tail = max(0, len(data) - _MAX_OGG_PAGE)  # the last page starts in it
    last_bytes = bytes(data[tail:])
    found = last_bytes.rfind(b"OggS")
    granule = -1
    while found >= 0:
        try:
            page_granule, page_serial, _, end = _ogg_page(data, tail + found)
        except MediaFailure:
            end = -1
        if end == len(data) and page_serial == serial:
            granule = page_granule
            break
        found = last_bytes.rfind(b"OggS", 0, found)
    if granule < 0:
        raise MediaFailure("corrupt", "Ogg Opus file without a last page that ends the stream")
    return AudioProbe("opus", _OPUS_RATE, channels, granule - pre_skip, pre_skip)


# ---------------------------------------------------------------------------------------- M4A
def _boxes(data: memoryview, start: int, end: int) -> dict[bytes, tuple[int, int]]:
    """``{type: (body start, box end)}`` of the boxes in ``data[start:end]`` (the first of
    each type)."""
    found: dict[bytes, tuple[int, int]] = {}
    at = start
    for _ in range(_MAX_CHUNKS):
        if at + 8 > end:
            break
        size, name = struct.unpack_from(">I4s", data, at)
        header = 8
        if size == 1:
            size, header = struct.unpack_from(">Q", data, at + 8)[0], 16
        elif size == 0:
            size = end - at
        if size < header or at + size > end:
            raise MediaFailure("corrupt", f"MP4 box {name!r} at byte {at} runs past its parent")
        found.setdefault(name, (at + header, at + size))
        at += size
    return found


def _need(boxes: dict[bytes, tuple[int, int]], name: bytes, parent: str) -> tuple[int, int]:
    """The box ``name`` of ``parent``'s ``boxes``; a corrupt failure where it is missing."""
    if name not in boxes:
        raise MediaFailure("corrupt", f"MP4 {parent} box without its {name.decode()} box")
    return boxes[name]


def _m4a(data: memoryview) -> AudioProbe:
    probe = _m4a_or_none(data)
    if probe is None:
        raise MediaFailure("unsupported", "MP4 file without an audio track")
    return probe


def _m4a_or_none(data: memoryview) -> AudioProbe | None:
    """The probe of the first audio track of an MP4 file; None where it has none."""
    top = _boxes(data, 0, len(data))
    if b"moov" not in top:
        raise MediaFailure("corrupt", "MP4 file without a moov box")
    moov = _boxes(data, *top[b"moov"])
    movie_scale = struct.unpack_from(">I", data, moov[b"mvhd"][0] + 12)[0] if b"mvhd" in moov else 0
    for _, (start, end) in _all_boxes(data, *top[b"moov"], b"trak"):
        trak = _boxes(data, start, end)
        mdia = _boxes(data, *_need(trak, b"mdia", "trak"))
        handler_at = _need(mdia, b"hdlr", "mdia")[0]
        handler = bytes(data[handler_at + 8 : handler_at + 12])
        if handler != b"soun":
            continue
        return _m4a_track(data, trak, mdia, movie_scale)
    return None


def _all_boxes(
    data: memoryview, start: int, end: int, wanted: bytes
) -> list[tuple[bytes, tuple[int, int]]]:
    out, at = [], start
    for _ in range(_MAX_CHUNKS):
        if at + 8 > end:
            break
        size, name = struct.unpack_from(">I4s", data, at)
        if size < 8 or at + size > end:
            break
        if name == wanted:
            out.append((name, (at + 8, at + size)))
        at += size
    return out


def _m4a_track(
    data: memoryview,
    trak: dict[bytes, tuple[int, int]],
    mdia: dict[bytes, tuple[int, int]],
    movie_scale: int,
) -> AudioProbe:
    header = _need(mdia, b"mdhd", "mdia")[0]
    if data[header] == 1:
        scale, duration = struct.unpack_from(">IQ", data, header + 20)
    else:
        scale, duration = struct.unpack_from(">II", data, header + 12)
    minf = _boxes(data, *_need(mdia, b"minf", "mdia"))
    stbl = _boxes(data, *_need(minf, b"stbl", "minf"))
    stsd = _need(stbl, b"stsd", "stbl")[0]
    entry = stsd + 8
    codec = bytes(data[entry + 4 : entry + 8])
    if codec != b"mp4a":
        raise MediaFailure("unsupported", f"MP4 audio track of {codec.decode('latin-1')!r}")
    channels = struct.unpack_from(">H", data, entry + 24)[0]
    rate = struct.unpack_from(">I", data, entry + 32)[0] >> 16
    if scale == 0:
        raise MediaFailure("corrupt", "M4A media header: timescale 0")
    frames = duration * rate // scale
    if b"edts" in trak and movie_scale:
        edits = _boxes(data, *trak[b"edts"])
        if b"elst" in edits:
            frames = _edited(data, edits[b"elst"][0], rate, scale, movie_scale, frames)
    return AudioProbe("m4a", rate, channels, frames)


def _edited(data: memoryview, at: int, rate: int, scale: int, movie: int, whole: int) -> int:
    """Frames the edit list plays: its first segment that shows media (the priming before its
    media time is skipped, the segment's duration kept)."""
    version, count = data[at], struct.unpack_from(">I", data, at + 4)[0]
    entry, width = at + 8, 20 if version == 1 else 12
    for _ in range(min(count, _MAX_CHUNKS)):
        if version == 1:
            length, start = struct.unpack_from(">Qq", data, entry)
        else:
            length, start = struct.unpack_from(">Ii", data, entry)
        entry += width
        if start >= 0:
            played = int(length) * rate // movie
            return min(played, whole - int(start) * rate // scale)
    return whole
