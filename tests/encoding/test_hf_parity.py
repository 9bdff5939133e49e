"""Token-for-token parity with transformers: chat template + Qwen2-VL placeholder expansion.

The reference is the locally built Qwen-style tokenizer and processor of ``hf_qwen``: ids from
``apply_chat_template`` with each image placeholder expanded by ``Qwen2VLProcessor`` (and each
video placeholder by its ``grid.prod() // merge**2`` rule), labels from the template's assistant
mask. The encoder sees the same conversation in the native sample format.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from helpers import SMALL_MEDIA, batches, image_bytes, read_samples, train_dataset, video_bytes
from hf_qwen import DEFAULT_SYSTEM, qwen_processor, qwen_tokenizer, reference_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from energon_pack import PackedDataset, PackingSpec, VLMPackingCollator, pack_offline
from energon_pack.encoding.chatml import ConversationEncoder, template_system_prompt
from energon_pack.media import probe_video
from energon_pack.packing.row import IGNORE_INDEX, build_packed_row, unpack

TOKENIZER = qwen_tokenizer()
PROCESSOR = qwen_processor(TOKENIZER, SMALL_MEDIA)
Part = dict[str, str]


def _native(
    messages: list[dict[str, Any]], images: list[bytes], videos: list[bytes]
) -> dict[str, Any]:
    """The same conversation as a native sample: placeholders in the text, media members."""
    turns, media, members = [], [], {}
    pending = {"image": iter(images), "video": iter(videos)}
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            turns.append({"role": message["role"], "content": content})
            continue
        text = ""
        for part in content:
            if part["type"] == "text":
                text += part["text"]
                continue
            name = f"{len(media)}.{'png' if part['type'] == 'image' else 'mp4'}"
            members[name] = next(pending[part["type"]])
            media.append(name)
            text += f"<{part['type']}>"
        turns.append({"role": message["role"], "content": text})
    return {"json": json.dumps({"conversations": turns, "media": media}).encode(), **members}


def _check(
    messages: list[dict[str, Any]],
    images: list[bytes] = (),  # type: ignore[assignment]
    videos: list[bytes] = (),  # type: ignore[assignment]
    **encoder_options: Any,
) -> None:
    encoder = ConversationEncoder(TOKENIZER, media=SMALL_MEDIA, **encoder_options)
    encoded = encoder.encode_sample("k", _native(messages, list(images), list(videos)))
    grids = [probe_video(v, SMALL_MEDIA).grid_thw for v in videos]
    pil = [Image.open(io.BytesIO(data)) for data in images]
    ids, mask, image_inputs = reference_ids(PROCESSOR, messages, pil, grids, SMALL_MEDIA.merge_size)
    assert encoded.input_ids.tolist() == ids
    assert encoded.loss_mask.tolist() == mask
    # labels of the packed row: the next token where it is a target, else -100
    segment = {"input_ids": encoded.input_ids, "loss_mask": encoded.loss_mask}
    row = build_packed_row([segment], seq_length=len(ids))
    expected = [ids[t + 1] if mask[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    assert row.labels.tolist() == [*expected, IGNORE_INDEX]
    if images:  # and the pixels the processor computes
        vision = encoded.materialize(SMALL_MEDIA).vision
        assert vision is not None
        assert vision.image_grid_thw is not None
        assert vision.image_grid_thw.tolist() == image_inputs["image_grid_thw"].tolist()
        reference = torch.as_tensor(image_inputs["pixel_values"], dtype=torch.float32)
        torch.testing.assert_close(vision.pixel_values, reference, rtol=0, atol=1e-6)


def _user(*parts: Part) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def _assistant(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


IMAGE: Part = {"type": "image"}
VIDEO: Part = {"type": "video"}


def _text(value: str) -> Part:
    return {"type": "text", "text": value}


def test_template_default_system_prompt_is_found() -> None:
    assert template_system_prompt(TOKENIZER) == DEFAULT_SYSTEM
    assert template_system_prompt(object()) is None


def test_text_only_with_the_templates_default_system_prompt() -> None:
    _check([_user(_text("What is shown here?")), _assistant("The quick brown fox.")])


def test_own_system_turn_replaces_the_default() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        _user(_text("Describe the image in detail.")),
        _assistant("A lazy dog."),
    ]
    _check(messages)


def test_header_newline_merging_with_content_is_a_target_token() -> None:
    # "assistant\n" + "\n\nThe" tokenises as "assistant", "\n\n", "\n", "The": the "\n\n"
    # token holds content, so it is a target, as transformers' assistant mask says.
    _check([_user(_text("\n\nWhat?")), _assistant("\n\nThe fox."), _user(_text("  indented"))])


def test_one_image() -> None:
    _check(
        [_user(IMAGE, _text("What is shown here?")), _assistant("A fox.")],
        images=[image_bytes(90, 64)],
    )


def test_several_images_over_several_turns() -> None:
    messages = [
        _user(IMAGE, _text("\nand"), IMAGE, _text(" compare them.")),
        _assistant("The first is larger."),
        _user(_text("And this one?"), IMAGE),
        _assistant("Smaller."),
    ]
    _check(
        messages,
        images=[image_bytes(64, 64), image_bytes(130, 90, seed=1), image_bytes(200, 50, seed=2)],
    )


def test_video_and_image() -> None:
    messages = [_user(VIDEO, _text("What happens?"), IMAGE), _assistant("The fox jumps.")]
    _check(messages, images=[image_bytes(64, 96)], videos=[video_bytes(96, 64, frames=8, fps=4)])


def test_explicit_system_prompt_and_no_template_default() -> None:
    encoder = ConversationEncoder(TOKENIZER, template_system=False)
    sample = _native([_user(_text("Hi")), _assistant("Yo")], [], [])
    text = TOKENIZER.decode(encoder.encode_sample("k", sample).input_ids.tolist())
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
    messages = [{"role": "system", "content": "Be brief."}, _user(_text("Hi")), _assistant("Yo")]
    given_prompt = ConversationEncoder(TOKENIZER, system_prompt="Be brief.")
    ids, _, _ = reference_ids(PROCESSOR, messages, [], [], 2)
    assert given_prompt.encode_sample("k", sample).input_ids.tolist() == ids


_PIECES = [*"ab xyz.,?!\n\t'é12", "the ", "fox", "\n\n", "  "]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=12).map("".join)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=3), system=st.booleans())
def test_any_text_gives_the_templates_ids_and_mask(
    turns: list[tuple[str, str]], system: bool
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Sys."}] if system else []
    for question, answer in turns:
        messages += [_user(_text(question)), _assistant(answer)]
    _check(messages)


def _segments(row: Any) -> list[list[int]]:
    return [segment["input_ids"].tolist() for segment in unpack(row)]


def test_every_path_takes_the_hf_tokenizer(tmp_path: Path, fixtures_dir: Path) -> None:
    """Offline, collator and Energon packing give the template's ids with an HF tokenizer."""
    question, answer = "What is shown here?", "The lazy dog."
    messages = [_user(_text(question)), _assistant(answer)]
    ids, mask, _ = reference_ids(PROCESSOR, messages, [], [], 2)
    # offline: {"input", "output"} and {"conversations"} lines
    lines = [
        {"input": question, "output": answer},
        {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]},
    ]
    source = tmp_path / "sft.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    pack_offline(source, tmp_path / "packed", PackingSpec(256), tokenizer=TOKENIZER)
    rows = PackedDataset(tmp_path / "packed")
    offline = [segment for index in range(len(rows)) for segment in unpack(rows[index])]
    assert [s["input_ids"].tolist() for s in offline] == [ids, ids]
    assert [s["loss_mask"][1:].tolist() for s in offline] == [[float(m) for m in mask[1:]]] * 2
    # collator, with an image sample next to the text one
    image = [_user(IMAGE, _text(question)), _assistant(answer)]
    pixels = image_bytes(90, 64)
    image_ids, _, _ = reference_ids(
        PROCESSOR, image, [Image.open(io.BytesIO(pixels))], [], SMALL_MEDIA.merge_size
    )
    collate = VLMPackingCollator(
        512, encoder=ConversationEncoder(TOKENIZER, media=SMALL_MEDIA), pad_token_id=0
    )
    batch = collate([("a", _native(messages, [], [])), ("b", _native(image, [pixels], []))])
    segments = unpack(batch.row())
    assert [s["input_ids"].tolist() for s in segments] == [ids, image_ids]
    # Energon: the Bridge fixture, every segment as the encoder gives it with this tokenizer
    encoder = ConversationEncoder(TOKENIZER, media=SMALL_MEDIA)
    samples = read_samples(fixtures_dir / "bridge_qwenvl")
    seen = 0
    dataset = train_dataset(
        fixtures_dir / "bridge_qwenvl", 4, tokenizer=TOKENIZER, media=SMALL_MEDIA
    )
    for packed in batches(dataset):
        want = [encoder.encode_sample(k, samples[k]).input_ids.tolist() for k in packed.__keys__]
        assert _segments(packed.row()) == want
        assert all(TOKENIZER.decode(s).startswith("<|im_start|>system\n") for s in want)
        seen += len(want)
    assert seen == len(samples)
