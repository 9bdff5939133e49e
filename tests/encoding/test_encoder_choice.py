"""Which encoder counts the tokens is never silent, and every Python entry checks the tokenizer.

Real transformers tokenizers only: Qwen's real tokenizer (tests/support/real_qwen.py), saved
without its template where a test needs one without, and a word-level tokenizer without the
ChatML special tokens.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chat_templates import QWEN2_VL, QWEN3, SHA256
from real_qwen import real_qwen_tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from energon_pack import (
    ConversationEncoder,
    PackingTaskEncoder,
    PackingWarning,
    TemplateEncoder,
    VLMPackingCollator,
    make_encoder,
)
from energon_pack.encoding.chatml import SPECIAL_TOKENS
from energon_pack.tune import load_tokenizer


def saved_without_template(tmp_path: Path) -> PreTrainedTokenizerBase:
    """Qwen's real tokenizer as a directory without a chat template would load it."""
    tokenizer = real_qwen_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "qwen-no-template")
    loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tmp_path / "qwen-no-template")
    assert loaded.chat_template is None
    return loaded


def words_tokenizer(tmp_path: Path) -> PreTrainedTokenizerBase:
    """A word-level HF tokenizer without the ChatML special tokens, saved and loaded back."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "user": 1, "assistant": 2, "\n": 3, "hello": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(r"\n|\w+"), behavior="isolated"
    )
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(
        tmp_path / "words"
    )
    loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tmp_path / "words")
    return loaded


# ---------------------------------------------------------------- the ChatML fallback warns once
def test_a_tokenizer_without_a_template_warns_once(tmp_path: Path) -> None:
    tokenizer = saved_without_template(tmp_path)
    with pytest.warns(PackingWarning, match="has no chat template") as caught:
        encoder = make_encoder(tokenizer)
    assert isinstance(encoder, ConversationEncoder)
    message = str(caught[0].message)
    assert str(tmp_path / "qwen-no-template") in message
    assert "no system prompt" in message
    assert "--chat-template FILE" in message
    assert "encoding='chatml'" in message
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        make_encoder(tokenizer)  # the same tokenizer: once is enough
        PackingTaskEncoder(tokenizer, seq_length=256)
    assert not [w for w in again if issubclass(w.category, PackingWarning)]


@pytest.mark.parametrize(
    "build",
    [
        lambda tok: make_encoder(tok, encoding="chatml"),  # ChatML chosen
        lambda tok: ConversationEncoder(tok),  # ChatML chosen
        lambda tok: make_encoder(None),  # the built-in byte tokenizer
    ],
    ids=["encoding-chatml", "ConversationEncoder", "byte-tokenizer"],
)
def test_chatml_chosen_on_purpose_does_not_warn(
    build: Callable[[Any], object], tmp_path: Path
) -> None:
    tokenizer = saved_without_template(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackingWarning)
        build(tokenizer)


def test_a_tokenizer_with_a_template_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PackingWarning)
        assert isinstance(make_encoder(real_qwen_tokenizer(QWEN2_VL)), TemplateEncoder)


# ------------------------------------------------------------- which encoder: record and line
def test_the_record_names_the_encoder_and_its_system_prompt(tmp_path: Path) -> None:
    from energon_pack.encoding.describe import encoding_line, encoding_record

    qwen2_vl = encoding_record(make_encoder(real_qwen_tokenizer(QWEN2_VL)))
    assert qwen2_vl == {
        "encoding": "template",
        "chat_template_sha256": SHA256["QWEN2_VL"],
        "template_kwargs": {},
        "system_prompt": "You are a helpful assistant.",  # the template's default
    }
    assert encoding_line(qwen2_vl) == (
        f"chat template (sha256 {SHA256['QWEN2_VL'][:12]}), "
        "system prompt 'You are a helpful assistant.'"
    )
    qwen3 = encoding_record(make_encoder(real_qwen_tokenizer(QWEN3)))
    assert qwen3["system_prompt"] is None  # Qwen3's template adds none
    assert encoding_line(qwen3).endswith("), no system prompt")
    with pytest.warns(PackingWarning):
        chatml = encoding_record(make_encoder(saved_without_template(tmp_path)))
    assert chatml == {"encoding": "chatml", "system_prompt": None}
    assert encoding_line(chatml) == "ChatML (the built-in rule, no chat template), no system prompt"
    byte = encoding_record(make_encoder(None, system_prompt="Be brief."))
    assert byte == {"encoding": "chatml", "system_prompt": "Be brief."}
    assert encoding_line(byte).endswith(", system prompt 'Be brief.'")
    own = encoding_record(TemplateEncoder(real_qwen_tokenizer(QWEN2_VL), system_prompt="Hi."))
    assert own["system_prompt"] == "Hi."


# ------------------------------------------------- the tokenizer check, shared with the CLI
def test_the_check_names_the_missing_tokens_and_the_fix(tmp_path: Path) -> None:
    from energon_pack.encoding.chatml import check_special_tokens

    tokenizer = words_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="has no special tokens") as python:
        check_special_tokens(tokenizer)
    message = str(python.value)
    named = f"tokenizer {str(tmp_path / 'words')!r} ({type(tokenizer).__name__})"
    assert message.startswith(named)
    assert f"has no special tokens {list(SPECIAL_TOKENS)}" in message
    assert "tokenizer.add_special_tokens({'additional_special_tokens': [" in message
    with pytest.raises(ValueError, match="--tokenizer") as cli:  # the CLI's check is this one
        load_tokenizer(str(tmp_path / "words"))
    assert str(cli.value) == message.replace(named, f"--tokenizer {str(tmp_path / 'words')!r}")
    check_special_tokens(real_qwen_tokenizer())  # Qwen's own has them all


@pytest.mark.parametrize(
    "build",
    [
        lambda tok: make_encoder(tok),
        lambda tok: make_encoder(tok, encoding="chatml"),
        lambda tok: ConversationEncoder(tok),
        lambda tok: TemplateEncoder(tok, chat_template=QWEN2_VL),
        lambda tok: PackingTaskEncoder(tok, seq_length=256),
        lambda tok: VLMPackingCollator(256, encoder=ConversationEncoder(tok)),
    ],
    ids=[
        "make_encoder",
        "make_encoder-chatml",
        "ConversationEncoder",
        "TemplateEncoder",
        "PackingTaskEncoder",
        "VLMPackingCollator",
    ],
)
def test_every_python_entry_refuses_a_tokenizer_without_the_chatml_tokens(
    build: Callable[[Any], object], tmp_path: Path
) -> None:
    tokenizer = words_tokenizer(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        with pytest.raises(ValueError, match=r"has no special tokens \['<\|endoftext\|>'"):
            build(tokenizer)
