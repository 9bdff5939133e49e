"""GLM-4V (``Glm4vProcessor``) against transformers' own processor and model code.

The processor is transformers' ``Glm4vProcessor`` (without its video processor, which needs
torchvision) on ``Glm4vImageProcessorPil`` and a small local tokenizer with GLM's special
tokens and a chat template in the released GLM-4.1V turn format
(``[gMASK]<sop><|system|>\\n...<|user|>\\n...<|assistant|>\\nreply``). The family's expansions
give the processor's ids exactly, its media and ``mm_token_type_ids`` equal the processor's,
its assistant spans cover the replies, and a packed row with the family's ``[4, 1, T]``
positions trains a tiny ``Glm4vForConditionalGeneration`` exactly like its samples alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from family_kit import IGNORE, packed_matches_alone, seeded, tiny_tokenizer
from family_kit import expanded_text as expanded
from family_kit import test_images as seeded_images
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    Glm4vConfig,
    Glm4vForConditionalGeneration,
    Glm4vImageProcessorPil,
    Glm4vProcessor,
    PreTrainedModel,
)

from energon_pack.encoding.families.glm4v import Glm4vFamily

# The released GLM-4.1V-9B-Thinking chat template's structure (its whitespace control included).
TEMPLATE = """[gMASK]<sop>
{%- for msg in messages %}
    {%- if msg.role == 'system' %}
<|system|>
{{ msg.content }}
    {%- elif msg.role == 'user' %}
<|user|>{{ '\\n' }}

        {%- if msg.content is string %}
{{ msg.content }}
        {%- else %}
            {%- for item in msg.content %}
                {%- if item.type == 'video' or 'video' in item %}
<|begin_of_video|><|video|><|end_of_video|>
                {%- elif item.type == 'image' or 'image' in item %}
<|begin_of_image|><|image|><|end_of_image|>
                {%- elif item.type == 'text' %}
{{ item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
    {%- elif msg.role == 'assistant' %}
        {%- if msg.metadata %}
<|assistant|>{{ msg.metadata }}
{{ msg.content }}
        {%- else %}
<|assistant|>
{{ msg.content }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{% if add_generation_prompt %}<|assistant|>
{% endif %}"""

SPECIAL = [
    "<|endoftext|>",
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|video|>",
]
TOKENIZER = tiny_tokenizer(
    SPECIAL,
    TEMPLATE,
    eos="<|endoftext|>",
    pad="<|endoftext|>",
    extra={"image_token": "<|image|>", "video_token": "<|video|>"},
)


class ImageOnlyGlm4vProcessor(Glm4vProcessor):
    """transformers' GLM-4V processor without its video processor (it needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[no-untyped-call]


def make_processor(**image_settings: Any) -> Glm4vProcessor:
    return ImageOnlyGlm4vProcessor(  # type: ignore[no-untyped-call]
        image_processor=Glm4vImageProcessorPil(**image_settings),
        tokenizer=TOKENIZER,
        chat_template=TEMPLATE,
    )


PROCESSOR = make_processor()
FAMILY = Glm4vFamily(PROCESSOR)
# Other geometry and a small pixel budget: patch 16, merge 1, 64 to 512 patches (over the
# processor's 2 temporal copies).
OTHER = make_processor(
    patch_size=16, merge_size=1, size={"shortest_edge": 2 * 64 * 256, "longest_edge": 2 * 512 * 256}
)
OTHER_FAMILY = Glm4vFamily(OTHER)

# 32 sizes in samples of 1, 2 and 3 images: tiny, below and above the pixel budget (2560x2400
# is over the default 11,760,000 / 2 pixels), extreme aspect ratios.
SAMPLES: list[list[tuple[int, int]]] = [
    [(1, 1)],
    [(27, 27), (28, 28)],
    [(2, 60), (1, 100), (3, 500)],
    [(30, 1500)],
    [(1500, 30), (10, 1900)],
    [(50, 70), (70, 50), (99, 101)],
    [(2560, 2400)],
    [(4000, 60), (60, 4000)],
    [(111, 112), (113, 114), (56, 56)],
    [(300, 200)],
    [(640, 480), (480, 640)],
    [(1024, 768), (28, 5000), (31, 33)],
    [(17, 3000)],
    [(180, 1), (1, 180)],
    [(223, 97), (97, 223), (1000, 999)],
    [(1234, 567), (5, 900)],
]


def messages(count: int, text: str = "What is shown here?") -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(count)]
    return [
        {"role": "system", "content": "the system sets the rules."},
        {"role": "user", "content": [*content, {"type": "text", "text": text}]},
        {"role": "assistant", "content": "The quick brown fox."},
    ]


def images_for(seed: int, sizes: Sequence[tuple[int, int]]) -> list[np.ndarray[Any, Any]]:
    """Seeded images, flat grey above a megapixel: the tokens depend on the size alone, and
    seeded noise that large costs seconds."""
    return [
        np.full((h, w, 3), 128, np.uint8)
        if h * w > 1_000_000
        else seeded_images(seed + i, [(h, w)])[0]
        for i, (h, w) in enumerate(sizes)
    ]


def check_exact(
    processor: Glm4vProcessor, family: Glm4vFamily, sizes: Sequence[tuple[int, int]]
) -> None:
    text = processor.apply_chat_template(messages(len(sizes)), tokenize=False)
    images = [Image.fromarray(a) for a in images_for(len(sizes), sizes)]
    out = processor(text=[text], images=[images], return_tensors="pt")
    want = TOKENIZER(expanded(family, text, sizes))["input_ids"]
    assert out["input_ids"][0].tolist() == want
    # the vision ids the processor put between each image's begin and end tokens
    row = out["input_ids"][0].tolist()
    begin, end = TOKENIZER.convert_tokens_to_ids(["<|begin_of_image|>", "<|end_of_image|>"])
    starts = [i for i, t in enumerate(row) if t == begin]
    counts = [sum(t in family.vision_token_ids for t in row[i : row.index(end, i)]) for i in starts]
    assert family.image_tokens(sizes) == counts
    merge = processor.image_processor.merge_size**2
    assert counts == (out["image_grid_thw"].prod(-1) // merge).tolist()
    types = family.token_inputs(out["input_ids"][0])
    assert types.keys() == family.token_keys
    assert torch.equal(types["mm_token_type_ids"], out["mm_token_type_ids"][0])


@pytest.mark.parametrize("sizes", SAMPLES, ids=str)
def test_expansions_match_processor(sizes: list[tuple[int, int]]) -> None:
    check_exact(PROCESSOR, FAMILY, sizes)


@settings(max_examples=20, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 700), st.integers(1, 700)).filter(lambda s: max(s) / min(s) < 150),
        min_size=1,
        max_size=3,
    )
)
def test_expansions_match_processor_hypothesis(sizes: list[tuple[int, int]]) -> None:
    check_exact(PROCESSOR, FAMILY, sizes)


