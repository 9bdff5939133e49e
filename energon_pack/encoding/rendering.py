"""One sample through a chat template and a fast tokenizer, failures named by the sample:
what the template-driven encoders share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from energon_pack.encoding.bounded import BoundedTemplate, RenderLimitError
from energon_pack.encoding.chatml import _why_unencodable
from energon_pack.media import MediaError

__all__ = ["render_sample", "tokenise_text", "with_system"]

Span = tuple[int, int]


def with_system(
    messages: list[dict[str, Any]], own: str | None, default: str | None
) -> list[dict[str, Any]]:
    """``messages`` with a first system message: the sample's ``own`` system prompt, else
    ``default`` when the conversation has no system turn first (plain text either way)."""
    system = own if own is not None or messages[0]["role"] == "system" else default
    return messages if system is None else [{"role": "system", "content": system}, *messages]


def render_sample(
    template: BoundedTemplate,
    key: str,
    messages: list[dict[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    variables: Mapping[str, Any],
    track_generation: bool,
    name: str,
) -> tuple[str, list[Span]]:
    """The text ``template`` renders for the sample ``key`` (and its ``{% generation %}``
    spans when ``track_generation``); a template error or a render over a bound is a
    ``bad_sample`` :class:`~energon_pack.media.MediaError` naming the sample and ``name`` (the
    template as errors call it)."""
    try:
        return template.render(
            messages, tools=tools, variables=variables, track_generation=track_generation
        )
    except MemoryError:
        raise
    except RenderLimitError as error:
        raise MediaError(
            key, "json", "bad_sample", f"{name} went over a render bound: {error}"
        ) from None
    except Exception as error:  # jinja errors, raise_exception(...) in templates, ...
        raise MediaError(
            key,
            "json",
            "bad_sample",
            f"{name} cannot render or tokenise the conversation: "
            f"{_why_unencodable(_text_of(messages), error)}; fix the sample or the template",
        ) from error


def tokenise_text(
    backend: Any, key: str, text: str, *, add_special_tokens: bool
) -> tuple[list[int], list[Span]]:
    """Ids and character offsets of ``text`` through a fast tokenizer's ``backend``; text it
    cannot take (a lone surrogate, ...) is a ``bad_sample`` naming the sample."""
    try:
        encoding = backend.encode(text, add_special_tokens=add_special_tokens)
    except MemoryError:
        raise
    except Exception as error:
        raise MediaError(
            key,
            "json",
            "bad_sample",
            f"the rendered conversation cannot be tokenised: "
            f"{_why_unencodable(text, error)}; fix or drop the sample",
        ) from error
    return list(encoding.ids), list(encoding.offsets)


def _text_of(value: Any) -> str:
    """Every string in ``value`` (messages, their parts), joined."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return "".join(_text_of(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return "".join(_text_of(item) for item in value)
    return ""
