"""LLaVA-OneVision family: token-exact against transformers' own ``LlavaOnevisionProcessor``
(built locally: the test tokenizer with the family's special tokens, the released turn format,
``LlavaOnevisionImageProcessorPil``), media equal to the processor's, the assistant rule, and a
packed row of a tiny ``LlavaOnevisionForConditionalGeneration`` equal to its samples alone."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import pytest
import torch
from family_kit import IGNORE, packed_matches_alone, seeded, tiny_tokenizer
from family_kit import expanded_text as expand
from family_kit import test_images as make_images
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from energon_pack.encoding.families.base import TEXT_KEYS
from energon_pack.encoding.families.llava_onevision import LlavaOnevisionFamily

# The released llava-hf/llava-onevision-* turn format (role then a space, the images first, then
# "\n" + each text, "<|im_end|>\n"), without generation markers; the generation prompt is
# "<|im_start|>assistant\n" (no space), as released.
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{% if message['content'] is string %}{{ '\\n' + message['content'] }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}"
    "{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\\n' + content['text'] }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]
SMALL_PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64], [32, 96], [96, 32], [96, 96]]


class ImageOnlyLlavaOnevisionProcessor(LlavaOnevisionProcessor):
    """transformers' processor without its video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[no-untyped-call]


@cache
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer(
        SPECIAL,
        TEMPLATE,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        extra={"image_token": "<image>", "video_token": "<video>"},
    )


def build(
    num_image_tokens: int = 729,
    strategy: str = "full",
    aspect: str = "anyres_max_9",
    **image_settings: Any,
) -> LlavaOnevisionProcessor:
    return ImageOnlyLlavaOnevisionProcessor(  # type: ignore[no-untyped-call]
        image_processor=LlavaOnevisionImageProcessorPil(**image_settings),
        tokenizer=tokenizer(),
        num_image_tokens=num_image_tokens,
        vision_feature_select_strategy=strategy,
        vision_aspect_ratio=aspect,
        chat_template=TEMPLATE,
    )


@cache
def released() -> LlavaOnevisionProcessor:
    """The released checkpoints' settings: SigLIP 384 / 14 (729 tokens), "full" strategy,
    anyres_max_9 and the image processor's 36 pinpoints."""
    return build()


@cache
def small() -> LlavaOnevisionProcessor:
    """Tiny, non-default settings (32-pixel patches, 16 tokens, anyres_max_1 so the grid is
    shrunk); the tiny model below matches them."""
    return build(
        16,
        aspect="anyres_max_1",
        size={"height": 32, "width": 32},
        image_grid_pinpoints=SMALL_PINPOINTS,
    )


@cache
def clip_like() -> LlavaOnevisionProcessor:
    """Other non-default settings: 336-pixel shortest edge, CLIP's 577 tokens with the
    "default" strategy (CLS dropped), anyres_max_4 and other pinpoints."""
    return build(
        577,
        strategy="default",
        aspect="anyres_max_4",
        size={"shortest_edge": 336},
        image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [336, 1008], [1008, 336]],
    )


def messages(count: int, reply: str | None = None, question: str = "What is shown here?") -> Any:
    turns: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "image"}] * count + [{"type": "text", "text": question}],
        }
    ]
    if reply is not None:
        turns.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return turns


def check_exact(
    processor: LlavaOnevisionProcessor, sizes: Sequence[tuple[int, int]], seed: int
) -> None:
    """Processor ids equal the family's expansion tokenised; per-image texts and counts equal."""
    family = LlavaOnevisionFamily(processor)
    text = processor.apply_chat_template(messages(len(sizes), "A fox."), tokenize=False)
    images = [Image.fromarray(image) for image in make_images(seed, sizes)]
    out = processor(
        text=[text], images=[images], return_tensors="pt", return_text_replacement_offsets=True
    )
    want = tokenizer()(expand(family, text, sizes))["input_ids"]
    assert out["input_ids"][0].tolist() == want, sizes
    replacements = [item["replacement"] for item in out["text_replacement_offsets"][0]]
    assert replacements == family.expansions(sizes), sizes
    image_id = processor.image_token_id
    counts = [tokenizer().encode(r, add_special_tokens=False).count(image_id) for r in replacements]
    assert family.image_tokens(sizes) == counts
    assert sum(counts) == int((out["input_ids"] == image_id).sum())