@pytest.mark.parametrize("sizes", [[(50, 70)], [(1500, 30), (300, 200)], [(2000, 1900), (1, 1)]])
def test_other_settings(sizes: list[tuple[int, int]]) -> None:
    assert OTHER_FAMILY.expansions(sizes) != FAMILY.expansions(sizes)
    check_exact(OTHER, OTHER_FAMILY, sizes)


def test_too_extreme_aspect_ratio_is_refused_as_by_the_processor() -> None:
    image = Image.fromarray(seeded_images(0, [(1, 300)])[0])
    with pytest.raises(ValueError, match="aspect ratio"):
        PROCESSOR(text=["<|image|>"], images=[[image]], return_tensors="pt")
    with pytest.raises(ValueError, match="aspect ratio"):
        FAMILY.expansions([(1, 300)])


def test_media_inputs_match_processor() -> None:
    sizes = [(50, 70), (1500, 30), (31, 33)]
    arrays = seeded_images(3, sizes)
    text = PROCESSOR.apply_chat_template(messages(3), tokenize=False)
    out = PROCESSOR(text=[text], images=[[Image.fromarray(a) for a in arrays]], return_tensors="pt")
    media = FAMILY.media_inputs(arrays)
    assert set(media) == {"pixel_values", "image_grid_thw"}
    assert torch.allclose(media["pixel_values"], out["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(media["image_grid_thw"], out["image_grid_thw"])
    assert FAMILY.media_inputs([]) == {}


def test_video_segments_get_type_two() -> None:
    ids = TOKENIZER("<|image|><|begin_of_video|><|image|><|image|><|end_of_video|>x<|image|>")
    types = FAMILY.token_inputs(torch.tensor(ids["input_ids"]))["mm_token_type_ids"]
    want = PROCESSOR.create_mm_token_type_ids([ids["input_ids"]])[0]
    assert types.tolist() == want == [1, 0, 2, 2, 0, 0, 1]


def assistant_mask(text: str) -> tuple[list[int], list[int]]:
    enc = TOKENIZER(text, return_offsets_mapping=True)
    spans = FAMILY.assistant_spans(text)
    assert spans is not None
    mask = [
        int(any(b <= start and end <= e for b, e in spans)) for start, end in enc["offset_mapping"]
    ]
    return enc["input_ids"], mask


def masked_runs(ids: list[int], mask: list[int]) -> list[str]:
    runs: list[list[int]] = []
    for i, (token, keep) in enumerate(zip(ids, mask, strict=True)):
        if keep:
            if i == 0 or not mask[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return [str(TOKENIZER.decode(run)) for run in runs]


@pytest.mark.parametrize("turns", [2, 3])
def test_assistant_spans(turns: int) -> None:
    replies = ["The quick brown fox.", "A lazy dog\n\nindented text", "12 345 6789"][:turns]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "the rules"}]
    for i, reply in enumerate(replies):
        content: Any = (
            [{"type": "image"}, {"type": "text", "text": "Describe"}] if i == 0 else "Why?"
        )
        msgs += [{"role": "user", "content": content}, {"role": "assistant", "content": reply}]
    text = PROCESSOR.apply_chat_template(msgs, tokenize=False)
    ids, mask = assistant_mask(text)
    # every reply but the last ends at the next user turn; the last runs to the end
    assert masked_runs(ids, mask) == [r + "<|user|>" for r in replies[:-1]] + [replies[-1]]
    assert len(FAMILY.assistant_spans(text) or []) == turns
    # a generation prompt is no reply; an EOS ends one
    prompt = PROCESSOR.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)
    assert len(FAMILY.assistant_spans(prompt) or []) == turns - 1
    ids, mask = assistant_mask(text + "<|endoftext|>")
    assert masked_runs(ids, mask)[-1] == replies[-1] + "<|endoftext|>"


