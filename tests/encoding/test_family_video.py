"""Videos for the processor families (LLaVA-OneVision, InternVL, the Qwen2.5-Omni and Qwen3-Omni
thinkers, GLM-4V, Gemma 4, SmolVLM): video tokens from the video's header and the frames its video
processor samples, ids, labels and pixels equal to transformers' own processor, and a packed
row of videos, images and text trains on a tiny model of the family as its samples alone; for
LLaVA-OneVision the Energon path (2 workers, a native WebDataset of MP4 members) packs what the
collator packs and resumes exactly at three cut points.

transformers' video processors exist only with torchvision, which this process never imports:
:func:`family_checks` and the other checks run in a child process (:mod:`torchvision_child`)
and send back plain values that the tests here assert on.
"""

from __future__ import annotations

import io
import json
import traceback
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
from energon_shards import write_dataset
from family_kit import IGNORE, packed_matches_alone, png_bytes, seeded
from family_kit import test_images as make_images
from torchvision_child import available, run_in_child

NUM_FRAMES = 4
CLIPS = {  # member -> (width, height, frames, fps)
    "a": (64, 48, 8, 4),
    "b": (96, 64, 12, 3),
    "c": (64, 64, 6, 3),
    "d": (32, 64, 10, 5),
    "short": (32, 32, 3, 3),
    "big": (448, 336, 8, 4),
}


def tiles_mp4(
    width: int,
    height: int,
    frames: int,
    fps: int,
    seed: int,
    tile: int = 8,
    audio_seconds: float = 0.0,
) -> bytes:
    """An H.264 MP4 of random ``tile``-pixel tiles that roll one tile a frame (so its frames
    differ in space and time), seeded by ``seed``; with ``audio_seconds``, an AAC track of a
    gliding tone that long (16 kHz, mono)."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // tile + 1, width // tile + 1, 3), dtype=np.uint8)
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        rate = 16_000
        track = container.add_stream("aac", rate=rate, layout="mono") if audio_seconds else None
        for index in range(frames):
            tiles = np.roll(base, index, axis=1).repeat(tile, axis=0).repeat(tile, axis=1)
            frame = av.VideoFrame.from_ndarray(tiles[:height, :width].copy(), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if track is not None:
            t = np.arange(int(audio_seconds * rate)) / rate
            pitch = rng.uniform(200, 600) * (1 + t / max(audio_seconds, 1e-9))
            wave = (0.3 * np.sin(2 * np.pi * pitch * t)).astype(np.float32)[None]
            sound = av.AudioFrame.from_ndarray(wave, format="fltp", layout="mono")
            sound.sample_rate = rate
            for packet in [*track.encode(sound), *track.encode(None)]:
                container.mux(packet)
    return out.getvalue()


@cache
def clip(name: str) -> bytes:
    """Clip ``name`` of :data:`CLIPS` (:func:`tiles_mp4` seeded by the name)."""
    return tiles_mp4(*CLIPS[name], seed=sum(map(ord, name)))


SAMPLES: list[tuple[list[str], list[tuple[int, int]], str]] = [
    (["a"], [], "A sliding pattern."),
    (["b"], [(50, 90)], "An image, then a clip."),
    ([], [], "Only text."),
    (["c", "d"], [], "Two clips."),
    (["d"], [(40, 60)], "A clip, then an image."),
    ([], [(30, 70)], "Only an image."),
]
"""Each sample's videos, image sizes and reply."""
MIXED = {1, 4}
"""The samples holding an image and a video."""
ONE_KIND = {"glm4v", "smolvlm"}
"""Families whose transformers code takes no sample of both kinds (GLM-4V's forward counts
video pads as image pads; SmolVLM's processor writes both into one ``pixel_values``): their
checks leave the mixed samples out."""
VIDEO_FIRST = 4
"""The sample whose message holds its clip before its image (LLaVA-OneVision's template
renders a message's images first, InternVL's in order)."""


