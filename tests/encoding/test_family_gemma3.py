"""Gemma 3 (``Gemma3Processor``) against its own processor, built locally: a tiny tokenizer with
Gemma's special tokens and turn format, ``Gemma3ImageProcessorPil`` (the default image
processor needs torchvision).

Token layout, pan-and-scan crops, media and ``token_type_ids`` equal the processor's; packed
rows train exactly like their samples alone only with the family's per-layer-type 4-D block
masks. With restarting positions alone, the sliding-window layers index the bidirectional image
overlay with per-segment positions (transformers passes it as an ``or_mask_function`` under the
packed-position remap), so later segments' images attend wrongly: the test measures that too.
transformers computes the loss in float32, hence ~1e-7 rather than float64 exactness.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from family_kit import IGNORE, packed_matches_alone, seeded, tiny_tokenizer
from family_kit import expanded_text as expand
from family_kit import test_images as seeded_images
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3Processor,
    PreTrainedModel,
)
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.modeling_gemma3 import (
    create_masks_for_vision_model,
    get_block_sequence_ids_for_mask,
)

from energon_pack.encoding.families.gemma3 import Gemma3Family

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# Gemma 3's released turn format: a system message joins the first user turn, the assistant
# role is "model", every turn ends with <end_of_turn> and a newline.
TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", BOI, EOI, SOFT]
TOKENIZER = tiny_tokenizer(
    SPECIAL,
    TEMPLATE,
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    add_bos=True,
    extra={"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT},
)
PAN_AND_SCAN = {
    "pan_and_scan_min_crop_size": 8,
    "pan_and_scan_max_num_crops": 3,
    "pan_and_scan_min_ratio_to_activate": 1.5,
}
SIZES = [
    (1, 1), (2, 3), (3, 1), (7, 9), (16, 16), (32, 32), (33, 31), (40, 90), (90, 40),
    (30, 1500), (1500, 30), (1, 1500), (1500, 1), (8, 17), (17, 8), (24, 12), (12, 24),
    (100, 149), (149, 100), (64, 320), (320, 64), (511, 512), (200, 1000), (1000, 200),
    (48, 15), (15, 48), (9, 41), (41, 9), (1200, 1500), (5, 5), (77, 250), (250, 77),
    (8, 15), (15, 9), (10, 15),  # at pan-and-scan's crop-size limits
]  # fmt: skip
GROUPS = [[0], [1, 2], [3, 4, 5]]  # samples with 1, 2 and 3 images


def make_processor(
    *, size: int = 32, seq: int = 4, pan_and_scan: Mapping[str, Any] | None = None
) -> Gemma3Processor:
    """The real processor; ``pan_and_scan`` turns it on in the processor's ``images_kwargs``
    (which override the image processor's attributes at call time)."""
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": size, "width": size}),
        tokenizer=TOKENIZER,
        chat_template=TEMPLATE,
        image_seq_length=seq,
    )
    if pan_and_scan is not None:
        processor.images_kwargs = {
            **processor.images_kwargs,
            "do_pan_and_scan": True,
            **pan_and_scan,
        }
    return processor


def messages(images: int, replies: Sequence[str] = ("The quick brown fox.",)) -> list[Any]:
    """A conversation with ``images`` images in the first user turn, one user turn per reply."""
    out: list[Any] = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    for turn, reply in enumerate(replies):
        content: list[Any] = [{"type": "image"}] * (images if turn == 0 else 0)
        content.append({"type": "text", "text": f"What is shown here? {turn}"})
        out.append({"role": "user", "content": content})
        out.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return out


def check_sample(processor: Gemma3Processor, sizes: Sequence[tuple[int, int]], seed: int) -> None:
    """The processor's ids equal the tokenised expanded text; per-image expansions equal the
    processor's own replacements and the vision-token counts theirs."""
    family = Gemma3Family(processor)
    text = processor.apply_chat_template(messages(len(sizes)), tokenize=False)
    images = [Image.fromarray(image) for image in seeded_images(seed, sizes)]
    out = processor(
        text=[text],
        images=[images] if images else None,
        return_tensors="pt",
        return_text_replacement_offsets=bool(images),
    )
    want = TOKENIZER(expand(family, text, sizes))["input_ids"]
    assert out["input_ids"][0].tolist() == want
    if images:
        replacements = [r["replacement"] for r in out["text_replacement_offsets"][0]]
        assert family.expansions(sizes) == replacements
        assert family.image_tokens(sizes) == [r.count(SOFT) for r in replacements]
    assert int(out["token_type_ids"].sum()) == sum(family.image_tokens(sizes))


