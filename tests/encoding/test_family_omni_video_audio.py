"""The Omni thinkers (Qwen2.5-Omni, Qwen3-Omni-MoE) with ``load_audio_from_video``: a video's own
audio track (an AAC track of an MP4) is counted from its header with the sample's other audio,
interleaved with the video's tokens by time as transformers' own processor interleaves them,
decoded after the video's frames for the audio encoder, and a packed row of such samples (a
silent video, a plain audio and an image among them) trains on a tiny thinker as its samples
alone (the model's rope index with ``use_audio_in_video`` per segment).

transformers' video processors need torchvision, which this process never imports: the checks
run in the torchvision child (:mod:`torchvision_child`) and send back plain values.
"""

from __future__ import annotations

import itertools
import json
import traceback
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from energon_shards import write_dataset
from family_kit import (
    IGNORE,
    Media,
    conversation,
    media_row,
    packed_matches_alone,
    png_bytes,
    seeded,
    sound,
)
from family_kit import test_images as make_images
from hypothesis import given, settings
from hypothesis import strategies as st
from test_family_video import omni_processor, tiles_mp4
from torchvision_child import available, run_in_child
from transformers import Qwen2_5OmniProcessor

from energon_pack.encoding.families.qwen2_5_omni import _chunk_sizes
from energon_pack.media import MediaError
from energon_pack.media.audio import probe_video_audio

RATE = 16_000
TRACKS = {  # member -> (width, height, frames, fps, seconds of audio; 0: no track)
    "t1": (64, 48, 8, 4, 2.0),
    "t2": (96, 64, 12, 3, 4.5),  # past two 2-second chunks
    "t3": (64, 64, 10, 5, 1.2),  # a track shorter than its video
    "silent": (64, 48, 8, 4, 0.0),
}
SAMPLES: list[tuple[Media, str]] = [
    ([("video", "t1")], "A rising tone."),
    ([("image", (50, 90)), ("video", "t2")], "An image, then a long clip."),
    ([], "Only text."),
    ([("video", "t3"), ("audio", 1.3)], "A clip, then a sound."),
    ([("audio", 1.1), ("video", "t1"), ("video", "t2")], "A sound, then two clips."),
    ([("video", "silent")], "A silent clip."),
]
"""Each sample's media in text order (a video by member, an image by size, an audio by its
seconds) and its reply."""


@cache
def track(member: str) -> bytes:
    """Clip ``member`` of :data:`TRACKS`."""
    width, height, frames, fps, seconds = TRACKS[member]
    return tiles_mp4(width, height, frames, fps, seed=len(member), audio_seconds=seconds)


def row(index: int) -> dict[str, Any]:
    """Sample ``index`` of :data:`SAMPLES` as a row."""
    return media_row(index, *SAMPLES[index], track)


# --- run in the torchvision child -----------------------------------------------------------


SECONDS_PER_CHUNK = 1.0
"""Qwen2.5-Omni's chunks of time, shorter than released (2 s) so that the 2-second audio window
of the test's feature extractor spans two."""


def processor(kind: str) -> Any:
    """The Omni processor of ``test_family_video`` reading the audio of videos (Qwen2.5-Omni:
    in chunks of :data:`SECONDS_PER_CHUNK`)."""
    built = omni_processor(kind)
    built.load_audio_from_video = True
    built.seconds_per_chunk = SECONDS_PER_CHUNK
    return built


def model(kind: str, proc: Any) -> Any:
    """The tiny thinker of ``test_family_omni``, timing positions as the processor does."""
    import test_family_omni as omni

    built = omni.tiny_model(kind, proc)
    call = proc._merge_kwargs(tokenizer_init_kwargs=proc.tokenizer.init_kwargs)
    built.config.position_id_per_seconds = int(call["position_id_per_seconds"])
    built.config.seconds_per_chunk = int(call["seconds_per_chunk"])  # the config takes whole ones
    return built


def reference(proc: Any, index: int) -> dict[str, Any]:
    """The processor's own outputs for sample ``index``: every decoded frame of each video, each
    audio (a track decoded from its video, as a caller that decoded it passes it) in text
    order with the video it comes from (``audio_from_video_indices``)."""
    from PIL import Image
    from test_family_video import _decoded

    from energon_pack.media.audio_decode import audio_samples

    media, reply = SAMPLES[index]
    text = proc.apply_chat_template(conversation(media, reply), tokenize=False)
    sizes = [spec for kind, spec in media if kind == "image"]
    images = [Image.fromarray(a) for a in make_images(index, sizes)]
    videos, metadata, audios, sources = [], [], [], []
    for kind, spec in media:
        if kind == "audio":
            audios.append(audio_samples(sound(spec), RATE))
            sources.append(None)
        elif kind == "video":
            frames, meta = _decoded(track(spec))
            videos.append(frames)
            metadata.append(meta)
            if TRACKS[spec][4]:
                audios.append(audio_samples(track(spec), RATE))
                sources.append(len(videos) - 1)
    tracks = any(source is not None for source in sources)
    extra = {"audio_from_video_indices": sources} if tracks else {}
    return dict(
        proc(
            text=[text],
            images=images or None,
            videos=videos or None,
            video_metadata=metadata or None,
            audio=audios or None,
            sampling_rate=RATE,
            load_audio_from_video=tracks,
            return_tensors="pt",
            **extra,
        )
    )


