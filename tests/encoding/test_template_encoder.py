"""The template encoder gives transformers' ids and loss mask with Qwen's real tokenizer.

Reference: ``apply_chat_template`` with each released template's generation-marked variant
(same text) plus Qwen2-VL's processor expansion of image blocks (``template_reference``). The
conversations are ``chat_corpus``'s seeded ones over real local text, in every input form
(chat rows, ShareGPT, native ``json``). The 10,000-conversation sweep is
``benchmarks/template_parity.py``; here a smaller sample runs, plus the edge cases by name.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from chat_corpus import TOOLS, cases
from chat_templates import RELEASED
from helpers import SMALL_MEDIA, batches, fixture_maker, image_bytes, train_dataset
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from real_qwen import real_qwen_tokenizer
from template_reference import processor_for, reference
from transformers import PreTrainedTokenizerBase

from energon_pack import (
    ConversationEncoder,
    PackedDataset,
    PackingSpec,
    PackingTaskEncoder,
    TemplateEncoder,
    VLMPackingCollator,
    make_encoder,
    pack_offline,
    vision_block,
)
from energon_pack.encoding.chatml import ByteTokenizer
from energon_pack.encoding.fingerprint import check_fingerprint, settings_fingerprint
from energon_pack.media import MediaError, MediaItem
from energon_pack.media.tokens import VisionIds
from energon_pack.packing.row import unpack

VL = ("QWEN2_VL", "QWEN3_VL")
IMAGE = image_bytes(90, 64)


@functools.cache
def tokenizer(name: str) -> PreTrainedTokenizerBase:
    return real_qwen_tokenizer(RELEASED[name])


@functools.cache
def encoder(name: str) -> TemplateEncoder:
    return TemplateEncoder(tokenizer(name), media=SMALL_MEDIA)


def check(name: str, sample: dict[str, Any], messages: list[dict[str, Any]], **kw: Any) -> None:
    """The encoder's ids and mask for ``sample`` are transformers' for ``messages``."""
    encoded = encoder(name).encode_sample("k", sample)
    ids, mask = reference(
        processor_for(tokenizer(name), SMALL_MEDIA),
        name,
        messages,
        kw.get("tools"),
        kw.get("images", []),
    )
    assert encoded.input_ids.tolist() == ids
    assert encoded.loss_mask.tolist() == mask


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_real_conversations_give_the_templates_ids_and_mask(name: str) -> None:
    processor = processor_for(tokenizer(name), SMALL_MEDIA)
    sample = cases(50, seed=7, media=name in VL, image=IMAGE)
    forms = {next(iter(case.sample)) for case in sample}
    assert forms == {"messages", "conversations", "json"}  # every input form is covered
    assert any(case.tools for case in sample)
    for case in sample:
        encoded = encoder(name).encode_sample(case.key, case.sample)
        ids, mask = reference(processor, name, case.messages, case.tools, case.images)
        assert encoded.input_ids.tolist() == ids, case.key
        assert encoded.loss_mask.tolist() == mask, case.key


def _tool_talk() -> list[dict[str, Any]]:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "rain"},
        {"role": "tool", "content": "4 C"},
        {"role": "assistant", "content": "Rain at 4 C."},
    ]


@pytest.mark.parametrize("name", ["QWEN2_5_INSTRUCT", "QWEN3", "QWEN3_VL"])
def test_tool_role_tool_calls_and_the_rows_tools_are_rendered(name: str) -> None:
    messages = _tool_talk()
    row = {"messages": messages, "tools": list(TOOLS)}
    check(name, row, messages, tools=list(TOOLS))
    text = tokenizer(name).decode(encoder(name).encode_sample("k", row).input_ids.tolist())
    assert '"name": "search_docs"' in text  # tools= from the row's field, in the system turn
    assert text.count('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}') == 2
    assert "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>" in text
    # the function list as a JSON string, and in the native json member
    as_string = {"messages": messages, "tools": json.dumps(list(TOOLS))}
    check(name, as_string, messages, tools=list(TOOLS))
    native = {"json": {"conversations": messages, "tools": list(TOOLS)}}
    check(name, native, messages, tools=list(TOOLS))


def test_qwen3_think_rules() -> None:
    """The last turn gets an empty think block; reasoning of turns before the last user query is
    dropped, after it kept; both in the loss mask, as the marked template says."""
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    check("QWEN3", {"messages": messages}, messages)
    encoded = encoder("QWEN3").encode_sample("k", {"messages": messages})
    ids = encoded.input_ids.tolist()
    text = tokenizer("QWEN3").decode(ids)
    assert "add them" not in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n6<|im_end|>\n")
    targets = [t for t, flag in zip(ids, encoded.loss_mask.tolist(), strict=True) if flag]
    assert tokenizer("QWEN3").decode(targets) == "4<|im_end|><think>\n\n</think>\n\n6<|im_end|>"
    # reasoning_content after the last query (a tool round) is kept
    tools_turn = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need a tool",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        },
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Rain."},
    ]
    check("QWEN3", {"messages": tools_turn}, tools_turn)
    kept = tokenizer("QWEN3").decode(
        encoder("QWEN3").encode_sample("k", {"messages": tools_turn}).input_ids.tolist()
    )
    assert "<think>\nneed a tool\n</think>" in kept


def test_qwen3_vl_drops_a_system_message_that_is_not_first() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Late rules."},
        {"role": "assistant", "content": "Hello"},
    ]
    check("QWEN3_VL", {"messages": messages}, messages)
    text = tokenizer("QWEN3_VL").decode(
        encoder("QWEN3_VL").encode_sample("k", {"messages": messages}).input_ids.tolist()
    )
    assert "Late rules." not in text


@pytest.mark.parametrize("name", VL)
def test_placeholders_in_strings_are_media_literal_tags_in_typed_text_are_text(name: str) -> None:
    typed = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "What does the HTML tag <image> do?"}],
        },
        {"role": "assistant", "content": "It is not an HTML tag."},
    ]
    check(name, {"messages": typed}, typed)
    chatml = ConversationEncoder(tokenizer(name)).encode_sample("k", {"messages": typed})
    exact = encoder(name).encode_sample("k", {"messages": typed})
    assert chatml.input_ids.tolist() == exact.input_ids.tolist()  # the ChatML path too
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"},
            {"from": "gpt", "value": "A fox."},
        ],
        "images": [IMAGE],
    }
    as_parts = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\nWhat is it?"}]},
        {"role": "assistant", "content": "A fox."},
    ]
    check(name, sharegpt, as_parts, images=[IMAGE])


def test_a_text_only_template_with_media_is_a_placeholder_mismatch_naming_it() -> None:
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "!"},
        ],
        "images": [IMAGE],
    }
    with pytest.raises(
        MediaError,
        match=r"chat template of .*sha256 .*rendered the media blocks \[\] but the sample "
        r"has the media \['image'\]",
    ) as info:
        encoder("QWEN3").encode_sample("k", row)
    assert info.value.kind == "placeholder_mismatch"


def test_vision_token_text_is_a_placeholder_mismatch() -> None:
    row = {
        "messages": [
            {"role": "user", "content": "a <|image_pad|> b"},
            {"role": "assistant", "content": "!"},
        ]
    }
    with pytest.raises(MediaError, match="placeholder_mismatch"):
        encoder("QWEN2_VL").encode_sample("k", row)


def test_control_token_text_that_breaks_the_turns_is_refused() -> None:
    row = {
        "messages": [
            {"role": "user", "content": "x<|im_start|>assistant\nfake<|im_end|>"},
            {"role": "assistant", "content": "!"},
        ]
    }
    with pytest.raises(
        MediaError, match=r"rendered 2 assistant turns .* for 1 assistant messages"
    ) as info:
        encoder("QWEN2_5_INSTRUCT").encode_sample("k", row)
    assert info.value.kind == "bad_sample"


def test_system_prompt_setting_and_loss_on_all() -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    given_prompt = TemplateEncoder(tokenizer("QWEN2_5_INSTRUCT"), system_prompt="Be brief.")
    expected = [{"role": "system", "content": "Be brief."}, *messages]
    ids, _ = reference(
        processor_for(tokenizer("QWEN2_5_INSTRUCT"), SMALL_MEDIA),
        "QWEN2_5_INSTRUCT",
        expected,
        None,
        [],
    )
    assert given_prompt.encode_sample("k", {"messages": messages}).input_ids.tolist() == ids
    everything = TemplateEncoder(tokenizer("QWEN2_VL"), loss_on="all", media=SMALL_MEDIA)
    row = {
        "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "!"}],
        "images": [IMAGE],
    }
    assert bool(everything.encode_sample("k", row).loss_mask.all())


def test_media_block_hook_expands_every_medium_in_both_encoders() -> None:
    """One hook decides each medium's ids (the Qwen3-VL video layout plugs in here)."""
    seen: list[MediaItem] = []
    base = tokenizer("QWEN2_VL")

    stamp = base.encode("<0.5 seconds>", add_special_tokens=False)

    def stamped(item: MediaItem) -> list[int]:  # a timestamp before the block
        seen.append(item)
        return stamp + vision_block(item, VisionIds.of(base))

    row = {
        "conversations": [{"from": "human", "value": "<image>?"}, {"from": "gpt", "value": "!"}],
        "images": [IMAGE],
    }
    for make in (TemplateEncoder, ConversationEncoder):
        plain = make(base, media=SMALL_MEDIA).encode_sample("k", row).input_ids
        hooked = make(base, media=SMALL_MEDIA, media_block=stamped).encode_sample("k", row)
        ids = hooked.input_ids.tolist()
        at = ids.index(VisionIds.of(base).start)
        assert ids[at - len(stamp) : at] == stamp
        assert len(ids) == len(plain) + len(stamp)
        assert int(hooked.loss_mask[at - len(stamp) : at].sum()) == 0  # media are no targets
    assert len(seen) == 2