@pytest.mark.parametrize("pan_and_scan", [None, PAN_AND_SCAN], ids=["plain", "pan_and_scan"])
def test_tokens_match_the_processor(pan_and_scan: Mapping[str, Any] | None) -> None:
    processor = make_processor(pan_and_scan=pan_and_scan)
    for seed, size in enumerate(SIZES):
        check_sample(processor, [size], seed)
    for seed, group in enumerate(GROUPS):
        check_sample(processor, [SIZES[i] for i in group], seed)
    check_sample(processor, [], 0)


SIDE = st.integers(1, 40) | st.integers(1, 600)  # small sides meet the crop limits


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(SIDE, SIDE),
        min_size=1,
        max_size=3,
    )
)
def test_pan_and_scan_sizes(sizes: list[tuple[int, int]]) -> None:
    check_sample(make_processor(pan_and_scan=PAN_AND_SCAN), sizes, len(sizes))


def test_settings_come_from_the_processor() -> None:
    """Other soft-token counts and pan-and-scan numbers give other expansions, still the
    processor's; the image processor's own ``do_pan_and_scan`` loses to the processor's."""
    plain = Gemma3Family(make_processor())
    other = make_processor(size=48, seq=9, pan_and_scan={"pan_and_scan_min_crop_size": 4})
    family = Gemma3Family(other)
    assert family.image_tokens([(40, 90)]) == [9 * 3]  # the original and 2 crops
    assert plain.image_tokens([(40, 90)]) == [4]
    assert family.settings() != plain.settings()
    for seed, group in enumerate(GROUPS):
        check_sample(other, [SIZES[i] for i in group], seed)
    check_sample(other, [(40, 90), (600, 10)], 0)
    ignored = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(
            size={"height": 32, "width": 32}, do_pan_and_scan=True, pan_and_scan_min_crop_size=4
        ),
        tokenizer=TOKENIZER,
        chat_template=TEMPLATE,
        image_seq_length=4,
    )
    assert Gemma3Family(ignored).crops(40, 90) == 0
    check_sample(ignored, [(40, 90)], 0)


@pytest.mark.parametrize("pan_and_scan", [None, PAN_AND_SCAN], ids=["plain", "pan_and_scan"])
def test_media_and_token_inputs(pan_and_scan: Mapping[str, Any] | None) -> None:
    processor = make_processor(pan_and_scan=pan_and_scan)
    family = Gemma3Family(processor)
    sizes = [(40, 90), (17, 8), (64, 320)]
    arrays = seeded_images(3, sizes)
    text = processor.apply_chat_template(messages(len(sizes)), tokenize=False)
    out = processor(text=[text], images=[[Image.fromarray(a) for a in arrays]], return_tensors="pt")
    media = family.media_inputs(arrays)
    assert set(media) == {"pixel_values"}
    crops = sum(family.crops(h, w) for h, w in sizes)
    assert media["pixel_values"].shape == (len(sizes) + crops, 3, 32, 32)
    torch.testing.assert_close(media["pixel_values"], out["pixel_values"], atol=1e-6, rtol=0)
    tokens = family.token_inputs(out["input_ids"][0])
    assert set(tokens) == set(family.token_keys) == {"token_type_ids"}
    assert torch.equal(tokens["token_type_ids"], out["token_type_ids"][0])
    assert family.media_inputs([]) == {}


def masked_text(family: Gemma3Family, text: str) -> tuple[list[int], list[bool]]:
    """Token ids of ``text`` and which of them lie inside the assistant spans (a token is never
    cut by a span boundary)."""
    spans = family.assistant_spans(text)
    encoded = TOKENIZER(text, return_offsets_mapping=True)
    mask = []
    for begin, end in encoded["offset_mapping"]:
        inside = any(b <= begin and end <= e for b, e in spans) and end > begin
        assert inside or not any(begin < e and b < end for b, e in spans), (begin, end)
        mask.append(inside)
    return encoded["input_ids"], mask