def checks(kind: str) -> dict[str, Any]:
    """Every check of ``kind``'s videos with audio tracks, as plain values (an exception's
    traceback under ``"error"``)."""
    try:
        return _checks(kind)
    except Exception:
        return {"error": traceback.format_exc()}


def _checks(kind: str) -> dict[str, Any]:
    import torch
    from family_kit import chatml_reply_mask

    from energon_pack import VLMPackingCollator, make_encoder, model_family
    from energon_pack.encoding.families.materialise import sample_media

    torch.set_num_threads(1)
    proc = processor(kind)
    family = model_family(proc)
    encoder = make_encoder(family=proc)
    audio_id = int(proc.audio_token_id)
    out: dict[str, Any] = {"samples": []}
    alone = []
    for index in range(len(SAMPLES)):
        sample = row(index)
        encoded = encoder.encode_sample(sample["id"], sample)
        want = reference(proc, index)
        ids = want["input_ids"][0]
        labels = torch.where(torch.tensor(chatml_reply_mask(proc, ids.tolist())), ids, IGNORE)
        labels[0] = IGNORE
        got = sample_media(family, encoded, encoder.media) if encoded.media else {}
        tracks = SAMPLES[index][0] and any(
            kind == "video" and TRACKS[spec][4] for kind, spec in SAMPLES[index][0]
        )
        result: dict[str, Any] = {
            "ids_equal": encoded.input_ids.tolist() == ids.tolist(),
            "mask_equal": encoded.loss_mask[1:].bool().tolist() == (labels != IGNORE)[1:].tolist(),
            "audio_tokens": encoded.audio_tokens,
            "processor_audio_tokens": int((ids == audio_id).sum()),
            "track_tokens": [m.audio_tokens for m in encoded.media if m.kind == "video"],
            "vision_tokens": encoded.vision_tokens,
            "keys": sorted(got),
            "want_keys": sorted(k for k in want if k not in {"input_ids", "attention_mask"}),
            "errors": {
                key: float((got[key].double() - want[key].double()).abs().max())
                for key in got
                if key in want
            },
            "interleaved": _runs(ids.tolist(), proc),
        }
        out["samples"].append(result)
        alone.append({**want, "labels": labels[None], "use_audio_in_video": bool(tracks)})
    tiny = seeded(lambda: model(kind, proc))
    collator = VLMPackingCollator(seq_length=4096, family=family, output="hf", hf_model=tiny)
    packed = collator([row(index) for index in range(len(SAMPLES))])
    packed.pop("use_cache", None)
    out["loss_error"], out["grad_error"] = packed_matches_alone(tiny, alone, packed)
    out["settings_differ"] = family.settings() != model_family(omni_processor(kind)).settings()
    return out


def _runs(ids: list[int], proc: Any) -> int:
    """How many times the ids switch from a video token to an audio token (interleaving)."""
    video, audio = int(proc.video_token_id), int(proc.audio_token_id)
    return sum(a == video and b == audio for a, b in itertools.pairwise(ids))


def refusals(kind: str) -> dict[str, str]:
    """What the family refuses with the setting on: ``case: kind: message``."""
    from energon_pack import make_encoder

    encoder = make_encoder(family=processor(kind))
    cases = {
        "mixed": ([("video", "t1"), ("video", "silent")], [track("t1"), track("silent")]),
        "cut": ([("video", "t1")], [track("t1")[:200]]),
    }
    out = {}
    for name, (media, videos) in cases.items():
        sample = {"id": name, "messages": conversation(media, "x"), "videos": videos}
        try:
            encoder.encode_sample(name, sample)
            out[name] = "encoded"
        except MediaError as error:
            out[name] = f"{error.kind}: {error}"
    return out


# --- the tests ------------------------------------------------------------------------------


ENERGON = {"seq_length": 2048, "pad_to_multiple_of": 8, "tokenizer": None}


def energon_samples() -> list[tuple[str, dict[str, bytes]]]:
    """:data:`SAMPLES` twice over as native samples: each medium a member (an MP4 with its
    track, a PNG, a WAV) named in text order, its placeholder before the question."""
    out = []
    for index in range(2 * len(SAMPLES)):
        media, reply = SAMPLES[index % len(SAMPLES)]
        members: dict[str, bytes] = {}
        images = iter(make_images(index, [spec for kind, spec in media if kind == "image"]))
        text = ""
        for position, (kind, spec) in enumerate(media):
            if kind == "image":
                members[f"{position}.png"] = png_bytes(next(images))
            elif kind == "video":
                members[f"{position}.mp4"] = track(spec)
            else:
                members[f"{position}.wav"] = sound(spec)
            text += f"<{kind}>"
        turns = [
            {"from": "human", "value": f"{text}What is it? {index}"},
            {"from": "gpt", "value": reply},
        ]
        names = list(members)
        members["json"] = json.dumps({"conversations": turns, "media": names}).encode()
        out.append((f"s{index:03d}", members))
    return out


