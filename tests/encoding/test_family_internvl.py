"""The InternVL family against transformers' own ``InternVLProcessor`` (GotOcr2 PIL image
processor, a local tokenizer with InternVL's special tokens and the released ChatML template):
token-exact expansions over many sizes and settings, the processor's media outputs, the ChatML
assistant spans, and a tiny InternVL (Qwen2 text backbone) trained packed versus alone."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from family_kit import IGNORE, packed_matches_alone, seeded, tiny_tokenizer
from family_kit import expanded_text as expanded
from family_kit import test_images as make_images
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    GotOcr2ImageProcessorPil,
    InternVLConfig,
    InternVLForConditionalGeneration,
    InternVLProcessor,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from energon_pack.encoding.families.base import TEXT_KEYS
from energon_pack.encoding.families.internvl import InternVLFamily, tile_grid

# The chat template of the released InternVL -hf checkpoints (transformers' conversion script).
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"]
SPECIAL += ["<video>"]
NAMED = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}
TILE = {"height": 32, "width": 32}
SEQ = 4  # (32 / 8) ** 2 patches x 0.5 ** 2 (pixel shuffle) per tile in the tiny model

# tiny, huge, extreme aspect ratios, exact grid ratios (tie-breaks), near-square
SIZES = [
    (1, 1), (2, 3), (20, 20), (31, 33), (32, 32), (48, 48), (64, 64), (65, 64), (96, 96),
    (100, 100), (200, 100), (100, 200), (64, 128), (128, 64), (96, 32), (32, 96), (50, 120),
    (120, 50), (30, 1500), (1500, 30), (1, 900), (900, 1), (40, 300), (300, 40), (240, 320),
    (480, 640), (720, 1280), (1080, 1920), (1500, 1100), (333, 777), (777, 333), (60, 45),
    (17, 250), (256, 96),
]  # fmt: skip


class ImageOnlyInternVLProcessor(InternVLProcessor):
    """transformers' InternVL processor without its video processor (which needs torchvision);
    everything else is transformers' own code."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[no-untyped-call]


@functools.cache
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer(SPECIAL, TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>", extra=NAMED)


def make_processor(image_seq_length: int = SEQ, **image_settings: Any) -> InternVLProcessor:
    image_processor = GotOcr2ImageProcessorPil(**{"size": TILE, **image_settings})
    return ImageOnlyInternVLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer(),
        image_seq_length=image_seq_length,
        chat_template=TEMPLATE,
    )


@functools.cache
def default() -> tuple[InternVLProcessor, InternVLFamily]:
    processor = make_processor()
    return processor, InternVLFamily(processor)


def conversation(images: int, turns: int = 1, system: bool = False) -> list[dict[str, Any]]:
    """``turns`` user/assistant exchanges, the images in the first user turn."""
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": "The system sets the rules."})
    for turn in range(turns):
        parts: list[dict[str, Any]] = [{"type": "image"}] * (images if turn == 0 else 0)
        parts.append({"type": "text", "text": f"What is shown here? {turn}"})
        messages.append({"role": "user", "content": parts})
        messages.append({"role": "assistant", "content": f"The quick brown fox {turn}."})
    return messages


def vision_counts(ids: list[int], processor: InternVLProcessor) -> list[int]:
    """Context tokens between each ``<img>`` and its ``</img>``."""
    counts, inside = [], False
    for token in ids:
        if token == processor.start_image_token_id:
            counts.append(0)
            inside = True
        elif token == processor.end_image_token_id:
            inside = False
        elif token == processor.image_token_id:
            assert inside
            counts[-1] += 1
    return counts