def conversation(
    videos: list[str], sizes: list[tuple[int, int]], reply: str, video_first: bool = False
) -> Any:
    parts = [{"type": "image"}] * len(sizes) + [{"type": "video"}] * len(videos)
    if video_first:
        parts.reverse()
    return [
        {"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
    ]


# --- run in the torchvision child -----------------------------------------------------------

VIDEO_FPS = 2
"""InternVL's video processor samples 2 frames a second (frame counts differ between clips)."""


def internvl_processor() -> Any:
    """The InternVL processor of ``test_family_internvl`` with its video processor (32-pixel
    frames for the tiny model, ``VIDEO_FPS`` frames a second from the middle of each span)."""
    import test_family_internvl as internvl
    from transformers import GotOcr2ImageProcessorPil, InternVLProcessor, InternVLVideoProcessor

    return InternVLProcessor(
        image_processor=GotOcr2ImageProcessorPil(size=internvl.TILE),
        video_processor=InternVLVideoProcessor(
            size=internvl.TILE, do_sample_frames=True, fps=VIDEO_FPS
        ),
        tokenizer=internvl.tokenizer(),
        image_seq_length=internvl.SEQ,
        chat_template=internvl.TEMPLATE,
    )


def llava_processor(**video: Any) -> Any:
    """The small LLaVA-OneVision processor of ``test_family_llava_onevision`` with its video
    processor (32-pixel frames for the tiny model, ``NUM_FRAMES`` sampled by default)."""
    import test_family_llava_onevision as llava
    from transformers import (
        LlavaOnevisionImageProcessorPil,
        LlavaOnevisionProcessor,
        LlavaOnevisionVideoProcessor,
    )

    settings = {"do_sample_frames": True, "num_frames": NUM_FRAMES, **video}
    return LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessorPil(
            size={"height": 32, "width": 32}, image_grid_pinpoints=llava.SMALL_PINPOINTS
        ),
        video_processor=LlavaOnevisionVideoProcessor(size={"height": 32, "width": 32}, **settings),
        tokenizer=llava.tokenizer(),
        num_image_tokens=16,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_1",
        chat_template=llava.TEMPLATE,
    )


def _decoded(data: bytes) -> tuple[np.ndarray[Any, Any], Any]:
    """Every frame of a clip (decord) and its metadata as transformers' decord loader writes
    it (frame count, average rate, duration)."""
    import decord
    from transformers.video_utils import VideoMetadata

    reader = decord.VideoReader(io.BytesIO(data), num_threads=1)
    frames = np.asarray(reader.get_batch(list(range(len(reader)))).asnumpy())
    fps = float(reader.get_avg_fps())
    metadata = VideoMetadata(total_num_frames=len(reader), fps=fps, duration=len(reader) / fps)
    return frames, metadata


def _reference(processor: Any, index: int) -> dict[str, Any]:
    """The processor's own outputs for sample ``index``: every decoded frame of each video
    with its metadata (the video processor samples them), the images as PIL; and the frames
    it sampled (``"sampled"``, from the video processor's own metadata)."""
    from PIL import Image

    videos, sizes, reply = SAMPLES[index]
    messages = conversation(videos, sizes, reply, index == VIDEO_FIRST)
    text = processor.apply_chat_template(messages, tokenize=False)
    images = [Image.fromarray(a) for a in make_images(index, sizes)]
    decoded = [_decoded(clip(name)) for name in videos]
    out = dict(
        processor(
            text=[text],
            images=[images] if images else None,
            videos=[frames for frames, _ in decoded] or None,
            video_metadata=[metadata for _, metadata in decoded] or None,
            return_tensors="pt",
        )
    )
    sampled = []
    for frames, metadata in decoded:
        own = processor.video_processor(
            videos=[frames], video_metadata=[metadata], return_metadata=True
        )
        sampled.append([int(i) for i in own["video_metadata"][0].frames_indices])
    return {**out, "sampled": sampled}


