"""Video families: what serving a video sample through energon_pack costs against the family's
own pipeline, and what the header probe costs against a decode.

For LLaVA-OneVision, InternVL, the Qwen2.5-Omni and Qwen3-Omni thinkers, GLM-4V, Gemma 4 and
SmolVLM, a processor with its video processor at the released video settings (LLaVA-OneVision
and InternVL 8 frames, the Omni thinkers and GLM-4V 2 frames a second, Gemma 4 32 frames of 70
soft tokens, SmolVLM at most 64 frames, 1 a second) and the test suite's small tokenizers and
templates (``tests/encoding/``); H.264 MP4 clips of three sizes and lengths. Per clip,
interleaved in each round:

* processor: the chat template rendered, the calls of transformers' decord loader
  (``read_video_decord``: the clip opened, its metadata, the frames the video processor
  samples decoded), with one decoding thread as the guarded decoder has (the loader leaves
  decord to take every core), and ``processor(text=[rendered], videos=[frames],
  video_metadata=[metadata])``: what a user's pipeline runs per sample;
* energon_pack: the family's encoder on the chat row (header probe, template, tokens) + the
  pack's materialisation (the sampled frames decoded in the guarded helper process, the video
  processor), and the same with ``decode_isolation="off"`` (decoded in this process);
* probe: the header read alone, against the guarded decode of the sampled frames alone.

The Omni thinkers run a second time with ``load_audio_from_video`` on clips with an AAC track
(``+track``): the processor given the track decoded by FFmpeg through PyAV (what transformers'
own loader does with torchcodec), ours its tokens from the track's header and its decode in
the guarded helper.

Video processors exist only with torchvision: the measuring runs in the test suite's
torchvision child process (``tests/support/torchvision_child.py``). Reports the median of the
per-round ratios. Torch runs on one thread.

Usage: python benchmarks/video_families.py [--rounds 5] [--out results/video_families.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests" / "encoding"), str(ROOT / "tests" / "support")]

from energon_pack.cli.tables import format_table  # noqa: E402

CLIPS = [(320, 240, 20, 15), (640, 352, 8, 30), (1280, 720, 4, 25)]
"""(width, height, seconds, fps) of each clip."""
FAMILIES = (
    "llava_onevision",
    "internvl",
    "qwen2_5_omni",
    "qwen3_omni",
    "glm4v",
    "gemma4",
    "smolvlm",
)
TRACKED = ("qwen2_5_omni", "qwen3_omni")
"""The families also run on clips with an audio track, reading it (``+track``)."""


def clip_bytes(width: int, height: int, seconds: int, fps: int, track: bool = False) -> bytes:
    """An H.264 MP4 of rolling random 16-pixel tiles (with ``track``, an AAC track as long)."""
    from test_family_video import tiles_mp4

    sound = float(seconds) if track else 0.0
    return tiles_mp4(width, height, seconds * fps, fps, seed=width, tile=16, audio_seconds=sound)


def track_decode(path: Path) -> Any:
    """The clip's audio track at 16 kHz, mono float32, decoded by FFmpeg through PyAV."""
    import av
    import numpy as np

    with av.open(str(path)) as container:
        resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
        parts = [
            resampled.to_ndarray()[0]
            for frame in container.decode(audio=0)
            for resampled in resampler.resample(frame)
        ]
    return np.concatenate(parts)


