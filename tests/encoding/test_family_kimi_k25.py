"""Kimi K2.5 family: token-exact against transformers' own ``Kimi_K25Processor``, media equal to
the processor's, the assistant rule, and a packed row of a tiny
``Kimi_K25ForConditionalGeneration`` equal to its samples alone.

``Kimi_K25ImageProcessor`` exists only with torchvision, which this process never imports: the
processor is built (the test tokenizer with Kimi's special tokens, a template in Kimi K2.5's
turn format) and run in one child process (:mod:`torchvision_child`), by :func:`child_checks`
below. It sends back plain values (ids, counts, texts, numpy arrays) that the tests here assert
on; the tiny model (no torchvision needed) runs here on the child's inputs.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from family_kit import IGNORE, packed_matches_alone, seeded, tiny_tokenizer
from family_kit import expanded_text as expand
from family_kit import test_images as make_images
from torchvision_child import available, run_in_child
from transformers import (
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

# Kimi K2.5's turn format (``<|im_user|>user<|im_middle|>...<|im_end|>``, the default system
# turn, ``<think></think>`` written before each finished reply, reasoning kept only after the
# last finished reply, images as ``<|media_begin|>image<|media_content|><|media_pad|>
# <|media_end|>`` + newline; the generation prompt pre-fills ``<think>``, or ``<think></think>``
# with ``thinking=False``); no generation markers, tools left out.
TEMPLATE = (
    "{%- macro render_content(msg) -%}{%- set c = msg.get('content') -%}"
    "{%- if c is string -%}{{- c -}}{%- elif c is not none -%}{%- for part in c -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\\n' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part or 'video_url' in part -%}"
    "{{- '<|kimi_k25_video_placeholder|>' -}}"
    "{%- else -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- macro set_roles(message) -%}{%- set name = message.get('name') or message['role'] -%}"
    "{%- if message['role'] == 'user' -%}{{- '<|im_user|>' + name + '<|im_middle|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_assistant|>' + name + '<|im_middle|>' -}}"
    "{%- else -%}{{- '<|im_system|>' + name + '<|im_middle|>' -}}{%- endif -%}{%- endmacro -%}"
    "{%- set ns = namespace(last=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' and not message.get('tool_calls') -%}"
    "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI."
    "<|im_end|>' -}}{%- endif -%}"
    "{%- for message in messages -%}{{- set_roles(message) -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- if loop.index0 <= ns.last -%}{{- '<think></think>' -}}"
    "{%- else -%}{{- '<think>' + message.get('reasoning_content', '') + '</think>' -}}"
    "{%- endif -%}{%- endif -%}"
    "{{- render_content(message) -}}{{- '<|im_end|>' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if thinking is defined and thinking is false -%}{{- '<think></think>' -}}"
    "{%- else -%}{{- '<think>' -}}{%- endif -%}{%- endif -%}"
)
SPECIAL = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
    "<think>",
    "</think>",
]


def side(patches: int) -> dict[str, int]:
    """A ``size`` of ``patches`` patches a side (the image processor wants both keys, equal)."""
    return {"max_height": patches, "max_width": patches}


NAMED = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"}

RELEASED_SAMPLES = [
    [(1, 1)],
    [(2, 2)],
    [(30, 1500)],
    [(1500, 30)],
    [(13, 13)],
    [(14, 14)],
    [(28, 29)],
    [(3, 7000)],
    [(7000, 3)],
    [(8000, 20)],
    [(480, 640)],
    [(1080, 1920)],
    [(2000, 1800)],
    [(1792, 1792)],
    [(1793, 1791)],
    [(333, 97)],
    [(300, 500), (40, 40)],
    [(30, 1500), (1500, 30)],
    [(1, 1), (1200, 1100)],
    [(12, 34), (56, 78), (910, 11)],
    [(1500, 30), (30, 1500), (384, 384)],
    [(1080, 1920), (7, 7), (999, 3)],
]
"""Released settings (the image processor's defaults, as Kimi K2.5's ``preprocessor_config``:
14-pixel patches, merge 2, 16384 patches, 512 patches a side): tiny, huge and extreme sizes."""
SMALL: dict[str, Any] = {"patch_size": 14, "merge_size": 2, "max_patches": 256, "size": side(24)}
"""Small non-default settings for the property test: both limits bind from a few hundred
pixels."""
NON_DEFAULT: dict[str, dict[str, Any]] = {
    "p16": {"patch_size": 16, "merge_size": 2, "max_patches": 400, "size": side(21)},
    "p8m4": {"patch_size": 8, "merge_size": 4, "max_patches": 2048, "size": side(40)},
    "no_resize": {"do_resize": False},
}
"""Other settings: an odd side limit (21 patches) the merge padding goes past, a merge of 4,
and no resizing (sizes a multiple of the patch)."""
NON_DEFAULT_SAMPLES = {
    "p16": [[(30, 1500)], [(1500, 30)], [(500, 400)], [(3, 3)], [(900, 1000), (20, 20)]],
    "p8m4": [[(30, 1500)], [(640, 480), (1, 2), (333, 97)], [(77, 77)]],
    "no_resize": [[(56, 84)], [(28, 28), (112, 56)]],
}
TINY: dict[str, Any] = {"patch_size": 8, "merge_size": 2, "max_patches": 48, "size": side(8)}
"""The tiny model's settings (8-pixel patches, at most 12 tokens an image)."""
MODEL_SAMPLES = [
    ([(50, 90)], "The fox."),
    ([(20, 100), (70, 40), (33, 33)], "Three images here."),
    ([], "Only text."),
    ([(100, 30)], "Tall and thin."),
]
MEDIA_SAMPLES = [[(50, 90)], [(20, 100), (70, 40), (33, 33)], [(300, 7)]]
REPLIES = ["The quick brown fox.", "It jumps over\nthe lazy dog.", "12 345 6789"]


