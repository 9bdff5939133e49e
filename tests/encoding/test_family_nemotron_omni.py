"""Nemotron-H Omni (``NemotronH_Omni_Reasoning_V3Processor``): images, videos and audio, token-exact
against transformers' own processor (built locally: the test tokenizer with the processor's
tokens, its RADIO image processor, its video processor, Parakeet's feature extractor, a ChatML
turn format), and packing refused by name: its Mamba-2 layers carry one sample's state into the
next inside a row, which the tiny model here shows.

The image and video processors need torchvision, which this process never imports: the checks
run in the torchvision child (:mod:`torchvision_child`) and send back plain values.
"""

from __future__ import annotations

import traceback
from functools import cache
from typing import Any

import pytest
from family_kit import (
    IGNORE,
    Media,
    chatml_reply_mask,
    conversation,
    media_row,
    png_bytes,
    sound,
    tiny_tokenizer,
)
from family_kit import test_images as make_images
from test_family_video import tiles_mp4
from torchvision_child import available, run_in_child

RATE = 16_000
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<image>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'audio' %}{{ '<so_embedding>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<pad>",
    "<image>",
    "<img>",
    "</img>",
    "<so_embedding>",
    "<so_start>",
    "<so_end>",
]
CLIPS = {  # member -> (width, height, frames, fps)
    "a": (64, 48, 8, 4),
    "b": (64, 48, 14, 7),  # 142 ms a frame: times differ from index / fps
}
SAMPLES: list[tuple[Media, str]] = [
    ([("image", (50, 90))], "An image."),
    ([("video", "a")], "A clip."),
    ([("audio", 1.3)], "A sound."),
    ([], "Only text."),
    ([("image", (40, 60)), ("audio", 0.7), ("image", (70, 30))], "Two images and a sound."),
    ([("audio", 2.1), ("video", "b")], "A sound, then a clip."),
]
"""Each sample's media in text order (an image by size, a video by clip, an audio by its
seconds) and its reply. The model takes no sample holding both an image and a video (their
features fill the same token)."""


@cache
def clip(name: str) -> bytes:
    return tiles_mp4(*CLIPS[name], seed=len(name) + 7)


def row(index: int) -> dict[str, Any]:
    """Sample ``index`` of :data:`SAMPLES` as a row."""
    return media_row(index, *SAMPLES[index], clip)


# --- run in the torchvision child -----------------------------------------------------------


def processor() -> Any:
    """The processor with small media: images of 64-256 patches of 16 px, video frames of about
    64 patches in tubelets of 2, Parakeet's 16 kHz features with 16 mel bins."""
    from transformers import (
        NemotronH_Omni_Reasoning_V3ImageProcessor,
        NemotronH_Omni_Reasoning_V3Processor,
        NemotronH_Omni_Reasoning_V3VideoProcessor,
        ParakeetFeatureExtractor,
    )

    tokenizer = tiny_tokenizer(SPECIAL, TEMPLATE, eos="<|im_end|>", pad="<pad>")
    mean, std = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]
    return NemotronH_Omni_Reasoning_V3Processor(
        image_processor=NemotronH_Omni_Reasoning_V3ImageProcessor(
            min_num_patches=64, max_num_patches=256
        ),
        video_processor=NemotronH_Omni_Reasoning_V3VideoProcessor(
            norm_mean=mean, norm_std=std, video_target_num_patches=64
        ),
        tokenizer=tokenizer,
        feature_extractor=ParakeetFeatureExtractor(feature_size=16),
        chat_template=TEMPLATE,
    )


def reference(proc: Any, index: int) -> dict[str, Any]:
    """The processor's own outputs for sample ``index``: every decoded frame of each video with
    its metadata (its frame indices set, as transformers' video loaders set them), each audio
    decoded at 16 kHz."""
    from PIL import Image
    from test_family_video import _decoded

    from energon_pack.media.audio_decode import audio_samples

    media, reply = SAMPLES[index]
    text = proc.apply_chat_template(conversation(media, reply), tokenize=False)
    sizes = [spec for kind, spec in media if kind == "image"]
    images = [Image.fromarray(a) for a in make_images(index, sizes)]
    decoded = [_decoded(clip(spec)) for kind, spec in media if kind == "video"]
    for frames, metadata in decoded:  # as transformers' own video loaders write it
        metadata.frames_indices = list(range(len(frames)))
    audios = [audio_samples(sound(spec), RATE) for kind, spec in media if kind == "audio"]
    return dict(
        proc(
            text=[text],
            images=images or None,
            videos=[frames for frames, _ in decoded] or None,
            video_metadata=[metadata for _, metadata in decoded] or None,
            audio=audios or None,
            return_tensors="pt",
        )
    )


