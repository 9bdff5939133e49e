"""Qwen2-Audio: what serving a sample through energon_pack costs against the processor's own
pipeline, interleaved per audio in each round.

The processor is transformers' ``Qwen2AudioProcessor`` with the released feature extractor
settings (128 mel bins, 30-second windows) and the test suite's small tokenizer
(``tests/encoding/test_family_qwen2_audio.py``). Audio: FFmpeg-written WAV, FLAC and MP3 files
of 2, 8 and 20 seconds at 44.1 kHz stereo. Per audio:

* processor: the chat template rendered, the file decoded to 16 kHz mono by FFmpeg (PyAV's
  decoder and ``AudioResampler``), ``processor(text=[rendered], audio=[waveform])``: what a
  user's pipeline runs per sample;
* energon_pack: the family's encoder on the chat row (header probe, template, tokens) + the
  pack's materialisation (decode in the guarded decoder process, resampled, the processor's
  feature extractor), and the same with ``decode_isolation="off"`` (decoded in this process).

Reports the median of the per-round ratios (energon_pack over processor). Torch runs on one
thread.

Usage: python benchmarks/audio_family.py [--rounds 7] [--out results/audio_family.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "encoding"), str(ROOT / "tests" / "support")]

import test_family_qwen2_audio as qwen2_audio  # noqa: E402
from audio_files import encode_audio  # noqa: E402

from energon_pack import make_encoder  # noqa: E402
from energon_pack.cli.tables import format_table  # noqa: E402
from energon_pack.encoding.families.materialise import sample_media  # noqa: E402
from energon_pack.media import MediaConfig  # noqa: E402

FILES = [(kind, seconds) for kind in ("wav", "flac", "mp3") for seconds in (2, 8, 20)]
RATE = 44100


def messages() -> list[dict[str, Any]]:
    user = [{"type": "audio"}, {"type": "text", "text": "What is that sound?"}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": "A tone."}]


def ffmpeg_waveform(data: bytes) -> np.ndarray[Any, Any]:
    """``data`` decoded and resampled to 16 kHz mono float32 by FFmpeg (PyAV)."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
    chunks = []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(chunks)


def timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/audio_family.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    processor = qwen2_audio.processor(30, 128)
    guarded = make_encoder(family=processor)
    in_process = make_encoder(family=processor, media=MediaConfig(decode_isolation="off"))
    files = {spec: encode_audio(spec[0], RATE, 2, RATE * spec[1], sweep=True) for spec in FILES}

    def theirs(data: bytes) -> None:
        text = processor.apply_chat_template(messages(), tokenize=False)
        processor(
            text=[text], audio=[ffmpeg_waveform(data)], sampling_rate=16000, return_tensors="pt"
        )

    def ours(encoder: Any, data: bytes) -> None:
        encoded = encoder.encode_sample("s", {"messages": messages(), "audios": [data]})
        sample_media(encoder.family, encoded, encoder.media)

    for data in files.values():  # warm-up: imports, the decoder process
        theirs(data)
        ours(guarded, data)
        ours(in_process, data)
    ratios: dict[tuple[str, int], dict[str, list[float]]] = {
        spec: {"guarded": [], "in_process": []} for spec in FILES
    }
    seconds: dict[tuple[str, int], list[float]] = {spec: [] for spec in FILES}
    for _ in range(args.rounds):
        for spec, data in files.items():
            reference = timed(lambda data=data: theirs(data))
            seconds[spec].append(reference)
            ratios[spec]["guarded"].append(timed(lambda data=data: ours(guarded, data)) / reference)
            ratios[spec]["in_process"].append(
                timed(lambda data=data: ours(in_process, data)) / reference
            )
    table = []
    results = []
    for spec in FILES:
        guarded_ratio = statistics.median(ratios[spec]["guarded"])
        in_process_ratio = statistics.median(ratios[spec]["in_process"])
        reference_ms = 1000 * statistics.median(seconds[spec])
        results.append(
            {
                "format": spec[0],
                "seconds": spec[1],
                "processor_ms": reference_ms,
                "guarded_ratio": guarded_ratio,
                "in_process_ratio": in_process_ratio,
            }
        )
        table.append(
            [
                spec[0],
                f"{spec[1]} s",
                f"{reference_ms:.1f}",
                f"{guarded_ratio:.2f}x",
                f"{in_process_ratio:.2f}x",
            ]
        )
    headers = ["format", "length", "processor ms", "ours (guarded)", "ours (in process)"]
    print(format_table(headers, table))
    overall = {
        "guarded": statistics.median(r["guarded_ratio"] for r in results),
        "in_process": statistics.median(r["in_process_ratio"] for r in results),
    }
    print(
        f"median ratio: guarded {overall['guarded']:.2f}x, in process {overall['in_process']:.2f}x"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rounds": args.rounds, "files": results, "median": overall}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
