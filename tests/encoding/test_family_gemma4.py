"""The Gemma 4 family against transformers' own ``Gemma4Processor`` (built locally: the test
tokenizer with Gemma 4's special tokens and turn format, the PIL image processor), and packed
rows against samples alone on a tiny ``Gemma4ForConditionalGeneration``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from family_kit import IGNORE, packed_matches_alone, seeded, tiny_tokenizer
from family_kit import test_images as make_images
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    Gemma4Config,
    Gemma4ForConditionalGeneration,
    Gemma4ImageProcessorPil,
    Gemma4Processor,
)
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

from energon_pack.encoding.families.gemma4 import Gemma4Family

TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<|turn>' + role + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] | trim -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{- item['text'] | trim -}}"
    "{%- elif item['type'] == 'image' -%}{{- '<|image|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}"
    "{%- if not enable_thinking | default(false) -%}{{- '<|channel>thought\\n<channel|>' -}}"
    "{%- endif -%}{%- endif -%}"
)
SPECIAL = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<|turn>",
    "<turn|>",
    "<|image|>",
    "<|image>",
    "<image|>",
    "<|audio|>",
    "<|audio>",
    "<audio|>",
    "<|channel>",
    "<channel|>",
]
NAMED = {  # the token attributes Gemma4Processor reads (it checks boa/eoa even without audio)
    "image_token": "<|image|>",
    "boi_token": "<|image>",
    "eoi_token": "<image|>",
    "audio_token": "<|audio|>",
    "boa_token": "<|audio>",
    "eoa_token": "<audio|>",
}


class ImageOnlyGemma4Processor(Gemma4Processor):
    """transformers' Gemma 4 processor without its video processor (which needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def build(**image_settings: Any) -> Gemma4Processor:
    """A Gemma 4 processor on a fresh test tokenizer (Gemma's BOS-adding tokenizer); building
    it adds ``<|video|>`` to that tokenizer, so ids are read from ``processor.tokenizer``."""
    tokenizer = tiny_tokenizer(
        SPECIAL, TEMPLATE, bos="<bos>", eos="<eos>", pad="<pad>", add_bos=True, extra=NAMED
    )
    return ImageOnlyGemma4Processor(  # type: ignore[no-untyped-call]
        feature_extractor=Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessorPil(**image_settings),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=TEMPLATE,
    )


PROCESSOR = build()
FAMILY = Gemma4Family(PROCESSOR)


def conversation(
    images: int, question: str = "What is shown here?", answer: str = "The quick brown fox."
) -> list[dict[str, Any]]:
    """One user turn with ``images`` images before the question (plain text without images),
    one reply."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(images)]
    user = [*content, {"type": "text", "text": question}] if images else question
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
    ]


def assert_exact(
    processor: Gemma4Processor, family: Gemma4Family, sizes: list[tuple[int, int]], seed: int
) -> None:
    """The processor's ids on the rendered conversation equal the tokenizer's on the text with
    each placeholder replaced by the family's expansion; per-image vision counts agree."""
    images = [Image.fromarray(a) for a in make_images(seed, sizes)]
    text = processor.apply_chat_template(conversation(len(sizes)), tokenize=False)
    # the template renders the BOS; the family tokenises without adding one
    assert family.add_special_tokens
    out = processor(text=[text], images=[images], return_tensors="pt")
    pieces = text.split(family.image_placeholder)
    assert len(pieces) == len(sizes) + 1
    expanded = pieces[0]
    for expansion, piece in zip(family.expansions(sizes), pieces[1:], strict=True):
        expanded += expansion + piece
    tokenizer = processor.tokenizer
    want = tokenizer(expanded, add_special_tokens=family.add_special_tokens)["input_ids"]
    got = out["input_ids"][0].tolist()
    assert got == want, sizes
    assert (
        got.count(tokenizer.bos_token_id) == 2
    )  # the template's and the tokenizer's, as the processor gives
    boi, eoi = (
        tokenizer.convert_tokens_to_ids(t) for t in (processor.boi_token, processor.eoi_token)
    )
    starts = [i for i, t in enumerate(got) if t == boi]
    ends = [i for i, t in enumerate(got) if t == eoi]
    counts = [got[s:e].count(processor.image_token_id) for s, e in zip(starts, ends, strict=True)]
    assert counts == family.image_tokens(sizes)
    assert counts == processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert sum(counts) == sum(t in family.vision_token_ids for t in got)


EXTREME = [
    [(1, 1)],
    [(30, 1500)],
    [(1500, 30)],
    [(1, 1500)],
    [(1500, 1)],
    [(1600, 1700)],
    [(17, 19)],
    [(48, 48)],
    [(431, 647)],
    [(40, 60), (1500, 30)],
    [(30, 1500), (7, 9), (900, 1200)],
]