def check_exact(
    processor: InternVLProcessor, family: InternVLFamily, images: Sequence[Image.Image]
) -> dict[str, torch.Tensor]:
    sizes = [(image.height, image.width) for image in images]
    text = processor.apply_chat_template(conversation(len(images)), tokenize=False)
    out = processor(text=[text], images=[list(images)] if images else None, return_tensors="pt")
    got = out["input_ids"][0].tolist()
    want = processor.tokenizer(expanded(family, text, sizes))["input_ids"]
    assert got == want, sizes
    assert vision_counts(got, processor) == family.image_tokens(sizes)
    seq = processor.image_seq_length
    assert family.image_tokens(sizes) == [seq * family.tiles(*size) for size in sizes]
    if images:
        tiles = sum(family.tiles(*size) for size in sizes)
        assert out["pixel_values"].shape[0] == tiles
    return dict(out)


def pil(arrays: Sequence[Any]) -> list[Image.Image]:
    return [Image.fromarray(array) for array in arrays]


@pytest.mark.parametrize("count", [1, 2, 3])
def test_token_exact_over_sizes(count: int) -> None:
    processor, family = default()
    for start in range(0, len(SIZES), count):
        sizes = SIZES[start : start + count]
        check_exact(processor, family, pil(make_images(start, sizes)))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1600), st.integers(1, 1600)), min_size=1, max_size=3))
def test_token_exact_hypothesis(sizes: list[tuple[int, int]]) -> None:
    processor, family = default()
    check_exact(processor, family, [Image.new("RGB", (w, h), (90, 20, 200)) for h, w in sizes])


def test_non_default_settings() -> None:
    """Another tile size (not square), tile bounds and tokens per tile: other expansions, still
    the processor's."""
    processor = make_processor(
        image_seq_length=9, size={"height": 48, "width": 40}, min_patches=2, max_patches=6
    )
    family = InternVLFamily(processor)
    _, base = default()
    assert family.image_tokens([(50, 120)]) != base.image_tokens([(50, 120)])
    assert family.tiles(20, 20) == 5  # 1x1 is under min_patches: 2x2 plus the thumbnail
    for start in range(0, 30, 2):
        sizes = SIZES[start : start + 2]
        check_exact(processor, family, pil(make_images(start, sizes)))


def test_processor_level_crop_off() -> None:
    """``crop_to_patches`` is the processor's default (the image processor's is False): turned
    off on the processor, every image is one tile."""
    processor = make_processor()
    processor.images_kwargs = {"crop_to_patches": False}  # type: ignore[typeddict-unknown-key]
    family = InternVLFamily(processor)
    assert family.image_tokens([(50, 120), (1500, 30)]) == [SEQ, SEQ]
    check_exact(processor, family, pil(make_images(3, [(50, 120), (1500, 30)])))
    assert not GotOcr2ImageProcessorPil().crop_to_patches


def test_tile_grid_tie_break() -> None:
    """Square images: more tiles while the image covers over half their area."""
    assert tile_grid(64, 64, (32, 32), 1, 12) == (2, 2)
    assert tile_grid(63, 63, (32, 32), 1, 12) == (2, 2)
    assert tile_grid(45, 45, (32, 32), 1, 12) == (1, 1)
    assert tile_grid(96, 96, (32, 32), 1, 12) == (3, 3)
    assert tile_grid(10, 10, (32, 32), 13, 12) == (1, 1)


def test_tie_at_exactly_half_area() -> None:
    """A tied grid is taken only while the image area is strictly over half the grid's: with
    48x24 tiles a 48x48 image covers exactly half of 2x2 (stays 1 tile) and 72x72 exactly half
    of 3x3 (stays 2x2 plus the thumbnail)."""
    processor = make_processor(size={"height": 48, "width": 24})
    family = InternVLFamily(processor)
    assert [family.tiles(48, 48), family.tiles(49, 49), family.tiles(72, 72)] == [1, 5, 5]
    assert family.tiles(73, 73) == 10
    for sizes in ([(48, 48), (72, 72)], [(49, 49), (73, 73)]):
        check_exact(processor, family, pil(make_images(0, sizes)))