def processor(name: str) -> Any:
    """The family's processor at its released video settings (run where torchvision is)."""
    import test_family_glm4v as glm4v
    import test_family_internvl as internvl
    import test_family_llava_onevision as llava
    import test_family_omni as omni
    import transformers as tf

    if name == "llava_onevision":
        return tf.LlavaOnevisionProcessor(  # type: ignore[no-untyped-call]
            image_processor=tf.LlavaOnevisionImageProcessorPil(),
            video_processor=tf.LlavaOnevisionVideoProcessor(do_sample_frames=True, num_frames=8),
            tokenizer=llava.tokenizer(),
            num_image_tokens=729,
            vision_feature_select_strategy="full",
            vision_aspect_ratio="anyres_max_9",
            chat_template=llava.TEMPLATE,
        )
    if name == "internvl":
        return tf.InternVLProcessor(
            image_processor=tf.GotOcr2ImageProcessorPil(),
            video_processor=tf.InternVLVideoProcessor(
                do_sample_frames=True, num_frames=8, size={"height": 448, "width": 448}
            ),
            tokenizer=internvl.tokenizer(),
            image_seq_length=256,
            chat_template=internvl.TEMPLATE,
        )
    if name.endswith("omni"):
        built = omni.processor(name)
        patch = omni.PATCH[name]
        return omni.PROCESSORS[name](
            image_processor=tf.Qwen2VLImageProcessorPil(patch_size=patch),
            video_processor=tf.Qwen2VLVideoProcessor(
                do_sample_frames=True, fps=2, cap_pixels_per_frame=False, patch_size=patch
            ),
            feature_extractor=tf.WhisperFeatureExtractor(),  # type: ignore[no-untyped-call]
            tokenizer=built.tokenizer,
            chat_template=built.chat_template,
        )
    if name == "smolvlm":
        from test_family_video import smolvlm_processor

        built = smolvlm_processor()  # its template and tokenizer; the released video settings
        return tf.SmolVLMProcessor(
            image_processor=tf.SmolVLMImageProcessorPil(),
            video_processor=tf.SmolVLMVideoProcessor(do_sample_frames=True, num_frames=64, fps=1),
            tokenizer=built.tokenizer,
            image_seq_len=64,
            chat_template=built.chat_template,
        )
    if name == "gemma4":
        from test_family_video import gemma4_processor

        built = gemma4_processor()  # its template and tokenizer; the released video settings
        return tf.Gemma4Processor(
            feature_extractor=built.feature_extractor,
            image_processor=built.image_processor,
            video_processor=tf.Gemma4VideoProcessor(),
            tokenizer=built.tokenizer,
            chat_template=built.chat_template,
        )
    return tf.Glm4vProcessor(  # type: ignore[no-untyped-call]
        image_processor=tf.Glm4vImageProcessorPil(),
        video_processor=tf.Glm4vVideoProcessor(do_sample_frames=True, fps=2),
        tokenizer=glm4v.TOKENIZER,
        chat_template=glm4v.TEMPLATE,
    )


