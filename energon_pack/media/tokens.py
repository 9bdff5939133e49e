"""A medium's vision tokens: the one place where a probed medium becomes token ids.

An image, and a video without timestamps, is one block ``<|vision_start|>`` + pads +
``<|vision_end|>``. A video with timestamps (``video_rule="qwen3_vl"``) is one block per
temporal patch, each preceded by the text ``<{t:.1f} seconds>``, as ``Qwen3VLProcessor`` of
transformers 4.57 (the release the Qwen3-VL checkpoints came with) and 5.25 write it: the blocks
replace the template's ``<|vision_start|><|video_pad|><|vision_end|>`` whole. transformers 5.0 to
5.24 keep that outer pair around the blocks; ``MediaConfig(video_outer_block=True)`` writes that
form.

The processor tokenises the expanded text whole, so in the 4.57 form the first timestamp is
tokenised together with the text before the medium (``"Watch this: <0.3 seconds>"`` may merge
``" <"``): :func:`vision_parts` gives that text apart for the encoders to join.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, SupportsIndex

from energon_pack.media.assembly import MediaItem
from energon_pack.media.config import MediaConfig

__all__ = [
    "SpecialTokens",
    "VisionIds",
    "special_token_id",
    "timestamp_text",
    "vision_block",
    "vision_parts",
    "vision_tokens",
]


class SpecialTokens(Protocol):
    """What reading a special token's id needs of a tokenizer: an HF tokenizer's
    ``convert_tokens_to_ids`` (which also takes a list, and then returns one)."""

    def convert_tokens_to_ids(self, tokens: str, /) -> int | list[int]: ...


def special_token_id(tokenizer: SpecialTokens, token: str) -> int:
    """The id ``tokenizer`` gives the special token ``token``; ValueError where it gives none."""
    found: object = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, SupportsIndex) or isinstance(found, bool):  # numpy's ints index
        raise ValueError(
            f"{type(tokenizer).__name__} gives the special token {token!r} no id (got "
            f"{found!r}); pass a tokenizer that has it, or add it with "
            f"tokenizer.add_special_tokens({{'additional_special_tokens': [{token!r}]}})"
        )
    return found.__index__()


@dataclass(frozen=True)
class VisionIds:
    """The ids of a tokenizer's vision tokens."""

    start: int
    end: int
    image_pad: int
    video_pad: int

    @classmethod
    def of(cls, tokenizer: SpecialTokens) -> VisionIds:
        """The ids ``tokenizer`` gives ``<|vision_start|>``, ``<|vision_end|>`` and the pads."""
        tokens = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
        return cls(*(special_token_id(tokenizer, token) for token in tokens))

    def pad(self, kind: Literal["image", "video"]) -> int:
        """The pad id of a medium of ``kind``."""
        return self.image_pad if kind == "image" else self.video_pad


def vision_block(item: MediaItem, ids: VisionIds) -> list[int]:
    """One block for the whole medium, as the Qwen2-VL / Qwen2.5-VL processors expand it:
    ``<|vision_start|>``, one pad per merged patch (``item.tokens`` = ``t*h*w / merge_size**2``
    of the probed grid), ``<|vision_end|>``."""
    return [ids.start, *[ids.pad(item.visual_kind)] * item.tokens, ids.end]


def timestamp_text(seconds: float) -> str:
    """The text before a temporal patch's block: ``<{seconds:.1f} seconds>``."""
    return f"<{seconds:.1f} seconds>"


def vision_parts(
    item: MediaItem, ids: VisionIds, text: Callable[[str], list[int]], cfg: MediaConfig
) -> tuple[str, list[int]]:
    """``item``'s vision tokens as ``(lead, ids)``: ``lead`` is the text they begin with that
    the processor tokenises together with the text before the medium (the first timestamp of a
    timestamped video in the 4.57 form, else ``""``), ``ids`` the tokens after it (the other
    timestamps tokenised by ``text``, each on its own between special tokens)."""
    if item.timestamps is None:
        return "", vision_block(item, ids)
    t, h, w = item.grid_thw
    if len(item.timestamps) != t:
        raise ValueError(
            f"medium {item.member!r} has {len(item.timestamps)} timestamps for a grid of {t} "
            "temporal patches; probe it with the config it is encoded with"
        )
    block = [ids.start, *[ids.video_pad] * (h * w // cfg.merge_size**2), ids.end]
    first, *rest = item.timestamps
    out = block.copy()
    for seconds in rest:
        out += text(timestamp_text(seconds)) + block
    if cfg.video_outer_block:  # the first timestamp follows the outer <|vision_start|>
        return "", [ids.start, *text(timestamp_text(first)), *out, ids.end]
    return timestamp_text(first), out


def vision_tokens(
    item: MediaItem, ids: VisionIds, text: Callable[[str], list[int]], cfg: MediaConfig
) -> list[int]:
    """The token ids of ``item``: its vision block(s) with ``t*h*w / merge_size**2`` pads in
    all (``merge_size`` of ``cfg``), timestamps tokenised by ``text`` each on its own (the
    first one too: an encoder joins it to the text before, see :func:`vision_parts`)."""
    lead, out = vision_parts(item, ids, text, cfg)
    return [*text(lead), *out] if lead else out
