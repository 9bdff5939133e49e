"""The chat-template constants are the released templates, and their marked variants render
the same text (so their assistant masks are a reference for the released templates)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from chat_templates import MARKED, RELEASED, SHA256, sha256
from real_qwen import real_qwen_tokenizer

_TRL_COPIES = {
    "QWEN2_VL": "qwen2_5_vl.jinja",
    "QWEN2_5_INSTRUCT": "qwen2_5.jinja",
    "QWEN3": "qwen3.jinja",
    "QWEN3_VL": "qwen3_vl.jinja",
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_templates_match_their_published_digest(name: str) -> None:
    assert sha256(RELEASED[name]) == SHA256[name]
    spec = importlib.util.find_spec("trl")
    assert spec is not None, "trl (in the test extra) is missing"
    assert spec.submodule_search_locations
    copy = Path(next(iter(spec.submodule_search_locations))) / "chat_templates" / _TRL_COPIES[name]
    assert sha256(copy.read_text(encoding="utf-8")) == SHA256[name]


_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
_CONVERSATIONS: list[tuple[list[dict[str, Any]], Any]] = [
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "<think>sum</think>6"},
        ],
        None,
    ),
    (
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [_CALL, _CALL]},
            {"role": "tool", "content": "rain"},
            {"role": "tool", "content": "cold"},
            {"role": "assistant", "content": "Rainy and cold.", "tool_calls": [_CALL]},
            {"role": "tool", "content": "still rain"},
            {"role": "assistant", "content": "Still rainy."},
        ],
        _TOOLS,
    ),
]


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_marked_variants_render_the_released_text(name: str) -> None:
    tokenizer = real_qwen_tokenizer()
    for messages, tools in _CONVERSATIONS:
        texts = [
            tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=t)
            for t in (RELEASED[name], MARKED[name])
        ]
        assert texts[0] == texts[1]
        marked = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=MARKED[name],
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        assert sum(marked["assistant_masks"]) > 0