def decord_loader(path: Path, pick: Callable[..., list[int]]) -> tuple[Any, Any]:
    """``transformers.video_utils.read_video_decord``'s calls, decord on one thread."""
    import decord
    from transformers.video_utils import VideoMetadata

    reader = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
    fps, total = reader.get_avg_fps(), len(reader)
    metadata = VideoMetadata(
        total_num_frames=total, fps=float(fps), duration=total / fps, video_backend="decord"
    )
    indices = pick(metadata=metadata)
    frames = reader.get_batch(indices).asnumpy()
    metadata.update(  # type: ignore[no-untyped-call]
        {"frames_indices": indices, "height": frames.shape[1], "width": frames.shape[2]}
    )
    return frames, metadata


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """Per family and clip, the per-round times of each pipeline (runs in the child)."""
    import torch
    from test_family_video import conversation

    from energon_pack import ProcessorFamily, make_encoder, model_family
    from energon_pack.encoding.families.materialise import sample_media
    from energon_pack.media import MediaConfig
    from energon_pack.media.decode import VideoHeader
    from energon_pack.media.displayed import displayed_video_header, displayed_videos

    torch.set_num_threads(1)
    scratch = Path(tempfile.mkdtemp(prefix="video-families-"))
    clips: dict[bool, list[bytes]] = {}
    paths: dict[bool, list[Path]] = {}
    for track in (False, True):
        clips[track] = [clip_bytes(*clip, track=track) for clip in CLIPS]
        paths[track] = []
        for index, data in enumerate(clips[track]):
            paths[track].append(scratch / f"clip{index}{'-track' if track else ''}.mp4")
            paths[track][-1].write_bytes(data)
    setups = {}
    for name in (*FAMILIES, *(f"{name}+track" for name in TRACKED)):
        proc = processor(name.removesuffix("+track"))
        proc.load_audio_from_video = name.endswith("+track")
        family = model_family(proc)
        assert isinstance(family, ProcessorFamily)
        messages = conversation(["clip"], [], "Something moves.")
        setups[name] = (proc, family, messages)
    times: dict[str, dict[str, list[float]]] = {}
    tokens: dict[str, int] = {}
    for _ in range(job["rounds"]):
        for name, (proc, family, messages) in setups.items():
            track = name.endswith("+track")
            for index, (data, path) in enumerate(zip(clips[track], paths[track], strict=True)):
                key = f"{name} {CLIPS[index][0]}x{CLIPS[index][1]}"
                own = times.setdefault(key, {})
                row = {"id": key, "messages": messages, "videos": [data]}

                def pick(metadata: Any, family: Any = family) -> list[int]:
                    """The video processor's frames (its sampling reads the count and rate)."""
                    header = VideoHeader(metadata.total_num_frames, metadata.fps, 0, 0)
                    return list(family.video_frames(header))

                def theirs(
                    proc: Any = proc,
                    messages: Any = messages,
                    path: Path = path,
                    track: bool = track,
                ) -> None:
                    text = proc.apply_chat_template(messages, tokenize=False)
                    frames, metadata = decord_loader(path, pick)
                    sound = {}
                    if track:
                        sound = {"audio": [track_decode(path)], "audio_from_video_indices": [0]}
                    proc(
                        text=[text],
                        videos=[frames],
                        video_metadata=[metadata],
                        do_sample_frames=False,
                        return_tensors="pt",
                        **sound,
                    )

                for isolation in ("process", "off"):
                    media = MediaConfig(decode_isolation=isolation)
                    encoder = make_encoder(family=proc, media=media)

                    def ours(
                        encoder: Any = encoder, row: Any = row, family: Any = family, key: str = key
                    ) -> None:
                        encoded = encoder.encode_sample(row["id"], row)
                        sample_media(family, encoded, encoder.media)
                        tokens[key] = encoded.media[0].tokens

                    own.setdefault(f"ours {isolation}", []).append(timed(ours))
                own.setdefault("processor", []).append(timed(theirs))
                header = displayed_video_header(data, key=key, member="clip")
                frames = family.video_frames(header)
                size = (header.height, header.width)
                job_args = [(key, "clip", data, frames, size, 0)]
                own.setdefault("probe", []).append(
                    timed(partial(displayed_video_header, data, key=key))
                )
                own.setdefault("decode", []).append(timed(partial(displayed_videos, job_args)))
    return {"times": times, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/video_families.json")
    args = parser.parse_args()
    from torchvision_child import available, run_in_child

    if not available():
        sys.exit("the reference torchvision is not installed (bash scripts/venv.sh)")
    import video_families  # noqa: F401  (so that the child finds this module)

    found = run_in_child("video_families:measure", {"rounds": args.rounds}, timeout=3600)
    rows, results = [], {}
    for key, own in found["times"].items():
        ratios = {
            name: statistics.median(a / b for a, b in zip(own[name], own[base], strict=True))
            for name, base in (
                ("ours process", "processor"),
                ("ours off", "processor"),
                ("probe", "decode"),
            )
        }
        processor_ms = statistics.median(own["processor"]) * 1000
        results[key] = {
            "tokens": found["tokens"][key],
            "processor_ms": processor_ms,
            "ours_over_processor": ratios["ours process"],
            "ours_off_over_processor": ratios["ours off"],
            "probe_over_decode": ratios["probe"],
        }
        rows.append(
            [
                key,
                found["tokens"][key],
                f"{processor_ms:.0f}",
                f"{ratios['ours process']:.2f}x",
                f"{ratios['ours off']:.2f}x",
                f"{ratios['probe']:.3f}",
            ]
        )
    headers = [
        "family, clip",
        "tokens",
        "processor ms",
        "ours / proc",
        "in-process",
        "probe/decode",
    ]
    print(format_table(headers, rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": args.rounds, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