@pytest.mark.parametrize("replies", [["Yes.", "No, a dog."], ["One.", "Two fox.", "Lazy dog."]])
def test_assistant_spans(replies: list[str]) -> None:
    family = Gemma3Family(make_processor())
    text = expand(
        family,
        make_processor().apply_chat_template(messages(1, replies), tokenize=False),
        [(40, 90)],
    )
    ids, mask = masked_text(family, text)
    assert len(family.assistant_spans(text)) == len(replies)
    picked = [i for i, m in zip(ids, mask, strict=True) if m]
    assert TOKENIZER.decode(picked) == "".join(f"{r}<end_of_turn>\n" for r in replies)


@pytest.mark.parametrize("replies", [["Yes.", "No, a dog."], ["One.", "Two fox.", "Lazy dog."]])
def test_assistant_spans_are_the_training_templates_generation_blocks(
    replies: list[str],
) -> None:
    """TRL's Gemma 3 training template marks what it trains with ``{% generation %}``: the reply,
    its ``<end_of_turn>`` and the newline after it. It renders the same ids as the released
    template, and its assistant mask is the family's spans."""
    import trl

    template = Path(trl.__file__).parent / "chat_templates" / "gemma3_training.jinja"
    conversation = messages(0, replies)
    theirs = TOKENIZER.apply_chat_template(
        conversation,
        chat_template=template.read_text(encoding="utf-8"),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    text = make_processor().apply_chat_template(conversation, tokenize=False)
    spans = Gemma3Family(make_processor()).assistant_spans(text)
    ours = TOKENIZER(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ours["input_ids"] == theirs["input_ids"]
    mask = [any(lo <= a and b <= hi for lo, hi in spans) for a, b in ours["offset_mapping"]]
    assert mask == [bool(m) for m in theirs["assistant_masks"]]
    assert sum(mask) > len(replies)


def tiny_model() -> PreTrainedModel:
    """A 2-layer Gemma 3 (a sliding layer of window 8, then a full one) with a 1-layer SigLIP
    on 32 px images (4x4 patches pooled to the processor's 4 soft tokens)."""
    config = Gemma3Config(
        text_config={
            "vocab_size": len(TOKENIZER),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "pad_token_id": TOKENIZER.pad_token_id,
            "bos_token_id": TOKENIZER.bos_token_id,
            "eos_token_id": TOKENIZER.eos_token_id,
        },
        vision_config={
            "model_type": "siglip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 32,
            "patch_size": 8,
        },
        mm_tokens_per_image=4,
        boi_token_index=TOKENIZER.boi_token_id,
        eoi_token_index=TOKENIZER.eoi_token_id,
        image_token_index=TOKENIZER.image_token_id,
        attn_implementation="sdpa",
    )
    model = Gemma3ForConditionalGeneration(config)
    # Gemma 3 starts the projection at zero: give the vision tower a gradient.
    torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.5)
    for name, parameter in model.named_parameters():
        if name.endswith("k_proj.bias"):  # its true gradient is 0 (softmax shift): only noise
            parameter.requires_grad_(False)
    return model


ROW = [  # (image sizes, reply): different sizes and counts, and a text-only sample
    ([(40, 90)], "The quick brown fox jumps."),
    ([], "The system sets the rules."),
    ([(60, 30), (33, 33)], "A lazy dog and a fox."),
]


def row(family: Gemma3Family) -> tuple[list[dict[str, Any]], dict[str, Any], list[int]]:
    """Each sample's processor inputs (with labels), the packed row with restarting positions
    (no mask yet), and the segment lengths."""
    processor = family.processor
    alone, ids, labels, media, tokens = [], [], [], [], []
    for seed, (sizes, reply) in enumerate(ROW):
        arrays = seeded_images(seed, sizes)
        text = processor.apply_chat_template(messages(len(sizes), [reply]), tokenize=False)
        images = [[Image.fromarray(a) for a in arrays]] if arrays else None
        out = processor(text=[text], images=images, return_tensors="pt")
        sample_ids, mask = masked_text(family, expand(family, text, sizes))
        assert out["input_ids"][0].tolist() == sample_ids
        label = torch.where(torch.tensor(mask), out["input_ids"][0], IGNORE)
        label[0] = IGNORE
        alone.append({**out, "labels": label[None]})
        ids.append(out["input_ids"][0])
        labels.append(label)
        media.append(family.media_inputs(arrays))
        tokens.append(family.token_inputs(out["input_ids"][0]))
    lengths = [len(i) for i in ids]
    packed = {
        "input_ids": torch.cat(ids)[None],
        "labels": torch.cat(labels)[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "token_type_ids": torch.cat([t["token_type_ids"] for t in tokens])[None],
        **family.row_inputs(media),
    }
    return alone, packed, lengths


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return seeded(tiny_model)


def test_packed_row_trains_like_its_samples(model: PreTrainedModel) -> None:
    family = Gemma3Family(make_processor())
    alone, packed, lengths = row(family)
    masks = family.attention_masks(model, lengths, packed["input_ids"][0])
    assert {m.dtype for m in masks.values()} == {torch.bool}
    loss, grad = packed_matches_alone(model, alone, {**packed, "attention_mask": masks})
    assert loss < 1e-6
    assert grad < 1e-5


def test_eager_masks_are_additive(model: PreTrainedModel) -> None:
    """Eager attention adds the mask: the float64 logits of the packed row agree with each
    sample's alone."""
    family = Gemma3Family(make_processor())
    alone, packed, lengths = row(family)
    model.set_attn_implementation("eager")
    try:
        masks = family.attention_masks(model, lengths, packed["input_ids"][0])
        assert {m.dtype for m in masks.values()} == {torch.float64}
        with torch.no_grad():
            inputs = {k: v for k, v in packed.items() if k != "labels"}
            logits = model(**inputs, attention_mask=masks, use_cache=False).logits[0]
            start = 0
            for sample in alone:
                one = {k: v for k, v in sample.items() if k != "labels"}
                want = model(**one, use_cache=False).logits[0]
                got = logits[start : start + len(want)]
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
                start += len(want)
    finally:
        model.set_attn_implementation("sdpa")


def test_positions_alone_are_not_exact(model: PreTrainedModel) -> None:
    """Why the family packs with block masks: positions alone (the model builds its own masks
    from them and token_type_ids) get the sliding layers' image overlay wrong."""
    family = Gemma3Family(make_processor())
    assert family.packing == "block_mask"
    alone, packed, _ = row(family)
    loss, grad = packed_matches_alone(model, alone, packed, rtol=math.inf, tensor_rtol=math.inf)
    assert loss > 1e-5, loss
    assert grad > 1e-3, grad


def test_masks_equal_the_models_own_per_sample(model: PreTrainedModel) -> None:
    """One segment: the family's masks are the ones transformers builds for the sample."""
    family = Gemma3Family(make_processor())
    alone, packed, lengths = row(family)
    sample = alone[2]
    types = sample["token_type_ids"]
    ours = family.attention_masks(model, [types.shape[1]], sample["input_ids"][0])
    embeds = torch.zeros(1, types.shape[1], 32, dtype=torch.float64)
    theirs = create_masks_for_vision_model(
        config=model.config.get_text_config(),
        inputs_embeds=embeds,
        attention_mask=sample["attention_mask"],
        cache=None,
        position_ids=None,
        block_sequence_ids=get_block_sequence_ids_for_mask(types),
    )
    assert set(ours) == set(theirs)
    for key, mask in theirs.items():
        assert torch.equal(ours[key], mask), key
    row_masks = family.attention_masks(model, lengths, packed["input_ids"][0])
    full, sliding = row_masks["full_attention"][0, 0], row_masks["sliding_attention"][0, 0]
    first = lengths[0]
    assert not full[first:, :first].any()
    assert not full[:first, first:].any()
    image = torch.nonzero(packed["token_type_ids"][0]).flatten()
    assert full[image[0], image[3]]  # bidirectional in an image
    assert sliding[image[0], image[3]]
    assert not full[image[4], image[8]]  # later images of a sample: causal to earlier ones
    assert not sliding[first - 1, first - 9]  # the window of 8
    assert sliding[first - 1, first - 8]
    with pytest.raises(ValueError, match="not a split of"):
        family.attention_masks(model, [1, 2], packed["input_ids"][0])
