"""The Omni thinkers' families, Qwen2.5-Omni and Qwen3-Omni-MoE: token-exact against
transformers' own ``Qwen2_5OmniProcessor`` / ``Qwen3OmniMoeProcessor`` (built locally: the test
tokenizer with the family's special tokens, a Qwen2-VL image processor of the family's patch
size, Whisper's feature extractor, the released turn format; no video processor, which needs
torchvision), image and audio tokens from the headers, model inputs equal to the processor's,
and a packed row of a tiny thinker (``Qwen2_5OmniThinkerForConditionalGeneration``,
``Qwen3OmniMoeThinkerForConditionalGeneration``; positions from its own rope index per segment)
equal to its samples alone, through the collator."""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from audio_files import encode_audio
from family_kit import (
    IGNORE,
    chatml_reply_mask,
    packed_matches_alone,
    png_bytes,
    seeded,
    tiny_tokenizer,
)
from family_kit import test_images as make_images
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    PreTrainedModel,
    Qwen2_5OmniProcessor,
    Qwen2_5OmniThinkerConfig,
    Qwen2_5OmniThinkerForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen3OmniMoeProcessor,
    Qwen3OmniMoeThinkerConfig,
    Qwen3OmniMoeThinkerForConditionalGeneration,
    WhisperFeatureExtractor,
)

from energon_pack import VLMPackingCollator, make_encoder, model_family
from energon_pack.encoding.families.materialise import sample_media
from energon_pack.encoding.families.qwen2_5_omni import Qwen25OmniFamily
from energon_pack.encoding.families.qwen3_omni import Qwen3OmniFamily
from energon_pack.media import MediaError
from energon_pack.media.audio_decode import Waveform, audio_probe, audio_samples

# The released Qwen2.5-Omni turn format: a default system turn, each image
# <|vision_bos|><|IMAGE|><|vision_eos|>, each audio <|audio_bos|><|AUDIO|><|audio_eos|>, the text
# parts as they are, "<|im_end|>\n" after each turn; no generation markers.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are Qwen, a virtual human.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|vision_bos|><|IMAGE|><|vision_eos|>' }}"
    "{% elif content['type'] == 'audio' %}{{ '<|audio_bos|><|AUDIO|><|audio_eos|>' }}"
    "{% elif content['type'] == 'video' %}{{ '<|vision_bos|><|VIDEO|><|vision_eos|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
NAMED = {
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *NAMED.values()]
RATE = 16_000


def without_video(cls: type[Any]) -> type[Any]:
    """transformers' processor class without its video processor (which needs torchvision)."""

    class NoVideo(cls):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return NoVideo


PROCESSORS = {"qwen2_5_omni": Qwen2_5OmniProcessor, "qwen3_omni": Qwen3OmniMoeProcessor}
PATCH = {"qwen2_5_omni": 14, "qwen3_omni": 16}
FAMILIES = {"qwen2_5_omni": Qwen25OmniFamily, "qwen3_omni": Qwen3OmniFamily}


