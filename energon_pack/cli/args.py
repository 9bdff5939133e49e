"""Argument types of the ``energon-pack`` flags (each error names the flag's rule) and the flag
tables that the parser and the commands share.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from energon_pack.packing.vision_budget import VisionBudget


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None


def positive_int(text: str) -> int:
    value = integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    value = number(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def share(text: str) -> float:
    """A number in [0, 1]."""
    value = number(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def rows_or_none(text: str) -> float | None:
    """A positive number of rows, or ``none``."""
    return None if text.lower() == "none" else positive_float(text)


def output_file(text: str) -> Path:
    """A file to write: not a directory, in an existing directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; name the file to write")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"{path.parent} is not an existing directory; create it or choose another path"
        )
    return path


def int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    """Comma-separated names (at least one)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


TOKENIZER_HELP = (
    "transformers tokenizer directory or cached name (AutoTokenizer.from_pretrained(PATH), "
    "loaded offline, never downloaded) for every token count; default: the built-in byte "
    "tokenizer"
)

CHAT_TEMPLATE_HELP = (
    "Jinja chat template file set as the tokenizer's chat_template (e.g. the model's "
    "chat_template.jinja), for a --tokenizer without one or to train with another; without "
    "a template the built-in ChatML rule counts, with a warning (the encoding is printed)"
)

FAMILY_HELP = (
    "model family preset (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, ...), a "
    "model directory with its processor JSON files, or a directory written by "
    "processor.save_pretrained (Gemma 3/4, Pixtral, GLM-4V, InternVL, LLaVA-OneVision, "
    "Idefics3/SmolVLM, Kimi K2.5: the processor's tokenizer and pixels): the media settings "
    "to use"
)


# check-config flags: (flag, TrainingSetup field, type); type None marks an on/off flag.
CONFIG_FLAGS: tuple[tuple[str, str, Callable[[str], int] | type[str] | None], ...] = (
    ("--seq-length", "seq_length", positive_int),
    ("--mode", "mode", str),
    ("--mbs", "micro_batch_size", positive_int),
    ("--gbs", "global_batch_size", positive_int),
    ("--dp", "data_parallel_size", positive_int),
    ("--tp", "tp", positive_int),
    ("--cp", "cp", positive_int),
    ("--sp", "sp", None),
    ("--pp", "pp", positive_int),
    ("--eval-cp", "eval_cp", positive_int),
    ("--mtp", "mtp", non_negative_int),
    ("--cuda-graphs", "cuda_graphs", None),
    ("--cuda-graph-scope", "cuda_graph_scope", str),
    ("--calculate-per-token-loss", "calculate_per_token_loss", None),
    ("--average-in-collective", "average_in_collective", None),
    ("--pad-to-max-length", "pad_to_max_length", None),
    ("--pad-cu-seqlens", "pad_cu_seqlens", None),
    ("--packing-buffer-size", "packing_buffer_size", non_negative_int),
    ("--finetuning", "finetuning", None),
    ("--kernel-multiple", "kernel_multiple", positive_int),
    ("--max-vision-tokens", "max_vision_tokens", positive_int),
    ("--max-media", "max_media", positive_int),
    ("--vision-balance", "vision_balance", None),
)


def vision_budget(args: argparse.Namespace) -> VisionBudget:
    """The vision budget a tune's flags give (``--max-media``, ``--vision-balance``,
    ``--vision-share``; the ``--max-vision-tokens`` caps are swept one run each)."""
    return VisionBudget(
        max_media=args.max_media, balance=args.vision_balance, vision_share=args.vision_share
    )
