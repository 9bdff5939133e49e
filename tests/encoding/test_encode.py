from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import hf_qwen
import pytest
import torch
from helpers import SMALL_MEDIA as SMALL
from helpers import image_bytes, video_bytes

from energon_pack.encoding.chatml import SPECIAL_TOKENS, ByteTokenizer, ConversationEncoder
from energon_pack.formats.native import parse_sample
from energon_pack.formats.raw import RawSample
from energon_pack.media import MediaError, MediaItem, probe_image

TOK = ByteTokenizer()
S = {token: TOK.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}


def text(value: str) -> list[int]:
    return TOK.encode(value)


def test_byte_tokenizer_round_trip() -> None:
    ids = [S["<|im_start|>"], *text("héllo"), S["<|im_end|>"]]
    assert TOK.decode(ids) == "<|im_start|>héllo<|im_end|>"
    assert TOK.vocab_size == 256 + len(SPECIAL_TOKENS)
    with pytest.raises(ValueError, match="no special token '<x>'"):
        TOK.convert_tokens_to_ids("<x>")


def test_text_turns_exact_layout_and_loss_mask() -> None:
    sample = {
        "json": json.dumps(
            {
                "system": "Be brief.",
                "conversations": [
                    {"from": "human", "value": "Hi"},
                    {"from": "gpt", "value": "Yo"},
                ],
            }
        ).encode()
    }
    encoded = ConversationEncoder().encode_sample("k1", sample)
    start, end, nl = S["<|im_start|>"], S["<|im_end|>"], text("\n")
    expected = [
        (start, 0), *[(t, 0) for t in text("system\nBe brief.")], (end, 0), *[(t, 0) for t in nl],
        (start, 0), *[(t, 0) for t in text("user\nHi")], (end, 0), *[(t, 0) for t in nl],
        (start, 0), *[(t, 0) for t in text("assistant\n")], *[(t, 1) for t in text("Yo")],
        (end, 1), *[(t, 0) for t in nl],
    ]  # fmt: skip
    assert encoded.input_ids.tolist() == [t for t, _ in expected]
    assert encoded.loss_mask.tolist() == [m for _, m in expected]
    assert encoded.input_ids.dtype == torch.long
    assert encoded.length == len(expected)
    assert encoded.media == ()
    assert encoded.is_materialized


def test_multi_turn_multi_image_layout() -> None:
    first, second = image_bytes(64, 64), image_bytes(130, 90, "JPEG", seed=1)
    sample = {
        "json": json.dumps(
            {
                "conversations": [
                    {"role": "user", "content": "<image>\nA<image>"},
                    {"role": "assistant", "content": "B"},
                    {"role": "user", "content": "C"},
                    {"role": "assistant", "content": "D"},
                ]
            }
        ).encode(),
        "0.png": first,
        "1.jpg": second,
    }
    encoded = ConversationEncoder(system_prompt="S").encode_sample("k2", sample)
    n1, n2 = probe_image(first).tokens, probe_image(second).tokens
    # 64x64 -> 56x56: 4x4 patches, 4 tokens; 130x90 -> 140x84: 10x6 patches, 15 tokens
    assert (n1, n2) == (4, 15)
    vs, ve, pad = S["<|vision_start|>"], S["<|vision_end|>"], S["<|image_pad|>"]
    start, end, nl = S["<|im_start|>"], S["<|im_end|>"], text("\n")
    ids = [
        start, *text("system\nS"), end, *nl,
        start, *text("user\n"), vs, *[pad] * n1, ve, *text("\nA"), vs, *[pad] * n2, ve, end, *nl,
        start, *text("assistant\n"), *text("B"), end, *nl,
        start, *text("user\nC"), end, *nl,
        start, *text("assistant\n"), *text("D"), end, *nl,
    ]  # fmt: skip
    assert encoded.input_ids.tolist() == ids
    targets = [i for i, m in enumerate(encoded.loss_mask.tolist()) if m]
    assert [encoded.input_ids[i].item() for i in targets] == [*text("B"), end, *text("D"), end]
    assert [m.member for m in encoded.media] == ["0.png", "1.jpg"]


def test_loss_on_all() -> None:
    sample = {"json": {"conversations": [{"from": "human", "value": "x"}]}}
    encoded = ConversationEncoder(loss_on="all").encode_sample("k", sample)
    assert encoded.loss_mask.tolist() == [1] * encoded.length