@cache
def processor(kind: str) -> Any:
    """Small images (4-16 merged patches) and 16 mel bins (2-second windows where the
    processor pads to a window)."""
    tok = tiny_tokenizer(SPECIAL, TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>", extra=NAMED)
    factor = 2 * PATCH[kind]
    images = Qwen2VLImageProcessorPil(
        patch_size=PATCH[kind], min_pixels=factor**2 * 4, max_pixels=factor**2 * 16
    )
    return without_video(PROCESSORS[kind])(
        image_processor=images,
        video_processor=None,
        feature_extractor=WhisperFeatureExtractor(feature_size=16, chunk_length=2),
        tokenizer=tok,
        chat_template=TEMPLATE,
    )


def family(kind: str) -> Qwen25OmniFamily:
    found = model_family(processor(kind))
    assert type(found) is FAMILIES[kind]
    return found


@pytest.fixture(params=sorted(PROCESSORS))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def tone(frames: int, rate: int = RATE, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    t = np.arange(frames) / rate
    return (0.3 * np.sin(2 * np.pi * rng.uniform(200, 900) * t)).astype(np.float32)


# Each sample with audio holds one of a second or more: Qwen3-Omni's audio encoder pads every
# chunk of a batch to its longest (100 mel frames once an audio has a second), and its
# convolutions see that padding (see test_qwen3_audio_shorter_than_a_chunk_follows_its_batch).
CASES = [  # (media in order: ("image", (h, w)) or ("audio", (format, rate, seconds))), turns
    ([("image", (50, 120)), ("audio", ("wav", 16000, 1.2))], 2),
    ([("audio", ("mp3", 44100, 1.4))], 1),
    ([], 1),
    ([("image", (64, 48)), ("image", (20, 30))], 1),
    ([("audio", ("array", 22050, 0.5)), ("image", (90, 40)), ("audio", ("flac", 48000, 1.6))], 1),
]


def row_of(seed: int, media: list[tuple[str, Any]], turns: int) -> tuple[Any, ...]:
    """The processor's messages, the chat row, and the decoded images and waveforms."""
    images, audios, items = [], [], {"images": [], "audios": []}
    sizes = [spec for kind, spec in media if kind == "image"]
    arrays = iter(make_images(seed, sizes))
    parts: list[dict[str, Any]] = []
    for index, (kind, spec) in enumerate(media):
        parts.append({"type": kind})
        if kind == "image":
            array = next(arrays)
            images.append(Image.fromarray(array))
            items["images"].append(png_bytes(array))
            continue
        fmt, rate, seconds = spec
        if fmt == "array":
            wave = tone(int(rate * seconds), rate, seed + index)
            items["audios"].append({"array": wave, "sampling_rate": rate})
            audios.append(audio_samples(Waveform.from_array(wave, rate), RATE))
        else:
            data = encode_audio(fmt, rate, 1, int(rate * seconds), sweep=True)
            items["audios"].append(data)
            audios.append(audio_samples(data, RATE))
    messages = []
    for turn in range(turns):
        content = [*(parts if turn == 0 else []), {"type": "text", "text": f"What is it? {turn}"}]
        messages.append({"role": "user", "content": content})
        messages.append({"role": "assistant", "content": f"The quick brown fox {seed}."})
    row = {"id": f"s{seed}", "messages": messages, **items}
    return messages, row, images, audios


def reference(
    proc: Any, messages: list[dict[str, Any]], images: list[Any], audios: list[Any]
) -> Any:
    text = proc.apply_chat_template(messages, tokenize=False)
    return proc(
        text=[text],
        images=images or None,
        audio=audios or None,
        sampling_rate=RATE,
        return_tensors="pt",
    )


def cases() -> list[tuple[Any, ...]]:
    return [row_of(seed, media, turns) for seed, (media, turns) in enumerate(CASES)]


def test_encoder_equals_the_processor(kind: str) -> None:
    """ids, the reply mask and every model input equal the processor's, for PNG images, audio
    files of three formats and a decoded array, in any order within a turn."""
    fam, proc = family(kind), processor(kind)
    encoder = make_encoder(family=proc)
    for messages, row, images, audios in cases():
        encoded = encoder.encode_sample(row["id"], row)
        want = reference(proc, messages, images, audios)
        ids = want["input_ids"][0].tolist()
        assert encoded.input_ids.tolist() == ids
        assert encoded.loss_mask.bool().tolist() == chatml_reply_mask(proc, ids)
        assert sum(m.tokens for m in encoded.media) == sum(
            int((want["input_ids"] == token).sum())
            for token in (proc.image_token_id, proc.audio_token_id)
        )
        got = sample_media(fam, encoded, encoder.media)
        expected = {k: v for k, v in want.items() if k not in ("input_ids", "attention_mask")}
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)


def tiny_model(kind: str, proc: Any) -> PreTrainedModel:
    """A two-layer thinker of the family (its MoE for Qwen3-Omni), float64, sdpa."""
    tok = proc.tokenizer
    audio = {
        "num_mel_bins": proc.feature_extractor.feature_size,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "d_model": 16,
        "max_source_positions": proc.feature_extractor.nb_max_frames // 2,
        "output_dim": 32,
    }
    vision = {
        "depth": 2,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": 32,
        "patch_size": PATCH[kind],
    }
    text: dict[str, Any] = {
        "vocab_size": len(tok),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4},
    }
    ids = {
        "audio_start_token_id": tok.convert_tokens_to_ids("<|audio_bos|>"),
        "audio_token_id": proc.audio_token_id,
        "image_token_id": proc.image_token_id,
        "video_token_id": proc.video_token_id,
    }
    if kind == "qwen2_5_omni":
        audio["n_window"] = 25
        vision |= {"fullatt_block_indexes": [1], "window_size": 56}
        config: Any = Qwen2_5OmniThinkerConfig(
            audio_config=audio,
            vision_config=vision,
            text_config=text,
            audio_token_index=ids["audio_token_id"],
            image_token_index=ids["image_token_id"],
            video_token_index=ids["video_token_id"],
            audio_start_token_id=ids["audio_start_token_id"],
            audio_end_token_id=tok.convert_tokens_to_ids("<|audio_eos|>"),
        )
        build: Any = Qwen2_5OmniThinkerForConditionalGeneration
    else:
        audio |= {"n_window": int(proc.n_window), "downsample_hidden_size": 8}
        vision |= {"deepstack_visual_indexes": [0], "num_position_embeddings": 64}
        text |= {"moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2}
        config = Qwen3OmniMoeThinkerConfig(
            audio_config=audio, vision_config=vision, text_config=text, **ids
        )
        build = Qwen3OmniMoeThinkerForConditionalGeneration
    config.vision_start_token_id = tok.convert_tokens_to_ids("<|vision_bos|>")
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # grouped matmuls take no float64
    return seeded(lambda: build(config))


def test_collated_row_trains_like_its_samples(kind: str) -> None:
    """The collator's packed ``output="hf"`` row (``[4, 1, T]`` positions from the model's rope
    index per segment) gives the loss and every gradient of its samples run alone through the
    processor's outputs (the model computing their positions)."""
    torch.set_num_threads(1)
    proc = processor(kind)
    model = tiny_model(kind, proc)
    collator = VLMPackingCollator(seq_length=4096, family=family(kind), output="hf", hf_model=model)
    batch = cases()
    packed = collator([row for _, row, _, _ in batch])
    packed.pop("use_cache")
    assert packed["position_ids"].shape[:2] == (4, 1)
    alone = []
    for messages, _, images, audios in batch:
        want = dict(reference(proc, messages, images, audios))
        ids = want["input_ids"][0]
        labels = torch.where(torch.tensor(chatml_reply_mask(proc, ids.tolist())), ids, IGNORE)
        labels[0] = IGNORE
        alone.append({**want, "labels": labels[None]})
    loss_error, worst = packed_matches_alone(model, alone, packed)
    assert loss_error < 1e-6, loss_error
    assert worst < 1e-10, worst


def test_an_audio_with_no_token_is_refused_and_one_token_is_taken() -> None:
    encoder = make_encoder(family=processor("qwen2_5_omni"))
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello."},
        ],
        "audios": [{"array": tone(320), "sampling_rate": RATE}],  # 2 mel frames: no token
    }
    with pytest.raises(MediaError, match="fewer than 1 audio tokens") as error:
        encoder.encode_sample("short", row)
    assert error.value.kind == "unsupported"
    row["audios"] = [{"array": tone(321), "sampling_rate": RATE}]  # 3 frames: 1 token
    assert [m.tokens for m in encoder.encode_sample("one", row).media] == [1]