RELEASED_SAMPLES = [
    [(2, 2)],
    [(1, 1)],
    [(30, 1500)],
    [(1500, 30)],
    [(384, 384)],
    [(383, 385)],
    [(10, 700)],
    [(700, 10)],
    [(480, 640)],
    [(1080, 1920)],
    [(2000, 1800)],
    [(333, 97)],
    [(767, 769)],
    [(300, 500), (40, 40)],
    [(30, 1500), (1500, 30)],
    [(1, 1), (1200, 1100)],
    [(640, 480), (64, 64)],
    [(12, 34), (56, 78), (910, 11)],
    [(1500, 30), (30, 1500), (384, 384)],
    [(200, 200), (201, 199), (5, 900)],
    [(1080, 1920), (7, 7), (999, 3)],
]


@pytest.mark.parametrize("sizes", RELEASED_SAMPLES, ids=str)
def test_released_settings_token_exact(sizes: list[tuple[int, int]]) -> None:
    check_exact(released(), sizes, seed=len(sizes))


def test_released_counts() -> None:
    """730 tokens per image of a multi-image sample; a lone image is tiled (more than 729)."""
    family = LlavaOnevisionFamily(released())
    assert family.image_tokens([(100, 100), (1500, 30)]) == [730, 730]
    assert family.image_tokens([(100, 200), (1, 1), (3, 3)]) == [730] * 3
    (lone,) = family.image_tokens([(1500, 30)])
    assert lone > 730
    assert family.vision_token_ids == frozenset({released().image_token_id})
    assert family.image_placeholder == "<image>"


size = st.tuples(st.integers(1, 400), st.integers(1, 400))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(size, min_size=1, max_size=3), st.integers(0, 10**6))
def test_small_settings_token_exact(sizes: list[tuple[int, int]], seed: int) -> None:
    check_exact(small(), sizes, seed)


@pytest.mark.parametrize(
    "sizes",
    [[(30, 1500)], [(1500, 30)], [(500, 400)], [(3, 3)], [(900, 1000), (20, 20)], [(1, 2)] * 3],
    ids=str,
)
def test_non_default_settings(sizes: list[tuple[int, int]]) -> None:
    """Other sizes, token counts, strategy and pinpoints give other expansions, still exact."""
    check_exact(clip_like(), sizes, seed=7)
    other = LlavaOnevisionFamily(clip_like()).image_tokens(sizes)
    assert other != LlavaOnevisionFamily(released()).image_tokens(sizes)
    if len(sizes) > 1:
        assert other == [577] * len(sizes)  # 576 patches + newline; CLS dropped
    assert LlavaOnevisionFamily(clip_like()).settings() != (
        LlavaOnevisionFamily(released()).settings()
    )