@cache
def tokenizer() -> PreTrainedTokenizerFast:
    return tiny_tokenizer(SPECIAL, TEMPLATE, bos="[BOS]", eos="[EOS]", pad="[PAD]", extra=NAMED)


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


def conversation(turns: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": "Sets the rules."}]
    for k, reply in enumerate(REPLIES[:turns]):
        out += messages(k % 2, reply, question=f"Question {k}?")
    return out


def covered(spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]]) -> list[bool]:
    """Whether each token (by its character offsets) touches a span."""
    return [any(start < b and a < end for a, b in spans) for start, end in offsets]


# --- the child side (run by torchvision_child, with torchvision importable) -------------------


def build(**image_settings: Any) -> Any:
    """transformers' ``Kimi_K25Processor`` with ``image_settings`` for its image processor."""
    from transformers import Kimi_K25ImageProcessor, Kimi_K25Processor, Kimi_K25VideoProcessor

    return Kimi_K25Processor(  # type: ignore[no-untyped-call]
        image_processor=Kimi_K25ImageProcessor(**image_settings),
        tokenizer=tokenizer(),
        video_processor=Kimi_K25VideoProcessor(),
        chat_template=TEMPLATE,
    )


def compare(processor: Any, sizes: Sequence[tuple[int, int]], seed: int) -> dict[str, Any]:
    """The processor's ids and per-image vision counts next to the family's."""
    from PIL import Image

    from energon_pack.encoding.families.kimi_k25 import KimiK25Family

    family = KimiK25Family(processor)
    text = processor.apply_chat_template(messages(len(sizes), "A fox."), tokenize=False)
    images = [Image.fromarray(image) for image in make_images(seed, sizes)]
    out = processor(
        text=[text], images=[images], return_tensors="np", return_text_replacement_offsets=True
    )
    want = tokenizer()(expand(family, text, sizes))["input_ids"]
    replacements = [item["replacement"] for item in out["text_replacement_offsets"][0]]
    image_id = processor.image_token_id
    counts = [tokenizer().encode(r, add_special_tokens=False).count(image_id) for r in replacements]
    ids = out["input_ids"][0].tolist()
    return {
        "ids_equal": ids == want,
        "length": (len(ids), len(want)),
        "expansions_equal": replacements == family.expansions(sizes),
        "counts": counts,
        "family_counts": family.image_tokens(sizes),
        "total": int((out["input_ids"] == image_id).sum()),
        "grid": out["image_grid_thw"].tolist(),
        "family_grid": [[1, *family.grid(h, w)] for h, w in sizes],
    }


def agrees(result: dict[str, Any]) -> bool:
    return bool(
        result["ids_equal"]
        and result["expansions_equal"]
        and result["counts"] == result["family_counts"]
        and sum(result["counts"]) == result["total"]
        and result["grid"] == result["family_grid"]
    )