def _row(index: int) -> dict[str, Any]:
    videos, sizes, reply = SAMPLES[index]
    messages = conversation(videos, sizes, reply, index == VIDEO_FIRST)
    row: dict[str, Any] = {"id": f"s{index}", "messages": messages}
    if videos:
        row["videos"] = [clip(name) for name in videos]
    if sizes:
        row["images"] = [png_bytes(a) for a in make_images(index, sizes)]
    return row


def _labels(processor: Any, ids: Any) -> Any:
    """The reply tokens (the family's assistant rule on the decoded text) as labels."""
    import torch

    from energon_pack import model_family

    family = model_family(processor)
    text = processor.tokenizer.decode(ids)
    spans = family.assistant_spans(text)
    offsets = processor.tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)[
        "offset_mapping"
    ]
    mask = torch.tensor([any(s < b and a < e for a, b in spans) for s, e in offsets])
    labels = torch.where(mask, ids, IGNORE)
    labels[0] = IGNORE
    return labels


def omni_processor(kind: str = "qwen2_5_omni", **video: Any) -> Any:
    """The Omni processor of ``test_family_omni`` (``kind``) with its Qwen2-VL video processor
    (``VIDEO_FPS`` frames a second, at least 4; the family's patch size)."""
    import test_family_omni as omni
    from transformers import Qwen2VLVideoProcessor

    built = omni.processor(kind)
    settings = {"do_sample_frames": True, "fps": VIDEO_FPS, "cap_pixels_per_frame": False}
    settings["patch_size"] = omni.PATCH[kind]
    return omni.PROCESSORS[kind](
        image_processor=built.image_processor,
        video_processor=Qwen2VLVideoProcessor(**{**settings, **video}),
        feature_extractor=built.feature_extractor,
        tokenizer=built.tokenizer,
        chat_template=built.chat_template,
    )


def glm4v_processor() -> Any:
    """The GLM-4V processor of ``test_family_glm4v`` with its video processor (2 frames a
    second, at most 8 for the tiny model; frames of 56 to 112 pixels a side)."""
    import test_family_glm4v as glm4v
    from transformers import Glm4vImageProcessorPil, Glm4vProcessor, Glm4vVideoProcessor

    budget = {"shortest_edge": 2 * 56 * 56, "longest_edge": 8 * 112 * 112}
    return Glm4vProcessor(
        image_processor=Glm4vImageProcessorPil(),
        video_processor=Glm4vVideoProcessor(do_sample_frames=True, fps=VIDEO_FPS, size=budget),
        tokenizer=glm4v.TOKENIZER,
        chat_template=glm4v.TEMPLATE,
    )


def gemma4_processor() -> Any:
    """The Gemma 4 processor of ``test_family_gemma4`` with its video processor (``NUM_FRAMES``
    frames, 70 soft tokens a frame) and its template writing ``<|video|>`` for a video part."""
    import test_family_gemma4 as gemma4
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
        Gemma4VideoProcessor,
    )

    template = gemma4.TEMPLATE.replace(
        "{%- elif item['type'] == 'image' -%}{{- '<|image|>' -}}",
        "{%- elif item['type'] == 'image' -%}{{- '<|image|>' -}}"
        "{%- elif item['type'] == 'video' -%}{{- '<|video|>' -}}",
    )
    tokenizer = gemma4.tiny_tokenizer(
        gemma4.SPECIAL,
        template,
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        add_bos=True,
        extra=gemma4.NAMED,
    )
    return Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessorPil(),
        video_processor=Gemma4VideoProcessor(num_frames=NUM_FRAMES, max_soft_tokens=70),
        tokenizer=tokenizer,
        chat_template=template,
    )


def gemma4_model() -> Any:
    import test_family_gemma4 as gemma4

    return gemma4.tiny_model(gemma4_processor(), "vision")