def checks(_: object) -> dict[str, Any]:
    """Every check, as plain values (an exception's traceback under ``"error"``)."""
    try:
        return _checks()
    except Exception:
        return {"error": traceback.format_exc()}


def _checks() -> dict[str, Any]:
    import torch

    from energon_pack import make_encoder, model_family
    from energon_pack.encoding.families.materialise import sample_media

    torch.set_num_threads(1)
    proc = processor()
    family = model_family(proc)
    encoder = make_encoder(family=proc)
    out: dict[str, Any] = {"samples": [], "family": family.name}
    for index in range(len(SAMPLES)):
        sample = row(index)
        encoded = encoder.encode_sample(sample["id"], sample)
        want = reference(proc, index)
        ids = want["input_ids"][0]
        labels = torch.where(torch.tensor(chatml_reply_mask(proc, ids.tolist())), ids, IGNORE)
        got = sample_media(family, encoded, encoder.media) if encoded.media else {}
        out["samples"].append(
            {
                "ids_equal": encoded.input_ids.tolist() == ids.tolist(),
                "text": [proc.tokenizer.decode(encoded.input_ids), proc.tokenizer.decode(ids)],
                "mask_equal": encoded.loss_mask.bool().tolist() == (labels != IGNORE).tolist(),
                "keys": sorted(got),
                "want_keys": sorted(k for k in want if k not in {"input_ids", "attention_mask"}),
                "errors": {
                    key: float((got[key].double() - want[key].double()).abs().max())
                    for key in got
                    if key in want and got[key].shape == want[key].shape
                },
            }
        )
    return out


def tiny_model(
    proc: Any, layers: tuple[str, ...] = ("linear_attention", "full_attention", "mlp")
) -> Any:
    """A tiny Nemotron-H Omni of ``layers`` (a Mamba-2, an attention and an MLP block by
    default), a one-block RADIO tower and Parakeet encoder, float64, sdpa."""
    import torch
    from family_kit import seeded
    from transformers import NemotronH_Omni_Reasoning_V3, NemotronH_Omni_Reasoning_V3_Config

    tok = proc.tokenizer
    quiet = {"dropout": 0.0, "layerdrop": 0.0, "activation_dropout": 0.0}
    quiet |= {"attention_dropout": 0.0, "dropout_positions": 0.0}
    config = NemotronH_Omni_Reasoning_V3_Config(
        vision_config={
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "patch_size": 16,
            "image_size": 64,
            "max_img_size": 512,
            "video_temporal_patch_size": 2,
        },
        text_config={
            "vocab_size": len(tok),
            "hidden_size": 32,
            "layers_block_type": list(layers),
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 64,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "ssm_state_size": 8,
            "chunk_size": 16,
            "pad_token_id": tok.pad_token_id,
        },
        audio_config={
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 32,
            "subsampling_conv_channels": 8,
            "num_mel_bins": proc.feature_extractor.feature_size,
            "conv_kernel_size": 3,
            "projection_hidden_size": 32,
            "projection_bias": False,
            **quiet,
        },
        projector_hidden_size=32,
        vision_hidden_size=16,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        audio_token_id=tok.convert_tokens_to_ids("<so_embedding>"),
    )
    config._attn_implementation = "sdpa"
    model = seeded(lambda: NemotronH_Omni_Reasoning_V3(config))
    model.vision_model.config.dtype = torch.float64  # the model casts pixels to it
    return model


def model_checks(_: object) -> dict[str, Any]:
    """One-sample rows against the samples alone, and a packed row of a Mamba-only model
    against its samples alone (the refusal), as plain values."""
    try:
        return _model_checks()
    except Exception:
        return {"error": traceback.format_exc()}