@pytest.mark.parametrize("sizes", EXTREME, ids=str)
def test_expansions_equal_the_processor_at_extreme_sizes(sizes: list[tuple[int, int]]) -> None:
    assert_exact(PROCESSOR, FAMILY, sizes, seed=len(sizes))


side = st.integers(1, 900)


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.tuples(side, side), min_size=1, max_size=3), seed=st.integers(0, 99))
def test_expansions_equal_the_processor(sizes: list[tuple[int, int]], seed: int) -> None:
    assert_exact(PROCESSOR, FAMILY, sizes, seed)


def test_non_default_image_settings() -> None:
    """Patch size, pooling and soft-token budget come from the processor instance."""
    processor = build(patch_size=8, pooling_kernel_size=2, max_soft_tokens=140)
    family = Gemma4Family(processor)
    sizes = [(30, 1500), (333, 444), (5, 5)]
    assert family.image_tokens(sizes) != FAMILY.image_tokens(sizes)
    # 11 x 11 pooled cells of 2 x 2 patches of 8 px (<= 140), against 16 x 16 cells of 3 x 3 x 16 px
    assert family.image_tokens([(2000, 2000)]) == [121]
    assert FAMILY.image_tokens([(2000, 2000)]) == [256]
    for seed, size in enumerate([[(30, 1500)], [(1500, 30), (333, 444)], [(5, 5), (64, 64)]]):
        assert_exact(processor, family, size, seed)


def test_media_and_token_inputs_equal_the_processor() -> None:
    sizes = [(40, 60), (300, 20), (90, 90)]
    arrays = make_images(3, sizes)
    images = [Image.fromarray(a) for a in arrays]
    text = PROCESSOR.apply_chat_template(conversation(3), tokenize=False)
    out = PROCESSOR(text=[text], images=[images], return_tensors="pt")
    media = FAMILY.media_inputs(arrays)
    assert set(media) == {"pixel_values", "image_position_ids"}
    assert media["pixel_values"].shape == (3, 280 * 9, 3 * 16 * 16)
    torch.testing.assert_close(media["pixel_values"], out["pixel_values"], rtol=0, atol=1e-6)
    assert torch.equal(media["image_position_ids"], out["image_position_ids"])
    tokens = FAMILY.token_inputs(out["input_ids"][0])
    assert set(tokens) == set(FAMILY.token_keys) == {"mm_token_type_ids"}
    assert torch.equal(tokens["mm_token_type_ids"], out["mm_token_type_ids"][0])
    row = FAMILY.row_inputs([media, {}, FAMILY.media_inputs(arrays[:1])])
    assert row["pixel_values"].shape[0] == row["image_position_ids"].shape[0] == 4