def property_check(processor: Any) -> dict[str, Any]:
    """A hypothesis property over 1-3 images of 1..700 pixels a side (run here, in the child);
    the falsifying example's text when it fails."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seen: list[list[tuple[int, int]]] = []
    size = st.tuples(st.integers(1, 700), st.integers(1, 700))

    @settings(
        max_examples=40,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(size, min_size=1, max_size=3), st.integers(0, 10**6))
    def exact(sizes: list[tuple[int, int]], seed: int) -> None:
        seen.append(sizes)
        result = compare(processor, sizes, seed)
        assert agrees(result), (sizes, result)

    try:
        exact()
    except Exception:
        return {"failure": traceback.format_exc()[-3000:], "examples": seen}
    return {"failure": None, "examples": seen}


def media_check(processor: Any) -> dict[str, Any]:
    """``media_inputs`` and ``token_inputs`` next to the processor's outputs per sample, and
    ``row_inputs`` next to the processor's batch of the same samples."""
    from PIL import Image

    from energon_pack.encoding.families.base import TEXT_KEYS
    from energon_pack.encoding.families.kimi_k25 import KimiK25Family

    family = KimiK25Family(processor)
    samples = []
    all_arrays = [make_images(3 + k, sizes) for k, sizes in enumerate(MEDIA_SAMPLES)]
    texts = []
    for sizes, arrays in zip(MEDIA_SAMPLES, all_arrays, strict=True):
        text = processor.apply_chat_template(messages(len(sizes), "A fox."), tokenize=False)
        texts.append(text)
        images = [[Image.fromarray(a) for a in arrays]]
        out = processor(text=[text], images=images, return_tensors="pt")
        media = family.media_inputs(arrays)
        samples.append(
            {
                "processor": {k: v.numpy() for k, v in out.items() if k not in TEXT_KEYS},
                "family": {k: v.numpy() for k, v in media.items()},
                "token_inputs": dict(family.token_inputs(out["input_ids"][0])),
            }
        )
    batch = processor(
        text=texts,
        images=[[Image.fromarray(a) for a in arrays] for arrays in all_arrays],
        return_tensors="pt",
        padding=True,
    )
    row = family.row_inputs([family.media_inputs(arrays) for arrays in all_arrays])
    return {
        "samples": samples,
        "batch": {k: v.numpy() for k, v in batch.items() if k not in TEXT_KEYS},
        "row": {k: v.numpy() for k, v in row.items()},
        "empty_row": family.row_inputs([family.media_inputs([]), family.media_inputs([])]),
        "token_keys": sorted(family.token_keys),
        "vision_token_ids": sorted(family.vision_token_ids),
        "image_token_id": int(processor.image_token_id),
        "placeholder": family.image_placeholder,
        "settings": family.settings(),
    }


def span_check(processor: Any) -> dict[str, Any]:
    """Rendered conversations (2 and 3 turns, generation prompts, a reply with reasoning after
    the last finished one) with the family's spans."""
    from energon_pack.encoding.families.kimi_k25 import KimiK25Family

    family = KimiK25Family(processor)
    texts = {
        f"turns{n}": processor.apply_chat_template(conversation(n), tokenize=False) for n in (2, 3)
    }
    prompt = processor.apply_chat_template(messages(1), tokenize=False, add_generation_prompt=True)
    quick = processor.apply_chat_template(
        messages(1), tokenize=False, add_generation_prompt=True, thinking=False
    )
    texts["prompt"] = prompt
    texts["thinking"] = prompt + "Look.</think>Yes.<|im_end|>"
    texts["no_thinking"] = quick + "Yes.<|im_end|>"
    texts["unended"] = quick + "Yes."
    reasoning = [
        *messages(1, "A fox."),
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "t"}]},
    ]
    reasoning[-1]["reasoning_content"] = "Think first."
    texts["reasoning"] = processor.apply_chat_template(reasoning, tokenize=False)
    return {name: (text, family.assistant_spans(text)) for name, text in texts.items()}


