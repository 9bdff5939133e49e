"""Checked by ``mypy --strict`` in ``scripts/test.sh`` (not a test module): user code that hands a
transformers tokenizer to every public entry that takes one type-checks against the package's
own hints (``py.typed``)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from energon_pack import (
    ConversationEncoder,
    MRopeConfig,
    PackingSpec,
    PackingTaskEncoder,
    TemplateEncoder,
    make_encoder,
    pack_offline,
)


def entries_taking_a_tokenizer(tokenizer: PreTrainedTokenizerBase, spec: PackingSpec) -> None:
    PackingTaskEncoder(seq_length=8192, tokenizer=tokenizer)
    make_encoder(tokenizer)
    ConversationEncoder(tokenizer)
    TemplateEncoder(tokenizer)
    MRopeConfig.from_tokenizer(tokenizer, tokens_per_second=2)
    pack_offline("rows.jsonl", "out", spec, tokenizer)
