"""Qwen3-VL video against transformers' ``Qwen3VLProcessor`` (the installed release, 5.24 or
5.25, in the video form of that release: :data:`OUTER_BLOCK`; its own ``Qwen3VLVideoProcessor``,
loaded from a model directory holding only processor/config JSON files and the tokenizer), run
in a child process (:mod:`qwen3_reference`).

Our side is the preset built from that same directory (:func:`energon_pack.model_family`):
ids with timestamps, ``video_grid_thw``, the sampled frame indices and the pixels, on the
fixtures' clips and on generated clips of 1-60 fps and 1 s to 10 min; the sampling and
timestamp rule on 2,000+ (fps, frame count) pairs without containers.
"""

from __future__ import annotations

import io
import json
import math
import re
import tarfile
from dataclasses import replace
from fractions import Fraction
from importlib.metadata import version
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import qwen3_reference
import torch
from chat_templates import MARKED, QWEN2_VL, QWEN3_VL
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.version import Version
from real_qwen import real_qwen_tokenizer

from energon_pack import ConversationEncoder, TemplateEncoder, model_family
from energon_pack.formats.raw import RawSample
from energon_pack.media import Frames, MediaConfig, MediaError, probe_video, timestamp_text
from energon_pack.media.sampling import video_rule

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "vlm_demo"
PROMPT, ANSWER = "Describe the clip.", "A moving ramp."
GENERATED = [  # (fps, seconds, width, height)
    (1, 600, 32, 32),  # 10 min
    (2, 45, 64, 32),
    (5, 1, 64, 48),
    (12, 20, 32, 32),
    (24, Fraction(64, 24), 64, 64),  # 64 frames at 24 fps: 3 temporal patches
    (25, 37, 32, 32),
    (Fraction(30000, 1001), 10, 64, 32),
    (30, 1, 96, 64),
    (2, 7, 160, 128),  # the custom checkpoint: 7 frames (odd) over its t*h*w budget
    (60, 1, 40, 40),
    (60, 5, 32, 32),
]
FRAMED = [  # (text before the video, text after it) in the user turn
    ("Watch this: ", " What happens?"),
    ("Clip 2 -", " what?"),
    ("(", ")"),
    ("Describe ", "."),
    ("Here it is:\n", "\nSummarise it."),
    ("Look at the video, please! ", "Thanks"),
    ("Q: what is in [", "]?"),
    ("Video → ", " — explain"),
    ("1.", " 2. ok"),
    ("«", "» and more text after the video, which ends here"),
]
"""Text before (and after) the video: the first timestamp merges with the text before it."""
PIXEL_TOLERANCE = 2 / 255 + 1e-6
"""Largest |difference| allowed between our normalised pixels (Pillow's bicubic resize) and the
reference's (torchvision's): one 8-bit level (2/255 in the [-1, 1] normalisation). Measured on
the clips here: 6e-8 (float rounding) where no resize happens, one level on at most 0.1% of the
values of a resized clip."""
DIFFERING_SHARE = 0.005
"""Most values of one clip allowed to differ by more than float rounding (measured: 0.1%)."""

TOKENIZER = real_qwen_tokenizer(chat_template=QWEN3_VL)
OUTER_BLOCK = Version(version("transformers")) < Version("5.25")
"""The video form of the installed transformers' ``Qwen3VLProcessor``, the reference here:
5.24 keeps the template's outer ``<|vision_start|>`` / ``<|vision_end|>`` pair around a video's
timestamped blocks (``video_outer_block=True``); 5.25 replaces the pair by the blocks, as 4.57
did (``video_outer_block=False``, the default)."""
TIMESTAMP = r"<\d+\.\d seconds>"


