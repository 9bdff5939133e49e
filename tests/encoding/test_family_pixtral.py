"""The Pixtral / Mistral 3 family against transformers' own ``PixtralProcessor``: token-exact
expansions (seeded and hypothesis sizes, released-like and non-default settings), the
processor's media outputs, the row padding of ``pixel_values``, the ``[/INST]...</s>`` reply
rule, and a packed row of a tiny ``Mistral3ForConditionalGeneration`` (and of Pixtral-12B's
``LlavaForConditionalGeneration``) against its samples alone.

``PixtralProcessor`` is declared as needing torchvision only because its module imports
``get_resize_output_image_size`` from the torchvision image processor (for
``_get_num_multimodal_tokens``); :func:`_processor_class` imports the real class with that one
function taken from the Pil image processor's module (the same code), nothing else replaced.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from family_kit import IGNORE, packed_matches_alone, seeded, tiny_tokenizer
from family_kit import test_images as make_images
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    LlavaConfig,
    LlavaForConditionalGeneration,
    Mistral3Config,
    Mistral3ForConditionalGeneration,
    PreTrainedModel,
)
from transformers.models.pixtral import image_processing_pil_pixtral

from energon_pack.encoding.families import processor_family
from energon_pack.encoding.families.pixtral import PixtralFamily

SPECIAL = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
]
TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + messages[0]['content'] + '[/SYSTEM_PROMPT]' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{{- '[IMG]' }}"
    "{%- else %}{{- raise_exception('Only text and image blocks are supported') }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}{{- block['text'] }}{%- endfor %}"
    "{%- endif %}"
    "{{- eos_token }}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported') }}"
    "{%- endif %}{%- endfor %}"
)
"""The Mistral (Pixtral / Mistral Small 3.1) turn format: ``<s>[SYSTEM_PROMPT]...
[/SYSTEM_PROMPT][INST]...[/INST]reply</s>``, ``[IMG]`` per image part."""

MISTRAL_SMALL = (14, 2, 1540)
"""Mistral-Small-3.1's processor: patch 14, spatial merge 2, longest edge 1540."""
PIXTRAL_12B = (16, 1, 1024)
"""Pixtral-12B's processor: patch 16, no merge, longest edge 1024."""


@functools.cache
def _processor_class() -> Any:
    """transformers' ``PixtralProcessor`` (see the module docstring)."""
    name = "transformers.models.pixtral.image_processing_pixtral"
    stub = types.ModuleType(name)
    stub.get_resize_output_image_size = image_processing_pil_pixtral.get_resize_output_image_size  # type: ignore[attr-defined]
    saved = sys.modules.get(name)
    sys.modules[name] = stub
    try:
        module = importlib.import_module("transformers.models.pixtral.processing_pixtral")
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved
    return module.PixtralProcessor


@functools.cache
def tokenizer() -> Any:
    return tiny_tokenizer(SPECIAL, TEMPLATE, bos="<s>", eos="</s>", pad="<unk>")


def processor(
    patch: int = 14,
    merge: int = 2,
    longest: int | None = 1540,
    *,
    size: dict[str, int] | None = None,
    **image_settings: Any,
) -> Any:
    """A ``PixtralProcessor`` over the tiny tokenizer and a Pil image processor whose own
    ``patch_size`` (7) is deliberately not the processor's (the processor's call wins)."""
    image_processor = image_processing_pil_pixtral.PixtralImageProcessorPil(
        size=size or {"longest_edge": longest},
        patch_size={"height": 7, "width": 7},
        **image_settings,
    )
    return _processor_class()(
        image_processor=image_processor,
        tokenizer=tokenizer(),
        patch_size=patch,
        spatial_merge_size=merge,
        chat_template=TEMPLATE,
    )


@functools.cache
def cached(settings: tuple[int, int, int]) -> tuple[Any, PixtralFamily]:
    proc = processor(*settings)
    return proc, PixtralFamily(proc)


