"""A tiny Voxtral built locally (no downloads), for the tests that run in the mistral child of
:mod:`torchvision_child` (``mistral=True``: mistral-common is importable there only).

:func:`write_tekken` writes a tekken tokenizer file: byte-level BPE with a few merges, the
released special-token ranks (``[AUDIO]`` 24, ``[BEGIN_AUDIO]`` 25, ``[TRANSCRIBE]`` 34) and an
audio section of 16 kHz audio padded to 30 s chunks of 375 tokens, as the released tokenizer's.
:func:`processor` is transformers' own ``VoxtralProcessor`` on it, with Whisper's feature
extractor at :data:`MELS` mel bins.
"""

from __future__ import annotations

import base64
import json
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

RATE = 16_000
MELS = 16
SPECIALS = 100
"""Special-token ranks before the byte vocabulary (the released file has 1000)."""
_NAMED = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
]
_SPECIAL_NAMES = [
    *_NAMED,
    *(f"<SPECIAL_{rank}>" for rank in range(20, 24)),
    "[AUDIO]",
    "[BEGIN_AUDIO]",
    *(f"<SPECIAL_{rank}>" for rank in range(26, 34)),
    "[TRANSCRIBE]",
]
_MERGES = [b"th", b"he", b"in", b"an", b" t", b"er", b"the", b" the", b"wh", b"at"]
_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def write_tekken(folder: Path) -> Path:
    """``folder/tekken.json``: see the module docstring."""
    vocab = [
        {"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": None}
        for i in range(256)
    ]
    vocab += [
        {"rank": 256 + i, "token_bytes": base64.b64encode(m).decode(), "token_str": m.decode()}
        for i, m in enumerate(_MERGES)
    ]
    data = {
        "config": {
            "pattern": _PATTERN,
            "num_vocab_tokens": len(vocab),
            "default_vocab_size": len(vocab) + SPECIALS,
            "default_num_special_tokens": SPECIALS,
            "version": "v7",
        },
        "vocab": vocab,
        "special_tokens": [
            {"rank": rank, "token_str": name, "is_control": True}
            for rank, name in enumerate(_SPECIAL_NAMES)
        ],
        "audio": {
            "sampling_rate": RATE,
            "frame_rate": 12.5,
            "chunk_length_s": 30.0,
            "audio_encoding_config": {"num_mel_bins": MELS, "hop_length": 160, "window_size": 400},
        },
        "version": 1,
        "type": "Tekken",
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tekken.json"
    path.write_text(json.dumps(data))
    return path


@cache
def tekken_path() -> Path:
    """A tekken file for this process (in a folder that lives as long as the process)."""
    return write_tekken(Path(tempfile.mkdtemp(prefix="voxtral-tekken-")))


def vocab_size() -> int:
    return 256 + len(_MERGES) + SPECIALS


@cache
def processor(mode: str = "test", mels: int = MELS) -> Any:
    """transformers' ``VoxtralProcessor`` on the tiny tokenizer (validating requests in
    ``mode``: ``"test"`` as ``from_pretrained`` loads it, ``"finetuning"`` to take
    conversations that end with the assistant's reply) and Whisper's feature extractor at
    ``mels`` mel bins (the released checkpoints': 128)."""
    from transformers import VoxtralProcessor, WhisperFeatureExtractor
    from transformers.tokenization_mistral_common import MistralCommonBackend

    tokenizer = MistralCommonBackend(tokenizer_path=str(tekken_path()), mode=mode)
    return VoxtralProcessor(WhisperFeatureExtractor(feature_size=mels), tokenizer)


def tiny_model() -> Any:
    """A ``VoxtralForConditionalGeneration`` with a 1-layer audio encoder of width 16 on
    :data:`MELS` mel bins (30 s chunks: 1500 positions, 375 outputs each) and a 2-layer Llama
    text model, in float64."""
    import torch
    from family_kit import seeded
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration

    config = VoxtralConfig(
        audio_config={
            "num_mel_bins": MELS,
            "hidden_size": 16,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "max_source_positions": 1500,
        },
        text_config={
            "vocab_size": vocab_size(),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rope_theta": 10000.0,
            "pad_token_id": 11,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        audio_token_id=24,
        attn_implementation="sdpa",
    )
    model = seeded(lambda: VoxtralForConditionalGeneration(config))
    return model.to(torch.float64)
