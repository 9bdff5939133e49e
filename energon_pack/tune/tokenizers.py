"""The tokenizer a ``tune`` measures with: loaded from a local directory or cache (never
downloaded), an optional chat template file, and how the report names them."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from energon_pack.encoding.chatml import (
    ByteTokenizer,
    SampleEncoder,
    Tokenizer,
    check_special_tokens,
)
from energon_pack.encoding.describe import encoding_record
from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.family import Family
from energon_pack.encoding.template import make_encoder


@functools.cache
def load_tokenizer(name: str, chat_template: str | None = None) -> Tokenizer:
    """A transformers tokenizer from a local directory or the local cache; never downloads.
    ``chat_template``: a Jinja template file set as its ``chat_template``.

    Raises ValueError when it cannot be loaded offline, the template file cannot be read, or
    the tokenizer lacks the Qwen2-VL special tokens that the conversation template uses
    (:func:`~energon_pack.encoding.chatml.check_special_tokens`).
    """
    try:
        from transformers import AutoTokenizer

        tokenizer: Any = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError, ...
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"--tokenizer {name!r} cannot be loaded offline ({reason}); pass a directory written "
            "by tokenizer.save_pretrained(...) or the name of a tokenizer in the local Hugging "
            "Face cache"
        ) from None
    check_special_tokens(tokenizer, f"--tokenizer {name!r}")
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    loaded: Tokenizer = tokenizer
    return loaded


MAX_TEMPLATE_BYTES = 1 << 20
"""Largest chat template file read (the released ones are a few KB)."""


def read_chat_template(path: str) -> str:
    """The text of the Jinja chat template file ``path`` (``--chat-template``), UTF-8, not
    empty, at most :data:`MAX_TEMPLATE_BYTES`; else a ValueError naming the flag."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_TEMPLATE_BYTES + 1)
    except OSError as error:
        raise ValueError(
            f"--chat-template {path!r} cannot be read ({error.strerror or error}); pass a Jinja "
            "chat template file (e.g. the model's chat_template.jinja)"
        ) from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ValueError(
            f"--chat-template {path!r} is over {MAX_TEMPLATE_BYTES:,} bytes; a chat template "
            "is a few KB: pass the template file, not a model file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--chat-template {path!r} is not UTF-8 text; pass a Jinja file") from None
    if not text.strip():
        raise ValueError(f"--chat-template {path!r} is empty; pass a Jinja chat template")
    return text


def tokenizer_of(name: str | None, chat_template: str | None = None) -> Tokenizer | None:
    """The ``--tokenizer`` ``name`` with ``--chat-template`` applied (:func:`load_tokenizer`),
    or None without one; a template without a tokenizer is a ValueError naming both flags."""
    if name is not None:
        return load_tokenizer(name, chat_template)
    if chat_template is not None:
        raise ValueError(
            f"--chat-template {chat_template!r} needs --tokenizer (an HF tokenizer to apply it "
            "to; the built-in byte tokenizer has no chat template)"
        )
    return None


def encoder_of(
    tokenizer: str | None, chat_template: str | None, family: Family | None
) -> SampleEncoder:
    """The encoder of the ``--tokenizer`` / ``--chat-template`` / ``--family`` flags: a processor
    family's own (which takes neither flag: a ValueError names the one given), else
    :func:`~energon_pack.make_encoder` over :func:`tokenizer_of`, with ``family``'s settings."""
    if isinstance(family, ProcessorFamily):
        refuse_template_for_processor(chat_template)
        if tokenizer:
            raise ValueError(
                f"--tokenizer with the {family.name!r} family: its processor brings its own "
                "tokenizer; drop --tokenizer"
            )
        return make_encoder(family=family)
    return make_encoder(tokenizer_of(tokenizer, chat_template), family=family)


def refuse_template_for_processor(chat_template: str | Path | None) -> None:
    """A ValueError naming ``--chat-template`` when one is given for a processor family (which
    renders its processor's own template)."""
    if chat_template is not None:
        raise ValueError(
            f"--chat-template {str(chat_template)!r} is not for a processor family, which "
            "renders its processor's template; drop it"
        )


def describe_tokenizer(
    name: str | None, family: Family | None = None, chat_template: str | None = None
) -> dict[str, object]:
    """Which tokenizer counts the tokens and how: ``name``, ``class``, ``vocab_size`` and the
    record of the encoder the task encoder builds for it
    (:func:`~energon_pack.encoding.describe.encoding_record`: ``encoding`` ``"template"``
    with its chat template's ``chat_template_sha256``, ``"chatml"``, or ``"processor"`` (or
    ``"request"``, a tokenizer that encodes conversations itself) for a processor ``family``,
    whose tokenizer it is; ``system_prompt``); ``chat_template``: the
    template file applied (``--chat-template``), recorded too."""
    if isinstance(family, ProcessorFamily):
        refuse_template_for_processor(chat_template)
        tokenizer: Any = family.tokenizer
        name, encoder = f"the {family.name} processor's", make_encoder(family=family)
    else:
        loaded = tokenizer_of(name, chat_template)
        tokenizer = ByteTokenizer() if loaded is None else loaded
        encoder = make_encoder(loaded)
    info: dict[str, object] = {
        "name": "byte" if name is None else name,
        "class": type(tokenizer).__name__,
        "vocab_size": tokenizer.vocab_size if name is None else len(tokenizer),
        **encoding_record(encoder),
    }
    if chat_template is not None:
        info["chat_template"] = chat_template
    return info


def tokenizer_label(tokenizer: dict[str, object]) -> str:
    """What counted the tokens, for titles, from :func:`describe_tokenizer`'s answer: its class
    and where it came from (the last two parts of a path or hub name), e.g.
    ``Qwen2TokenizerFast (qwen2-vl/tokenizer)``."""
    name, kind = str(tokenizer["name"]), str(tokenizer["class"])
    if kind == "ByteTokenizer":
        return "ByteTokenizer (one token per byte)"
    if tokenizer.get("encoding") in ("processor", "request"):
        return f"{name} {kind}"
    return f"{kind} ({'/'.join(Path(name).parts[-2:]) or name})"
