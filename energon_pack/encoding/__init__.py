"""Conversations to tokens: ids, the loss mask and vision placeholders, per model family.

* ``chatml``: the built-in ChatML encoders (:class:`ConversationEncoder`, :class:`SampleEncoder`)
  and :class:`ByteTokenizer`;
* ``template``: :class:`TemplateEncoder`, token-exact through a tokenizer's chat template, and
  :func:`make_encoder`, which picks the encoder for a tokenizer;
* ``family``: :class:`ModelFamily` presets (geometry, normalisation, frames, token layout, rope);
* ``fingerprint``: the identities and settings records that saved states carry.
"""

from energon_pack.encoding.chatml import ByteTokenizer, ConversationEncoder, SampleEncoder
from energon_pack.encoding.family import ModelFamily, model_family
from energon_pack.encoding.template import TemplateEncoder, make_encoder

__all__ = [
    "ByteTokenizer",
    "ConversationEncoder",
    "ModelFamily",
    "SampleEncoder",
    "TemplateEncoder",
    "make_encoder",
    "model_family",
]