def smolvlm_processor() -> Any:
    """The small SmolVLM processor of ``test_family_idefics3`` with its video processor (at most
    ``NUM_FRAMES`` frames, ``VIDEO_FPS`` a second, squared to the 28 px tiles) and the
    processor's own video template (its ``apply_chat_template`` takes it for a video)."""
    import test_family_idefics3 as idefics3
    from transformers import SmolVLMImageProcessorPil, SmolVLMProcessor, SmolVLMVideoProcessor
    from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE

    tile = idefics3.SMALL["max_image_size"]
    return SmolVLMProcessor(
        image_processor=SmolVLMImageProcessorPil(**idefics3.SMALL),
        video_processor=SmolVLMVideoProcessor(
            size=tile,
            max_image_size=tile,
            do_sample_frames=True,
            num_frames=NUM_FRAMES,
            fps=VIDEO_FPS,
        ),
        tokenizer=idefics3.tokenizer_for("smolvlm"),
        image_seq_len=idefics3.SMALL_SEQ,
        chat_template=DEFAULT_CHAT_TEMPLATE,
    )


def smolvlm_model() -> Any:
    import test_family_idefics3 as idefics3

    return idefics3.tiny_model("smolvlm", smolvlm_processor())


def omni_model() -> Any:
    import test_family_omni as omni

    return omni.tiny_model("qwen2_5_omni", omni_processor())


def qwen3_omni_processor() -> Any:
    return omni_processor("qwen3_omni")


def qwen3_omni_model() -> Any:
    import test_family_omni as omni

    return omni.tiny_model("qwen3_omni", qwen3_omni_processor())


FAMILIES = {
    "llava_onevision": ("llava_processor", "test_family_llava_onevision", "pixel_values_videos"),
    "internvl": ("internvl_processor", "test_family_internvl", "pixel_values"),
    "qwen2_5_omni": ("omni_processor", "test_family_video:omni_model", "pixel_values_videos"),
    "glm4v": ("glm4v_processor", "test_family_glm4v", "pixel_values"),
    "gemma4": ("gemma4_processor", "test_family_video:gemma4_model", "pixel_values_videos"),
    "smolvlm": ("smolvlm_processor", "test_family_video:smolvlm_model", "pixel_values"),
    "qwen3_omni": (
        "qwen3_omni_processor",
        "test_family_video:qwen3_omni_model",
        "pixel_values_videos",
    ),
}
"""Per family: its processor builder here, the test module of its tiny model, and the input
that holds its video frames."""


def family_checks(name: str) -> dict[str, Any]:
    """Every check of family ``name``'s videos, as plain values (an exception's traceback
    under ``"error"``)."""
    try:
        return _family_checks(name)
    except Exception:
        return {"error": traceback.format_exc()}