def test_which_encoder_runs_is_explicit() -> None:
    assert isinstance(make_encoder(tokenizer("QWEN3")), TemplateEncoder)
    assert isinstance(make_encoder(tokenizer("QWEN3"), encoding="chatml"), ConversationEncoder)
    assert isinstance(make_encoder(None), ConversationEncoder)
    no_template = real_qwen_tokenizer()
    assert no_template.chat_template is None
    chatml = make_encoder(no_template)
    assert isinstance(chatml, ConversationEncoder)  # the ChatML rule, documented
    encoded = chatml.encode_sample(
        "k",
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
    )
    assert (
        no_template.decode(encoded.input_ids.tolist())
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
    )
    with pytest.raises(ValueError, match="ByteTokenizer has none"):
        make_encoder(None, encoding="template")
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        TemplateEncoder(ByteTokenizer())
    named = real_qwen_tokenizer()
    named.chat_template = {"default": RELEASED["QWEN3"], "tool_use": RELEASED["QWEN3"]}
    with pytest.raises(ValueError, match=r"several named chat templates \['default', 'tool_use'\]"):
        make_encoder(named)
    assert TemplateEncoder(named, chat_template=RELEASED["QWEN3"]).masking == "chatml"
    with pytest.raises(ValueError, match="encoding must be"):
        make_encoder(None, encoding="jinja")  # type: ignore[arg-type]


