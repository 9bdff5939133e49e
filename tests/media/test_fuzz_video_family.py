"""Seeded fuzzing of the processor families' video path: mutated MP4s (an H.264 video with an
AAC track; bytes flipped, cut short, and the box fields the readers take set to boundary values)
go through ``probe_video_audio`` by the thousand, and by the hundred through the whole path (the
upright header and sampled frames decoded in the guarded helper, then the track's probe and
decode), in a child process, so that a crash or a hang would be seen as the child's death. Every
outcome must be a result within its header (frames of the header's size, a track of the probed
length) or a ``MediaError`` naming the member; never another exception."""

from __future__ import annotations

import struct
import textwrap
from pathlib import Path

import pytest
from fuzz_child import fuzz_report
from helpers import SUPPORT

from energon_pack.media import MediaError
from energon_pack.media.audio import probe_video_audio

ROOT = Path(__file__).resolve().parents[2]
TRACK_PROBES = 3000
WHOLE_PATHS = 150

CHILD = textwrap.dedent(
    """
    import json, random, sys, time
    sys.path[:0] = sys.argv[4:]
    from fuzz_child import marker_field, mutated
    from test_family_video import tiles_mp4
    from energon_pack.media import MediaConfig, MediaError
    from energon_pack.media.audio import probe_video_audio
    from energon_pack.media.audio_decode import decode_audio, played_frames
    from energon_pack.media.displayed import displayed_video_header, displayed_videos

    rng = random.Random(int(sys.argv[1]))
    count = int(sys.argv[2])
    whole = sys.argv[3] == "whole"
    SEED = tiles_mp4(64, 48, 8, 4, seed=3, audio_seconds=1.5)
    CONFIG = MediaConfig(decode_timeout_s=10.0)
    MARKERS = [b"ftyp", b"moov", b"mvhd", b"trak", b"tkhd", b"mdia", b"mdhd", b"hdlr", b"soun",
               b"minf", b"stbl", b"stsd", b"mp4a", b"avc1", b"edts", b"elst", b"stts", b"stsz",
               b"stco", b"mdat"]
    VALUES = [0, 1, 2, 7, 8, 16, 255, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, 65535]

    # a box size or a field after a box name the readers take, set to a boundary value
    FIELD = marker_field(MARKERS, VALUES, shift=-4, span=40)

    def whole_path(data):
        header = displayed_video_header(data, CONFIG, key="s", member="v.mp4")
        picked = tuple(sorted({i * header.frames // 4 for i in range(4)}))
        size = (header.height, header.width)
        (frames,) = displayed_videos([("s", "v.mp4", data, picked, size, 0)], CONFIG)
        assert frames.shape == (len(picked), *size, 3), (frames.shape, picked, size)
        track = probe_video_audio(data, "s", "v.mp4")
        if track is not None:
            waveform, probe = decode_audio(data, key="s", member="v.mp4", config=CONFIG)
            assert len(waveform) == played_frames(probe, 16000), probe

    table = {"ok": 0, "no_track": 0}
    others = []
    slowest = 0.0
    for _ in range(count):
        data = mutated(rng, SEED, FIELD)
        start = time.perf_counter()
        try:
            if whole:
                whole_path(data)
                table["ok"] += 1
            else:
                probe = probe_video_audio(data, "s", "v.mp4")
                table["ok" if probe is not None else "no_track"] += 1
        except MediaError as error:
            assert error.key == "s" and error.member == "v.mp4", error
            table[error.kind] = table.get(error.kind, 0) + 1
        except Exception as error:
            others.append(f"{type(error).__name__}: {error}"[:200])
        slowest = max(slowest, time.perf_counter() - start)
    print(json.dumps({"table": table, "others": others[:20], "slowest": slowest}))
    """
)


def _report(seed: str, count: int, mode: str) -> dict[str, object]:
    paths = (str(SUPPORT), str(ROOT / "tests" / "encoding"))
    return fuzz_report(CHILD, seed, str(count), mode, *paths, timeout=900)


def test_mutated_videos_give_their_track_a_probe_or_a_named_media_error() -> None:
    report = _report("0", TRACK_PROBES, "probe")
    assert report["others"] == [], report["others"]
    table = report["table"]
    assert isinstance(table, dict)
    assert sum(table.values()) == TRACK_PROBES
    assert table["ok"] > TRACK_PROBES / 10, table  # many mutations leave the track readable
    assert table.get("corrupt", 0) > 0, table
    assert report["slowest"] < 1.0, report  # header reads: no mutation makes one slow


def test_mutated_videos_decode_through_the_family_path_or_give_a_named_media_error() -> None:
    """The upright header, four sampled frames and the track, in the guarded helper: a native
    crash or hang is a counted ``crashed`` / ``timeout``; frames of another size than the header
    gave, or a track shorter than its header, are refused."""
    report = _report("1", WHOLE_PATHS, "whole")
    assert report["others"] == [], report["others"]
    table = report["table"]
    assert isinstance(table, dict)
    assert sum(table.values()) == WHOLE_PATHS
    assert table["ok"] > 0, table
    assert sum(table.values()) - table["ok"] > WHOLE_PATHS / 10, table


def _box(name: bytes, body: bytes) -> bytes:
    return struct.pack(">I", 8 + len(body)) + name + body


def test_a_track_whose_fields_run_past_the_file_is_corrupt_and_named() -> None:
    """An audio track whose media header box ends the file before its fields (the boxes' sizes
    all consistent) is ``corrupt``, naming the member."""
    handler = _box(b"hdlr", bytes(8) + b"soun" + bytes(12))
    moov = _box(b"moov", _box(b"trak", _box(b"mdia", handler + _box(b"mdhd", b""))))
    data = _box(b"ftyp", b"isom" + bytes(4)) + moov
    with pytest.raises(MediaError) as error:
        probe_video_audio(data, "k", "v.mp4")
    assert (error.value.kind, error.value.key, error.value.member) == ("corrupt", "k", "v.mp4")
    assert "cut short or damaged" in str(error.value)