def test_materialize_decodes_only_when_asked() -> None:
    image, video = image_bytes(200, 120, "JPEG"), video_bytes()
    sample = {
        "json": json.dumps(
            {
                "conversations": [
                    {"from": "human", "value": "<video> then <image>"},
                    {"from": "gpt", "value": "ok"},
                ],
                "media": ["1.mp4", "0.jpg"],
            }
        ),
        "0.jpg": image,
        "1.mp4": video,
    }
    encoder = ConversationEncoder()
    lazy = encoder.encode_sample("k3", sample)
    assert lazy.vision is None
    assert not lazy.is_materialized
    compressed = lazy.nbytes
    assert compressed == 2 * lazy.length * 8 + len(image) + len(video)

    full = lazy.materialize()
    vision = full.vision
    assert vision is not None
    assert vision.pixel_values is not None
    assert vision.image_grid_thw is not None
    assert vision.video_grid_thw is not None
    assert vision.pixel_values_videos is not None
    assert vision.second_per_grid_ts is not None
    assert vision.image_grid_thw.tolist() == [list(lazy.media[1].grid_thw)]
    assert vision.video_grid_thw.tolist() == [list(lazy.media[0].grid_thw)]
    assert vision.pixel_values.shape[0] == int(vision.image_grid_thw.prod())
    assert vision.pixel_values_videos.shape[0] == int(vision.video_grid_thw.prod())
    image_pads = int((lazy.input_ids == S["<|image_pad|>"]).sum())
    video_pads = int((lazy.input_ids == S["<|video_pad|>"]).sum())
    assert image_pads == int(vision.image_grid_thw.prod()) // 4
    assert video_pads == int(vision.video_grid_thw.prod()) // 4
    assert full.nbytes == compressed + vision.nbytes
    assert vision.nbytes > 20 * (len(image) + len(video))
    assert torch.equal(full.input_ids, lazy.input_ids)


def test_placeholder_count_mismatch_names_key_and_counts() -> None:
    more = {"json": {"conversations": [{"from": "human", "value": "<image><image>"}]}}
    more["0.png"] = image_bytes(32, 32)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"'k4'.* 2 placeholders .* but 1 media members"):
        parse_sample("k4", more)
    fewer = {"json": {"conversations": [{"from": "human", "value": "none"}]}}
    fewer["0.png"] = image_bytes(32, 32)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"'k5'.* 0 placeholders .* but 1 media members"):
        ConversationEncoder().encode_sample("k5", fewer)


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({}, "no 'json' member"),
        ({"json": b"{not json"}, "invalid JSON"),
        ({"json": {"conversations": []}}, "non-empty 'conversations'"),
        ({"json": {"conversations": [{"from": "human"}]}}, "turn 0 needs string"),
        ({"json": {"conversations": [{"from": "x", "value": "v"}]}}, "unknown conversation role"),
        ({"json": {"conversations": [{"from": "human", "value": "v"}], "media": "0.png"}}, "list"),
        ({"json": {"conversations": [{"from": "human", "value": "v"}], "media": ["0.gif"]}}, "gif"),
        (
            {"json": {"conversations": [{"from": "human", "value": "v"}], "media": ["0.png"]}},
            "miss",
        ),
    ],
)
def test_bad_samples_name_the_key(sample: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"'bad'.*{message}"):
        ConversationEncoder().encode_sample("bad", sample)


def test_broken_image_is_a_media_error_with_key_and_member() -> None:
    sample = {"json": {"conversations": [{"from": "human", "value": "<image>"}]}, "0.png": b""}
    with pytest.raises(MediaError, match=r"sample 'k6', member '0.png'"):
        ConversationEncoder().encode_sample("k6", sample)


def test_hf_tokenizer_is_accepted() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "user": 1, "assistant": 2, "hi": 3, "yo": 4, "\n": 5}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(r"\n|\w+"), behavior="isolated"
    )
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    hf.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    sample = {
        "json": {
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
        }
    }
    encoded = ConversationEncoder(hf).encode_sample("k7", sample)
    start, end = hf.convert_tokens_to_ids("<|im_start|>"), hf.convert_tokens_to_ids("<|im_end|>")
    assert encoded.input_ids.tolist() == [start, 1, 5, 3, end, 5, start, 2, 5, 4, end, 5]
    assert encoded.loss_mask.tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0]