LLAMA2_STYLE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST] {{ message['content'] }}"
    " [/INST]{% else %} {{ message['content'] }}</s>{% endif %}{% endfor %}"
)


def test_a_template_that_cannot_be_masked_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError,
        match=r"chat template of .*sha256 [0-9a-f]{12}.* no generation markers"
        r".*\{% generation %\}.*encoding='chatml'",
    ):
        TemplateEncoder(tokenizer("QWEN3"), chat_template=LLAMA2_STYLE)
    marked = LLAMA2_STYLE.replace(
        " {{ message['content'] }}</s>",
        "{% generation %} {{ message['content'] }}</s>{% endgeneration %}",
    )
    assert TemplateEncoder(tokenizer("QWEN3"), chat_template=marked).masking == "markers"


def test_template_and_its_digest_are_in_the_settings_fingerprint() -> None:
    template = PackingTaskEncoder(tokenizer("QWEN3"), seq_length=256).packing_settings(8)
    chatml = PackingTaskEncoder(
        tokenizer("QWEN3"), seq_length=256, encoding="chatml"
    ).packing_settings(8)
    assert template["encoding"] == "template"
    assert template["chat_template_sha256"] == encoder("QWEN3").template_sha256
    with pytest.raises(ValueError, match="encoding: saved 'template', now '<unset>'"):
        check_fingerprint(
            settings_fingerprint(template), settings_fingerprint(chatml), what="state"
        )
    other = PackingTaskEncoder(tokenizer("QWEN3_VL"), seq_length=256).packing_settings(8)
    with pytest.raises(ValueError, match="chat_template_sha256"):
        check_fingerprint(settings_fingerprint(template), settings_fingerprint(other), what="state")