def model_inputs(processor: Any) -> dict[str, Any]:
    """Each sample alone (the processor's own outputs, labels on the assistant mask) and the
    packed row (ids and labels joined, positions restarting, media by ``row_inputs``)."""
    from PIL import Image

    from energon_pack.encoding.families.kimi_k25 import KimiK25Family

    family = KimiK25Family(processor)
    alone, ids, labels, positions, media = [], [], [], [], []
    for k, (sizes, reply) in enumerate(MODEL_SAMPLES):
        text = processor.apply_chat_template(messages(len(sizes), reply), tokenize=False)
        arrays = make_images(k, sizes)
        pil = [[Image.fromarray(a) for a in arrays]] if arrays else None
        out = processor(text=[text], images=pil, return_tensors="pt")
        expanded = expand(family, text, sizes)
        encoding = tokenizer()(expanded, return_offsets_mapping=True)
        assert encoding["input_ids"] == out["input_ids"][0].tolist(), sizes
        mask = torch.tensor(covered(family.assistant_spans(expanded), encoding["offset_mapping"]))
        sample_ids = out["input_ids"][0]
        sample_labels = torch.where(mask, sample_ids, IGNORE)
        sample_labels[0] = IGNORE
        alone.append({**{k: v.numpy() for k, v in out.items()}, "labels": sample_labels[None]})
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
    return {
        "alone": [{k: np.asarray(v) for k, v in sample.items()} for sample in alone],
        "packed": {k: v.numpy() for k, v in packed.items()},
        "image_token_id": int(processor.image_token_id),
        "video_token_id": int(processor.video_token_id),
    }


def guarded(check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)``, or its traceback (so one failing check fails only its tests)."""
    try:
        return check(*args)
    except Exception:
        return {"error": traceback.format_exc()[-4000:]}


def child_checks(_: Any) -> dict[str, Any]:
    """Everything the tests below need from the real processor, in one child process."""
    vocabulary = dict(tokenizer().get_vocab())
    released, small, tiny = build(), build(**SMALL), build(**TINY)
    others = {name: build(**values) for name, values in NON_DEFAULT.items()}
    grown = len(tokenizer()) - len(vocabulary)
    return {
        "vocabulary": vocabulary,
        "tokens_added": grown,
        "released": [guarded(compare, released, s, len(s)) for s in RELEASED_SAMPLES],
        "non_default": {
            name: [guarded(compare, others[name], s, 7) for s in samples]
            for name, samples in NON_DEFAULT_SAMPLES.items()
        },
        "released_counts": {
            name: guarded(_family_counts, processor)
            for name, processor in {"released": released, **others}.items()
            if name != "no_resize"
        },
        "no_resize_refusals": guarded(_refusals, others["no_resize"]),
        "property": guarded(property_check, small),
        "media": guarded(media_check, tiny),
        "spans": guarded(span_check, released),
        "model": guarded(model_inputs, tiny),
    }


def _family_counts(processor: Any) -> dict[str, Any]:
    from energon_pack.encoding.families.kimi_k25 import KimiK25Family

    family = KimiK25Family(processor)
    probe = [(30, 1500), (1500, 30), (500, 400), (3, 3), (1080, 1920)]
    return {"counts": family.image_tokens(probe), "settings": family.settings()}


def _refusals(processor: Any) -> list[str]:
    """What the processor and the family say to a 30 x 1500 image without resizing (not a
    14-pixel grid)."""
    from PIL import Image

    from energon_pack.encoding.families.kimi_k25 import KimiK25Family

    out = []
    image = Image.fromarray(make_images(0, [(30, 1500)])[0])
    for attempt in (
        lambda: processor(images=[[image]], return_tensors="pt"),
        lambda: KimiK25Family(processor).expansions([(30, 1500)]),
    ):
        try:
            attempt()
            out.append("")
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


# --- the tests ------------------------------------------------------------------------------


@cache
def child() -> dict[str, Any]:
    """The child's results (one process for the module)."""
    return dict(run_in_child("test_family_kimi_k25:child_checks", timeout=400))


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    """The child's results, skipped (with the reason) where the reference torchvision is not
    installed (``scripts/venv.sh``: ``.venv/reference``)."""
    if not available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    out = child()
    assert "torchvision" not in sys.modules  # only the child imported it
    # the child's tokenizer is this process's (the tests below decode with it); the processor
    # adds no tokens to it
    assert out["vocabulary"] == tokenizer().get_vocab()
    assert out["tokens_added"] == 0
    return out


def ok(result: Any) -> Any:
    """``result`` after checking that its check raised nothing in the child."""
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    return result