def clip_bytes(width: int, height: int, frames: int, fps: Fraction | int) -> bytes:
    """An H.264 MP4 of a moving ramp (every frame differs), written fast."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "ultrafast"}
        ramp = np.add.outer(np.arange(height), np.arange(width))[..., None]
        for index in range(frames):
            level = np.broadcast_to((ramp + index * 37) % 256, (height, width, 3))
            frame = av.VideoFrame.from_ndarray(level.astype(np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return out.getvalue()


def fixture_members(*extensions: str) -> dict[str, bytes]:
    found = {}
    for shard in sorted(FIXTURES.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(extensions):
                    data = tar.extractfile(member)
                    assert data is not None
                    found[member.name] = data.read()
    return found


def fixture_clips() -> dict[str, bytes]:
    return fixture_members(".mp4")


def fixture_images() -> dict[str, bytes]:
    """The first four images of each format."""
    images: dict[str, bytes] = {}
    for extension in (".jpg", ".png", ".webp"):
        images |= dict(list(fixture_members(extension).items())[:4])
    return images


def sweep_pairs() -> list[tuple[float, int]]:
    """2,100 (fps, frame count) pairs: common and odd rates, 1 frame to 2 hours."""
    rng = np.random.default_rng(24)
    rates = [1.0, 2.0, 5.0, 8.0, 12.0, 15.0, 24000 / 1001, 24.0, 25.0, 30000 / 1001, 30.0]
    rates += [48.0, 50.0, 60000 / 1001, 60.0, 120.0]
    pairs = [(fps, frames) for fps in rates for frames in (1, 2, 3, 4, 5, 7, 63, 64, 65)]
    while len(pairs) < 2100:
        fps = float(rng.choice(rates)) if rng.random() < 0.7 else float(rng.uniform(0.5, 60))
        frames = int(np.exp(rng.uniform(0, math.log(2 * 3600 * fps))))
        pairs.append((fps, max(1, frames)))
    return pairs


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3")
    return {
        "released": qwen3_reference.write_model_dir(root / "released"),
        # the checkpoint's own values, not the class defaults, must be read
        "custom": qwen3_reference.write_model_dir(
            root / "custom",
            fps=1,
            max_frames=10,
            size={"longest_edge": 40 * 32 * 32 * 2, "shortest_edge": 4096},
        ),
    }


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    out = fixture_clips()
    for fps, seconds, width, height in GENERATED:
        frames = round(Fraction(fps) * Fraction(seconds))
        out[f"gen-{float(fps):.3f}fps-{frames}f"] = clip_bytes(width, height, frames, fps)
    return out


@pytest.fixture(scope="module")
def reference(
    model_dirs: dict[str, Path], clips: dict[str, bytes], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """All reference results, from one child process (skipped, with the reason, where the
    reference torchvision is not installed)."""
    if not qwen3_reference.available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    folder = tmp_path_factory.mktemp("clips")
    jobs: list[dict[str, Any]] = []
    names = []
    for index, (name, data) in enumerate(clips.items()):
        path = folder / f"{name}.mp4"
        path.write_bytes(data)
        generated = name.startswith("gen-")
        for form, model_dir in model_dirs.items():
            if form == "custom" and not (generated or index % 3 == 0):
                continue  # the custom checkpoint: a third of the fixture clips
            pixels = form == "released" and (generated or index < 10)
            jobs.append(
                {
                    "kind": "video",
                    "path": str(path),
                    "prompt": PROMPT,
                    "answer": ANSWER,
                    "pixels": pixels,
                    "model_dir": str(model_dir),
                }
            )
            names.append((form, name))
    fixture = [name for name in clips if not name.startswith("gen-")]
    framed = [(fixture[4 * i], before, after) for i, (before, after) in enumerate(FRAMED)]
    for name, before, after in framed:
        job = {"kind": "video", "path": str(folder / f"{name}.mp4"), "before": before}
        jobs.append({**job, "prompt": after, "answer": ANSWER})
    frames = np.stack([np.full((48, 64, 3), 40 * i, dtype=np.uint8) for i in range(5)])
    jobs.append({"kind": "video", "frames": frames, "fps": 3.0, "prompt": PROMPT, "answer": ANSWER})
    jobs.append({"kind": "rule", "pairs": sweep_pairs()})
    images = fixture_images()
    for name, data in images.items():
        path = folder / name
        path.write_bytes(data)
        jobs.append({"kind": "image", "path": str(path), "prompt": PROMPT, "answer": ANSWER})
    results = qwen3_reference.run_reference(model_dirs["released"], jobs)
    by_name = dict(zip(names, results[: len(names)], strict=True))
    rest = results[len(names) :]
    return {
        "videos": by_name,
        "framed": [(*job, ref) for job, ref in zip(framed, rest[: len(framed)], strict=True)],
        "frames": (frames, rest[len(framed)]),
        "rule": rest[len(framed) + 1],
        "images": dict(zip(images, rest[len(framed) + 2 :], strict=True)),
    }


def _sample(content: str, member: str, data: bytes | Frames) -> dict[str, Any]:
    turns = [{"role": "user", "content": content}, {"role": "assistant", "content": ANSWER}]
    return {"json": json.dumps({"conversations": turns, "media": [member]}).encode(), member: data}


def _encoder(media: MediaConfig) -> ConversationEncoder:
    return ConversationEncoder(TOKENIZER, media=media)


def _template_encoder(media: MediaConfig) -> TemplateEncoder:
    """The encoder driven by the Qwen3-VL chat template itself (the same media hook)."""
    return TemplateEncoder(TOKENIZER, media=media)


def _marked_template_encoder(media: MediaConfig) -> TemplateEncoder:
    """The template encoder on the Qwen3-VL template with generation markers (its mask from
    the rendered generation spans)."""
    return TemplateEncoder(TOKENIZER, media=media, chat_template=MARKED["QWEN3_VL"])


def without_outer_block(ids: list[int]) -> list[int]:
    """The form without the outer pair (transformers 4.57's and 5.25's) of ids in 5.24's form:
    those processors replace the template's ``<|vision_start|><|video_pad|><|vision_end|>`` by
    the blocks and then tokenise the text; here the outer pairs are cut from 5.24's text (a
    start before a timestamp, the second of two ends) and the text tokenised again."""
    text = TOKENIZER.decode(ids, skip_special_tokens=False)
    text = re.sub(rf"<\|vision_start\|>(?={TIMESTAMP})", "", text)
    text = text.replace("<|vision_end|><|vision_end|>", "<|vision_end|>")
    result: list[int] = TOKENIZER(text)["input_ids"]
    return result


def with_outer_block(ids: list[int]) -> list[int]:
    """5.24's form of ids without the outer pair: a start before each video's first timestamp
    (one not right after a block's end), a second end after its last block (an end that no
    timestamp follows), the text tokenised again."""
    text = TOKENIZER.decode(ids, skip_special_tokens=False)
    text = re.sub(rf"(?<!<\|vision_end\|>)(?={TIMESTAMP})", "<|vision_start|>", text)
    text = re.sub(rf"<\|vision_end\|>(?!{TIMESTAMP})", "<|vision_end|><|vision_end|>", text)
    result: list[int] = TOKENIZER(text)["input_ids"]
    return result


def both_forms(ids: list[int]) -> dict[bool, list[int]]:
    """The installed processor's ids (in its form, :data:`OUTER_BLOCK`) and the same ids in the
    other form, by the ``video_outer_block`` value that writes each."""
    if OUTER_BLOCK:
        return {True: ids, False: without_outer_block(ids)}
    return {False: ids, True: with_outer_block(ids)}


def test_the_reference_writes_the_video_form_of_its_release(reference: dict[str, Any]) -> None:
    """The one difference in video text between the releases this file follows: 5.24 opens a
    video with the outer ``<|vision_start|>`` before its first timestamp and closes it with a
    second ``<|vision_end|>``; 5.25 writes neither. The other form is derived exactly."""
    for ref in [*reference["videos"].values(), *(r for *_, r in reference["framed"])]:
        text = TOKENIZER.decode(ref["input_ids"], skip_special_tokens=False)
        opened = re.search(rf"<\|vision_start\|>{TIMESTAMP}", text) is not None
        assert opened == OUTER_BLOCK, text
        assert ("<|vision_end|><|vision_end|>" in text) == OUTER_BLOCK, text
        forms = both_forms(ref["input_ids"])
        assert with_outer_block(forms[False]) == forms[True]
        assert without_outer_block(forms[True]) == forms[False]


def test_ids_grid_and_frames_equal_the_processor(
    model_dirs: dict[str, Path], clips: dict[str, bytes], reference: dict[str, Any]
) -> None:
    """For every clip and both checkpoints: ids with timestamps in the installed release's form
    and in the other one (:func:`both_forms`), the grid and the sampled frames."""
    checked = 0
    for (form, name), ref in reference["videos"].items():
        media = model_family(model_dirs[form]).media
        data = clips[name]
        probe = probe_video(data, media)
        assert list(probe.grid_thw) == ref["video_grid_thw"][0], (form, name)
        assert list(probe.frame_indices[: probe.frames]) == ref["frames_indices"], (form, name)
        assert (probe.source_frames, probe.fps) == (ref["total"], ref["fps"]), (form, name)
        sample = _sample(f"<video>{PROMPT}", "0.mp4", data)
        for make in (_encoder, _template_encoder):
            for outer, expected in both_forms(ref["input_ids"]).items():
                encoded = make(replace(media, video_outer_block=outer)).encode_sample(name, sample)
                assert encoded.input_ids.tolist() == expected, (form, name, outer)
        checked += 1
    generated = sum(name.startswith("gen-") for name in clips)
    assert checked == len(clips) + generated + math.ceil((len(clips) - generated) / 3)
    # the custom checkpoint's settings were read: fewer frames than the released one's
    videos = reference["videos"]
    short = [
        (videos[("custom", n)], videos[("released", n)]) for n in clips if ("custom", n) in videos
    ]
    assert any(len(c["frames_indices"]) < len(r["frames_indices"]) for c, r in short)


def test_text_before_the_video_is_tokenised_with_its_first_timestamp(
    model_dirs: dict[str, Path], clips: dict[str, bytes], reference: dict[str, Any]
) -> None:
    """Ten user turns with text before and after the video (:data:`FRAMED`): the processor
    tokenises the expanded text whole, so without the outer pair (4.57, 5.25) the first timestamp
    merges with the text before it (``" <"``, ``"(<"``, ``".<"``); both encoders (the template
    one with and without generation markers) give those ids, and 5.24's with
    ``video_outer_block=True``. The loss stays on the answer alone."""
    media = model_family(model_dirs["released"]).media
    assert len(reference["framed"]) == len(FRAMED)
    differing: dict[str, list[str]] = {}
    for name, before, after, ref in reference["framed"]:
        expanded = TOKENIZER.decode(ref["input_ids"], skip_special_tokens=False)
        assert TOKENIZER(expanded)["input_ids"] == ref["input_ids"], name  # decoding is exact
        opening = "<|vision_start|>" if OUTER_BLOCK else ""
        assert f"{before}{opening}<" in expanded, name
        sample = _sample(f"{before}<video>{after}", "0.mp4", clips[name])
        for make in (_encoder, _template_encoder, _marked_template_encoder):
            for outer, expected in both_forms(ref["input_ids"]).items():
                encoded = make(replace(media, video_outer_block=outer)).encode_sample(name, sample)
                if encoded.input_ids.tolist() != expected:
                    case = f"{make.__name__} video_outer_block={outer}"
                    differing.setdefault(case, []).append(before)
                targets = encoded.input_ids[encoded.loss_mask.bool()].tolist()
                assert TOKENIZER.decode(targets) == f"{ANSWER}<|im_end|>", (name, outer)
    assert not differing, "; ".join(
        f"{case}: {len(b)} of {len(FRAMED)} differ {b}" for case, b in differing.items()
    )


def test_a_timestamp_is_no_target_where_it_merges_with_assistant_text() -> None:
    """A video after text in an assistant turn (Qwen2-VL's template renders media there): the
    ids of the expanded text tokenised whole, equal in both encoders (a template with and
    without generation markers); a token holding assistant text and the timestamp (``" <"``)
    is a target, the timestamp's own tokens are not. A hook's ids are placed as they are."""
    turns = [
        {"role": "user", "content": "Show me (<video>) now"},
        {"role": "assistant", "content": "Look: <video> ok"},
    ]
    data = next(iter(fixture_clips().values()))
    sample = {"json": json.dumps({"conversations": turns, "media": ["0.mp4", "1.mp4"]}).encode()}
    sample |= {"0.mp4": data, "1.mp4": data}
    system = "You are a helpful assistant."  # Qwen2-VL's default, for the ChatML encoder
    media = model_family("qwen3_vl").media
    targets = {False: "Look: < ok<|im_end|>", True: "Look:  ok<|im_end|>"}
    found: dict[bool, list[int]] = {}
    for outer, expected in targets.items():
        cfg = replace(media, video_outer_block=outer)
        encoders = [
            ConversationEncoder(TOKENIZER, media=cfg, system_prompt=system),
            TemplateEncoder(TOKENIZER, media=cfg, chat_template=QWEN2_VL),
            TemplateEncoder(TOKENIZER, media=cfg, chat_template=MARKED["QWEN2_VL"]),
        ]
        encoded = [encoder.encode_sample("k", sample) for encoder in encoders]
        for one in encoded:
            assert one.input_ids.tolist() == encoded[0].input_ids.tolist()
            assert one.loss_mask.tolist() == encoded[0].loss_mask.tolist()
            assert TOKENIZER.decode(one.input_ids[one.loss_mask.bool()].tolist()) == expected
        found[outer] = encoded[0].input_ids.tolist()
    assert found[False] == without_outer_block(found[True])
    default = ConversationEncoder(TOKENIZER, media=media, system_prompt=system)
    hooked = ConversationEncoder(
        TOKENIZER, media=media, system_prompt=system, media_block=default.media_block
    )
    encoded = hooked.encode_sample("k", sample)
    ids = encoded.input_ids.tolist()
    assert ids != found[False]  # " (<" merged by default; "(" and "<" apart with the hook
    block = default.media_block(encoded.media[0])
    start = TOKENIZER.convert_tokens_to_ids("<|vision_start|>")
    at = ids.index(start) - block.index(start)
    assert ids[at : at + len(block)] == block


def test_pixels_within_tolerance(
    model_dirs: dict[str, Path], clips: dict[str, bytes], reference: dict[str, Any]
) -> None:
    """Our pixels (Pillow bicubic) against the processor's (torchvision bicubic, antialiased):
    within :data:`PIXEL_TOLERANCE`, few values differing at all (:data:`DIFFERING_SHARE`)."""
    media = model_family(model_dirs["released"]).media
    worst = 0.0
    compared = 0
    for (_form, name), ref in reference["videos"].items():
        if "pixel_values_videos" not in ref:
            continue
        encoded = _encoder(media).encode_sample(
            name, _sample(f"<video>{PROMPT}", "0.mp4", clips[name])
        )
        vision = encoded.materialize(media).vision
        assert vision is not None
        assert vision.pixel_values_videos is not None
        ours = vision.pixel_values_videos
        theirs = torch.from_numpy(ref["pixel_values_videos"])
        assert ours.shape == theirs.shape, name
        diff = (ours - theirs).abs()
        assert float((diff > 1e-6).float().mean()) <= DIFFERING_SHARE, name
        worst = max(worst, float(diff.max()))
        compared += 1
    assert compared >= 20
    assert worst <= PIXEL_TOLERANCE, f"max |difference| {worst}"


def test_images_equal_the_processor_of_the_directory(
    model_dirs: dict[str, Path], reference: dict[str, Any]
) -> None:
    """Images through the preset built from the directory: the ids and grid of
    ``Qwen3VLProcessor.from_pretrained`` (its torchvision image processor there), pixels within
    :data:`PIXEL_TOLERANCE`."""
    media = model_family(model_dirs["released"]).media
    images = fixture_images()
    for name, ref in reference["images"].items():
        encoded = _encoder(media).encode_sample(
            name, _sample(f"<image>{PROMPT}", name, images[name])
        )
        assert encoded.input_ids.tolist() == ref["input_ids"], name
        vision = encoded.materialize(media).vision
        assert vision is not None
        assert vision.image_grid_thw is not None
        assert vision.image_grid_thw.tolist() == ref["image_grid_thw"], name
        assert vision.pixel_values is not None
        diff = (vision.pixel_values - torch.from_numpy(ref["pixel_values"])).abs()
        assert float(diff.max()) <= PIXEL_TOLERANCE, (name, float(diff.max()))
    assert len(reference["images"]) == 12


def test_decoded_frames_take_an_explicit_fps(reference: dict[str, Any]) -> None:
    """Frames without a container (Bridge-style arrays) with ``Frames(fps=...)``: the same ids
    as the processor given those frames and that rate (in its form, :data:`OUTER_BLOCK`);
    without the fps, a clear error."""
    array, ref = reference["frames"]
    media = model_family("qwen3_vl").media_config(video_outer_block=OUTER_BLOCK)
    turns = (("user", f"<video>{PROMPT}"), ("assistant", ANSWER))

    def encode(frames: Frames, cfg: MediaConfig) -> list[int]:
        raw = RawSample("f", turns, None, (("videos[0]", "video", frames),))
        ids: list[int] = _encoder(cfg).encode(raw).input_ids.tolist()
        return ids

    assert encode(Frames.from_array(array, fps=3.0), media) == ref["input_ids"]
    # the frames' own rate wins over the setting
    other = replace(media, video_frames_fps=7.0)
    assert encode(Frames.from_array(array, fps=3.0), other) == ref["input_ids"]
    # a dataset's arrays without a rate (Megatron-Bridge layout): the setting gives it
    assert (
        encode(Frames.from_array(array), replace(media, video_frames_fps=3.0)) == ref["input_ids"]
    )
    with pytest.raises(MediaError, match=r"Frames\(\.\.\., fps=\.\.\.\) or MediaConfig"):
        encode(Frames.from_array(array), media)


def test_sampling_rule_sweep(reference: dict[str, Any]) -> None:
    """2,100 (fps, frame count) pairs: the same sampled indices, temporal patch count and
    timestamps (and their text) as the processor's rule."""
    media = model_family("qwen3_vl").media
    rule = video_rule(media)
    pairs = sweep_pairs()
    assert len(pairs) >= 2000
    for (fps, total), (indices, seconds) in zip(pairs, reference["rule"], strict=True):
        ours = rule.sample(total, fps, media)
        assert ours == indices, (fps, total)
        stamps = rule.timestamps(ours, fps, media)
        assert stamps is not None
        assert rule.grid(64, 64, len(ours), media)[0] == len(seconds) == len(stamps), (fps, total)
        assert list(stamps) == seconds, (fps, total)
        assert [timestamp_text(s) for s in stamps] == [f"<{s:.1f} seconds>" for s in seconds]


@settings(max_examples=300, deadline=None)
@given(
    fps=st.floats(0.1, 240.0, allow_nan=False),
    total=st.integers(1, 500_000),
    min_frames=st.integers(1, 16),
    max_frames=st.integers(2, 1024),
)
def test_sampling_invariants(fps: float, total: int, min_frames: int, max_frames: int) -> None:
    """Indices are sorted, within the clip, as many as the bounds allow; one timestamp per
    temporal patch, non-decreasing, each within its patch's frames."""
    media = MediaConfig(
        video_rule="qwen3_vl", video_min_frames=min_frames, video_max_frames=max_frames
    )
    rule = video_rule(media)
    indices = rule.sample(total, fps, media)
    assert indices == sorted(indices)
    assert indices[0] >= 0
    assert indices[-1] <= total - 1
    assert len(indices) == min(max(int(total / fps * 2), min_frames), max_frames, total)
    stamps = rule.timestamps(indices, fps, media)
    assert stamps is not None
    assert len(stamps) == math.ceil(len(indices) / 2)
    assert list(stamps) == sorted(stamps)
    assert all(indices[2 * i] / fps <= s <= (total - 1) / fps for i, s in enumerate(stamps))


def test_a_single_frame_is_sized_as_its_padded_pair() -> None:
    """transformers refuses a one-frame clip; here it is one temporal patch (the frame twice),
    sized as two frames, at 0.0 seconds."""
    media = model_family("qwen3_vl").media
    probe = probe_video(clip_bytes(64, 64, 1, 30), media)
    assert (probe.frames, probe.frame_indices, probe.timestamps) == (1, (0, 0), (0.0,))
    assert probe.grid_thw == (1, 4, 4)
