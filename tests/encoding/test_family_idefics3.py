"""The Idefics3 / SmolVLM family against transformers' own processors, built locally (a tiny
tokenizer with the family's tokens, the released turn format, the PIL image processors): the
expansion text token for token, the vision-token counts, the media and the assistant spans; and
a tiny Idefics3 and SmolVLM model trained on a packed row against its samples alone.

``SmolVLMProcessor`` is built without its video processor (it needs torchvision) and without
``num2words`` (only its video prompt uses it; the check in its constructor is patched for that
call alone)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import pytest
import torch
from family_kit import IGNORE, packed_matches_alone, seeded, tiny_tokenizer
from family_kit import expanded_text as expanded
from family_kit import test_images as make_images
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    PreTrainedModel,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
)
from transformers.models.smolvlm import processing_smolvlm
from transformers.processing_utils import ProcessorMixin

from energon_pack.encoding.families.idefics3 import Idefics3Family

KINDS = ("idefics3", "smolvlm")
FAKE, IMAGE, END, GLOBAL = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
)
ROW_COL = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
_BODY = (
    "{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TEMPLATES = {"idefics3": "<|begin_of_text|>" + _BODY, "smolvlm": "<|im_start|>" + _BODY}
"""The released turn formats (Idefics3-8B-Llama3, SmolVLM-Instruct), images as ``<image>``."""
SMALL = {"size": {"longest_edge": 112}, "max_image_size": {"longest_edge": 28}}
"""Small image settings in the released ratio (4 tiles a side): 28 px tiles, 4 tokens each."""
SMALL_SEQ = 4


class ImageOnlySmolVLMProcessor(SmolVLMProcessor):
    """transformers' SmolVLM processor without its video processor (which needs torchvision);
    its chat template is rendered by ProcessorMixin (SmolVLM's own reads video settings)."""

    def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
        if argument is None and argument_name == "video_processor":
            return None
        return super().check_argument_for_proper_class(argument_name, argument)  # type: ignore[no-untyped-call]

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        return ProcessorMixin.apply_chat_template(self, conversation, **kwargs)


SMOLVLM_TOKENS = {
    "fake_image_token": FAKE,
    "image_token": IMAGE,
    "end_of_utterance_token": END,
    "global_image_token": GLOBAL,
}
"""The named tokenizer attributes SmolVLMProcessor reads its token strings from."""


def tokenizer_for(kind: str) -> Any:
    """A tiny tokenizer for ``kind``; Idefics3's lacks the three tokens its processor adds."""
    if kind == "idefics3":
        return tiny_tokenizer(
            ["<|begin_of_text|>", "<|end_of_text|>", GLOBAL, *ROW_COL],
            TEMPLATES[kind],
            bos="<|begin_of_text|>",
            eos="<|end_of_text|>",
            pad="<|end_of_text|>",
        )
    return tiny_tokenizer(
        ["<|im_start|>", "<|endoftext|>", *SMOLVLM_TOKENS.values(), *ROW_COL],
        TEMPLATES[kind],
        eos="<|endoftext|>",
        pad="<|endoftext|>",
        extra=SMOLVLM_TOKENS,
    )


def processor(kind: str, image_seq_len: int = SMALL_SEQ, **image: Any) -> Any:
    """A fresh tokenizer and the ``kind`` processor on it with image settings ``image``."""
    tokenizer = tokenizer_for(kind)
    if kind == "idefics3":
        return Idefics3Processor(  # type: ignore[no-untyped-call]
            image_processor=Idefics3ImageProcessorPil(**image),
            tokenizer=tokenizer,
            image_seq_len=image_seq_len,
            chat_template=TEMPLATES[kind],
        )
    with mock.patch.object(processing_smolvlm, "num2words", str):
        return ImageOnlySmolVLMProcessor(  # type: ignore[no-untyped-call]
            image_processor=SmolVLMImageProcessorPil(**image),
            tokenizer=tokenizer,
            video_processor=None,
            image_seq_len=image_seq_len,
            chat_template=TEMPLATES[kind],
        )


_SMALL_PROCESSORS: dict[str, Any] = {}


def small(kind: str) -> Any:
    """The ``kind`` processor with :data:`SMALL` settings (built once)."""
    if kind not in _SMALL_PROCESSORS:
        _SMALL_PROCESSORS[kind] = processor(kind, **SMALL)
    return _SMALL_PROCESSORS[kind]


def conversation(images: int, turns: int, tag: str = "") -> list[dict[str, Any]]:
    """``turns`` user/assistant turns, the images in the first user turn."""
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        content: list[dict[str, Any]] = [{"type": "image"}] * (images if turn == 0 else 0)
        content.append({"type": "text", "text": f"What is shown here? {tag}{turn}"})
        messages.append({"role": "user", "content": content})
        reply = f"The quick brown fox {tag}{turn}, the lazy dog."
        messages.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
    return messages


def per_image_counts(ids: Sequence[int], image_id: int, global_id: int) -> list[int]:
    """Image tokens of each image in the processor's ids: an image ends after the image tokens
    that follow its ``<global-img>``."""
    counts: list[int] = []
    current, in_global = 0, False
    for token in ids:
        if token == image_id:
            current += 1
        elif in_global:
            counts.append(current)
            current, in_global = 0, False
        if token == global_id:
            in_global = True
    return counts


def check_sample(proc: Any, sizes: Sequence[tuple[int, int]], seed: int = 0) -> list[int]:
    """The processor's ids for one conversation with images of ``sizes`` equal the tokenised
    family expansion, and its per-image vision-token counts equal ``image_tokens``; returns the
    counts."""
    family = Idefics3Family(proc)
    pil = [Image.fromarray(a) for a in make_images(seed, sizes)]
    text = proc.apply_chat_template(conversation(len(sizes), 1), tokenize=False)
    out = proc(text=[text], images=[pil], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert ids == proc.tokenizer(expanded(family, text, sizes))["input_ids"], sizes
    tokenizer = proc.tokenizer
    image_id = tokenizer.convert_tokens_to_ids(IMAGE)
    counts = per_image_counts(ids, image_id, tokenizer.convert_tokens_to_ids(GLOBAL))
    assert family.image_tokens(sizes) == counts, sizes
    # every tile is one image_seq_len block (pixel_values [1, tiles, 3, H, W])
    assert out["pixel_values"].shape[1] * proc.image_seq_len == sum(counts)
    assert family.vision_token_ids == {image_id}
    return counts


SIZES = [
    (1, 1), (1, 2), (2, 1), (5, 7), (27, 28), (28, 28), (28, 29), (29, 28), (56, 56), (57, 57),
    (111, 112), (112, 112), (113, 113), (30, 1500), (1500, 30), (1, 1500), (1500, 1), (3000, 20),
    (20, 3000), (333, 100), (100, 333), (64, 48), (48, 64), (200, 199), (199, 200), (31, 89),
    (89, 31), (700, 350), (350, 700), (13, 1000), (1000, 13), (2000, 2000), (4, 11), (640, 480),
]  # fmt: skip
"""Seeded sizes: tiny, at and around the tile and resize edges, huge, extreme aspect ratios."""


def groups(sizes: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``sizes`` cut into samples of 1, 2 and 3 images in turn."""
    out, at, count = [], 0, 1
    while at < len(sizes):
        out.append(list(sizes[at : at + count]))
        at += count
        count = count % 3 + 1
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_token_exact_over_sizes(kind: str) -> None:
    proc = small(kind)
    for seed, sizes in enumerate(groups(SIZES)):
        check_sample(proc, sizes, seed)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(1, 900), st.integers(1, 900)), min_size=1, max_size=3))
def test_token_exact_hypothesis(kind: str, sizes: list[tuple[int, int]]) -> None:
    check_sample(small(kind), sizes)


@pytest.mark.parametrize("kind", KINDS)
def test_processor_defaults(kind: str) -> None:
    """The class defaults (1456 px, 364 px tiles, 169 tokens a tile): a 4 x 4 grid at most."""
    proc = processor(kind, image_seq_len=169)
    family = Idefics3Family(proc)
    assert family.grid(30, 1500) == (1, 4)
    assert family.grid(2000, 1999) == (4, 4)
    assert family.grid(364, 364) == (4, 4)  # upscaled to 1456 first
    assert check_sample(proc, [(30, 1500), (1, 1)]) == [5 * 169, 17 * 169]


NON_DEFAULT = [
    {"size": {"longest_edge": 100}, "max_image_size": {"longest_edge": 36}},
    {
        "size": {"longest_edge": 90},
        "max_image_size": {"longest_edge": 30},
        "do_image_splitting": False,
    },
    {"size": {"height": 50, "width": 80}, "max_image_size": {"longest_edge": 28}},
    {"do_resize": False, "max_image_size": {"longest_edge": 40}},
]
OTHER_SIZES = [(4, 11), (35, 100), (1, 1), (30, 700), (700, 30), (77, 77), (200, 150), (9, 400)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("image", NON_DEFAULT)
def test_non_default_settings(kind: str, image: dict[str, Any]) -> None:
    """Other settings give other expansions, each still the processor's."""
    proc = processor(kind, image_seq_len=9, **image)
    theirs = [Idefics3Family(proc).expansions([s]) for s in OTHER_SIZES]
    ours = [Idefics3Family(small(kind)).expansions([s]) for s in OTHER_SIZES]
    assert theirs != ours
    for seed, sizes in enumerate(groups(OTHER_SIZES)):
        check_sample(proc, sizes, seed)


def test_short_edge_follows_the_grown_long_edge() -> None:
    """The short edge's tiles come from the long edge grown to whole tiles and the aspect ratio
    (as the pixels are resized), not from the short edge: a 4 x 11 image at 100 px / 36 px
    tiles is 2 x 3 tiles, where transformers' ``get_number_of_image_patches`` says 1 x 3."""
    proc = processor("idefics3", image_seq_len=9, **NON_DEFAULT[0])
    assert Idefics3Family(proc).grid(4, 11) == (2, 3)
    assert proc.image_processor.get_number_of_image_patches(4, 11) == (4, 1, 3)
    pil = [Image.fromarray(a) for a in make_images(0, [(4, 11)])]
    assert proc(text=[IMAGE], images=[pil])["pixel_values"].shape[1] == 2 * 3 + 1


def test_idefics3_adds_its_tokens() -> None:
    """Idefics3Processor adds its image and turn tokens to the tokenizer it is given (so the
    model's vocabulary is the tokenizer's length after the processor is built); the family
    reads the ids from that tokenizer."""
    tokenizer = tokenizer_for("idefics3")
    before = len(tokenizer)
    assert not {FAKE, IMAGE, END} & set(tokenizer.get_vocab())
    proc = Idefics3Processor(image_processor=Idefics3ImageProcessorPil(), tokenizer=tokenizer)  # type: ignore[no-untyped-call]
    assert proc.tokenizer is tokenizer
    assert len(tokenizer) == before + 3
    ids = {tokenizer.convert_tokens_to_ids(t) for t in (FAKE, IMAGE, END)}
    assert ids == {before, before + 1, before + 2}
    assert Idefics3Family(proc).vision_token_ids == {proc.image_token_id}
    assert tokenizer.encode(FAKE + IMAGE + END, add_special_tokens=False) == sorted(ids)


def test_settings() -> None:
    """``image_seq_len`` (a processor attribute) is in the settings fingerprint."""
    settings = Idefics3Family(processor("smolvlm", image_seq_len=81, **SMALL)).settings()
    assert settings["family"] == "idefics3"
    assert settings["image_seq_len"] == 81
    assert settings["image_processor"]["max_image_size"] == {"longest_edge": 28}


@pytest.mark.parametrize("kind", KINDS)
def test_layout(kind: str) -> None:
    family = Idefics3Family(small(kind))
    image = IMAGE * SMALL_SEQ
    glob = f"{FAKE}{GLOBAL}{image}{FAKE}"
    # 40 x 80 -> 56 x 112 -> 2 x 4 tiles of 28 px
    rows = "".join(
        "".join(f"{FAKE}<row_{r}_col_{c}>{image}" for c in range(1, 5)) + "\n" for r in range(1, 3)
    )
    assert family.expansions([(40, 80)]) == [f"{rows}\n{glob}"]
    assert family.grid(28, 28) == (4, 4)  # upscaled to 112 x 112 first
    assert family.expansions([(28, 28)])[0].count(FAKE) == 16 + 2
    unsplit = Idefics3Family(processor(kind, do_image_splitting=False, **SMALL))
    assert unsplit.expansions([(500, 20), (1, 1)]) == [glob, glob]


@pytest.mark.parametrize("kind", KINDS)
def test_media_inputs(kind: str) -> None:
    proc = small(kind)
    family = Idefics3Family(proc)
    images = make_images(3, [(40, 90), (13, 13), (300, 20)])
    pil = [Image.fromarray(a) for a in images]
    text = proc.apply_chat_template(conversation(3, 1), tokenize=False)
    out = proc(text=[text], images=[pil], return_tensors="pt")
    media = family.media_inputs(images)
    assert set(media) == {"pixel_values", "pixel_attention_mask"}
    assert set(out) - set(media) == {"input_ids", "attention_mask"}  # no token-level outputs
    assert media["pixel_values"].shape == out["pixel_values"].shape
    assert torch.allclose(media["pixel_values"], out["pixel_values"], atol=1e-6, rtol=0)
    assert torch.equal(media["pixel_attention_mask"], out["pixel_attention_mask"])
    assert family.token_inputs(out["input_ids"][0]) == {}
    assert family.media_inputs([]) == {}


def test_row_inputs() -> None:
    """Samples' tiles side by side in one batch row; text-only samples add none; smaller tiles
    are zero-padded with a zero mask there (as the processor pads a batch)."""
    family = Idefics3Family(small("idefics3"))
    ones = torch.ones
    a = {"pixel_values": torch.rand(1, 2, 3, 28, 28), "pixel_attention_mask": ones(1, 2, 28, 28)}
    b = {"pixel_values": torch.rand(1, 3, 3, 20, 28), "pixel_attention_mask": ones(1, 3, 20, 28)}
    row = family.row_inputs([a, {}, b])
    assert row["pixel_values"].shape == (1, 5, 3, 28, 28)
    assert torch.equal(row["pixel_values"][:, :2], a["pixel_values"])
    assert torch.equal(row["pixel_values"][:, 2:, :, :20], b["pixel_values"])
    assert not row["pixel_values"][:, 2:, :, 20:].any()
    assert int(row["pixel_attention_mask"][0, 2:].sum()) == 3 * 20 * 28
    assert family.row_inputs([{}, {}]) == {}


def _mask(family: Idefics3Family, text: str) -> tuple[list[int], list[int]]:
    """Ids of ``text`` and 1 for each token overlapping an assistant span."""
    spans = family.assistant_spans(text)
    assert spans is not None
    encoding = family.tokenizer(text, return_offsets_mapping=True)
    mask = [
        int(any(a < end and b > begin for begin, end in spans))
        for a, b in encoding["offset_mapping"]
    ]
    return list(encoding["input_ids"]), mask


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("turns", [2, 3])
def test_assistant_spans(kind: str, turns: int) -> None:
    proc = small(kind)
    family = Idefics3Family(proc)
    messages = conversation(1, turns)
    messages[0]["content"][-1]["text"] += " Assistant: not a turn"
    text = proc.apply_chat_template(messages, tokenize=False)
    ids, mask = _mask(family, text)
    replies = [m["content"][0]["text"] for m in messages if m["role"] == "assistant"]
    masked = [i for i, m in zip(ids, mask, strict=True) if m]
    assert proc.tokenizer.decode(masked) == "".join(f" {r}{END}" for r in replies)
    assert len(family.assistant_spans(text) or []) == turns
    # an assistant turn that opens the conversation; the generation prompt is no span
    assert family.assistant_spans(f"Assistant: hi{END}\n") == [(10, 13 + len(END))]
    prompt = proc.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert family.assistant_spans(prompt) == []


def tiny_model(kind: str, proc: Any) -> PreTrainedModel:
    """A two-layer Llama text model, a one-layer vision tower on 28 px tiles of 7 px patches
    (16 patches, 4 tokens after the 2x pixel shuffle)."""
    tokenizer = proc.tokenizer
    config_class, model_class = {
        "idefics3": (Idefics3Config, Idefics3ForConditionalGeneration),
        "smolvlm": (SmolVLMConfig, SmolVLMForConditionalGeneration),
    }[kind]
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    vision |= {"num_attention_heads": 4, "image_size": 28, "patch_size": 7}
    text = {"model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 32}
    text |= {"intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    text |= {"num_key_value_heads": 2, "pad_token_id": tokenizer.pad_token_id}
    config = config_class(
        vision_config=vision,
        text_config=text,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        scale_factor=2,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    return seeded(lambda: model_class(config))


def alone_inputs(
    proc: Any, sizes: Sequence[tuple[int, int]], turns: int, seed: int
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One sample through the processor (labels on the assistant spans, the first -100) and
    its media through the family."""
    family = Idefics3Family(proc)
    images = make_images(seed, sizes)
    text = proc.apply_chat_template(conversation(len(sizes), turns, tag=str(seed)), tokenize=False)
    pil = [Image.fromarray(a) for a in images]
    inputs = dict(proc(text=[text], images=[pil] if pil else None, return_tensors="pt"))
    ids, mask = _mask(family, expanded(family, text, sizes))
    assert ids == inputs["input_ids"][0].tolist()
    labels = torch.tensor([i if m else IGNORE for i, m in zip(ids, mask, strict=True)])
    labels[0] = IGNORE
    inputs["labels"] = labels[None]
    return inputs, family.media_inputs(images)


def packed_row(
    family: Idefics3Family, alone: Sequence[dict[str, Any]], media: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The samples in one row: positions restart per segment, -100 on each first label."""
    labels = []
    for inputs in alone:
        segment = inputs["labels"][0].clone()
        segment[0] = IGNORE
        labels.append(segment)
    return {
        "input_ids": torch.cat([a["input_ids"][0] for a in alone])[None],
        "position_ids": torch.cat([torch.arange(a["input_ids"].shape[1]) for a in alone])[None],
        "labels": torch.cat(labels)[None],
        **family.row_inputs(media),
    }


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny matrices: one torch thread (several spin on a shared machine's two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", KINDS)
def test_packed_matches_alone(kind: str) -> None:
    """Position ids restarting per segment are enough: the text model derives a per-segment
    causal mask from them, each tile goes through the vision tower on its own, and the
    features fill the image tokens in order. Without them the row is not exact."""
    proc = small(kind)
    family = Idefics3Family(proc)
    model = tiny_model(kind, proc)
    samples = [
        alone_inputs(proc, [(20, 50), (40, 30)], 2, 1),
        alone_inputs(proc, [], 2, 2),
        alone_inputs(proc, [(60, 13)], 3, 3),
    ]
    alone = [inputs for inputs, _ in samples]
    media = [m for _, m in samples]
    for inputs, sample_media in zip(alone, media, strict=True):
        for key, value in sample_media.items():
            assert torch.equal(inputs[key], value), key
    packed = packed_row(family, alone, media)
    loss_error, grad_error = packed_matches_alone(model, alone, packed)
    # the loss is taken in float32 by transformers' loss function (hence ~1e-7)
    assert loss_error < 1e-6
    assert grad_error < 1e-9
    unmasked = {k: v for k, v in packed.items() if k != "position_ids"}
    with pytest.raises(AssertionError):
        packed_matches_alone(model, alone, unmasked)