@pytest.mark.parametrize(
    "index", range(len(RELEASED_SAMPLES)), ids=lambda i: str(RELEASED_SAMPLES[i])
)
def test_released_settings_token_exact(results: dict[str, Any], index: int) -> None:
    result = ok(results["released"][index])
    assert agrees(result), (RELEASED_SAMPLES[index], result)


def test_property_token_exact(results: dict[str, Any]) -> None:
    """A hypothesis property (run in the child, derandomized) on small non-default settings."""
    result = ok(results["property"])
    assert result["failure"] is None, result["failure"]
    examples = result["examples"]
    assert len(examples) >= 30
    assert {len(sizes) for sizes in examples} == {1, 2, 3}


@pytest.mark.parametrize(
    ("name", "index"),
    [(name, i) for name, samples in NON_DEFAULT_SAMPLES.items() for i in range(len(samples))],
)
def test_non_default_settings_token_exact(results: dict[str, Any], name: str, index: int) -> None:
    result = ok(results["non_default"][name][index])
    assert agrees(result), (NON_DEFAULT_SAMPLES[name][index], result)


def test_non_default_settings_give_other_counts(results: dict[str, Any]) -> None:
    counts = {name: ok(value) for name, value in results["released_counts"].items()}
    released = counts.pop("released")
    # 1500 x 30 at the released settings: kept, padded to 1512 x 56 (28-pixel multiples): 108 x 4
    # patches, 108 tokens
    assert released["counts"][:2] == [108, 108]
    for name in ("p16", "p8m4"):
        assert counts[name]["counts"] != released["counts"], name
        assert counts[name]["settings"] != released["settings"], name
    # p16: the 21-patch side limit (336 px) pads to 352 px (22 patches) with the merge of 2
    assert counts["p16"]["counts"][1] == 11
    results_p16 = ok(results["non_default"]["p16"][1])
    assert results_p16["grid"] == [[1, 22, 2]]
    # without resizing a size off the patch grid fails in the processor; the family says why
    processor_error, family_error = ok(results["no_resize_refusals"])
    assert processor_error.startswith("RuntimeError"), processor_error
    assert family_error.startswith("ValueError: without resizing"), family_error


def test_media_inputs_equal_processor(results: dict[str, Any]) -> None:
    media = ok(results["media"])
    for sizes, sample in zip(MEDIA_SAMPLES, media["samples"], strict=True):
        got, want = sample["family"], sample["processor"]
        assert set(got) == set(want) == {"pixel_values", "image_grid_thw"}, sizes
        assert got["pixel_values"].shape == want["pixel_values"].shape, sizes
        np.testing.assert_allclose(got["pixel_values"], want["pixel_values"], rtol=0, atol=1e-6)
        assert np.array_equal(got["image_grid_thw"], want["image_grid_thw"]), sizes
        patches = int(np.prod(want["image_grid_thw"], axis=1).sum())
        assert want["pixel_values"].shape == (patches, 3, 8, 8)
        assert sample["token_inputs"] == {}  # the processor returns no token-level inputs
    assert media["token_keys"] == []
    assert media["vision_token_ids"] == [media["image_token_id"]]
    assert media["placeholder"] == "<|media_pad|>"


def test_row_inputs_equal_processor_batch(results: dict[str, Any]) -> None:
    media = ok(results["media"])
    row, batch = media["row"], media["batch"]
    assert set(row) == set(batch) == {"pixel_values", "image_grid_thw"}
    np.testing.assert_allclose(row["pixel_values"], batch["pixel_values"], rtol=0, atol=1e-6)
    assert np.array_equal(row["image_grid_thw"], batch["image_grid_thw"])
    assert media["empty_row"] == {}


def masked_runs(text: str, spans: Sequence[tuple[int, int]]) -> list[str]:
    """The decoded runs of tokens that touch a span."""
    encoding = tokenizer()(text, return_offsets_mapping=True)
    runs: list[list[int]] = []
    previous = False
    inside = covered(spans, encoding["offset_mapping"])
    for token, now in zip(encoding["input_ids"], inside, strict=True):
        if now and not previous:
            runs.append([])
        if now:
            runs[-1].append(token)
        previous = now
    return [str(tokenizer().decode(run)) for run in runs]


