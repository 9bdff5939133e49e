"""Seeded, varied conversations over real local text, in every input form the project reads.

The text is real English prose and code: the paragraphs of Python's own documentation topics
(``pydoc_data.topics``, in the standard library), cut at random points, with a few fixed
multilingual and whitespace-edge strings mixed in. A :class:`Case` holds one conversation twice:
``messages`` / ``tools`` as transformers' ``apply_chat_template`` takes them (the reference),
and ``sample`` as the project reads it (a chat row, a ShareGPT row or a native ``json`` member,
chosen at random). Cases cover system prompts, multi-turn talks, think blocks (in the content
and as ``reasoning_content``), tool use (``tools=``, ``tool_calls`` with dict and string
arguments, consecutive ``tool`` turns) and, with ``media=True``, image placeholders.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass, field
from pydoc_data.topics import topics
from typing import Any

EDGE_TEXTS = (
    "Wie geht's? Très bien, merci.",
    "日本語のテキストと中文文本。",
    "emoji 🦊🐕 and a flag 🇳🇴",
    "\n\nleading newlines",
    "trailing newlines\n\n",
    "  indented\n\tand tabbed",
    "a literal <think> tag and </think> in a question",
    "```python\nprint('hi')\n```",
)
TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the Python documentation.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
)


@dataclass
class Case:
    """One conversation: the reference form and the sample form (see the module docstring)."""

    key: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    sample: dict[str, Any]
    images: list[bytes] = field(default_factory=list)


@functools.cache
def paragraphs() -> tuple[str, ...]:
    """Every non-empty paragraph of the Python documentation topics."""
    return tuple(
        part.strip()
        for text in topics.values()
        for part in re.split(r"\n\s*\n", text)
        if part.strip()
    )


def _text(rng: random.Random) -> str:
    if rng.random() < 0.12:
        return rng.choice(EDGE_TEXTS)
    pool = paragraphs()
    text = pool[rng.randrange(len(pool))]
    if rng.random() < 0.3:
        text += "\n\n" + pool[rng.randrange(len(pool))]
    if len(text) > 600 and rng.random() < 0.7:
        start = rng.randrange(len(text) - 400)
        text = text[start : start + rng.randrange(50, 400)]
    return text


def _assistant(rng: random.Random, think: bool) -> dict[str, Any]:
    answer = _text(rng)
    roll = rng.random()
    if think and roll < 0.25:
        return {"role": "assistant", "content": f"<think>\n{_text(rng)}\n</think>\n\n{answer}"}
    if think and roll < 0.35:
        return {"role": "assistant", "content": answer, "reasoning_content": _text(rng)}
    return {"role": "assistant", "content": answer}


def _call(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.5:
        name, arguments = "get_weather", {"city": rng.choice(["Oslo", "Lyon", "Kyoto"])}
    else:
        name, arguments = "search_docs", {"query": _text(rng)[:40]}
    value: Any = json.dumps(arguments) if rng.random() < 0.3 else arguments
    return {"type": "function", "function": {"name": name, "arguments": value}}


def _tool_exchange(rng: random.Random) -> list[dict[str, Any]]:
    calls = [_call(rng) for _ in range(rng.choice([1, 1, 2]))]
    content = _text(rng)[:80] if rng.random() < 0.4 else ""
    out: list[dict[str, Any]] = [{"role": "assistant", "content": content, "tool_calls": calls}]
    out += [{"role": "tool", "content": _text(rng)[:120]} for _ in calls]
    return out


def conversation(
    rng: random.Random, *, tools: bool = True, think: bool = True, media: bool = False
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int]:
    """Messages (string content, or typed parts where an image stands), tools, image count."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": _text(rng)})
    images = 0
    use_tools = tools and rng.random() < 0.25
    for turn in range(rng.choice([1, 1, 2, 3])):
        question = _text(rng)
        if media and rng.random() < 0.5:
            parts = [{"type": "image"}, {"type": "text", "text": question}]
            if rng.random() < 0.3:
                parts.reverse()
            messages.append({"role": "user", "content": parts})
            images += 1
        else:
            messages.append({"role": "user", "content": question})
        if use_tools and turn == 0:
            messages += _tool_exchange(rng)
        messages.append(_assistant(rng, think))
    return messages, list(TOOLS) if use_tools else None, images


def _sharegpt(message: dict[str, Any]) -> dict[str, Any]:
    """A message in ShareGPT form: typed parts become one string with ``<image>`` placeholders."""
    role = {"user": "human", "assistant": "gpt"}.get(message["role"], message["role"])
    content = message["content"]
    if isinstance(content, list):
        content = "".join(part["text"] if part["type"] == "text" else "<image>" for part in content)
    extra = {k: v for k, v in message.items() if k not in ("role", "content")}
    return {"from": role, "value": content, **extra}


def _sample(
    rng: random.Random,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    images: list[bytes],
) -> dict[str, Any]:
    form = rng.choice(["messages", "sharegpt", "native"])
    if form == "native":
        names = [f"{index}.png" for index in range(len(images))]
        meta = {"conversations": [_sharegpt(m) for m in messages], "tools": tools, "media": names}
        return {"json": meta, **dict(zip(names, images, strict=True))}
    row: dict[str, Any] = (
        {"messages": messages}
        if form == "messages"
        else {"conversations": [_sharegpt(m) for m in messages]}
    )
    if images:
        row["images"] = images
    if tools is not None:
        row["tools"] = tools
    return row


def cases(
    count: int,
    seed: int = 0,
    *,
    tools: bool = True,
    think: bool = True,
    media: bool = False,
    image: bytes | None = None,
) -> list[Case]:
    """``count`` seeded cases (see the module docstring); media cases use ``image``'s bytes."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        messages, functions, images = conversation(rng, tools=tools, think=think, media=media)
        if images and image is None:
            raise ValueError("media=True needs image= (the bytes of an image file)")
        payload = [image] * images if image is not None else []
        sample = _sample(rng, messages, functions, payload)
        out.append(Case(f"case{seed}-{index}", messages, functions, sample, payload))
    return out