def test_a_video_is_refused_by_name(kind: str) -> None:
    encoder = make_encoder(family=processor(kind))
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello."},
        ],
        "videos": [b"\x00\x00\x00\x18ftypmp42"],
    }
    with pytest.raises(MediaError, match="takes encoded images and audio only") as error:
        encoder.encode_sample("clip", row)
    assert (error.value.kind, error.value.member) == ("unsupported", "videos[0]")


@settings(max_examples=30, deadline=None)
@given(
    frames=st.one_of(st.integers(201, 200_000), st.sampled_from([15_999, 16_000, 16_001, 32_160])),
    name=st.sampled_from(sorted(PROCESSORS)),
)
def test_audio_tokens_from_the_header_are_the_processors(frames: int, name: str) -> None:
    """Any length the extractor takes: the window's cut (Qwen2.5-Omni) and the 100-frame
    chunks (Qwen3-Omni)."""
    wave = Waveform.from_array(tone(frames), RATE)
    proc = processor(name)
    messages = [{"role": "user", "content": [{"type": "audio"}]}]
    out = reference(proc, messages, [], [wave.array()])
    counted = int((out["input_ids"] == proc.audio_token_id).sum())
    assert family(name).audio_tokens(audio_probe(wave)) == counted


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(201, 40_000), min_size=2, max_size=3))
def test_qwen3_counts_each_audio_against_the_longest_of_its_sample(lengths: list[int]) -> None:
    """Qwen3-Omni's extractor pads a sample's audio to its longest and drops the frame begun
    past that one's partial last hop: each audio's tokens equal the processor's own count in
    its block."""
    proc = processor("qwen3_omni")
    waves = [Waveform.from_array(tone(n, seed=i), RATE) for i, n in enumerate(lengths)]
    messages = [{"role": "user", "content": [{"type": "audio"}] * len(waves)}]
    ids = reference(proc, messages, [], [w.array() for w in waves])["input_ids"][0].tolist()
    start, end = (
        proc.tokenizer.convert_tokens_to_ids(t) for t in ("<|audio_bos|>", "<|audio_eos|>")
    )
    counted = [
        ids[a + 1 : b].count(proc.audio_token_id)
        for a, b in zip(
            [i for i, t in enumerate(ids) if t == start],
            [i for i, t in enumerate(ids) if t == end],
            strict=True,
        )
    ]
    expansions = family("qwen3_omni").audio_expansions([audio_probe(w) for w in waves])
    assert [e.count(proc.audio_token) for e in expansions] == counted


