"""Audio: the header probe against a decode, per format.

For each format (WAV, FLAC, MP3, Ogg Opus, M4A) a 30-second mono file at 16 kHz (Opus: 48 kHz)
and a 10-second stereo file at 44.1 kHz (Opus: 48 kHz) of a tone sweep are written with PyAV
(``tests/support/audio_files.py``). Each round times, interleaved,

  probe    ``probe_audio(data)``: the header alone
  decode   ``decode_audio(data, config=MediaConfig(decode_isolation="off"))``: FFmpeg (PyAV)
           at the stream's rate, trimmed to the probed frames, mixed to mono, resampled to 16 kHz

(in this process, so the ratio is the work's, not the helper's hand-over), each the median of
``--repeats`` calls; the table shows medians over ``--rounds`` rounds and the median of the
per-round ratios. The goal: probe <= 0.1x decode.

Usage: python benchmarks/audio_probe.py [--rounds 5] [--repeats 5] [--out results/audio_probe.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
from audio_files import encode_audio  # noqa: E402  (the tests' audio writer)

from energon_pack.cli.tables import format_table  # noqa: E402
from energon_pack.media import MediaConfig  # noqa: E402
from energon_pack.media.audio import probe_audio  # noqa: E402
from energon_pack.media.audio_decode import decode_audio  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "audio_probe.json"
IN_PROCESS = MediaConfig(decode_isolation="off")
FILES = {  # name: (format, rate, channels, seconds)
    "wav 16k mono 30 s": ("wav", 16000, 1, 30),
    "flac 16k mono 30 s": ("flac", 16000, 1, 30),
    "mp3 16k mono 30 s": ("mp3", 16000, 1, 30),
    "opus 48k mono 30 s": ("opus", 48000, 1, 30),
    "m4a 16k mono 30 s": ("m4a", 16000, 1, 30),
    "wav 44.1k stereo 10 s": ("wav", 44100, 2, 10),
    "flac 44.1k stereo 10 s": ("flac", 44100, 2, 10),
    "mp3 44.1k stereo 10 s": ("mp3", 44100, 2, 10),
    "opus 48k stereo 10 s": ("opus", 48000, 2, 10),
    "m4a 44.1k stereo 10 s": ("m4a", 44100, 2, 10),
}


def timed(call: Callable[[], object], repeats: int) -> float:
    """The median seconds of ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(1)
    files = {
        name: encode_audio(kind, rate, channels, rate * seconds, sweep=True)
        for name, (kind, rate, channels, seconds) in FILES.items()
    }
    runs: dict[str, dict[str, list[float]]] = {
        name: {"probe": [], "decode": [], "ratio": []} for name in files
    }
    for _ in range(args.rounds):
        for name, data in files.items():
            probe = timed(partial(probe_audio, data), args.repeats)
            decode = timed(partial(decode_audio, data, config=IN_PROCESS), args.repeats)
            runs[name]["probe"].append(probe)
            runs[name]["decode"].append(decode)
            runs[name]["ratio"].append(probe / decode)
    rows: list[list[Any]] = []
    summary = {}
    for name, times in runs.items():
        medians = {key: statistics.median(values) for key, values in times.items()}
        summary[name] = {**medians, "bytes": len(files[name])}
        rows.append(
            [
                name,
                len(files[name]),
                f"{medians['probe'] * 1e6:.1f}",
                f"{medians['decode'] * 1e3:.2f}",
                f"{medians['ratio']:.5f}",
            ]
        )
    headers = ["file", "bytes", "probe us", "decode ms", "probe / decode"]
    print(format_table(headers, rows))
    worst = max(entry["ratio"] for entry in summary.values())
    print(f"\nworst ratio {worst:.4f} (goal <= 0.1); {args.rounds} rounds x {args.repeats} calls")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "files": summary}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
