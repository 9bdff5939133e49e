"""The vision budget of a packed row: caps on the vision tokens and media it holds, and the balance
rule that keeps each row's vision tokens near the stream's mean. Pure Python, no I/O, no torch.

A row's *vision tokens* are the image/video pad tokens its samples put in ``input_ids`` (known
from the media probe, before any decode); its *media* are its images plus videos. Both packers
(:class:`~energon_pack.OnlineBinPacker`, and through it the Energon task encoder, and the
collator) take a :class:`VisionBudget`.

Which candidates make a row within the budget is a chooser's decision
(:mod:`~energon_pack.packing.choosers`). With caps, the fullest row by tokens is walked back
never past a cap. With ``balance``, each row aims at the *target* (the stream's vision tokens per
token so far, starting from ``vision_share`` where it is known, times the row capacity):
media-carrying samples are picked by their vision tokens and the rest of the row is filled with
light ones (text-only, or little vision per token). A full row leaves early only if it is at
most :data:`BALANCE_SLACK` below and :data:`BALANCE_TOLERANCE` above its target (and, without a
``vision_share``, only once the packer has read :data:`WARMUP_ROWS` rows' worth of tokens); a
sample that alone passes that tolerance leads a row of its own, topped up with light samples (a
sample cannot be split). Rows that must leave (full buffer, a ``max_wait`` due, the end of the
stream) take the nearest they find.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from energon_pack.packing.bins import Overlong

BALANCE_TOLERANCE = 0.05
"""With ``balance``: how far above its target a row's vision tokens may be (a row above the mean
delays the whole step)."""
KNOWN_SHARE_ROWS = 16
"""With ``vision_share``: how many rows' worth of tokens the known share counts as beside the
tokens a packer has seen (the target starts at it, and the stream's own share takes over as the
packer sees more: a rank's first rows no longer follow the few samples its buffer holds)."""
BALANCE_SLACK = 0.15
"""With ``balance``: how far below its target a full row may be and still leave early (one
below only lowers the step's mean)."""
WARMUP_ROWS = 8
"""With ``balance`` and no ``vision_share``: how many rows' worth of tokens a packer reads before
a row may leave early. Its target is the share it has seen, and over fewer tokens that share
follows the few images it happened to read (the targets of data-parallel ranks then differ most);
rows that must leave (full buffer, a ``max_wait`` due, the end of the stream) still leave."""

VISION_FIX = (
    "raise the cap, lower the media's resolution or frame count (MediaConfig max_pixels, "
    "video_max_frames), or pass VisionBudget(over_cap='skip') (or overlong='skip') to count and "
    "skip such samples"
)
"""The fix a sample over a vision cap names (after :meth:`VisionBudget.excess`)."""


def _check_cap(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(
            f"{name} must be None (no cap) or an int >= 1, got {value!r}; pass e.g. {name}="
            f"{16384 if name == 'max_vision_tokens' else 8}"
        )


@dataclass(frozen=True)
class VisionBudget:
    """Per-pack vision caps and the balance mode (all off by default), for
    :class:`~energon_pack.OnlineBinPacker`, :class:`~energon_pack.PackingTaskEncoder` (``vision=``),
    :class:`~energon_pack.VLMPackingCollator` (``vision=``), ``tune`` and the topology check.

    Args:
        max_vision_tokens: most vision tokens per pack (None: no cap), counted from the media
            probe before any decode.
        max_media: most images + videos per pack (None: no cap).
        balance: keep each pack's vision tokens near the stream's running mean, so that
            data-parallel ranks wait less for each other's vision encoder.
        over_cap: a sample alone over a cap: ``"error"`` raises, ``"skip"`` counts and skips
            it; None (default) follows the loader's ``overlong`` (``"truncate"`` skips, since
            cutting text does not lower a sample's vision tokens).
        vision_share: with ``balance``, the dataset's vision tokens per token where known
            (``energon-pack tune`` reports it): every rank's target starts from it instead of
            from the few samples its buffer holds, and the share the packer sees takes over as
            it packs (:data:`KNOWN_SHARE_ROWS`). None (default): the share seen so far alone.
    """

    max_vision_tokens: int | None = None
    max_media: int | None = None
    balance: bool = False
    over_cap: Overlong | None = None
    vision_share: float | None = None

    def __post_init__(self) -> None:
        _check_cap("max_vision_tokens", self.max_vision_tokens)
        _check_cap("max_media", self.max_media)
        if not isinstance(self.balance, bool):
            raise ValueError(
                f"vision_balance must be True or False (VisionBudget.balance), got {self.balance!r}"
            )
        if self.over_cap not in (None, "error", "skip"):
            raise ValueError(
                f"over_cap must be None (as overlong), 'error' or 'skip', got {self.over_cap!r}"
            )
        share = self.vision_share
        if share is not None:
            number = isinstance(share, (int, float)) and not isinstance(share, bool)
            if not number or not 0 <= share <= 1:
                raise ValueError(
                    f"vision_share must be None or a number in [0, 1] (vision tokens per token of "
                    f"the dataset, as energon-pack tune reports it), got {share!r}"
                )
            if not self.balance:
                raise ValueError(
                    f"vision_share={share} is where balance starts its target; it does nothing "
                    "without balance: pass VisionBudget(balance=True, vision_share=...) or drop it"
                )

    def over_cap_policy(self, overlong: str) -> Overlong:
        """What happens to a sample alone over a cap, given the loader's ``overlong``."""
        if self.over_cap is not None:
            return self.over_cap
        return "error" if overlong == "error" else "skip"

    @property
    def active(self) -> bool:
        """Whether any cap or the balance is on (off: packs are chosen by tokens alone)."""
        return self.max_vision_tokens is not None or self.max_media is not None or self.balance

    def settings(self) -> dict[str, Any]:
        """The settings that are on, by name (none when off, so states saved before the budget
        existed keep their settings)."""
        out: dict[str, Any] = {}
        if self.max_vision_tokens is not None:
            out["max_vision_tokens"] = self.max_vision_tokens
        if self.max_media is not None:
            out["max_media"] = self.max_media
        if self.balance:
            out["vision_balance"] = True
        if self.over_cap is not None:
            out["over_cap"] = self.over_cap
        if self.vision_share is not None:
            out["vision_share"] = self.vision_share
        return out

    def warmed_up(self, seen_tokens: int, capacity: int) -> bool:
        """Whether a row may leave early after the packer has read ``seen_tokens`` (emitted and
        held): always, but with ``balance`` and no ``vision_share`` only from
        :data:`WARMUP_ROWS` rows' worth of tokens on."""
        if not self.balance or self.vision_share is not None:
            return True
        return seen_tokens >= WARMUP_ROWS * capacity

    def fits(self, vision: int, media: int) -> bool:
        """Whether ``vision`` tokens and ``media`` are within the caps."""
        cap, most = self.max_vision_tokens, self.max_media
        return (cap is None or vision <= cap) and (most is None or media <= most)

    def excess(self, key: object, vision: int, media: int) -> tuple[str, str] | None:
        """``(reason, message)`` if one sample alone exceeds a cap, else None."""
        cap = self.max_vision_tokens
        if cap is not None and vision > cap:
            return "vision_tokens", (
                f"sample {key!r} has {vision} vision tokens, above max_vision_tokens={cap}"
            )
        if self.max_media is not None and media > self.max_media:
            return "media", (
                f"sample {key!r} has {media} images and videos, above max_media={self.max_media}"
            )
        return None


def _count(key: object, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"sample {key!r}: {name} must be an int >= 0, got {value!r}")
    return value


def check_vision(key: object, vision: object, media: object) -> tuple[int, int]:
    """``(vision, media)`` if both are ints >= 0; ValueError naming the sample otherwise."""
    return _count(key, "vision_tokens", vision), _count(key, "media", media)


def vision_target(vision: int, tokens: int, capacity: int, share: float | None = None) -> float:
    """A row's vision-token target: the stream's vision tokens per token times the capacity;
    with a known ``share``, that share counted as :data:`KNOWN_SHARE_ROWS` rows' worth of
    tokens beside the ``tokens`` seen."""
    if share is None:
        return vision / tokens * capacity if tokens else 0.0
    known = KNOWN_SHARE_ROWS * capacity
    return (vision + share * known) / (tokens + known) * capacity


def straggler_ratio(loads: Sequence[Sequence[float]]) -> float:
    """Mean over steps of the most loaded rank's load over the ranks' mean load (``loads[step]``
    lists one load per rank); 1.0 for steps where every load is 0."""
    ratios = []
    for step in loads:
        mean = sum(step) / len(step)
        ratios.append(max(step) / mean if mean > 0 else 1.0)
    return sum(ratios) / len(ratios) if ratios else math.nan


def even_share(largest: Sequence[float], total: float) -> float:
    """The level ``L`` that spreads ``total`` vision tokens over packs as evenly as whole samples
    allow: each pack carries ``max(L, largest[p])`` (its largest single sample cannot be split),
    and the packs together carry ``total``. 0.0 where the largest samples alone exceed it."""
    if any(value < 0 for value in largest) or total < 0:
        raise ValueError("even_share: vision tokens must be >= 0")
    rest, count = float(total), len(largest)
    for taken, value in enumerate(sorted(largest, reverse=True)):
        level = rest / (count - taken)
        if level >= value:
            return level
        rest -= value
    return 0.0


def straggler_floor(largest: Sequence[Sequence[float]], loads: Sequence[Sequence[float]]) -> float:
    """The straggler ratio the same packs would have if their vision tokens were spread as
    evenly as whole samples allow (``largest[step][rank]``: a pack's largest single sample,
    ``loads``: its vision tokens). Every pack carries the even share of the packs' total,
    or its largest sample where that is more, so the packs keep their total: how far whole samples
    alone hold the most loaded rank above the mean."""
    if [len(step) for step in largest] != [len(step) for step in loads]:
        raise ValueError("straggler_floor: largest and loads must have the same steps and ranks")
    level = even_share([v for step in largest for v in step], sum(map(sum, loads)))
    return straggler_ratio([[max(level, v) for v in step] for step in largest])