def test_qwen3_audio_shorter_than_a_chunk_follows_its_batch() -> None:
    """The limit that keeps the packed test's audio at a second or more: Qwen3-Omni's audio
    encoder pads every chunk of a batch to the batch's longest chunk, and its convolutions
    read that padding. An audio of a second or more (its chunks 100 mel frames) encodes the
    same beside others (the row's features padded as the packer pads them): the same
    gradients; one under a chunk does not."""
    proc, fam = processor("qwen3_omni"), family("qwen3_omni")
    model = tiny_model("qwen3_omni", proc)
    extract = {"sampling_rate": RATE, "return_tensors": "pt", "return_attention_mask": True}

    def features(wave: np.ndarray[Any, Any]) -> dict[str, torch.Tensor]:
        out = proc.feature_extractor([wave], padding=True, **extract)
        return {
            "input_features": out["input_features"],
            "feature_attention_mask": out["attention_mask"],
        }

    def gradient(waves: list[np.ndarray[Any, Any]]) -> torch.Tensor:
        row = fam.row_inputs([features(wave) for wave in waves])
        model.zero_grad(set_to_none=True)
        encoded = model.get_audio_features(
            row["input_features"].double(), feature_attention_mask=row["feature_attention_mask"]
        ).last_hidden_state
        first = fam.audio_tokens(audio_probe(Waveform.from_array(waves[0], RATE)))
        weights = torch.linspace(-1, 1, encoded.shape[1], dtype=encoded.dtype)
        (encoded[:first] * weights).sum().backward()
        grad = model.model.audio_tower.conv2d1.weight.grad
        assert grad is not None
        return grad.clone()

    def change(first: np.ndarray[Any, Any], beside: np.ndarray[Any, Any]) -> float:
        alone, together = gradient([first]), gradient([first, beside])
        return float((alone - together).abs().max() / alone.abs().max())

    assert change(tone(24_000, seed=1), tone(30_000, seed=2)) == 0.0  # 1.5 s: 100 + 50 frames
    assert change(tone(8_000), tone(24_000, seed=1)) > 1e-3  # 0.5 s: one 50-frame chunk