@pytest.mark.parametrize("turns", [2, 3])
def test_assistant_spans(results: dict[str, Any], turns: int) -> None:
    text, spans = ok(results["spans"])[f"turns{turns}"]
    assert text.count("<|im_assistant|>assistant<|im_middle|><think></think>") == turns
    assert masked_runs(text, spans) == [reply + "<|im_end|>" for reply in REPLIES[:turns]]


def test_assistant_spans_after_generation_prompts(results: dict[str, Any]) -> None:
    spans = ok(results["spans"])
    text, found = spans["prompt"]
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert found == []
    text, found = spans["thinking"]  # the thinking prompt pre-fills "<think>"
    assert masked_runs(text, found) == ["Look.</think>Yes.<|im_end|>"]
    text, found = spans["no_thinking"]  # the non-thinking prompt pre-fills "<think></think>"
    assert text.count("<think></think>Yes.") == 1
    assert masked_runs(text, found) == ["Yes.<|im_end|>"]
    assert spans["unended"][1] == []
    text, found = spans["reasoning"]  # reasoning kept after the last finished reply
    assert "<think>Think first.</think><|im_end|>" in text
    assert masked_runs(text, found) == ["A fox.<|im_end|>", "Think first.</think><|im_end|>"]


def tiny_model(image_token_id: int, video_token_id: int) -> PreTrainedModel:
    vocabulary = tokenizer()
    config = Kimi_K25Config(
        vision_config={
            "patch_size": TINY["patch_size"],
            "pos_emb_height": 8,
            "pos_emb_width": 8,
            "pos_emb_time": 4,
            "num_attention_heads": 2,
            "num_hidden_layers": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "merge_kernel_size": [TINY["merge_size"]] * 2,
        },
        text_config={
            "model_type": "deepseek_v3",
            "vocab_size": len(vocabulary),
            "hidden_size": 32,
            "intermediate_size": 64,
            "moe_intermediate_size": 16,
            "num_hidden_layers": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "max_position_embeddings": 1024,
            "bos_token_id": vocabulary.bos_token_id,
            "eos_token_id": vocabulary.eos_token_id,
            "pad_token_id": vocabulary.pad_token_id,
        },
        projection_hidden_size=32,
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        vision_start_token_id=vocabulary.get_vocab()["<|media_begin|>"],
        vision_end_token_id=vocabulary.get_vocab()["<|media_end|>"],
    )
    config._attn_implementation = "sdpa"
    # the per-expert loop: grouped_mm has no float64 CPU kernel
    config._experts_implementation = "eager"
    return Kimi_K25ForConditionalGeneration(config)


def model_tensors(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors of the child's arrays, ``pixel_values`` in the model's float64 (the vision tower
    takes them as they come)."""
    out = {k: torch.as_tensor(v) for k, v in inputs.items()}
    if "pixel_values" in out:
        out["pixel_values"] = out["pixel_values"].double()
    return out


def test_packed_matches_alone(results: dict[str, Any]) -> None:
    """Positions restarting per segment make the packed row exact: DeepSeek-V3 derives its
    block-diagonal mask from them, its MoE routes each token alone, and the vision tower
    attends within each image (``image_grid_thw``)."""
    inputs = ok(results["model"])
    image_id, video_id = inputs["image_token_id"], inputs["video_token_id"]
    assert image_id == tokenizer().convert_tokens_to_ids("<|media_pad|>")
    model = seeded(lambda: tiny_model(image_id, video_id))
    alone = [model_tensors(sample) for sample in inputs["alone"]]
    packed = model_tensors(inputs["packed"])
    assert packed["image_grid_thw"].shape == (5, 3)
    assert int((packed["input_ids"] == image_id).sum()) == sum(
        int((sample["input_ids"] == image_id).sum()) for sample in alone
    )
    assert len(packed["position_ids"][0]) == sum(sample["input_ids"].shape[1] for sample in alone)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only wait on a shared machine
    try:
        loss_error, grad_error = packed_matches_alone(model, alone, packed)
        # the loss is reduced in float32 by transformers; the MoE router computes its logits in
        # float32 (its weight's gradient is float32-accurate, ~1e-7); everything else is float64
        assert loss_error < 1e-6
        assert grad_error < 1e-6
        routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
        assert routers
        for router in routers:
            router.requires_grad_(False)
        _, float64_error = packed_matches_alone(model, alone, packed)
        assert float64_error < 1e-10
    finally:
        torch.set_num_threads(threads)
