"""Conversations to tokens: ids, the loss mask and vision placeholders, per model family.

* ``chatml``: the built-in ChatML encoders (:class:`ConversationEncoder`, :class:`SampleEncoder`)
  and :class:`ByteTokenizer`;
* ``template``: :class:`TemplateEncoder`, token-exact through a tokenizer's chat template, and
  :func:`make_encoder`, which picks the encoder for a tokenizer;
* ``family``: :class:`ModelFamily` presets (geometry, normalisation, frames, token layout, rope)
  and :func:`model_family`, which also serves processor-backed families;
* ``families``: :class:`ProcessorFamily`, one per transformers processor family (Gemma 3/4,
  Pixtral, GLM-4V, InternVL, LLaVA-OneVision, Idefics3/SmolVLM, Kimi K2.5): token layout from
  the image size, media through the processor, the packing rule;
* ``processor_encoder``: :class:`ProcessorEncoder`, token-exact with a family's processor;
* ``request_encoder``: :class:`RequestEncoder`, token-exact with a family whose tokenizer
  encodes conversations itself (Voxtral's mistral-common); ``family_encoder`` their base;
* ``fingerprint``: the identities and settings records that saved states carry.
* ``describe``: which encoder counts the tokens, as a record (manifests, reports) and a line.
"""

from energon_pack.encoding.chatml import ByteTokenizer, ConversationEncoder, SampleEncoder
from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.family import ModelFamily, model_family
from energon_pack.encoding.processor_encoder import ProcessorEncoder
from energon_pack.encoding.request_encoder import RequestEncoder
from energon_pack.encoding.template import TemplateEncoder, make_encoder

__all__ = [
    "ByteTokenizer",
    "ConversationEncoder",
    "ModelFamily",
    "ProcessorEncoder",
    "ProcessorFamily",
    "RequestEncoder",
    "SampleEncoder",
    "TemplateEncoder",
    "make_encoder",
    "model_family",
]
