"""Encoding for a processor family: ids equal the family's processor on the rendered template.

:class:`ProcessorEncoder` renders each conversation with the processor's chat template (in the
bounded sandbox, as :class:`~energon_pack.TemplateEncoder` does), replaces each image or audio
placeholder the template rendered by the text the processor writes for that medium
(:meth:`~energon_pack.encoding.families.ProcessorFamily.expansions` from the image's header
size, :meth:`~energon_pack.encoding.families.ProcessorFamily.audio_expansions` from the audio's
header probe, :meth:`~energon_pack.encoding.families.ProcessorFamily.video_expansions` from the
frames the video processor keeps of the video's header, and its audio track's header where the
family reads it: :meth:`~energon_pack.encoding.families.ProcessorFamily.media_expansions`), and
tokenises the whole text as the
processor does, so text next to a medium merges exactly as it does there. Nothing is decoded:
the pixels and audio features come from the processor itself when the sample's pack is chosen
(:meth:`ProcessorFamily.media_inputs`, :meth:`ProcessorFamily.audio_inputs`,
:meth:`ProcessorFamily.video_inputs`).

The loss mask covers the assistant replies: the template's ``{% generation %}`` spans where it
has them, else the family's own rule (:meth:`ProcessorFamily.assistant_spans`); tokens touching
a medium's expansion are never targets.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from typing_extensions import Unpack

from energon_pack.encoding.bounded import (
    BoundedTemplate,
    has_generation_markers,
    template_sha256,
)
from energon_pack.encoding.chatml import TurnOptions
from energon_pack.encoding.families.base import ProcessorFamily
from energon_pack.encoding.family_encoder import FamilyEncoder, media_item
from energon_pack.encoding.rendering import render_sample, tokenise_text
from energon_pack.formats.raw import RawSample
from energon_pack.media import MediaError
from energon_pack.media.config import MediaKind
from energon_pack.packing.packed import EncodedSample

__all__ = ["ProcessorEncoder"]

Span = tuple[int, int]
Placed = tuple[int, str]
"""Where a placeholder starts in the rendered text, and its text."""


class ProcessorEncoder(FamilyEncoder):
    """Encodes conversations for a processor family (see the module docstring).

    Args:
        family: the family (:func:`~energon_pack.model_family` of a processor).
        media: limits for reading media (pixel bomb guard, media per sample, decoder
            isolation); resizing is the processor's.
        system_prompt, loss_on: see :class:`~energon_pack.SampleEncoder`.
        chat_template: render with this template instead of the processor's.
        template_kwargs: extra template variables, JSON-able; in the settings fingerprint.

    Raises:
        ValueError: the processor has no chat template, or the template has no generation
            markers and the family has no assistant rule of its own.
    """

    def __init__(
        self,
        family: ProcessorFamily,
        *,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        **options: Unpack[TurnOptions],
    ) -> None:
        super().__init__(family, **options)
        template = chat_template or processor_chat_template(family)
        if template is None:
            raise ValueError(
                f"{type(family.processor).__name__} has no chat template; set "
                "processor.chat_template or pass chat_template="
            )
        self.chat_template = template
        self.template_sha256 = template_sha256(template)
        self.template_kwargs: dict[str, Any] = dict(template_kwargs or {})
        self.masking: Literal["markers", "family"] = (
            "markers" if has_generation_markers(template) else "family"
        )
        if self.masking == "family" and family.assistant_spans("") is None:
            raise ValueError(
                f"the chat template of {family.name!r} has no generation markers and the family "
                "has no assistant rule: wrap the replies in {% generation %}...{% endgeneration %}"
            )
        self._bounded = BoundedTemplate(template)
        self._backend = family.tokenizer.backend_tokenizer
        special = getattr(family.tokenizer, "special_tokens_map", None)
        self._special: dict[str, Any] = dict(special) if isinstance(special, Mapping) else {}

    def settings(self) -> dict[str, Any]:
        """The family's settings, loss rule, template digest and template variables."""
        return {
            "encoding": "processor",
            **self.family.settings(),
            "system_prompt": self.system_prompt,
            "loss_on": self.loss_on,
            "chat_template_sha256": self.template_sha256,
            "template_kwargs": self.template_kwargs,
        }

    def encode(self, raw: RawSample) -> EncodedSample:
        """Encode a parsed sample, reading only its media's headers (see the module docstring).

        Raises :class:`~energon_pack.media.MediaError`: ``unsupported`` for a medium the
        family's processor does not take (a video without a video processor; audio for a
        vision family, images for an audio family) or a video its video processor cannot
        sample, ``placeholder_mismatch`` when the rendered placeholders are not the
        sample's media, ``bad_sample`` when the template cannot render the conversation.
        """
        messages = self._messages(raw)
        measured = [self._measure(raw.key, member, kind, data) for member, kind, data in raw.media]
        text, replies = self._render(raw.key, messages, raw.tools)
        found, order = self._placeholders(raw.key, text, [kind for _, kind, _ in raw.media])
        in_text = [raw.media[index] for index in order]
        measured = [measured[index] for index in order]
        expansions = self._family_takes(
            raw, measured, lambda: self.family.media_expansions(measured)
        )
        expanded, blocks, moved = _expand(text, found, expansions)
        found_ids, found_offsets = tokenise_text(
            self._backend, raw.key, expanded, add_special_tokens=self.family.add_special_tokens
        )
        ids = np.asarray(found_ids, dtype=np.int64)
        offsets = np.asarray(found_offsets, dtype=np.int64).reshape(-1, 2)
        in_media = _overlapping(offsets, blocks)
        if self.loss_on == "all":
            mask = np.ones(len(ids), dtype=bool)
        else:
            mask = _overlapping(offsets, [(moved(a), moved(b)) for a, b in replies])
        mask &= ~in_media
        is_media = np.isin(ids, self.media_ids_tensor.numpy())
        is_audio = np.isin(ids, list(self.family.audio_token_ids))
        within = [_overlapping(offsets, [block]) for block in blocks]
        media = tuple(
            media_item(
                member, data, shape, int(is_media[inside].sum()), int(is_audio[inside].sum())
            )
            for (member, _, data), shape, inside in zip(in_text, measured, within, strict=True)
        )
        stray = int(is_media.sum()) - sum(item.tokens for item in media)
        if stray:
            raise MediaError(
                raw.key,
                "json",
                "placeholder_mismatch",
                f"the text holds {stray} media tokens outside the media's expansions; remove "
                "image- or audio-token text from the conversation",
            )
        return EncodedSample(
            key=raw.key,
            input_ids=torch.from_numpy(ids),
            loss_mask=torch.from_numpy(mask.astype(np.int64)),
            media=media,
        )

    def _placeholders(
        self, key: str, text: str, kinds: list[MediaKind]
    ) -> tuple[list[Placed], list[int]]:
        """Where the template rendered each medium's placeholder, in text order, and which
        medium each one takes (the next of its kind, as the processor assigns them: a template
        may render a message's images before its videos); a ``placeholder_mismatch`` unless
        there are as many of each kind as the sample has media."""
        texts = {
            kind: placeholder
            for kind, placeholder in (
                ("image", self.family.image_placeholder if self.family.takes_images else None),
                ("audio", self.family.audio_placeholder),
                ("video", self.family.video_placeholder),
            )
            if placeholder is not None
        }
        found = sorted(
            (start, placeholder, kind)
            for kind, placeholder in texts.items()
            for start in _occurrences(text, placeholder)
        )
        if sorted(kind for _, _, kind in found) != sorted(kinds):
            raise MediaError(
                key,
                "json",
                "placeholder_mismatch",
                f"the chat template of {self.family.name!r} rendered the placeholders "
                f"{[placeholder for _, placeholder, _ in found]} for media of kinds {kinds}; a "
                "literal placeholder in the text must be removed",
            )
        of_kind = {kind: iter([i for i, k in enumerate(kinds) if k == kind]) for kind in texts}
        order = [next(of_kind[kind]) for _, _, kind in found]
        return [(start, placeholder) for start, placeholder, _ in found], order

    def _render(
        self, key: str, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> tuple[str, list[Span]]:
        """The rendered text and the character spans of its assistant replies."""
        markers = self.masking == "markers"
        text, generation = render_sample(
            self._bounded,
            key,
            messages,
            tools,
            variables={**self._special, **self.template_kwargs},
            track_generation=markers,
            name=f"the chat template of {self.family.name!r}",
        )
        if markers:
            return text, generation
        spans = self.family.assistant_spans(text) or []
        assistants = sum(message["role"] == "assistant" for message in messages)
        if len(spans) != assistants:
            raise MediaError(
                key,
                "json",
                "bad_sample",
                f"family {self.family.name!r} found {len(spans)} assistant replies in the "
                f"rendered conversation for {assistants} assistant messages, so the loss mask "
                "cannot be placed; remove turn-marker text from the conversation",
            )
        return text, spans


def processor_chat_template(family: ProcessorFamily) -> str | None:
    """The chat template the family renders: its processor's, else its tokenizer's."""
    for owner in (family.processor, family.tokenizer):
        template = getattr(owner, "chat_template", None)
        if isinstance(template, str) and template:
            return template
    return None


def _occurrences(text: str, needle: str) -> list[int]:
    """Start offsets of the non-overlapping occurrences of ``needle`` in ``text``."""
    found, start = [], text.find(needle)
    while start >= 0:
        found.append(start)
        start = text.find(needle, start + len(needle))
    return found


def _expand(
    text: str, placed: Sequence[Placed], expansions: Sequence[str]
) -> tuple[str, list[Span], Callable[[int], int]]:
    """``text`` with each placed placeholder replaced by its expansion; the expansions' spans
    in the new text; and the map from old offsets to new ones."""
    pieces, blocks, shifts = [], [], [0]
    last, shift = 0, 0
    for (start, placeholder), expansion in zip(placed, expansions, strict=True):
        pieces += [text[last:start], expansion]
        begin = start + shift
        blocks.append((begin, begin + len(expansion)))
        shift += len(expansion) - len(placeholder)
        shifts.append(shift)
        last = start + len(placeholder)
    pieces.append(text[last:])
    ends = [start + len(placeholder) for start, placeholder in placed]

    def moved(offset: int) -> int:
        return offset + shifts[bisect.bisect_right(ends, offset)]

    return "".join(pieces), blocks, moved


def _overlapping(offsets: np.ndarray[Any, Any], spans: Sequence[Span]) -> np.ndarray[Any, Any]:
    """True for each token whose character offsets overlap a span (transformers' rule); a
    token without characters (an added BOS) overlaps nothing."""
    mask = np.zeros(len(offsets), dtype=bool)
    for begin, end in spans:
        mask |= (offsets[:, 1] > begin) & (offsets[:, 0] < end)
    return mask