def test_media_and_token_inputs() -> None:
    processor, family = default()
    for seed, sizes in enumerate([[(50, 120)], [(20, 20), (1500, 30)], [(64, 64)] * 3]):
        arrays = make_images(seed, sizes)
        out = check_exact(processor, family, pil(arrays))
        media = family.media_inputs(arrays)
        assert set(media) == {"pixel_values"} == set(out) - TEXT_KEYS
        assert media["pixel_values"].shape == out["pixel_values"].shape
        assert torch.allclose(media["pixel_values"], out["pixel_values"], rtol=0, atol=1e-6)
        assert family.token_inputs(out["input_ids"][0]) == {}
    assert family.media_inputs([]) == {}


def assistant_mask(text: str, family: InternVLFamily) -> tuple[list[int], list[int]]:
    """Ids of ``text`` and 1 for each token overlapping an assistant span."""
    encoded = family.tokenizer(text, return_offsets_mapping=True)
    spans = family.assistant_spans(text)
    mask = [
        int(any(stop > begin and start < end for begin, end in spans))
        for start, stop in encoded["offset_mapping"]
    ]
    return encoded["input_ids"], mask


@pytest.mark.parametrize(("turns", "system"), [(2, False), (3, True)])
def test_assistant_spans(turns: int, system: bool) -> None:
    processor, family = default()
    messages = conversation(2, turns, system)
    text = expanded(family, processor.apply_chat_template(messages, tokenize=False), [(9, 9)] * 2)
    ids, mask = assistant_mask(text, family)
    masked = [token for token, flag in zip(ids, mask, strict=True) if flag]
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert family.tokenizer.decode(masked) == "".join(replies)
    assert len(family.assistant_spans(text)) == turns
    prompt = processor.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True
    )
    assert len(family.assistant_spans(prompt)) == turns - 1  # an open turn is no span


def tiny_model() -> PreTrainedModel:
    tok = tokenizer()
    config = InternVLConfig(
        vision_config={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "image_size": 32,
            "patch_size": 8,
        },
        text_config={
            "model_type": "qwen2",
            "hidden_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "intermediate_size": 96,
            "vocab_size": len(tok),
            "max_position_embeddings": 1024,
            "pad_token_id": tok.pad_token_id,
            "eos_token_id": tok.eos_token_id,
        },
        image_token_id=int(tok.context_image_token_id),
        image_seq_length=SEQ,
    )
    model = InternVLForConditionalGeneration(config)
    model.config._attn_implementation = "sdpa"
    return model


def test_packed_matches_alone() -> None:
    processor, family = default()
    samples = [([(50, 120)], 1), ([(20, 20), (40, 90)], 2), ([], 1), ([(64, 64)], 2)]
    alone, ids, positions, labels, media = [], [], [], [], []
    for seed, (sizes, turns) in enumerate(samples):
        arrays = make_images(seed, sizes)
        text = processor.apply_chat_template(conversation(len(sizes), turns), tokenize=False)
        out = processor(text=[text], images=[pil(arrays)] if arrays else None, return_tensors="pt")
        sample_ids, mask = assistant_mask(expanded(family, text, sizes), family)
        assert out["input_ids"][0].tolist() == sample_ids
        label = torch.where(torch.tensor(mask, dtype=torch.bool), out["input_ids"][0], IGNORE)
        label[0] = IGNORE
        alone.append({**out, "labels": label[None]})
        ids.append(out["input_ids"][0])
        positions.append(torch.arange(len(sample_ids)))
        labels.append(label)
        media.append(family.media_inputs(arrays))
    packed = {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat(positions)[None],
        "labels": torch.cat(labels)[None],
        **family.row_inputs(media),
    }
    assert family.packing == "position_ids"
    model = seeded(tiny_model)
    loss_error, worst = packed_matches_alone(model, alone, packed)
    # transformers' causal-LM loss casts the logits to float32 (.float()), so the summed loss
    # differs by float32 summation order (~1e-7); the gradients agree to float64 rounding
    assert loss_error < 1e-6, loss_error
    assert worst < 1e-10, worst