def _model_checks() -> dict[str, Any]:
    import torch
    from family_kit import packed_matches_alone

    from energon_pack import PackingTaskEncoder, RowLayout, VLMPackingCollator, model_family

    torch.set_num_threads(1)
    proc = processor()
    family = model_family(proc)
    out: dict[str, Any] = {}
    try:
        VLMPackingCollator(seq_length=1024, family=family)
        out["refused"] = "accepted"
    except ValueError as error:
        out["refused"] = str(error)
    try:
        PackingTaskEncoder(seq_length=1024, family=proc)
        out["energon_refused"] = "accepted"
    except ValueError as error:
        out["energon_refused"] = str(error)
    one = RowLayout(1024, pad_to_max_length=True, pad_cu_seqlens=True, max_segments=1)
    model = tiny_model(proc)
    collator = VLMPackingCollator(family=family, output="hf", layout=one, hf_model=model)
    errors = []
    for index in range(len(SAMPLES)):
        want = reference(proc, index)
        ids = want["input_ids"][0]
        labels = torch.where(torch.tensor(chatml_reply_mask(proc, ids.tolist())), ids, IGNORE)
        batch = collator([row(index)])
        batch.pop("use_cache", None)
        errors.append(packed_matches_alone(model, [{**want, "labels": labels[None]}], batch))
    out["one_per_row"] = errors
    # a packed row of text through Mamba-2 blocks alone: the second sample sees the first
    mamba = tiny_model(proc, ("linear_attention", "mlp", "linear_attention", "mlp"))
    texts = [reference(proc, 3), reference(proc, 3)]
    alone = []
    for want in texts:
        ids = want["input_ids"]
        alone.append({"input_ids": ids, "labels": ids.clone()})
    ids = torch.cat([a["input_ids"] for a in alone], dim=1)
    packed = {"input_ids": ids, "labels": ids.clone()}
    packed["labels"][0, texts[0]["input_ids"].shape[1]] = IGNORE  # no target across samples
    try:
        packed_matches_alone(mamba, alone, packed)
        out["mamba_packed"] = "equal"
    except AssertionError as error:
        out["mamba_packed"] = f"differs: {error}"
    return out


def _outcome(function: Any, *args: Any) -> Any:
    """``function(*args)``, or ``"refused"`` where it raises (ours a ValueError naming the
    image, the processor's a ZeroDivisionError)."""
    try:
        return function(*args)
    except (ValueError, ZeroDivisionError):
        return "refused"


def mixed_refusal(_: object) -> dict[str, str]:
    """The encoder's answer to a sample holding an image and a video, and the collator's to a
    micro-batch of rows whose videos differ in shape."""
    from energon_pack import (
        MediaError,
        RowLayout,
        VLMPackingCollator,
        make_encoder,
        model_family,
    )

    media: Media = [("image", (40, 60)), ("video", "a")]
    sample = {
        "id": "mixed",
        "messages": conversation(media, "x"),
        "images": [png_bytes(make_images(0, [(40, 60)])[0])],
        "videos": [clip("a")],
    }
    out = {}
    try:
        make_encoder(family=processor()).encode_sample("mixed", sample)
        out["mixed"] = "encoded"
    except MediaError as error:
        out["mixed"] = f"{error.kind}: {error}"
    # rows whose videos differ in tubelets (clip a: 4, clip b: 7) cannot share a micro-batch
    one = RowLayout(1024, pad_to_max_length=True, pad_cu_seqlens=True, max_segments=1)
    collator = VLMPackingCollator(family=model_family(processor()), layout=one)
    rows = [
        {"id": name, "messages": conversation([("video", name)], "x"), "videos": [clip(name)]}
        for name in ("a", "b")
    ]
    try:
        collator(rows)
        out["stacked"] = "collated"
    except ValueError as error:
        out["stacked"] = str(error)
    return out