def _family_checks(name: str) -> dict[str, Any]:
    import importlib

    import torch

    from energon_pack import VLMPackingCollator, make_encoder, model_family
    from energon_pack.encoding.families.materialise import sample_media

    torch.set_num_threads(1)
    builder, module, frames_key = FAMILIES[name]
    processor = globals()[builder]()
    family = model_family(processor)
    encoder = make_encoder(family=processor)
    media_ids = [int(i) for i in encoder.media_ids_tensor]
    out: dict[str, Any] = {"samples": [], "placeholder": family.video_placeholder}
    indices = [i for i in range(len(SAMPLES)) if name not in ONE_KIND or i not in MIXED]
    for index in indices:
        row = _row(index)
        encoded = encoder.encode_sample(row["id"], row)
        want = _reference(processor, index)
        ids = want["input_ids"][0]
        got = sample_media(family, encoded, encoder.media) if encoded.media else {}
        if name == "glm4v":
            want = _as_images(want)
        videos = [m for m in encoded.media if m.kind == "video"]
        result: dict[str, Any] = {
            "index": index,
            "ids_equal": encoded.input_ids.tolist() == ids.tolist(),
            "mask_equal": encoded.loss_mask[1:].bool().tolist()
            == (_labels(processor, ids) != IGNORE)[1:].tolist(),
            "video_tokens": [m.tokens for m in videos],
            "media_tokens": sum(m.tokens for m in encoded.media),
            "processor_media_tokens": int(torch.isin(ids, torch.tensor(media_ids)).sum()),
            "frames": [list(m.frame_indices or ()) for m in videos],
            "sampled": want.pop("sampled"),
            "keys": sorted(got),
            "want_keys": sorted(
                k for k in want if k not in {"input_ids", "attention_mask", *family.token_keys}
            ),
        }
        for key in ("pixel_values_videos", "pixel_values"):
            if key in want:
                mine, theirs = got[key], want[key]
                if name == "smolvlm":  # the processor stacks a sample's videos on the batch
                    mine, theirs = mine.flatten(0, 1), theirs.flatten(0, 1)  # dim: the model too
                result[f"{key}_error"] = float((mine - theirs).abs().max())
        out["samples"].append(result)
    # a packed row of all four trains as they do alone
    module_name, _, model_name = module.partition(":")
    model = seeded(getattr(importlib.import_module(module_name), model_name or "tiny_model"))
    collator = VLMPackingCollator(seq_length=2048, family=family, output="hf", hf_model=model)
    packed = collator([_row(index) for index in indices])
    packed.pop("use_cache", None)
    out["packed_frames"] = list(packed[frames_key].shape)
    alone = []
    for index in indices:
        want = _reference(processor, index)
        want.pop("sampled")
        ids = want["input_ids"][0]
        tokens = {key: value[None] for key, value in family.token_inputs(ids).items()}
        alone.append({**want, **tokens, "labels": _labels(processor, ids)[None]})
    out["loss_error"], out["grad_error"] = packed_matches_alone(model, alone, packed)
    if name == "glm4v":  # a sample of both kinds: its positions are the model's rope index's
        out["mixed_positions"] = [_glm4v_positions_equal(processor, model, i) for i in MIXED]
    return out


def _glm4v_positions_equal(processor: Any, model: Any, index: int) -> bool:
    """Whether the GLM-4V family's positions of sample ``index`` (its videos' patches among
    its images) equal the model's rope index on the processor's own grids, and its pixels the
    processor's images and videos in text order."""
    import torch

    from energon_pack import make_encoder, model_family
    from energon_pack.encoding.families.materialise import sample_media

    family = model_family(processor)
    encoder = make_encoder(family=processor)
    row = _row(index)
    encoded = encoder.encode_sample(row["id"], row)
    media = sample_media(family, encoded, encoder.media)
    ours = family.position_ids(model, encoded.input_ids, media)
    want = _reference(processor, index)
    ids = want["input_ids"]
    types = family.token_inputs(ids[0])["mm_token_type_ids"][None]
    positions, _ = model.model.get_rope_index(
        ids,
        mm_token_type_ids=types,
        image_grid_thw=want["image_grid_thw"],
        video_grid_thw=want["video_grid_thw"],
    )
    parts = [want["pixel_values"], want["pixel_values_videos"]]
    pixels = torch.cat(parts[::-1] if index == VIDEO_FIRST else parts)  # in text order
    return bool(torch.equal(ours[1:], positions)) and bool(
        torch.equal(media["pixel_values"], pixels)
    )


def omni_capped_ids(_: object) -> list[bool]:
    """Whether each sample's ids equal the processor's when its video processor shares a
    pixel budget of 300 tokens over each video's frames (``cap_pixels_per_frame``)."""
    from energon_pack import make_encoder

    processor = omni_processor(cap_pixels_per_frame=True, max_video_tokens=300)
    encoder = make_encoder(family=processor)
    out = []
    for index in range(len(SAMPLES)):
        row = _row(index)
        ids = _reference(processor, index)["input_ids"][0].tolist()
        out.append(encoder.encode_sample(row["id"], row).input_ids.tolist() == ids)
    # a clip over the per-frame share of the budget: resized below the uncapped size
    frames, metadata = _decoded(clip("big"))
    messages = conversation(["big"], [], "Big.")
    row = {"id": "big", "messages": messages, "videos": [clip("big")]}
    counts = []
    for proc in (processor, omni_processor()):
        text = proc.apply_chat_template(messages, tokenize=False)
        ids = proc(text=[text], videos=[frames], video_metadata=[metadata], return_tensors="pt")
        ids = ids["input_ids"][0].tolist()
        out.append(make_encoder(family=proc).encode_sample("big", row).input_ids.tolist() == ids)
        counts.append(ids.count(proc.video_token_id))
    out.append(counts[0] < counts[1])
    return out


