"""Special-token ids read from a transformers tokenizer (whose ``convert_tokens_to_ids`` gives
None for a token it lacks, and a list for a list): an id where it has the token, else an error
naming the token and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from energon_pack import ByteTokenizer, ConversationEncoder, MRopeConfig
from energon_pack.encoding.chatml import SPECIAL_TOKENS
from energon_pack.media import VisionIds

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")


def word_tokenizer(special: list[str]) -> Any:
    """A transformers tokenizer of a few words, with ``special`` tokens and no unknown token."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"the": 0, "cat": 1}))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    hf.add_special_tokens({"additional_special_tokens": special})
    return hf


def test_the_ids_of_a_tokenizer_that_has_the_tokens() -> None:
    hf = word_tokenizer(list(SPECIAL_TOKENS))
    ids = VisionIds.of(hf)
    assert ids.image_pad == hf.convert_tokens_to_ids("<|image_pad|>")
    assert len({ids.start, ids.end, ids.image_pad, ids.video_pad}) == 4
    assert MRopeConfig.from_tokenizer(hf).image_token_id == ids.image_pad
    assert VisionIds.of(ByteTokenizer()).start == ByteTokenizer().convert_tokens_to_ids(
        "<|vision_start|>"
    )


def test_a_missing_special_token_is_named_with_the_fix() -> None:
    hf = word_tokenizer(["<|im_start|>", "<|im_end|>"])
    assert hf.convert_tokens_to_ids("<|vision_start|>") is None
    with pytest.raises(
        ValueError, match=r"gives the special token '<\|vision_start\|>' no id"
    ) as e:
        MRopeConfig.from_tokenizer(hf)
    assert "add_special_tokens({'additional_special_tokens': ['<|vision_start|>']})" in str(e.value)
    with pytest.raises(ValueError, match="special tokens"):  # the encoder names all it lacks
        ConversationEncoder(hf)