def test_parse_sample_takes_media_in_index_order_without_a_list() -> None:
    turns = [{"from": "human", "value": "<image>\n<image>\nHi"}]
    raw = parse_sample("k", {"json": {"conversations": turns}, "10.png": b"p", "2.jpg": b"j"})
    assert [(member, kind) for member, kind, _ in raw.media] == [
        ("2.jpg", "image"),
        ("10.png", "image"),
    ]


def test_the_old_sample_module_still_gives_the_native_parser() -> None:
    from energon_pack import sample
    from energon_pack.formats import native, raw

    assert sample.parse_sample is native.parse_sample
    assert sample.load_json is native.load_json
    assert sample.RawSample is raw.RawSample


# --- text the encoder must not misread (issue 27) -------------------------------------------


def vision_blocks(ids: list[int]) -> int:
    return ids.count(S["<|vision_start|>"])


def test_placeholders_in_the_samples_system_prompt_are_text() -> None:
    turns = [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "Yo"}]
    meta = {"system": "Use <image> and <video> tags", "conversations": turns}
    sample = {"json": json.dumps(meta).encode(), "0.png": image_bytes(64, 64)}
    ids = ConversationEncoder().encode_sample("k", sample).input_ids.tolist()
    assert TOK.decode(ids).startswith(
        "<|im_start|>system\nUse <image> and <video> tags<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|>"
    )
    assert vision_blocks(ids) == 1
    assert ids.count(S["<|image_pad|>"]) == probe_image(image_bytes(64, 64)).tokens


def test_placeholders_in_the_system_prompt_setting_are_text() -> None:
    sample = {"json": {"conversations": [{"from": "human", "value": "Hi"}]}}
    encoder = ConversationEncoder(system_prompt="Use <image> tags")
    ids = encoder.encode_sample("k", sample).input_ids.tolist()
    assert TOK.decode(ids).startswith("<|im_start|>system\nUse <image> tags<|im_end|>\n")
    assert vision_blocks(ids) == 0


def test_a_system_turn_of_the_conversation_takes_media_like_any_turn() -> None:
    turns = [{"from": "system", "value": "<image>Rules"}, {"from": "human", "value": "Hi"}]
    sample = {"json": {"conversations": turns}, "0.png": image_bytes(64, 64)}
    encoded = ConversationEncoder(system_prompt="unused").encode_sample("k", sample)
    assert TOK.decode(encoded.input_ids.tolist()).startswith(
        "<|im_start|>system\n<|vision_start|><|image_pad|>"
    )
    assert vision_blocks(encoded.input_ids.tolist()) == 1


def test_a_raw_sample_whose_placeholders_miss_media_is_a_placeholder_mismatch() -> None:
    """RawSample is public: the encoder checks placeholders against media itself."""
    raw = RawSample("k9", (("user", "<image> and <video>"),), None, ())
    with pytest.raises(MediaError, match=r"sample 'k9'.*\['image', 'video'\]") as info:
        ConversationEncoder().encode(raw)
    assert info.value.kind == "placeholder_mismatch"
    video = RawSample("k9", (("user", "<image>"),), None, (("0.mp4", "video", video_bytes()),))
    with pytest.raises(MediaError, match="sample 'k9'") as info:
        ConversationEncoder().encode(video)
    assert info.value.kind == "placeholder_mismatch"


CUT = "cut emoji \ud83d"  # json.dumps escapes it: valid JSON, a lone surrogate once parsed
SURROGATE_SAMPLES = {
    "turn": {"conversations": [{"from": "human", "value": CUT}]},
    "system": {"system": CUT, "conversations": [{"from": "human", "value": "Hi"}]},
    "after_image": {"conversations": [{"from": "human", "value": f"<image>{CUT}"}]},
}


@pytest.mark.parametrize("where", sorted(SURROGATE_SAMPLES))
@pytest.mark.parametrize("hf", [False, True], ids=["byte", "hf"])
def test_text_the_tokenizer_cannot_encode_is_a_bad_sample(where: str, hf: bool) -> None:
    tokenizer = QWEN if hf else None
    raw = json.dumps(SURROGATE_SAMPLES[where]).encode()
    assert b"cut emoji \\ud83d" in raw
    sample = {"json": raw}
    if where == "after_image":
        sample["0.png"] = image_bytes(32, 32)
    with pytest.raises(MediaError, match=r"sample 'cut', member 'json'.*surrogate") as info:
        ConversationEncoder(tokenizer).encode_sample("cut", sample)
    assert info.value.kind == "bad_sample"


def test_a_system_prompt_setting_the_tokenizer_cannot_encode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="system_prompt"):
        ConversationEncoder(system_prompt=CUT)


