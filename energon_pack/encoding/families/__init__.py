"""Processor-backed model families: each transformers processor a family of its own, built
from the processor instance (its settings, never class defaults).

:func:`processor_family` builds the family of a processor; :data:`PROCESSOR_FAMILIES` names the
processor classes served, by family. The Qwen processors are not here: their families are the
presets of :mod:`energon_pack.encoding.family`, which read the processor's settings too.
"""

from __future__ import annotations

import importlib
from typing import Any

from energon_pack.encoding.families.base import (
    TEXT_KEYS,
    PackingRule,
    ProcessorFamily,
    delimited_spans,
)

__all__ = [
    "PROCESSOR_FAMILIES",
    "TEXT_KEYS",
    "PackingRule",
    "ProcessorFamily",
    "delimited_spans",
    "family_class",
    "processor_family",
    "served_processors",
]

PROCESSOR_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma3": ("Gemma3Family", ("Gemma3Processor",)),
    "gemma3n": ("Gemma3nFamily", ("Gemma3nProcessor",)),
    "gemma4": ("Gemma4Family", ("Gemma4Processor",)),
    "pixtral": ("PixtralFamily", ("PixtralProcessor",)),
    "glm4v": ("Glm4vFamily", ("Glm4vProcessor",)),
    "internvl": ("InternVLFamily", ("InternVLProcessor",)),
    "llava_onevision": ("LlavaOnevisionFamily", ("LlavaOnevisionProcessor",)),
    "idefics3": ("Idefics3Family", ("Idefics3Processor", "SmolVLMProcessor")),
    "kimi_k25": ("KimiK25Family", ("Kimi_K25Processor",)),
    "qwen2_audio": ("Qwen2AudioFamily", ("Qwen2AudioProcessor",)),
    "qwen2_5_omni": ("Qwen25OmniFamily", ("Qwen2_5OmniProcessor",)),
    "qwen3_omni": ("Qwen3OmniFamily", ("Qwen3OmniMoeProcessor",)),
    "nemotron_h_omni": ("NemotronHOmniFamily", ("NemotronH_Omni_Reasoning_V3Processor",)),
    "voxtral": ("VoxtralFamily", ("VoxtralProcessor",)),
}
"""Family module name -> (its class, the transformers processor classes it serves)."""

_BY_PROCESSOR = {
    processor: module for module, (_, names) in PROCESSOR_FAMILIES.items() for processor in names
}


def family_class(processor_class: str) -> type[ProcessorFamily] | None:
    """The family class serving the transformers processor class ``processor_class`` (a
    subclass's name counts as its own), or None."""
    module = _BY_PROCESSOR.get(processor_class)
    if module is None:
        return None
    loaded = importlib.import_module(f"energon_pack.encoding.families.{module}")
    cls: type[ProcessorFamily] = getattr(loaded, PROCESSOR_FAMILIES[module][0])
    return cls


def processor_family(processor: Any) -> ProcessorFamily | None:
    """The family of a transformers processor instance (by its class or the first served
    class it derives from), or None when no family here serves it."""
    for cls in type(processor).__mro__:
        found = family_class(cls.__name__)
        if found is not None:
            return found(processor)
    return None


def served_processors() -> list[str]:
    """Every processor class name served here, sorted."""
    return sorted(_BY_PROCESSOR)
