"""Audio families (Qwen2-Audio, the Qwen2.5-Omni and Qwen3-Omni thinkers, Gemma 3n, Voxtral):
what serving a sample through energon_pack costs against the processor's own pipeline,
interleaved per audio in each round.

The processors are transformers' ``Qwen2AudioProcessor``, ``Qwen2_5OmniProcessor``,
``Qwen3OmniMoeProcessor`` and ``Gemma3nProcessor`` with the released feature extractor settings
(128 mel bins, 30-second windows where the processor pads to one; Gemma 3n's 188 audio soft
tokens) and the test suite's small tokenizers and templates
(``tests/encoding/test_family_qwen2_audio.py``, ``test_family_omni.py``,
``test_family_gemma3n.py``). Audio: FFmpeg-written
WAV, FLAC and MP3 files of 2, 8 and 20 seconds at 44.1 kHz stereo. Per audio:

* processor: the chat template rendered, the file decoded to 16 kHz mono by FFmpeg (PyAV's
  decoder and ``AudioResampler``), ``processor(text=[rendered], audio=[waveform])``: what a
  user's pipeline runs per sample; Voxtral's processor takes audio files only, so its own
  ``apply_chat_template(..., tokenize=True)`` on the file's path (mistral-common decodes it with
  soundfile and resamples it with soxr), with the released 128 mel bins and the test suite's
  tekken tokenizer (``tests/support/voxtral_kit.py``; mistral-common from ``.venv/mistral``,
  where ``scripts/venv.sh`` installs it: without it Voxtral is left out);
* energon_pack: the family's encoder on the chat row (header probe, template, tokens) + the
  pack's materialisation (decode in the guarded decoder process, resampled, the processor's
  feature extractor), and the same with ``decode_isolation="off"`` (decoded in this process).

Reports the median of the per-round ratios (energon_pack over processor). Torch runs on one
thread.

Usage: python benchmarks/audio_family.py [--rounds 7] [--families voxtral,gemma3n]
       [--out results/audio_family.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "encoding"), str(ROOT / "tests" / "support")]
MISTRAL = Path(sys.prefix) / "mistral"
"""Voxtral's tokenizer backend, a test reference of scripts/venv.sh (before transformers loads:
it looks for mistral-common once)."""
if MISTRAL.is_dir():
    sys.path.append(str(MISTRAL))

import test_family_gemma3n as gemma3n  # noqa: E402
import test_family_omni as omni  # noqa: E402
import test_family_qwen2_audio as qwen2_audio  # noqa: E402
import voxtral_kit  # noqa: E402
from audio_files import encode_audio  # noqa: E402
from transformers import Qwen2VLImageProcessorPil, WhisperFeatureExtractor  # noqa: E402

from energon_pack import make_encoder  # noqa: E402
from energon_pack.cli.tables import format_table  # noqa: E402
from energon_pack.encoding.families.materialise import sample_media  # noqa: E402
from energon_pack.media import MediaConfig  # noqa: E402

FILES = [(kind, seconds) for kind in ("wav", "flac", "mp3") for seconds in (2, 8, 20)]
RATE = 44100


def omni_processor(kind: str) -> Any:
    """The Omni thinker's processor of ``test_family_omni`` with the released feature
    extractor (128 mel bins) and image patch size."""
    built = omni.processor(kind)
    return omni.without_video(omni.PROCESSORS[kind])(
        image_processor=Qwen2VLImageProcessorPil(patch_size=omni.PATCH[kind]),
        video_processor=None,
        feature_extractor=WhisperFeatureExtractor(feature_size=128),  # type: ignore[no-untyped-call]
        tokenizer=built.tokenizer,
        chat_template=built.chat_template,
    )


FAMILIES: dict[str, Callable[[], Any]] = {
    "qwen2_audio": lambda: qwen2_audio.processor(30, 128),
    "qwen2_5_omni": lambda: omni_processor("qwen2_5_omni"),
    "qwen3_omni": lambda: omni_processor("qwen3_omni"),
    "gemma3n": lambda: gemma3n.processor(256, 188, 128),
}
if MISTRAL.is_dir():
    FAMILIES["voxtral"] = lambda: voxtral_kit.processor("finetuning", 128)


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
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/audio_family.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    files = {spec: encode_audio(spec[0], RATE, 2, RATE * spec[1], sweep=True) for spec in FILES}
    scratch = Path(tempfile.mkdtemp(prefix="audio-family-"))
    paths = {}
    for (kind, length), data in files.items():
        paths[data] = scratch / f"{length}s.{kind}"
        paths[data].write_bytes(data)
    names = args.families.split(",")
    setups = {}
    for name in names:
        build = FAMILIES[name]
        processor = build()
        guarded = make_encoder(family=processor)
        in_process = make_encoder(family=processor, media=MediaConfig(decode_isolation="off"))
        setups[name] = (processor, guarded, in_process)

    def theirs(processor: Any, data: bytes) -> None:
        if type(processor).__name__ == "VoxtralProcessor":  # it reads files itself
            audio = {"type": "audio", "path": str(paths[data])}
            turns = messages()
            turns[0] = {**turns[0], "content": [audio, *turns[0]["content"][1:]]}
            processor.apply_chat_template(turns, tokenize=True, return_dict=True)
            return
        text = processor.apply_chat_template(messages(), tokenize=False)
        processor(
            text=[text], audio=[ffmpeg_waveform(data)], sampling_rate=16000, return_tensors="pt"
        )

    def ours(encoder: Any, data: bytes) -> None:
        encoded = encoder.encode_sample("s", {"messages": messages(), "audios": [data]})
        sample_media(encoder.family, encoded, encoder.media)

    for processor, guarded, in_process in setups.values():  # warm-up: imports, the helper
        for data in files.values():
            theirs(processor, data)
            ours(guarded, data)
            ours(in_process, data)
    keys = [(name, *spec) for name in names for spec in FILES]
    ratios: dict[tuple[Any, ...], dict[str, list[float]]] = {
        key: {"guarded": [], "in_process": []} for key in keys
    }
    seconds: dict[tuple[Any, ...], list[float]] = {key: [] for key in keys}
    for _ in range(args.rounds):
        for key in keys:
            processor, guarded, in_process = setups[key[0]]
            data = files[key[1:]]
            reference = timed(partial(theirs, processor, data))
            seconds[key].append(reference)
            for label, encoder in (("guarded", guarded), ("in_process", in_process)):
                spent = timed(partial(ours, encoder, data))
                ratios[key][label].append(spent / reference)
    table = []
    results: list[dict[str, Any]] = []
    for key in keys:
        guarded_ratio = statistics.median(ratios[key]["guarded"])
        in_process_ratio = statistics.median(ratios[key]["in_process"])
        reference_ms = 1000 * statistics.median(seconds[key])
        results.append(
            {
                "family": key[0],
                "format": key[1],
                "seconds": key[2],
                "processor_ms": reference_ms,
                "guarded_ratio": guarded_ratio,
                "in_process_ratio": in_process_ratio,
            }
        )
        table.append(
            [
                key[0],
                key[1],
                f"{key[2]} s",
                f"{reference_ms:.1f}",
                f"{guarded_ratio:.2f}x",
                f"{in_process_ratio:.2f}x",
            ]
        )
    headers = ["family", "format", "length", "processor ms", "ours (guarded)", "ours (in process)"]
    print(format_table(headers, table))
    overall = {
        name: {
            "guarded": statistics.median(
                r["guarded_ratio"] for r in results if r["family"] == name
            ),
            "in_process": statistics.median(
                r["in_process_ratio"] for r in results if r["family"] == name
            ),
        }
        for name in names
    }
    for name, medians in overall.items():
        print(
            f"{name}: median ratio guarded {medians['guarded']:.2f}x, "
            f"in process {medians['in_process']:.2f}x"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"rounds": args.rounds, "files": results, "median": overall}, indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
