"""transformers' ids and assistant mask of a conversation, the reference the template encoder
must equal: ``apply_chat_template`` with the released template's generation-marked variant
(same text, see ``chat_templates``), then each image block expanded by ``Qwen2VLProcessor``
(its image processor decides the grids), as the processor does before tokenising."""

from __future__ import annotations

import io
from typing import Any

from chat_templates import MARKED, RELEASED
from hf_qwen import qwen_processor
from PIL import Image
from transformers import PreTrainedTokenizerBase, Qwen2VLProcessor

from energon_pack.media import MediaConfig


def processor_for(tokenizer: PreTrainedTokenizerBase, media: MediaConfig) -> Qwen2VLProcessor:
    """Qwen2-VL's processor (PIL image processor set up like ``media``) around ``tokenizer``."""
    return qwen_processor(tokenizer, media)  # type: ignore[arg-type]


def reference(
    processor: Qwen2VLProcessor,
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    images: list[bytes],
) -> tuple[list[int], list[int]]:
    """Ids and loss mask transformers gives (see the module docstring); ``template`` names a
    released template (a key of ``chat_templates.RELEASED``)."""
    tokenizer = processor.tokenizer
    marked = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=MARKED[template],
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = list(marked["input_ids"]), list(marked["assistant_masks"])
    if not images:
        return ids, mask
    text = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=RELEASED[template], tokenize=False
    )
    pil = [Image.open(io.BytesIO(data)) for data in images]
    _, replacements = processor._process_images(pil)
    expanded, _ = processor.get_text_with_replacements([text], replacements, [], [])
    expanded_ids = list(tokenizer(expanded[0], add_special_tokens=False)["input_ids"])
    return expanded_ids, _expand_mask(tokenizer, ids, mask, expanded_ids)


def _expand_mask(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], mask: list[int], expanded: list[int]
) -> list[int]:
    """The template's mask carried over to the expanded ids; media tokens are no targets."""
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    vision = {pad, *map(tokenizer.convert_tokens_to_ids, ("<|vision_start|>", "<|vision_end|>"))}
    out: list[int] = []
    position = 0
    for token, flag in zip(ids, mask, strict=True):
        if token == pad:  # the processor's run of pads
            while position < len(expanded) and expanded[position] == pad:
                out.append(0)
                position += 1
            continue
        if expanded[position] != token:
            raise AssertionError("the expanded ids are not the template's with pads repeated")
        out.append(0 if token in vision else flag)
        position += 1
    return out