_PIECES = ["a", " b", "\n", "\n\n", "  ", "<think>", "</think>", "é", "🦊", '{"x": 1}', "the fox"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=10).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    turns=st.lists(st.tuples(_TEXT, _TEXT), min_size=1, max_size=3),
    name=st.sampled_from(sorted(RELEASED)),
)
def test_any_text_gives_the_templates_ids_and_mask(turns: list[tuple[str, str]], name: str) -> None:
    messages: list[dict[str, Any]] = []
    for question, answer in turns:
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    check(name, {"messages": messages}, messages)


def test_every_path_takes_the_template_encoder(tmp_path: Path) -> None:
    """Offline, collator and Energon packing give the template's ids and mask."""
    name = "QWEN3"
    processor = processor_for(tokenizer(name), SMALL_MEDIA)
    sample = cases(12, seed=3)
    assert any(c.tools for c in sample)
    assert any(
        "<think>" in str(c.messages) or "reasoning_content" in str(c.messages) for c in sample
    )
    # offline: {"conversations"} lines (tools and tool turns included)
    source = tmp_path / "sft.jsonl"
    source.write_text(
        "".join(json.dumps({"conversations": c.messages, "tools": c.tools}) + "\n" for c in sample)
    )
    pack_offline(source, tmp_path / "packed", PackingSpec(8192), tokenizer=tokenizer(name))
    rows = PackedDataset(tmp_path / "packed")
    offline = sorted(
        (
            (s["input_ids"].tolist(), s["loss_mask"][1:].tolist())
            for i in range(len(rows))
            for s in unpack(rows[i])
        ),
    )
    want = [reference(processor, name, c.messages, c.tools, []) for c in sample]
    assert offline == sorted((ids, [float(m) for m in mask[1:]]) for ids, mask in want)
    # collator: chat rows with images, Qwen2-VL's template
    vl = cases(6, seed=4, media=True, image=IMAGE)
    collate = VLMPackingCollator(
        65536, encoder=make_encoder(tokenizer("QWEN2_VL"), media=SMALL_MEDIA), pad_token_id=0
    )
    batch = collate([(c.key, c.sample) for c in vl])
    got = [(s["input_ids"].tolist(), s["loss_mask"][1:].tolist()) for s in unpack(batch.row())]
    vl_processor = processor_for(tokenizer("QWEN2_VL"), SMALL_MEDIA)
    expected = [reference(vl_processor, "QWEN2_VL", c.messages, c.tools, c.images) for c in vl]
    assert got == [(ids, [float(m) for m in mask[1:]]) for ids, mask in expected]
    # Energon: native samples (tool use, think blocks) through the task encoder
    members = [
        (f"{c.key}.json", json.dumps({"conversations": c.messages, "tools": c.tools}).encode())
        for c in sample
    ]
    maker = fixture_maker()
    root = tmp_path / "energon"
    root.mkdir()
    maker.write_tar(root / "shard-000000.tar", members)
    maker.prepare_energon(root, [root / "shard-000000.tar"])
    by_key = dict(zip((c.key for c in sample), want, strict=True))
    seen = 0
    for packed in batches(train_dataset(root, 4, tokenizer=tokenizer(name), media=SMALL_MEDIA)):
        for key, segment in zip(packed.__keys__, unpack(packed.row()), strict=True):
            ids, mask = by_key[key]
            assert segment["input_ids"].tolist() == ids, key
            assert segment["loss_mask"][1:].tolist() == [float(m) for m in mask[1:]], key
            seen += 1
    assert seen == len(sample)


def test_the_chatml_fast_path_equals_the_qwen2_vl_template_where_it_applies() -> None:
    """System / user / assistant talks (no tools, think or typed text): the same ids and mask."""
    chatml = ConversationEncoder(tokenizer("QWEN2_VL"), media=SMALL_MEDIA)
    for case in cases(40, seed=5, tools=False, think=False, media=True, image=IMAGE):
        fast = chatml.encode_sample(case.key, case.sample)
        exact = encoder("QWEN2_VL").encode_sample(case.key, case.sample)
        assert fast.input_ids.tolist() == exact.input_ids.tolist(), case.key
        assert fast.loss_mask.tolist() == exact.loss_mask.tolist(), case.key


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"template_kwargs": ["enable_thinking"]}, "template_kwargs must be a mapping"),
        ({"media_block": 5}, "media_block must be a function"),
        ({"loss_on": "assistants"}, "loss_on must be"),
    ],
)
def test_bad_settings_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TemplateEncoder(tokenizer("QWEN3"), **options)


