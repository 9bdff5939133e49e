"""A model of the user's architecture at a size a CPU runs in seconds: its config with every
layer type kept and the widths cut within the config's own constraints, random weights from a
seed, and a vocabulary cut to the ids that occur.

What is kept: the model class (so its attention, masks, rotary rule and vision tower are the
user's transformers code), one layer of each declared layer type (full, sliding-window, linear
attention; dense and MoE MLPs), the rope kind and the share of each mRoPE section, the media
geometry (patch, merge and image sizes, so media tokens match the processor). What is cut: the
number of layers, heads, hidden and MLP widths, experts, the sliding window (to a length the
samples cross), and the vocabulary: the ids that occur in the samples and the config's special
ids are renumbered ``0..n-1`` (:class:`Vocabulary`), so the logits stay small.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

HEAD_DIM = 32
"""Attention head width of the cut model (mRoPE sections are rescaled to it)."""
HEADS = 2
HIDDEN = HEADS * HEAD_DIM
VISION_HIDDEN = 32
AUDIO_HIDDEN = 32
EXPERTS = 4
WINDOW = 16
"""Sliding window of the cut model: short enough that a sample of the probe crosses it."""
MLA_ROPE_DIM = 8
MLA_NOPE_DIM = 8
"""Rotated and unrotated query/key widths of a multi-head latent attention head."""
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_SPECIAL_SUFFIXES = ("_token_id", "_token_index")


@dataclass(frozen=True)
class Vocabulary:
    """The ids the cut model knows: ``ids[i]`` is the tokenizer's id of model id ``i``."""

    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        table = torch.full((max(self.ids) + 1,), -1, dtype=torch.long)
        table[torch.tensor(self.ids)] = torch.arange(len(self.ids))
        object.__setattr__(self, "_table", table)

    def __len__(self) -> int:
        return len(self.ids)

    def model_id(self, token: int) -> int:
        """The cut model's id of the tokenizer's ``token``."""
        return int(self.to_model(torch.tensor([token]))[0])

    def to_model(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` (tokenizer ids; ``-100`` kept) renumbered for the cut model."""
        table: torch.Tensor = self._table  # type: ignore[attr-defined]
        ignore = input_ids < 0
        out = table[input_ids.clamp(min=0, max=len(table) - 1)]
        unknown = (out < 0) | (input_ids >= len(table))
        if bool(unknown[~ignore].any()):
            raise ValueError("an id outside the vocabulary of the cut model")
        return torch.where(ignore, input_ids, out)


def special_ids(config: Any) -> set[int]:
    """Every ``*_token_id`` / ``*_token_index`` of ``config`` and its sub-configs."""
    found: set[int] = set()
    for holder in _configs(config):
        for name, value in vars(holder).items():
            if not _special(name):
                continue
            values = value if isinstance(value, list) else [value]
            found.update(v for v in values if isinstance(v, int) and v >= 0)
    return found


UNCUT: dict[str, str] = {
    "gemma3n": (
        "its per-layer MLP widths and key-value sharing, its media ids at fixed vocabulary "
        "offsets and its timm vision tower"
    ),
}
"""Model types whose configs the cut does not handle yet, and what it would have to cut."""


def cut_config(config: Any, vocabulary: Vocabulary) -> Any:
    """A copy of ``config`` at the cut size (see the module docstring); a ValueError naming
    the model type for one of :data:`UNCUT`."""
    why = UNCUT.get(str(config.model_type))
    if why is not None:
        raise ValueError(
            f"verify cannot cut a {config.model_type} model to CPU size yet ({why}); its "
            "packing is proven on a tiny model in energon_pack's tests (docs/families.md)"
        )
    out = copy.deepcopy(config)
    for holder in _configs(out):
        _renumber_special(holder, vocabulary)
    text = out.get_text_config()
    _cut_text(text, len(vocabulary))
    vision = getattr(out, "vision_config", None)
    if vision is not None:
        _cut_vision(vision, text_hidden=HIDDEN)
    audio = getattr(out, "audio_config", None)
    if audio is not None:
        _cut_audio(audio)
    return out


def tiny_model(
    cut: Any,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    attn_implementation: str = "eager",
) -> Any:
    """The model of the cut config ``cut`` (:func:`cut_config`), built with the class
    transformers picks for it, with random weights from ``seed``, in training mode."""
    model_class = model_class_of(cut)
    torch.manual_seed(seed)
    model = model_class._from_config(cut, attn_implementation=attn_implementation)
    _wake_zero_matrices(model, seed)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel on CPU
    return model.to(dtype).train()


def _wake_zero_matrices(model: Any, seed: int) -> None:
    """Weight matrices a model starts at zero (e.g. Gemma 3's image projection) get seeded
    values, so every path, media included, carries a signal and a gradient."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and not bool(parameter.any()):
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.copy_(noise / parameter.shape[-1] ** 0.5)


def model_class_of(config: Any) -> Any:
    """The transformers class that trains ``config`` on next-token loss: image-text-to-text
    where it has a vision tower, else causal LM, else multimodal LM (an audio-text model);
    each only where its ``forward`` takes ``labels``."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForMultimodalLM,
    )

    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM, AutoModelForMultimodalLM):
        mapping = auto._model_mapping
        if type(config) in mapping:
            found: Any = mapping[type(config)]
            if "labels" in inspect.signature(found.forward).parameters:
                return found
    raise ValueError(
        f"config.json's model_type {config.model_type!r} has no causal-LM, "
        "image-text-to-text or multimodal-LM class whose forward takes labels in this "
        "transformers; verify checks models that train on next-token loss"
    )


def layer_types_of(config: Any) -> list[str]:
    """The text model's type of each layer (``"full_attention"`` where none is declared)."""
    return layer_types_of_text(config.get_text_config())


def _configs(config: Any) -> list[Any]:
    """``config`` and the sub-configs it holds."""
    found = [config]
    for value in vars(config).values():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            found.extend(_configs(value))
    return found


@contextmanager
def tokenizer_numbering(config: Any, vocabulary: Vocabulary) -> Iterator[None]:
    """Inside, the special ids of the cut ``config`` (and its sub-configs) are the tokenizer's
    again (``vocabulary.ids``), for code that compares them with tokenizer ids (a family's
    rope positions, built before the ids are renumbered); restored on the way out."""
    saved = []
    for holder in _configs(config):
        for name, value in list(vars(holder).items()):
            if _special(name) and isinstance(value, int) and 0 <= value < len(vocabulary):
                saved.append((holder, name, value))
                setattr(holder, name, vocabulary.ids[value])
    try:
        yield
    finally:
        for holder, name, value in saved:
            setattr(holder, name, value)


def _special(name: str) -> bool:
    """Whether a config attribute holds a special token's id (``pad_token_id`` and
    ``eos_token_id`` among them)."""
    return name.endswith(_SPECIAL_SUFFIXES)


def _renumber_special(holder: Any, vocabulary: Vocabulary) -> None:
    for name, value in list(vars(holder).items()):
        if not _special(name):
            continue
        if isinstance(value, int) and value >= 0:
            setattr(holder, name, vocabulary.model_id(value))
        elif isinstance(value, list):
            setattr(holder, name, [vocabulary.model_id(v) for v in value if isinstance(v, int)])


def _layer_count(config: Any) -> int:
    for key in _LAYER_COUNT_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return 1


def _set(config: Any, name: str, value: Any) -> None:
    """Set ``name`` only where the config has it (the cut never adds settings)."""
    if getattr(config, name, None) is not None:
        setattr(config, name, value)


def _cut_text(text: Any, vocab_size: int) -> None:
    types = layer_types_of_text(text)
    kept = list(dict.fromkeys(types))  # one layer of each type, in order of first use
    moe = _has_dense_and_moe(text)
    layers = max(len(kept), 2 if moe else 1)
    kept += [kept[-1]] * (layers - len(kept))
    for key in _LAYER_COUNT_KEYS:
        _set(text, key, layers)
    if getattr(text, "layer_types", None):
        text.layer_types = kept
    rotary = _rotary_share(text)
    rope_head = getattr(text, "qk_rope_head_dim", None)
    rope_is_head = rope_head is not None and getattr(text, "head_dim", None) == rope_head
    text.vocab_size = vocab_size
    text.hidden_size = HIDDEN
    kv_heads = getattr(text, "num_key_value_heads", None)
    grouped = isinstance(kv_heads, int) and kv_heads < getattr(text, "num_attention_heads", 0)
    text.num_attention_heads = HEADS
    _set(text, "num_key_value_heads", 1 if grouped else HEADS)  # grouped-query stays grouped
    _set(text, "head_dim", HEAD_DIM)
    _set(text, "query_pre_attn_scalar", HEAD_DIM)
    _set(text, "intermediate_size", 2 * HIDDEN)
    _set(text, "moe_intermediate_size", HIDDEN // 2)
    _set(text, "shared_expert_intermediate_size", HIDDEN // 2)
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        _set(text, key, EXPERTS)
    top_k = getattr(text, "num_experts_per_tok", None)
    if isinstance(top_k, int):
        text.num_experts_per_tok = min(top_k, 2)
    _set(text, "n_group", 1)
    _set(text, "topk_group", 1)
    if isinstance(getattr(text, "first_k_dense_replace", None), int) and moe:
        text.first_k_dense_replace = 1
    if getattr(text, "mlp_only_layers", None):
        text.mlp_only_layers = [0]
    window = getattr(text, "sliding_window", None)
    if isinstance(window, int):
        text.sliding_window = min(window, WINDOW)
    for key, value in (
        ("linear_key_head_dim", 8),
        ("linear_value_head_dim", 8),
        ("linear_num_key_heads", 2),
        ("linear_num_value_heads", 4),
        ("kv_lora_rank", 16),
        ("q_lora_rank", 16),
        ("qk_rope_head_dim", MLA_ROPE_DIM),
        ("qk_nope_head_dim", MLA_NOPE_DIM),
        ("v_head_dim", 16),
    ):
        _set(text, key, value)
    if rope_is_head:  # multi-head latent attention rotates a head_dim of qk_rope_head_dim
        text.head_dim = MLA_ROPE_DIM
    _set(text, "qk_head_dim", MLA_ROPE_DIM + MLA_NOPE_DIM)
    _rescale_mrope(text, rotary)


def layer_types_of_text(text: Any) -> list[str]:
    """A text config's type of each layer (``"full_attention"`` where none is declared)."""
    declared = getattr(text, "layer_types", None)
    return list(declared) if declared else ["full_attention"] * _layer_count(text)


def _has_dense_and_moe(text: Any) -> bool:
    dense_first = getattr(text, "first_k_dense_replace", None)
    return bool(getattr(text, "mlp_only_layers", None)) or (
        isinstance(dense_first, int) and dense_first > 0
    )


def _rotary_share(text: Any) -> float:
    """The share of each head that rotates (``partial_rotary_factor``, 1 where unset)."""
    rope = getattr(text, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    factor = factor or getattr(text, "partial_rotary_factor", None) or 1.0
    return float(factor)


def _rescale_mrope(text: Any, rotary: float) -> None:
    """mRoPE sections summed to the cut head's rotary half, each keeping its share (>= 1)."""
    rope = getattr(text, "rope_parameters", None)
    if not isinstance(rope, dict) or not rope.get("mrope_section"):
        return
    sections = [int(s) for s in rope["mrope_section"]]
    total = max(int(HEAD_DIM * rotary) // 2, len(sections))
    shares = [s * total / sum(sections) for s in sections]
    cut = [max(1, int(share)) for share in shares]
    by_remainder = sorted(range(len(cut)), key=lambda i: shares[i] - int(shares[i]), reverse=True)
    index = 0
    while sum(cut) < total:
        cut[by_remainder[index % len(cut)]] += 1
        index += 1
    while sum(cut) > total:
        largest = max(range(len(cut)), key=lambda i: cut[i])
        cut[largest] -= 1
    text.rope_parameters = {**rope, "mrope_section": cut}


def _cut_vision(vision: Any, *, text_hidden: int) -> None:
    """Two blocks, small widths; patch, merge and image sizes as they are."""
    for key in ("depth", "num_hidden_layers"):
        _set(vision, key, 2)
    _set(vision, "num_heads", 2)
    _set(vision, "num_attention_heads", 2)
    _set(vision, "num_key_value_heads", 2)
    _set(vision, "intermediate_size", 2 * VISION_HIDDEN)
    _set(vision, "head_dim", VISION_HIDDEN // 2)
    if getattr(vision, "embed_dim", None) is not None:
        vision.embed_dim = VISION_HIDDEN  # Qwen2-VL: hidden_size is the merger's output
        vision.hidden_size = text_hidden
    else:
        _set(vision, "hidden_size", VISION_HIDDEN)
    _set(vision, "out_hidden_size", text_hidden)
    if getattr(vision, "fullatt_block_indexes", None):
        vision.fullatt_block_indexes = [1]
    if getattr(vision, "deepstack_visual_indexes", None):
        vision.deepstack_visual_indexes = [0]


def _cut_audio(audio: Any) -> None:
    """One block, small widths (a Whisper-style encoder's names), the feed-forward width the
    same multiple of the model width as before (Voxtral's projector regroups the encoder's
    outputs by it); the mel bins and the source positions (the audio window) as they are."""
    for key in ("encoder_layers", "num_hidden_layers"):
        _set(audio, key, 1)
    width, feed_forward = getattr(audio, "d_model", None), getattr(audio, "encoder_ffn_dim", None)
    multiple = feed_forward // width if width and feed_forward and feed_forward % width == 0 else 2
    _set(audio, "d_model", AUDIO_HIDDEN)
    _set(audio, "encoder_attention_heads", 2)
    _set(audio, "encoder_ffn_dim", multiple * AUDIO_HIDDEN)
    _set(audio, "output_dim", HIDDEN)  # an Omni audio encoder projects to the text width
    _set(audio, "downsample_hidden_size", 8)
