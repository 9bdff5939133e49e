"""Seeded fuzzing of the audio path: thousands of mutated WAV, FLAC, MP3, Ogg Opus and M4A
files (bytes flipped, cut short, and the header fields the probe reads overwritten with boundary
values: chunk and box sizes, frame headers, page headers, STREAMINFO) go through
``probe_audio``, and hundreds through ``decode_audio`` (FFmpeg in the guarded decoder process),
in a child process, so that a crash or a hang would be seen as the child's death. Every outcome
must be a probe within the limits (a waveform of the probed length) or a ``MediaError`` naming
the member; never another exception."""

from __future__ import annotations

import textwrap

from fuzz_child import fuzz_report
from helpers import SUPPORT

MUTATIONS_PER_FORMAT = 2000
DECODES_PER_FORMAT = 200

CHILD = textwrap.dedent(
    """
    import json, random, sys, time
    sys.path[:0] = sys.argv[4:]
    from fuzz_child import marker_field, mutated
    from audio_files import encode_audio
    from energon_pack.media import MediaError
    from energon_pack.media.audio import MAX_CHANNELS, MAX_SAMPLE_RATE, probe_audio
    from energon_pack.media.audio_decode import decode_audio, played_frames

    rng = random.Random(int(sys.argv[1]))
    count = int(sys.argv[2])
    decoding = sys.argv[3] == "decode"
    SEEDS = {
        "wav": encode_audio("wav", 16000, 2, 3000),
        "flac": encode_audio("flac", 22050, 1, 5000),
        "mp3": encode_audio("mp3", 16000, 1, 8000),
        "mp3-no-xing": encode_audio("mp3", 44100, 2, 9000, write_xing="0"),
        "opus": encode_audio("opus", 16000, 1, 8000),
        "m4a": encode_audio("m4a", 16000, 1, 8000),
    }
    MARKERS = [b"RIFF", b"fmt ", b"data", b"fLaC", b"OggS", b"OpusHead", b"moov", b"trak",
               b"mdia", b"mdhd", b"stsd", b"elst", b"Xing", b"Info", b"ID3", b"\\xff\\xf3",
               b"\\xff\\xfb"]
    VALUES = [0, 1, 2, 3, 7, 8, 255, 0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, 65535]

    # a field near a marker the probe reads, set to a boundary value
    FIELD = marker_field(MARKERS, VALUES, shift=0, span=48, orders="<>")

    table = {}
    others = []
    slowest = 0.0
    for name, seed in SEEDS.items():
        row = table.setdefault(name, {"ok": 0})
        for _ in range(count):
            data = mutated(rng, seed, FIELD, min_length=2)
            start = time.perf_counter()
            try:
                if decoding:
                    waveform, probe = decode_audio(data, key="s", member="a")
                    assert len(waveform) == played_frames(probe, 16000), probe
                else:
                    probe = probe_audio(data, "s", "a")
                assert 1 <= probe.sample_rate <= MAX_SAMPLE_RATE, probe
                assert 1 <= probe.channels <= MAX_CHANNELS, probe
                assert probe.frames > 0, probe
                row["ok"] += 1
            except MediaError as error:
                assert error.key == "s" and error.member == "a", error
                row[error.kind] = row.get(error.kind, 0) + 1
            except Exception as error:
                others.append(f"{name}: {type(error).__name__}: {error}"[:200])
            slowest = max(slowest, time.perf_counter() - start)
    print(json.dumps({"table": table, "others": others[:20], "slowest": slowest}))
    """
)


def test_mutated_audio_decodes_or_gives_a_named_media_error() -> None:
    """Decoding in the guarded decoder process: a native crash or hang of FFmpeg is a counted
    ``crashed`` / ``timeout``; a decode shorter than its header a ``corrupt``. FFmpeg checks
    every Ogg page's CRC, so no damaged Opus file decodes (each is ``corrupt``)."""
    count = DECODES_PER_FORMAT
    report = fuzz_report(CHILD, "1", str(count), "decode", str(SUPPORT), timeout=900)
    assert report["others"] == [], report["others"]
    for name, row in report["table"].items():
        assert sum(row.values()) == count, name
        assert row["ok"] > 0 or name == "opus", (name, row)
        assert row.get("corrupt", 0) > 0, (name, row)


def test_mutated_audio_gives_a_probe_or_a_named_media_error() -> None:
    report = fuzz_report(CHILD, "0", str(MUTATIONS_PER_FORMAT), "probe", str(SUPPORT))
    assert report["others"] == [], report["others"]
    table = report["table"]
    for name, row in table.items():
        assert sum(row.values()) == MUTATIONS_PER_FORMAT, name
        assert row["ok"] > 0, (name, row)  # many mutations leave a readable header
        assert sum(row.values()) - row["ok"] > MUTATIONS_PER_FORMAT / 20, (name, row)
    assert report["slowest"] < 1.0, report  # header reads: no mutation makes one slow