def masked_text(conversation: list[dict[str, Any]]) -> list[str]:
    """The rendered conversation's tokens overlapping the family's assistant spans, decoded
    per run of masked tokens."""
    text = PROCESSOR.apply_chat_template(conversation, tokenize=False)
    spans = FAMILY.assistant_spans(text)
    encoding = PROCESSOR.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
    mask = [any(b > lo and a < hi for lo, hi in spans) for a, b in offsets]
    runs: list[list[int]] = []
    for i, (token, masked) in enumerate(zip(ids, mask, strict=True)):
        if masked:
            if i == 0 or not mask[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return [PROCESSOR.tokenizer.decode(run) for run in runs]


def turns(*pairs: tuple[str, str], system: str | None = None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = (
        [] if system is None else [{"role": "system", "content": system}]
    )
    for question, answer in pairs:
        messages += [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": answer},
        ]
    return messages


def test_assistant_spans() -> None:
    two = turns(("What is shown here?", "A fox."), ("And here?", "The lazy dog.\n indented"))
    assert masked_text(two) == ["A fox.<turn|>\n", "The lazy dog.\n indented<turn|>\n"]
    three = turns(
        ("Describe the image.", "The quick brown fox."),
        ("12 345", "6789"),
        ("user model assistant", "émigré façade naïve."),
        system="the system sets the rules.",
    )
    assert masked_text(three) == [
        "The quick brown fox.<turn|>\n",
        "6789<turn|>\n",
        "émigré façade naïve.<turn|>\n",
    ]
    # the template's pre-filled empty thought channel belongs to the prompt
    prompt = PROCESSOR.apply_chat_template([two[0]], tokenize=False, add_generation_prompt=True)
    assert isinstance(prompt, str)
    assert prompt.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    text = prompt + "The lazy dog.<turn|>\n"
    (span,) = FAMILY.assistant_spans(text)
    assert text[span[0] : span[1]] == "The lazy dog.<turn|>\n"
    thought = "<|turn>model\n<|channel>thought\nhmm<channel|>A fox.<turn|>"
    assert [thought[a:b] for a, b in FAMILY.assistant_spans(thought)] == [
        "<|channel>thought\nhmm<channel|>A fox.<turn|>"
    ]
    assert FAMILY.assistant_spans("<|turn>model\nunfinished") == []


def tiny_model(processor: Gemma4Processor, bidirectional: str | None) -> Any:
    """Two text layers (sliding, full; window 8, so images cross it) and one vision layer."""
    tokenizer = processor.tokenizer
    token = tokenizer.convert_tokens_to_ids
    config = Gemma4Config(
        text_config={
            "vocab_size": len(tokenizer),
            "vocab_size_per_layer_input": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "hidden_size_per_layer_input": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "global_head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "use_bidirectional_attention": bidirectional,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "patch_size": processor.image_processor.patch_size,
            "pooling_kernel_size": processor.image_processor.pooling_kernel_size,
            "position_embedding_size": 256,
        },
        audio_config=None,
        image_token_id=processor.image_token_id,
        boi_token_id=token(processor.boi_token),
        eoi_token_id=token(processor.eoi_token),
        video_token_id=processor.video_token_id,
        audio_token_id=token("<|audio|>"),
        boa_token_id=token("<|audio>"),
        eoa_token_index=token("<audio|>"),
        attn_implementation="sdpa",
    )
    return seeded(lambda: Gemma4ForConditionalGeneration(config))


SAMPLES = [
    ([(40, 60)], "Describe the image.", "The quick brown fox."),
    ([], "What is shown here?", "A user asks, the assistant answers."),
    ([(50, 20), (33, 77)], "What is shown here?", "The lazy dog."),
]


@pytest.fixture(scope="module")
def rows() -> tuple[Gemma4Processor, list[dict[str, Any]], dict[str, Any], list[int]]:
    """Each sample alone (the processor's own outputs) and the packed row (family inputs)."""
    processor = build(max_soft_tokens=70)
    family = Gemma4Family(processor)
    alone, ids, labels, media, lengths = [], [], [], [], []
    for seed, (sizes, question, answer) in enumerate(SAMPLES):
        arrays = make_images(seed, sizes)
        messages = conversation(len(sizes), question, answer)
        text = processor.apply_chat_template(messages, tokenize=False)
        out = processor(
            text=[text],
            images=[[Image.fromarray(a) for a in arrays]] if arrays else None,
            return_tensors="pt",
            add_special_tokens=False,
        )
        pieces = text.split(family.image_placeholder)
        expanded = pieces[0] + "".join(
            e + p for e, p in zip(family.expansions(sizes), pieces[1:], strict=True)
        )
        spans = family.assistant_spans(expanded)
        offsets = processor.tokenizer(
            expanded, add_special_tokens=False, return_offsets_mapping=True
        )["offset_mapping"]
        target = torch.tensor([any(b > lo and a < hi for lo, hi in spans) for a, b in offsets])
        sample_ids = out["input_ids"][0]
        assert len(target) == len(sample_ids)
        label = torch.where(target, sample_ids, IGNORE)
        label[0] = IGNORE
        alone.append(
            {**{k: v for k, v in out.items() if k != "attention_mask"}, "labels": label[None]}
        )
        ids.append(sample_ids)
        labels.append(label)
        lengths.append(len(sample_ids))
        media.append(family.media_inputs(arrays))
    input_ids = torch.cat(ids)
    packed = {
        "input_ids": input_ids[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        **{k: v[None] for k, v in family.token_inputs(input_ids).items()},
        **family.row_inputs(media),
    }
    return processor, alone, packed, lengths


@pytest.mark.parametrize("bidirectional", ["vision", None])
def test_packed_matches_alone(
    rows: tuple[Gemma4Processor, list[dict[str, Any]], dict[str, Any], list[int]],
    bidirectional: str | None,
) -> None:
    """With the family's 4-D masks the packed row trains as its samples alone (to the float32
    noise of Gemma 4's RMSNorm and transformers' loss); with ``"vision"`` bidirectional image
    attention, positions alone are not enough (transformers reads the image blocks at
    per-segment positions)."""
    processor, alone, packed, lengths = rows
    family = Gemma4Family(processor)
    model = tiny_model(processor, bidirectional)
    masks = family.attention_masks(model, lengths, packed["input_ids"][0])
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert masks["sliding_attention"].shape == (1, 1, sum(lengths), sum(lengths))
    packed_matches_alone(model, alone, {**packed, "attention_mask": masks})
    if bidirectional == "vision":
        with pytest.raises(AssertionError):
            packed_matches_alone(model, alone, packed)


def test_attention_masks_refuse_what_they_cannot_build(
    rows: tuple[Gemma4Processor, list[dict[str, Any]], dict[str, Any], list[int]],
) -> None:
    processor, _, packed, lengths = rows
    family = Gemma4Family(processor)
    model = tiny_model(processor, "vision")
    with pytest.raises(ValueError, match="not a split"):
        family.attention_masks(model, [*lengths, 1], packed["input_ids"][0])
    model.config.text_config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="takes no 4-D mask"):
        family.attention_masks(model, lengths, packed["input_ids"][0])