@functools.cache
def image(height: int, width: int, seed: int = 0) -> np.ndarray[Any, Any]:
    """A seeded test image; one over 2**18 pixels is a smaller one scaled up (faster)."""
    seed = seed * 7919 + height * 31 + width
    if height * width <= 1 << 18:
        return make_images(seed, [(height, width)])[0]
    small = make_images(seed, [(max(1, height // 4), max(1, width // 4))])[0]
    return np.asarray(Image.fromarray(small).resize((width, height), Image.Resampling.NEAREST))


def messages(count: int, reply: str = "The quick brown fox.") -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "image"}] * count
    return [
        {"role": "user", "content": [*content, {"type": "text", "text": "What is shown here?"}]},
        {"role": "assistant", "content": reply},
    ]


def check_sample(proc: Any, family: PixtralFamily, sizes: Sequence[tuple[int, int]]) -> None:
    """The processor's ids on the rendered chat equal the tokenizer's on the text with each
    ``[IMG]`` replaced by the family's expansion; per-image ``[IMG]`` counts agree."""
    text = proc.apply_chat_template(messages(len(sizes)), tokenize=False)
    pil = [Image.fromarray(image(h, w)) for h, w in sizes]
    try:
        expansions = family.expansions(sizes)
    except ValueError:  # an image resized to no token row or column: the processor fails too
        with pytest.raises(ValueError, match="Size must contain"):
            proc(text=[text], images=[pil], return_tensors="pt")
        return
    out = proc(text=[text], images=[pil], return_tensors="pt")
    pieces = text.split(family.image_placeholder)
    assert len(pieces) == len(sizes) + 1
    expanded = pieces[0]
    for expansion, piece in zip(expansions, pieces[1:], strict=True):
        expanded += expansion + piece
    want = proc.tokenizer(expanded)["input_ids"]
    assert out["input_ids"][0].tolist() == want
    (image_id,) = family.vision_token_ids
    cell = proc.patch_size * proc.spatial_merge_size
    counts = [int(h // cell * (w // cell)) for h, w in out["image_sizes"].tolist()]
    assert family.image_tokens(sizes) == counts
    assert sum(counts) == int((out["input_ids"] == image_id).sum())


SIZES = [
    (1, 1),
    (5, 7),
    (13, 14),
    (14, 14),
    (15, 29),
    (28, 28),
    (29, 57),
    (30, 1500),
    (1500, 30),
    (2, 1500),
    (1500, 3),
    (1540, 1540),
    (1541, 1540),
    (1540, 1541),
    (2300, 1700),
    (1700, 2300),
    (1024, 1025),
    (1025, 1023),
    (999, 1001),
    (60, 1600),
    *[
        (int(h), int(w))
        for h, w in np.random.default_rng(7).integers(1, 1200, size=(16, 2)).tolist()
    ],
]
"""36 sizes: tiny, exact and off-by-one fits, huge, extreme aspect ratios, seeded ones."""


def grouped(sizes: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``sizes`` as samples of 1, 2 and 3 images in turn."""
    out, start, count = [], 0, 1
    while start < len(sizes):
        out.append(list(sizes[start : start + count]))
        start += count
        count = count % 3 + 1
    return out


@pytest.mark.parametrize("settings", [MISTRAL_SMALL, PIXTRAL_12B], ids=["mistral3", "pixtral12b"])
def test_expansions_match_the_processor(settings: tuple[int, int, int]) -> None:
    proc, family = cached(settings)
    samples = grouped(SIZES)
    assert {len(s) for s in samples} == {1, 2, 3}
    assert sum(map(len, samples)) >= 30
    for sizes in samples:
        check_sample(proc, family, sizes)


def test_other_settings_give_other_tokens() -> None:
    """Settings read from the instance: merge, patch, longest edge, a height/width box, no
    resize and the processor's own ``images_kwargs`` each change the layout, still exact."""
    sizes = [(300, 200), (45, 900), (77, 77)]
    default = cached(MISTRAL_SMALL)[1].expansions(sizes)
    variants = [
        processor(14, 1, 1540),
        processor(16, 2, 1540),
        processor(14, 2, 256),
        processor(8, 2, size={"height": 96, "width": 400}),
        processor(14, 2, 1540, do_resize=False),
    ]
    override = processor(14, 2, 1540)
    override.images_kwargs = {**override.images_kwargs, "size": {"longest_edge": 112}}
    variants.append(override)
    for proc in variants:
        family = PixtralFamily(proc)
        assert family.expansions(sizes) != default
        check_sample(proc, family, sizes)
    rows = PixtralFamily(variants[3]).expansions([(300, 200)])[0].split("[IMG_BREAK]")
    assert len(rows) == 6  # 96 / 16 rows
    assert rows[0] == "[IMG]" * 4  # 200 * 96 / 300 = 64 -> 4 columns


def test_layout_text() -> None:
    family = cached(MISTRAL_SMALL)[1]
    assert family.expansions([(56, 84), (10, 10)]) == [
        "[IMG][IMG][IMG][IMG_BREAK][IMG][IMG][IMG][IMG_END]",
        "[IMG][IMG_END]",
    ]
    assert family.image_tokens([(56, 84)]) == [6]
    assert family.image_placeholder == "[IMG]"
    assert family.vision_token_ids == {tokenizer().convert_tokens_to_ids("[IMG]")}
    assert processor_family(cached(MISTRAL_SMALL)[0]).__class__ is PixtralFamily
    assert family.settings()["processor"]["spatial_merge_size"] == 2


def test_an_image_with_no_token_row_is_refused_as_by_the_processor() -> None:
    proc, family = cached(MISTRAL_SMALL)
    with pytest.raises(ValueError, match="no token rows"):
        family.expansions([(1, 2000)])
    with pytest.raises(ValueError, match="Size must contain"):  # resized to height 0
        proc(text=["[IMG]"], images=[[Image.fromarray(image(1, 2000))]], return_tensors="pt")


SMALL = [
    processor(4, 2, 48),
    processor(4, 1, 40),
    processor(8, 2, size={"height": 40, "width": 72}),
]


@settings(max_examples=80, deadline=None)
@given(
    which=st.integers(0, len(SMALL) - 1),
    sizes=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 300)), min_size=1, max_size=3),
)
def test_expansions_match_the_processor_hypothesis(
    which: int, sizes: list[tuple[int, int]]
) -> None:
    proc = SMALL[which]
    check_sample(proc, PixtralFamily(proc), sizes)


def test_media_inputs_are_the_processors() -> None:
    proc, family = cached(MISTRAL_SMALL)
    sizes = [(300, 200), (45, 900), (77, 77)]
    arrays = [image(h, w) for h, w in sizes]
    text = proc.apply_chat_template(messages(3), tokenize=False)
    want = proc(text=[text], images=[[Image.fromarray(a) for a in arrays]], return_tensors="pt")
    got = family.media_inputs(arrays)
    assert (
        set(got) == {"pixel_values", "image_sizes"} == set(want) - {"input_ids", "attention_mask"}
    )
    assert got["pixel_values"].shape == want["pixel_values"].shape == (3, 3, 308, 924)
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(got["image_sizes"], want["image_sizes"])
    assert family.token_inputs(want["input_ids"][0]) == {}
    assert family.media_inputs([]) == {}


def test_row_inputs_pad_to_the_largest_image_as_a_processor_batch() -> None:
    """A row's media equal the processor's own batch of those samples (zero-padded to the
    largest height and width among all their images)."""
    proc, family = cached(MISTRAL_SMALL)
    first = [image(300, 60)]
    second = [image(40, 500), image(90, 90)]
    media = [family.media_inputs(first), {}, family.media_inputs(second)]
    assert media[0]["pixel_values"].shape[-2:] != media[2]["pixel_values"].shape[-2:]
    row = family.row_inputs(media)
    texts = [proc.apply_chat_template(messages(n), tokenize=False) for n in (1, 2)]
    pil = [[Image.fromarray(a) for a in first], [Image.fromarray(a) for a in second]]
    want = proc(text=texts, images=pil, return_tensors="pt", padding=True)
    assert row["pixel_values"].shape == want["pixel_values"].shape == (3, 3, 308, 504)
    torch.testing.assert_close(row["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(row["image_sizes"], want["image_sizes"])
    assert family.row_inputs([{}, {}]) == {}


def assistant_mask(family: PixtralFamily, text: str) -> tuple[list[int], list[bool]]:
    """Ids of ``text`` and which touch the family's assistant spans."""
    encoding = family.tokenizer(text, return_offsets_mapping=True)
    spans = family.assistant_spans(text)
    mask = [
        any(b < end and e > begin for begin, end in spans) for b, e in encoding["offset_mapping"]
    ]
    return encoding["input_ids"], mask


def test_assistant_spans_two_and_three_turns() -> None:
    proc, family = cached(MISTRAL_SMALL)
    two = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "The quick brown fox."},
        {"role": "user", "content": "Describe the image in detail."},
        {"role": "assistant", "content": [{"type": "text", "text": "A lazy dog, 12 345."}]},
    ]
    three = [
        {"role": "system", "content": "the system sets the rules."},
        *two,
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": "\n  indented text\tand tabs, émigré façade."},
    ]
    for conversation in (two, three):
        replies = [m["content"] for m in conversation if m["role"] == "assistant"]
        replies = [r if isinstance(r, str) else r[0]["text"] for r in replies]
        text = proc.apply_chat_template(conversation, tokenize=False)
        spans = family.assistant_spans(text)
        assert [text[b:e] for b, e in spans] == [r + "</s>" for r in replies]
        ids, mask = assistant_mask(family, text)
        kept = [i for i, m in zip(ids, mask, strict=True) if m]
        assert family.tokenizer.decode(kept) == "".join(r + "</s>" for r in replies)
    prompt = proc.apply_chat_template(two[:3], tokenize=False)
    assert len(family.assistant_spans(prompt)) == 1  # the generation prompt is no reply
    assert family.assistant_spans("<s>[INST]a[/INST][INST]b[/INST]c</s>") == [(31, 36)]
    assert family.assistant_spans("") == []
    tools = '<s>[INST]q[/INST][TOOL_CALLS][{"name": "f"}]</s>[TOOL_RESULTS]1[/TOOL_RESULTS]two</s>'
    spans = family.assistant_spans(tools)
    assert [tools[b:e] for b, e in spans] == ['[TOOL_CALLS][{"name": "f"}]</s>', "two</s>"]


# The tiny-model check ------------------------------------------------------------------------

MODEL_PROCESSORS = {"mistral3": processor(4, 2, 32), "llava": processor(4, 1, 24)}
"""The processors the tiny models read: Mistral 3 merges 2x2 patches; Pixtral-12B's Llava
does not."""


def tiny_model(kind: str) -> PreTrainedModel:
    tok = tokenizer()
    ids = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    text = {
        "model_type": "mistral",
        "vocab_size": len(tok),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 1024,
        "sliding_window": None,
        **ids,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 8,
        "patch_size": 4,
        "image_size": 32,
    }
    image_id = tok.convert_tokens_to_ids("[IMG]")
    if kind == "mistral3":
        config: Any = Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=image_id,
            spatial_merge_size=MODEL_PROCESSORS[kind].spatial_merge_size,
            **ids,
        )
        build: Any = Mistral3ForConditionalGeneration
    else:
        config = LlavaConfig(
            text_config=text,
            vision_config=vision,
            image_token_index=image_id,
            vision_feature_layer=-1,
            vision_feature_select_strategy="full",
            **ids,
        )
        build = LlavaForConditionalGeneration
    config._attn_implementation = "sdpa"
    return seeded(lambda: build(config))


@pytest.mark.parametrize("kind", ["mistral3", "llava"])
def test_packed_row_matches_samples_alone(kind: str) -> None:
    proc = MODEL_PROCESSORS[kind]
    family = PixtralFamily(proc)
    model = tiny_model(kind)
    samples = [
        (messages(1, "The lazy dog."), [image(20, 12, 1)]),
        (
            [
                {"role": "user", "content": "What is shown here?"},
                {"role": "assistant", "content": "Text only, 12 345."},
            ],
            [],
        ),
        (messages(2, "A fox and a dog."), [image(32, 9, 2), image(13, 40, 3)]),
    ]
    alone, ids, labels, positions, media = [], [], [], [], []
    for conversation, arrays in samples:
        text = proc.apply_chat_template(conversation, tokenize=False)
        pil = [Image.fromarray(a) for a in arrays]
        out = dict(proc(text=[text], images=[pil] if pil else None, return_tensors="pt"))
        sizes = [a.shape[:2] for a in arrays]
        pieces = text.split(family.image_placeholder)
        expanded = pieces[0] + "".join(
            e + p for e, p in zip(family.expansions(sizes), pieces[1:], strict=True)
        )
        sample_ids, mask = assistant_mask(family, expanded)
        assert out["input_ids"][0].tolist() == sample_ids
        label = torch.tensor([i if m else IGNORE for i, m in zip(sample_ids, mask, strict=True)])
        label[0] = IGNORE
        alone.append({**out, "labels": label[None]})
        ids.append(out["input_ids"][0])
        labels.append(label)
        positions.append(torch.arange(len(sample_ids)))
        media.append(family.media_inputs(arrays))
    packed = {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat(positions)[None],
        "labels": torch.cat(labels)[None],
        **family.row_inputs(media),
    }
    shapes = [m["pixel_values"].shape[-2:] for m in media if m]
    assert shapes[0][0] < shapes[1][0]  # the first sample's image is padded in height
    assert shapes[0][1] < shapes[1][1]  # and in width
    # the loss is float32 (transformers' causal-LM loss upcasts the logits to float32, so a
    # float64 model's loss sums in float32: ~1e-7 relative); the gradients agree to float64
    _, grad_error = packed_matches_alone(model, alone, packed)
    assert grad_error < 1e-12, grad_error