@pytest.mark.parametrize("sizes", [[(50, 90)], [(20, 100), (70, 40), (33, 33)], [(300, 7)]])
def test_media_inputs_equal_processor(sizes: list[tuple[int, int]]) -> None:
    processor = small()
    family = LlavaOnevisionFamily(processor)
    arrays = make_images(3, sizes)
    text = processor.apply_chat_template(messages(len(sizes), "A fox."), tokenize=False)
    out = processor(text=[text], images=[[Image.fromarray(a) for a in arrays]], return_tensors="pt")
    media = family.media_inputs(arrays)
    assert set(media) == set(out) - TEXT_KEYS == {"pixel_values", "image_sizes", "batch_num_images"}
    assert media["pixel_values"].shape == out["pixel_values"].shape
    torch.testing.assert_close(media["pixel_values"], out["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(media["image_sizes"], out["image_sizes"])
    assert torch.equal(media["batch_num_images"], out["batch_num_images"])
    # no token-level inputs: the processor returns none
    assert family.token_keys == frozenset()
    assert family.token_inputs(out["input_ids"][0]) == {}


def test_row_inputs_equal_processor_batch() -> None:
    """Joining samples of different patch and image counts (and a text-only one) gives what
    the processor gives for the same samples as one batch."""
    processor = small()
    family = LlavaOnevisionFamily(processor)
    samples = [[(50, 90)], [(20, 100), (70, 40), (33, 33)], [], [(300, 7)], [(5, 5), (64, 64)]]
    arrays = [make_images(k, sizes) for k, sizes in enumerate(samples)]
    texts = [
        processor.apply_chat_template(messages(len(sizes), "A fox."), tokenize=False)
        for sizes in samples
    ]
    images = [[Image.fromarray(a) for a in sample] for sample in arrays]
    out = processor(text=texts, images=images, return_tensors="pt", padding=True)
    row = family.row_inputs([family.media_inputs(sample) for sample in arrays])
    assert set(row) == set(out) - TEXT_KEYS
    assert row["pixel_values"].shape == out["pixel_values"].shape
    torch.testing.assert_close(row["pixel_values"], out["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(row["image_sizes"], out["image_sizes"])
    assert row["batch_num_images"].tolist() == out["batch_num_images"].tolist() == [1, 3, 1, 2]
    assert family.row_inputs([{}, {}]) == {}


def masked_text(family: LlavaOnevisionFamily, text: str) -> list[str]:
    """The decoded runs of tokens that touch an assistant span."""
    spans = family.assistant_spans(text)
    encoding = tokenizer()(text, return_offsets_mapping=True)
    runs: list[list[int]] = []
    previous = False
    for token, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True):
        inside = any(start < b and a < end for a, b in spans)
        if inside and not previous:
            runs.append([])
        if inside:
            runs[-1].append(token)
        previous = inside
    return [str(tokenizer().decode(run)) for run in runs]


@pytest.mark.parametrize("turns", [2, 3])
def test_assistant_spans(turns: int) -> None:
    family = LlavaOnevisionFamily(released())
    replies = ["The quick brown fox.", "It jumps over\nthe lazy dog.", "12 345 6789"][:turns]
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "Sets the rules."}]
    for k, reply in enumerate(replies):
        conversation += messages(k % 2, reply, question=f"Question {k}?")
    text = released().apply_chat_template(conversation, tokenize=False)
    assert "<|im_start|>assistant \n" in text
    assert masked_text(family, text) == [reply + "<|im_end|>" for reply in replies]
    # the generation prompt's header (no space) opens a reply too; an unended reply is none
    prompt = released().apply_chat_template(messages(1), tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert masked_text(family, prompt + "Yes.<|im_end|>\n") == ["Yes.<|im_end|>"]
    assert family.assistant_spans(prompt + "Yes.") == []


def tiny_model() -> PreTrainedModel:
    processor = small()
    config = LlavaOnevisionConfig(
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
            "vision_use_head": False,
        },
        text_config={
            "model_type": "qwen2",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": len(tokenizer()),
            "max_position_embeddings": 1024,
        },
        image_token_index=processor.image_token_id,
        video_token_index=processor.video_token_id,
        image_grid_pinpoints=SMALL_PINPOINTS,
        vision_aspect_ratio=processor.vision_aspect_ratio,
        vision_feature_select_strategy=processor.vision_feature_select_strategy,
    )
    config._attn_implementation = "sdpa"
    return LlavaOnevisionForConditionalGeneration(config)


def test_packed_matches_alone() -> None:
    """Positions restarting per segment make the packed row exact: Qwen2 derives its
    block-diagonal mask from them, the vision tower sees each patch alone, and the row's
    ``batch_num_images`` keeps each sample's tiled / untiled rule."""
    processor = small()
    family = LlavaOnevisionFamily(processor)
    assert family.packing == "position_ids"
    model = seeded(tiny_model)
    samples = [
        ([(50, 90)], "The fox."),
        ([(20, 100), (70, 40), (33, 33)], "Three images here."),
        ([], "Only text."),
        ([(100, 30)], "Tall and thin."),
    ]
    alone, ids, labels, positions, media = [], [], [], [], []
    for k, (sizes, reply) in enumerate(samples):
        text = processor.apply_chat_template(messages(len(sizes), reply), tokenize=False)
        arrays = make_images(k, sizes)
        pil = [[Image.fromarray(a) for a in arrays]] if arrays else None
        out = processor(text=[text], images=pil, return_tensors="pt")
        expanded = expand(family, text, sizes)
        encoding = tokenizer()(expanded, return_offsets_mapping=True)
        assert encoding["input_ids"] == out["input_ids"][0].tolist()
        spans = family.assistant_spans(expanded)
        mask = torch.tensor(
            [any(s < b and a < e for a, b in spans) for s, e in encoding["offset_mapping"]]
        )
        sample_ids = out["input_ids"][0]
        sample_labels = torch.where(mask, sample_ids, IGNORE)
        sample_labels[0] = IGNORE
        alone.append({**out, "labels": sample_labels[None]})
        ids.append(sample_ids)
        labels.append(sample_labels)
        positions.append(torch.arange(len(sample_ids)))
        media.append(family.media_inputs(arrays))
    packed = {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat(positions)[None],
        **family.row_inputs(media),
    }
    assert packed["batch_num_images"].tolist() == [1, 3, 1]
    most = max(int(m["pixel_values"].shape[1]) for m in media if m)
    assert packed["pixel_values"].shape[:2] == (5, most)
    assert most > 1
    loss_error, grad_error = packed_matches_alone(model, alone, packed)
    # the loss is reduced in float32 by transformers (logits.float()); gradients stay float64
    assert loss_error < 1e-6
    assert grad_error < 1e-10


def test_rejects_unset_token_count() -> None:
    with pytest.raises(ValueError, match="num_image_tokens"):
        LlavaOnevisionFamily(build(num_image_tokens=None))  # type: ignore[arg-type]