def tiny_model() -> PreTrainedModel:
    ids: dict[str, Any] = {
        name: TOKENIZER.convert_tokens_to_ids(token)
        for name, token in (
            ("image_token_id", "<|image|>"),
            ("video_token_id", "<|video|>"),
            ("image_start_token_id", "<|begin_of_image|>"),
            ("image_end_token_id", "<|end_of_image|>"),
            ("video_start_token_id", "<|begin_of_video|>"),
            ("video_end_token_id", "<|end_of_video|>"),
        )
    }
    config = Glm4vConfig(
        text_config={
            "vocab_size": len(TOKENIZER),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "pad_token_id": TOKENIZER.pad_token_id,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "image_size": 56,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        **ids,
    )
    config._attn_implementation = "sdpa"
    return Glm4vForConditionalGeneration(config)


def labelled(text: str) -> torch.Tensor:
    ids, mask = assistant_mask(text)
    labels = torch.tensor([t if m else IGNORE for t, m in zip(ids, mask, strict=True)])
    labels[0] = IGNORE
    return labels


def test_packed_row_trains_like_its_samples_alone() -> None:
    model = seeded(tiny_model)
    conversations = [
        (messages(1), [(50, 70)]),
        (messages(2, "Describe the image in detail."), [(30, 90), (60, 40)]),
        (
            [
                {"role": "user", "content": "The quick brown fox?"},
                {"role": "assistant", "content": "jumps over the lazy dog."},
                {"role": "user", "content": "And?"},
                {"role": "assistant", "content": "12 345"},
            ],
            [],
        ),
    ]
    alone, ids, positions, labels, types, media = [], [], [], [], [], []
    for seed, (msgs, sizes) in enumerate(conversations):
        text = PROCESSOR.apply_chat_template(msgs, tokenize=False)
        arrays = seeded_images(seed, sizes)
        images = [[Image.fromarray(a) for a in arrays]] if arrays else None
        out = dict(PROCESSOR(text=[text], images=images, return_tensors="pt"))
        label = labelled(expanded(FAMILY, text, sizes))
        assert label.shape == out["input_ids"][0].shape
        out["pixel_values"] = out["pixel_values"].double() if "pixel_values" in out else None
        alone.append({k: v for k, v in out.items() if v is not None} | {"labels": label[None]})
        row = out["input_ids"][0]
        sample_media = FAMILY.media_inputs(arrays)
        ids.append(row)
        positions.append(FAMILY.position_ids(model, row, sample_media))
        labels.append(label)
        types.append(FAMILY.token_inputs(row)["mm_token_type_ids"])
        media.append(sample_media)
    joined = FAMILY.row_inputs(media)
    joined["pixel_values"] = joined["pixel_values"].double()
    packed = {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat(positions, dim=-1),
        "mm_token_type_ids": torch.cat(types)[None],
        "labels": torch.cat(labels)[None],
        **joined,
    }
    assert packed["position_ids"].shape == (4, 1, packed["input_ids"].shape[1])
    loss_error, grad_error = packed_matches_alone(model, alone, packed)
    print(f"glm4v packed vs alone: loss {loss_error:.2e}, worst gradient {grad_error:.2e}")


def test_positions_are_the_models_own() -> None:
    """One segment's mRoPE rows equal what the model computes for it alone (with the
    processor's ``mm_token_type_ids``); the text row counts from 0."""
    model = seeded(tiny_model)
    text = PROCESSOR.apply_chat_template(messages(2), tokenize=False)
    arrays = seeded_images(0, [(50, 70), (100, 40)])
    out = PROCESSOR(text=[text], images=[[Image.fromarray(a) for a in arrays]], return_tensors="pt")
    got = FAMILY.position_ids(model, out["input_ids"][0], FAMILY.media_inputs(arrays))
    want, _ = model.model.get_rope_index(
        out["input_ids"],
        mm_token_type_ids=out["mm_token_type_ids"],
        image_grid_thw=out["image_grid_thw"],
        attention_mask=out["attention_mask"],
    )
    assert torch.equal(got[1:], want)
    assert torch.equal(got[0, 0], torch.arange(out["input_ids"].shape[1]))
    assert not torch.equal(got[1], got[0])  # image pads are 3-D


def test_family_settings() -> None:
    assert FAMILY.packing == "mrope"
    assert FAMILY.image_placeholder == "<|image|>"
    assert FAMILY.vision_token_ids == {TOKENIZER.convert_tokens_to_ids("<|image|>")}
    assert FAMILY.settings()["image_processor"]["merge_size"] == 2