QWEN = hf_qwen.qwen_tokenizer()
VISION_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]


@pytest.mark.parametrize("token", VISION_TOKENS)
@pytest.mark.parametrize("where", ["user", "assistant", "system"])
def test_vision_token_text_is_a_placeholder_mismatch(token: str, where: str) -> None:
    """An HF tokenizer encodes special-token text to its id, as apply_chat_template does; a
    vision token from text has no medium, so the sample is refused (as transformers' Qwen-VL
    processor refuses it) instead of training on pads without pixels."""
    text = f"look: {token} here"
    meta: dict[str, object] = {
        "conversations": [
            {"from": "human", "value": text if where == "user" else "Hi"},
            {"from": "gpt", "value": text if where == "assistant" else "Yo"},
        ]
    }
    if where == "system":
        meta["system"] = text
    sample = {"json": json.dumps(meta).encode()}
    with pytest.raises(MediaError, match=rf"sample 'sp'.*{re.escape(token)}") as info:
        ConversationEncoder(QWEN).encode_sample("sp", sample)
    assert info.value.kind == "placeholder_mismatch"
    ConversationEncoder().encode_sample("sp", sample)  # ByteTokenizer: plain text


def test_transformers_qwen_vl_processor_refuses_vision_token_text_too() -> None:
    """The reference for refusing: the processor counts the text's pads as images."""
    processor = hf_qwen.qwen_processor(QWEN, SMALL)
    text = QWEN.apply_chat_template(
        [{"role": "user", "content": "a <|image_pad|>"}], tokenize=False
    )
    with pytest.raises(ValueError, match="image_pad"):
        processor(text=[text])


@pytest.mark.parametrize("token", VISION_TOKENS)
def test_vision_token_text_next_to_a_real_image_is_a_placeholder_mismatch(token: str) -> None:
    png = image_bytes(64, 64)
    turns = [{"from": "human", "value": f"<image>{token}"}, {"from": "gpt", "value": "Yo"}]
    sample = {"json": {"conversations": turns}, "0.png": png}
    with pytest.raises(MediaError, match="sample 'sp'") as info:
        ConversationEncoder(QWEN, media=SMALL).encode_sample("sp", sample)
    assert info.value.kind == "placeholder_mismatch"
    good = {"json": {"conversations": [{"from": "human", "value": "<image>"}]}, "0.png": png}
    encoded = ConversationEncoder(QWEN, media=SMALL).encode_sample("ok", good)
    (item,) = encoded.media
    t, h, w = item.grid_thw
    assert encoded.input_ids.tolist().count(QWEN.convert_tokens_to_ids("<|image_pad|>")) == (
        t * h * w // SMALL.merge_size**2
    )


def test_other_special_token_text_gives_the_chat_templates_ids() -> None:
    """<|im_end|> and the like in content become their ids, as apply_chat_template does."""
    messages = [
        {"role": "user", "content": "a <|im_end|> b <|im_start|>c"},
        {"role": "assistant", "content": "<|endoftext|>"},
    ]
    sample = {"json": {"conversations": messages}}
    encoded = ConversationEncoder(QWEN).encode_sample("k", sample)
    assert encoded.input_ids.tolist() == QWEN.apply_chat_template(messages)["input_ids"]


class MiscountingEncoder(ConversationEncoder):
    """An encoder whose probe gives ``delta`` tokens more than its grid: the check must see it."""

    def __init__(self, delta: int) -> None:
        super().__init__(media=SMALL)
        self.delta = delta

    def _probe(self, *args: Any, **kwargs: Any) -> MediaItem:
        item = super()._probe(*args, **kwargs)
        return replace(item, tokens=item.tokens + self.delta)


@pytest.mark.parametrize("delta", [1, -1])
@pytest.mark.parametrize("kind", ["image", "video"])
def test_pads_that_do_not_match_the_grid_are_a_placeholder_mismatch(kind: str, delta: int) -> None:
    name, data = ("0.png", image_bytes(64, 64)) if kind == "image" else ("0.mp4", video_bytes())
    sample = {"json": {"conversations": [{"from": "human", "value": f"<{kind}>"}]}, name: data}
    ConversationEncoder(media=SMALL).encode_sample("g", sample)
    with pytest.raises(MediaError, match=rf"sample 'g'.*<\|{kind}_pad\|>") as info:
        MiscountingEncoder(delta).encode_sample("g", sample)
    assert info.value.kind == "placeholder_mismatch"
