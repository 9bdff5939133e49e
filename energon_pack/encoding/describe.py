"""Which encoder counts the tokens, as a record (for manifests and reports) and as one line (for
the command line): the template or ChatML, and the system prompt a sample without its own gets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from energon_pack.encoding.chatml import ConversationEncoder, SampleEncoder
from energon_pack.encoding.processor_encoder import ProcessorEncoder
from energon_pack.encoding.request_encoder import RequestEncoder
from energon_pack.encoding.template import TemplateEncoder

__all__ = ["encoding_line", "encoding_record"]

_SHOWN_PROMPT = 60
"""Most characters of a system prompt :func:`encoding_line` quotes."""


def encoding_record(encoder: SampleEncoder) -> dict[str, Any]:
    """What decides how ``encoder`` counts tokens, JSON-able: ``encoding`` (``"template"``,
    ``"chatml"``, ``"processor"`` or ``"request"``), ``system_prompt`` (what a sample without a
    system prompt of its own gets: ``system_prompt=``, else the template's default; None: none)
    and, for a template, ``chat_template_sha256`` and ``template_kwargs``; for a tokenizer that
    encodes requests itself, its ``tokenizer`` settings."""
    if isinstance(encoder, (ConversationEncoder, TemplateEncoder)):
        system = encoder.system_prompt
        if system is None:
            system = encoder.default_system_prompt
        if isinstance(encoder, ConversationEncoder):
            return {"encoding": "chatml", "system_prompt": system}
        encoding = "template"
    elif isinstance(encoder, ProcessorEncoder):
        system, encoding = encoder.system_prompt, "processor"
    elif isinstance(encoder, RequestEncoder):
        return {
            "encoding": "request",
            "tokenizer": encoder.family.settings().get("tokenizer"),
            "system_prompt": encoder.system_prompt,
        }
    else:
        raise ValueError(
            f"{type(encoder).__name__} is none of energon_pack's encoders; pass one that "
            "make_encoder() builds"
        )
    return {
        "encoding": encoding,
        "chat_template_sha256": encoder.template_sha256,
        "template_kwargs": encoder.template_kwargs,
        "system_prompt": system,
    }


def encoding_line(record: Mapping[str, Any]) -> str:
    """:func:`encoding_record` in words, e.g. ``chat template (sha256 0123456789ab), system
    prompt 'You are a helpful assistant.'`` or ``ChatML (no chat template), no system
    prompt``."""
    encoding = record.get("encoding")
    if encoding == "chatml":
        what = "ChatML (the built-in rule, no chat template)"
    elif encoding == "request":
        version = (record.get("tokenizer") or {}).get("version")
        what = f"the tokenizer's own request encoding (mistral-common {version})"
    else:
        owner = "the processor's chat template" if encoding == "processor" else "chat template"
        what = f"{owner} (sha256 {str(record.get('chat_template_sha256'))[:12]})"
        if record.get("template_kwargs"):
            what += f" with {record['template_kwargs']}"
    system = record.get("system_prompt")
    if system is None:
        return f"{what}, no system prompt"
    shown = system if len(system) <= _SHOWN_PROMPT else f"{system[:_SHOWN_PROMPT]}..."
    return f"{what}, system prompt {shown!r}"