def _as_images(outputs: dict[str, Any]) -> dict[str, Any]:
    """GLM-4V's processor outputs for a sample of one kind with its video patches given as
    images, one per temporal patch, as its model's ``get_video_features`` flattens them (and
    as the family gives them; ``video_grid_thw`` kept)."""
    if "pixel_values_videos" not in outputs:
        return outputs
    out = dict(outputs)
    grid = out["video_grid_thw"]
    out["pixel_values"] = out.pop("pixel_values_videos")
    hw = grid[:, 1:].repeat_interleave(grid[:, 0], dim=0)
    out["image_grid_thw"] = np.concatenate([np.ones((len(hw), 1), dtype=np.int64), hw], axis=1)
    return out


def video_refusals(_: object) -> dict[str, Any]:
    """What a video processor cannot sample (LLaVA-OneVision: or stack): ``kind: message``."""
    from energon_pack import MediaError, make_encoder, model_family

    out: dict[str, Any] = {}
    for name, proc, member in (
        ("short", llava_processor(), "short"),
        ("unfixed", llava_processor(do_sample_frames=False), "a"),
        ("by_fps", llava_processor(num_frames=None, fps=2), "a"),
    ):
        row = {"id": name, "messages": conversation([member], [], "x"), "videos": [clip(member)]}
        try:
            make_encoder(family=proc).encode_sample(name, row)
            out[name] = "encoded"
        except MediaError as error:
            out[name] = f"{error.kind}: {error}"
    # a video processor without the rate its sampling needs: named, not a crash
    proc = smolvlm_processor()
    proc.video_processor.fps = None
    row = {"id": "no_fps", "messages": conversation(["a"], [], "x"), "videos": [clip("a")]}
    try:
        make_encoder(family=proc).encode_sample("no_fps", row)
        out["no_fps"] = "encoded"
    except MediaError as error:
        out["no_fps"] = f"{error.kind}: {error}"
    out["settings_differ"] = model_family(llava_processor(num_frames=2)).settings() != (
        model_family(llava_processor()).settings()
    )
    return out


ENERGON = {"seq_length": 1024, "pad_to_multiple_of": 8, "tokenizer": None}
SKIPPED = {"s005": "unsupported", "s010": "unreadable"}
"""Samples the Energon path skips: a clip shorter than ``num_frames``, a cut MP4."""