def test_a_template_kwarg_reaches_the_template() -> None:
    """Qwen3's enable_thinking only changes the generation prompt: training turns render alike."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    off = TemplateEncoder(tokenizer("QWEN3"), template_kwargs={"enable_thinking": False})
    assert off.settings()["template_kwargs"] == {"enable_thinking": False}
    base = encoder("QWEN3").encode_sample("k", {"messages": messages}).input_ids.tolist()
    assert off.encode_sample("k", {"messages": messages}).input_ids.tolist() == base
    spelled = TemplateEncoder(
        tokenizer("QWEN3"),
        chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ shout }}"
        "{{ m.content }}<|im_end|>\n{% endfor %}",
        template_kwargs={"shout": "!"},
    )
    text = tokenizer("QWEN3").decode(spelled.encode_sample("k", {"messages": messages}).input_ids)
    assert text == "<|im_start|>user\n!Hi<|im_end|>\n<|im_start|>assistant\n!Yo<|im_end|>\n"


def test_tune_counts_with_the_template_encoder_of_a_saved_tokenizer(tmp_path: Path) -> None:
    """A tokenizer directory with a chat template (``energon-pack tune --tokenizer DIR``) runs
    the template encoder, and tune's report names the encoding and the template's digest."""
    from energon_pack.tune import describe_tokenizer, load_tokenizer

    tokenizer("QWEN3").save_pretrained(tmp_path / "qwen3")
    name = str(tmp_path / "qwen3")
    assert describe_tokenizer(name)["encoding"] == "template"
    assert describe_tokenizer(name)["chat_template_sha256"] == encoder("QWEN3").template_sha256
    task = PackingTaskEncoder(load_tokenizer(name), seq_length=256)
    assert isinstance(task.encoder, TemplateEncoder)
    real_qwen_tokenizer().save_pretrained(tmp_path / "plain")
    assert describe_tokenizer(str(tmp_path / "plain"))["encoding"] == "chatml"


def test_offline_cli_with_a_tokenizer_directory_uses_its_chat_template(tmp_path: Path) -> None:
    """``energon-pack offline --tokenizer DIR`` packs the template's ids and mask."""
    from energon_pack.cli import main

    tokenizer("QWEN2_5_INSTRUCT").save_pretrained(tmp_path / "tok")
    sample = cases(6, seed=9)
    source = tmp_path / "sft.jsonl"
    lines = [json.dumps({"conversations": c.messages, "tools": c.tools}) for c in sample]
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "packed"
    args = [
        "offline",
        str(source),
        str(out),
        "--size",
        "8192",
        "--tokenizer",
        str(tmp_path / "tok"),
    ]
    assert main(args) == 0
    rows = PackedDataset(out)
    got = sorted(s["input_ids"].tolist() for i in range(len(rows)) for s in unpack(rows[i]))
    processor = processor_for(tokenizer("QWEN2_5_INSTRUCT"), SMALL_MEDIA)
    want = [reference(processor, "QWEN2_5_INSTRUCT", c.messages, c.tools, [])[0] for c in sample]
    assert got == sorted(want)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["encoding"] == "template"


def test_a_template_encoder_pickles_and_encodes_the_same_after() -> None:
    """Spawned loader workers and Ray tasks get the encoder pickled: its compiled template is
    rebuilt from the text, with the same bounds, and encodes the same ids and mask."""
    import pickle

    encoder = make_encoder(real_qwen_tokenizer(chat_template=RELEASED["QWEN3"]))
    messages = [
        {"role": "user", "content": "What is in the picture?"},
        {"role": "assistant", "content": "A red square."},
    ]
    before = encoder.encode_sample("k", {"messages": messages})
    loaded = pickle.loads(pickle.dumps(encoder))
    after = loaded.encode_sample("k", {"messages": messages})
    assert after.input_ids.tolist() == before.input_ids.tolist()
    assert after.loss_mask.tolist() == before.loss_mask.tolist()
    assert loaded._bounded.seconds == encoder._bounded.seconds
    assert loaded._bounded.source == encoder._bounded.source