def omni_energon(payload: dict[str, str]) -> dict[str, Any]:
    """The Energon path of thinker ``payload["kind"]`` with audio tracks over the dataset at
    ``payload["path"]`` (:func:`energon_samples`), its model inputs built by the tiny thinker,
    as plain values (:func:`~energon_family.family_run_report`)."""
    from energon_family import family_run_report

    proc = processor(payload["kind"])
    return family_run_report(
        Path(payload["path"]),
        proc,
        dict(energon_samples()),
        ENERGON,
        model=lambda: model(payload["kind"], proc),
    )


def _child(target: str, payload: Any) -> Any:
    if not available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    result = run_in_child(f"test_family_omni_video_audio:{target}", payload, timeout=500)
    assert "error" not in result, result.get("error")
    return result


@cache
def results(kind: str) -> dict[str, Any]:
    return dict(_child("checks", kind))


KINDS = ["qwen2_5_omni", "qwen3_omni"]


@pytest.mark.parametrize("kind", KINDS)
def test_ids_labels_and_audio_counts_are_the_processors(kind: str) -> None:
    for index, sample in enumerate(results(kind)["samples"]):
        assert sample["ids_equal"], index
        assert sample["mask_equal"], index
        assert sample["audio_tokens"] == sample["processor_audio_tokens"], index
        media = SAMPLES[index][0]
        with_track = [bool(TRACKS[spec][4]) for k, spec in media if k == "video"]
        assert [count > 0 for count in sample["track_tokens"]] == with_track, index
        # a track longer than a chunk of time is cut into chunks among the video's tokens
        if any(spec == "t2" for _, spec in media):
            assert sample["interleaved"] >= 2, index
    assert results(kind)["settings_differ"]


@pytest.mark.parametrize("kind", KINDS)
def test_model_inputs_are_the_processors(kind: str) -> None:
    for index, sample in enumerate(results(kind)["samples"]):
        assert sample["keys"] == sample["want_keys"], index
        assert max(sample["errors"].values(), default=0.0) == 0.0, (index, sample["errors"])


@pytest.mark.parametrize("kind", KINDS)
def test_a_packed_row_with_audio_tracks_trains_as_its_samples_alone(kind: str) -> None:
    result = results(kind)
    assert result["loss_error"] < 1e-6
    assert result["grad_error"] < 1e-10


def test_mixed_or_unreadable_tracks_are_refused_by_name() -> None:
    refused = _child("refusals", "qwen2_5_omni")
    assert refused["mixed"].startswith("unsupported"), refused["mixed"]
    assert "must all have an audio track or none" in refused["mixed"]
    assert refused["cut"].split(":")[0] in {"corrupt", "unreadable"}, refused["cut"]


def test_the_track_probe_reads_mp4_audio_and_names_other_containers() -> None:
    probe = probe_video_audio(track("t2"), "k", "v.mp4")
    assert probe is not None
    assert (probe.sample_rate, probe.channels) == (RATE, 1)
    assert abs(probe.seconds - 4.5) < 0.1
    assert probe_video_audio(track("silent"), "k", "v.mp4") is None
    with pytest.raises(MediaError) as error:
        probe_video_audio(b"\x1aE\xdf\xa3" + bytes(64), "k", "v.webm")
    assert error.value.kind == "unsupported"
    assert "MP4 or QuickTime" in str(error.value)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.lists(st.floats(0, 80, allow_nan=False), max_size=40),
    per_chunk=st.integers(1, 60),
)
def test_chunks_of_time_are_cut_as_the_processor_cuts_them(
    steps: list[float], per_chunk: int
) -> None:
    """Chunk sizes equal ``get_chunked_index``'s on any ascending times (a time past several
    chunk ends closes one chunk only, as there)."""
    times = list(itertools.accumulate(steps))
    bounds = Qwen2_5OmniProcessor.get_chunked_index(None, np.asarray(times), per_chunk)
    assert _chunk_sizes(times, per_chunk) == [end - start for start, end in bounds]


@pytest.mark.parametrize("kind", KINDS)
def test_the_energon_path_packs_tracks_as_the_collator_and_resumes(
    kind: str, tmp_path: Path
) -> None:
    """2 workers over MP4 clips with and without tracks, images and audio: every pack and its
    model-built inputs equal the collator's, every sample leaves once, nothing is skipped, and
    a loader restored at three cut points continues exactly."""
    path = write_dataset(tmp_path / "ds", energon_samples())
    result = _child("omni_energon", {"kind": kind, "path": str(path)})
    assert result["unequal"] == []
    assert sorted(result["seen"]) == sorted(key for key, _ in energon_samples())
    assert not any(sum(counts.values()) for counts in result["skipped"].values())
    assert result["resumed"] == {1: "exact", 4: "exact", 9: "exact"}