def energon_samples() -> list[tuple[str, dict[str, bytes]]]:
    """18 native samples: every fourth text-only, the others one clip (every fifth with an
    image before it); ``s005`` holds a 3-frame clip, ``s010`` a cut one."""
    out = []
    names = ["a", "b", "c", "d"]
    for index in range(18):
        key = f"s{index:03d}"
        members: dict[str, bytes] = {}
        text = f"What happens in {index}?"
        if index % 4:
            data = clip("short" if key == "s005" else names[index % 4])
            members["0.mp4"] = data[: len(data) // 3] if key == "s010" else data
            text = "<video>" + text
            if index % 5 == 1:
                members["1.png"] = png_bytes(make_images(index, [(40, 60)])[0])
                text = "<image>" + text
        media = sorted(name for name in members)[::-1]  # the image, then the clip
        turns = [
            {"from": "human", "value": text},
            {"from": "gpt", "value": f"Something moves {index}."},
        ]
        members["json"] = json.dumps({"conversations": turns, "media": media}).encode()
        out.append((key, members))
    return out


def llava_onevision_energon(path: str) -> dict[str, Any]:
    """The Energon path over the dataset at ``path`` (see :func:`energon_samples`), as plain
    values (:func:`~energon_family.family_run_report`)."""
    from energon_family import family_run_report

    return family_run_report(Path(path), llava_processor(), dict(energon_samples()), ENERGON)


# --- the tests ------------------------------------------------------------------------------


def _child(target: str, payload: Any = None) -> dict[str, Any]:
    """``target``'s results in the torchvision child, skipped where it is not installed."""
    if not available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    result = dict(run_in_child(f"test_family_video:{target}", payload, timeout=500))
    assert "error" not in result, result.get("error")
    return result


@cache
def checks(name: str) -> dict[str, Any]:
    return _child("family_checks", name)


def expected_frames(name: str, member: str) -> list[int]:
    """The frames the family's video processor samples of clip ``member``, by its rule."""
    _, _, total, fps = CLIPS[member]
    if name in ("llava_onevision", "gemma4"):  # NUM_FRAMES, uniform from the first frame
        return [i * total // NUM_FRAMES for i in range(NUM_FRAMES)]
    count = int(total / fps * VIDEO_FPS)  # VIDEO_FPS a second
    if name.endswith("omni"):  # at least 4, whole temporal patches of 2, from the first frame
        count = min(max(count, 4), total // 2 * 2) // 2 * 2
        return [int(i * (total / count)) for i in range(count)]
    if name == "smolvlm":  # VIDEO_FPS a second, at most NUM_FRAMES, evenly from first to last
        count = min(round(total / fps * VIDEO_FPS), NUM_FRAMES)
        return sorted({int(i * (total - 1) / (count - 1)) for i in range(count)})
    if name == "glm4v":  # the frame at each half second, an odd count's last one twice
        times = max(int(total / fps * VIDEO_FPS), 1)
        picked = list(dict.fromkeys(min(total - 1, -(-i * fps // VIDEO_FPS)) for i in range(times)))
        return picked + picked[-1:] * (len(picked) % 2)
    step = total / count  # InternVL: from the middle of each span
    return [int(step / 2 + i * step) for i in range(count)]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_video_tokens_ids_and_labels_are_the_processors(name: str) -> None:
    result = checks(name)
    placeholders = {"glm4v": "<|video|>", "gemma4": "<|video|>"}
    placeholders |= {"qwen2_5_omni": "<|VIDEO|>", "qwen3_omni": "<|VIDEO|>"}
    assert result["placeholder"] == placeholders.get(name, "<video>")
    for sample in result["samples"]:
        index = sample["index"]
        assert sample["ids_equal"], index
        assert sample["mask_equal"], index
        assert sample["media_tokens"] == sample["processor_media_tokens"], index
        if name in placeholders:  # sized per clip: the ids and counts above are the check
            continue
        frames = [len(expected_frames(name, member)) for member in SAMPLES[index][0]]
        per_frame = 4  # 4x4 patches pooled (LLaVA-OneVision) or pixel-shuffled (InternVL) to 4
        newline = 1 if name == "llava_onevision" else 0
        assert sample["video_tokens"] == [count * per_frame + newline for count in frames]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_frames_are_the_video_processors(name: str) -> None:
    """The frames kept are those the video processor samples (its own metadata says which, and
    its rule gives them), and the pixels equal its own on every decoded frame."""
    for sample in checks(name)["samples"]:
        videos = SAMPLES[sample["index"]][0]
        assert sample["frames"] == sample["sampled"]
        assert sample["frames"] == [expected_frames(name, member) for member in videos]
        assert sample["keys"] == sample["want_keys"]
        assert sample.get("pixel_values_videos_error", 0.0) <= 1e-6
        assert sample.get("pixel_values_error", 0.0) <= 1e-6


@pytest.mark.parametrize(
    ("name", "frames"),
    [
        ("llava_onevision", [5, NUM_FRAMES, 3, 32, 32]),  # videos x frames
        # frames and tiles in text order: 4 frames; the image's 4x2 tiles and thumbnail, 8
        # frames; 4 and 4 frames; 4 frames, then the image's 3x2 tiles and thumbnail; the last
        # image's 5x2 tiles and thumbnail
        ("internvl", [4 + 9 + 8 + 4 + 4 + 4 + 7 + 11, 3, 32, 32]),
        # 2x2 merged patches of each video's tokens, each patch 2 frames x 3 x 14 x 14
        ("qwen2_5_omni", [4 * (280 + 560 + 288 + 256 + 256), 2 * 3 * 14 * 14]),
        # the videos' temporal patches given as images (8, 8 + 4 tokens), then the image's 10
        # (s1 and s4 hold both kinds, which GLM-4V's model takes in no sample)
        ("glm4v", [4 * (8 + 8 + 4 + 10), 2 * 3 * 14 * 14]),
        # every video's frames, each padded to 70 soft tokens of 3x3 patches of 16 px
        ("gemma4", [4 * 5, 70 * 9, 3 * 16 * 16]),
        ("qwen3_omni", [4 * (280 + 560 + 288 + 256 + 256), 2 * 3 * 16 * 16]),  # 16 px patches
        # one batch row: 4, 4 + 4 frames and the image's 9 tiles, squared to 28 px
        ("smolvlm", [1, 4 + 8 + 9, 3, 28, 28]),
    ],
)
def test_a_packed_row_of_videos_trains_as_its_samples_alone(name: str, frames: list[int]) -> None:
    result = checks(name)
    assert result["packed_frames"] == frames
    # the loss is reduced in float32 by transformers (logits.float()); gradients stay float64,
    # but for GLM-4V's vision tower, which interpolates its position table (grid_sample) and
    # normalises in float32, and Gemma 4, whose RMSNorm and attention run in float32, in image
    # rows as in video rows
    assert result["loss_error"] < 1e-6
    assert result["grad_error"] < (1e-6 if name in ("glm4v", "gemma4") else 1e-10)
    if name == "glm4v":
        assert result["mixed_positions"] == [True] * len(MIXED)


def test_omni_video_tokens_under_a_shared_pixel_budget_are_the_processors() -> None:
    if not available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    assert run_in_child("test_family_video:omni_capped_ids", timeout=500) == [True] * 9


def test_videos_a_video_processor_cannot_sample_or_stack_are_refused_by_name() -> None:
    refusals = _child("video_refusals")
    assert refusals["short"].startswith("unsupported")
    assert "num_frames=4" in refusals["short"]
    assert "total_num_frames=3" in refusals["short"]
    for name in ("unfixed", "by_fps"):
        assert refusals[name].startswith("unsupported"), refusals[name]
        assert "do_sample_frames=True and num_frames" in refusals[name]
    assert refusals["settings_differ"]
    assert refusals["no_fps"].startswith("unsupported")
    assert "TypeError" in refusals["no_fps"]
    assert "check its sampling settings (num_frames, fps)" in refusals["no_fps"]


def test_llava_onevision_videos_on_the_energon_path_pack_as_the_collator_and_resume(
    tmp_path: Path,
) -> None:
    if not available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    path = write_dataset(tmp_path / "videos", energon_samples())
    result = run_in_child("test_family_video:llava_onevision_energon", str(path), timeout=500)
    assert "error" not in result, result.get("error")
    assert result["unequal"] == []
    assert len(result["seen"]) == len(set(result["seen"]))
    assert set(result["seen"]) == {key for key, _ in energon_samples()} - set(SKIPPED)
    counted: dict[str, int] = {}
    for counts in result["skipped"].values():
        for kind, count in counts.items():
            counted[kind] = counted.get(kind, 0) + count
    assert counted == {"unsupported": 1, "unreadable": 1}
    assert result["resumed"] == {1: "exact", 4: "exact", 9: "exact"}