def rule_checks(_: object) -> dict[str, Any]:
    """The family's grid, tile and audio rules against the processor's own functions on 3,000
    seeded draws each: the draws where they differ (none expected)."""
    import random

    from transformers.models.nemotron_h_omni.image_processing_nemotron_h_omni import (
        get_patch_grid_size,
    )

    from energon_pack import model_family
    from energon_pack.encoding.families.base import SampledVideo
    from energon_pack.encoding.families.nemotron_h_omni import _patch_grid
    from energon_pack.media.audio import AudioProbe
    from energon_pack.media.decode import VideoHeader

    rng = random.Random(5)
    proc = processor()
    family = model_family(proc)
    out: dict[str, Any] = {"grid": [], "tile": [], "audio": []}
    for _ in range(3000):
        height, width = rng.randint(1, 4000), rng.randint(1, 4000)
        least, most = rng.choice([1, 16, 64, 1024]), rng.choice([64, 256, 1000, 13312])
        least = min(least, most)
        if _outcome(_patch_grid, height, width, 16, 2, least, most) != _outcome(
            get_patch_grid_size, height, width, 16, 2, least, most
        ):
            out["grid"].append((height, width, least, most))
        samples = rng.randint(1, 2_000_000)
        probe = AudioProbe("array", RATE, 1, samples)
        if family._audio_tokens(probe) != max(1, proc._estimate_audio_num_embeddings(samples)):
            out["audio"].append(samples)
    for target in (16, 50, 64, 256, 1024, 3000):
        proc.video_processor.video_target_num_patches = target
        family = model_family(proc)  # the family reads the setting when built
        for _ in range(500):
            height, width = rng.randint(1, 4000), rng.randint(1, 4000)
            video = SampledVideo(VideoHeader(8, 4.0, width, height), tuple(range(8)))
            columns, rows = proc.video_processor._compute_target_patches(height, width)
            if family._video_tile(video) != (rows, columns):
                out["tile"].append((height, width, target))
    return out


# --- the tests ------------------------------------------------------------------------------


def _child(target: str, payload: Any = None) -> Any:
    if not available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    result = run_in_child(f"test_family_nemotron_omni:{target}", payload, timeout=500)
    assert "error" not in result, result.get("error")
    return result


@cache
def results() -> dict[str, Any]:
    return dict(_child("checks"))


def test_ids_labels_and_inputs_are_the_processors() -> None:
    found = results()
    assert found["family"] == "nemotron_h_omni"
    for index, sample in enumerate(found["samples"]):
        assert sample["ids_equal"], (index, sample["text"])
        assert sample["mask_equal"], index
        assert sample["keys"] == sample["want_keys"], index
        assert max(sample["errors"].values(), default=0.0) == 0.0, (index, sample["errors"])


@cache
def model_results() -> dict[str, Any]:
    return dict(_child("model_checks"))


def test_packing_is_refused_by_name_and_one_sample_rows_train_as_alone() -> None:
    found = model_results()
    assert "family='nemotron_h_omni' cannot be packed exactly" in found["refused"]
    assert "Mamba-2 layers" in found["refused"]
    assert "max_segments=1" in found["refused"]
    assert "family='nemotron_h_omni' cannot be packed exactly" in found["energon_refused"]
    assert "one sample per row with VLMPackingCollator" in found["energon_refused"]
    # each sample alone in a padded row: the loss exact, the gradients to float32 (the Mamba-2
    # scan of transformers' PyTorch path runs in float32, over a row of another length)
    for loss_error, grad_error in found["one_per_row"]:
        assert loss_error < 1e-12
        assert grad_error < 1e-6


def test_a_packed_row_through_mamba_blocks_is_not_its_samples_alone() -> None:
    """What the refusal guards: the same text twice in one row trains differently from twice
    alone, though no token attends across samples (Mamba-2 blocks only)."""
    assert model_results()["mamba_packed"].startswith("differs"), model_results()["mamba_packed"]


def test_grid_tile_and_audio_rules_are_the_processors() -> None:
    assert _child("rule_checks") | {"child_seconds": 0} == {
        "grid": [],
        "tile": [],
        "audio": [],
        "child_seconds": 0,
    }


def test_mixed_samples_and_micro_batches_of_unlike_videos_are_refused_by_name() -> None:
    refused = _child("mixed_refusal")
    assert refused["mixed"].startswith("unsupported"), refused["mixed"]
    assert "no sample holding both an image and a video" in refused["mixed"]
    assert "stacks a micro-batch's videos" in refused["stacked"], refused["stacked"]
    assert "use a micro-batch of one row" in refused["stacked"]
