"""Offline packing of text SFT data: tokenise once, pack once, train with micro-batch 1.

:func:`pack_offline` turns a JSONL file into a packed dataset directory and
:class:`PackedDataset` reads it back as :class:`~energon_pack.PackedRow` objects.

Input, one JSON object per line (blank lines are ignored; formats may be mixed):

* ``{"input": str, "output": str}`` (optional ``"system"``): a prompt/answer pair, encoded as a
  user turn and an assistant turn by :func:`~energon_pack.make_encoder`'s encoder for the
  tokenizer (its chat template when it has one, else ChatML); the loss covers the answer only;
* ``{"conversations": [...]}`` (optional ``"system"``, ``"tools"``): a text conversation, same
  encoder;
* ``{"input_ids": [...], "loss_mask": [...]}``: pre-tokenised, used as is.

Samples are named ``<file name>:<line number>`` in errors and logs.

Packed directory (all arrays are ``.npy`` files, read memory-mapped):

* ``input_ids.npy`` int32 ``[tokens]``: every packed sequence's tokens, concatenated in pack
  order, without padding; ``loss_mask.npy`` uint8 ``[tokens]`` aligned with it (1 = target);
* ``seq_starts.npy`` int64 ``[S]`` and ``seq_lengths.npy`` int32 ``[S]``: where each sequence
  lies in those arrays; ``seq_lines.npy`` int64 ``[S]``: its input line number;
* ``pack_starts.npy`` int64 ``[P + 1]``: pack ``p`` holds sequences
  ``pack_starts[p]:pack_starts[p + 1]`` (in input order within the pack);
* ``metadata.json``: a list with one dict of :class:`PackMetadata` keys, as Megatron-Bridge
  writes its packing metadata;
* ``manifest.json`` (written last, so only a complete directory has one): format version,
  package version, the :class:`PackingSpec`, the tokenizer identity, the input's sha256, the
  build statistics and, per array file, its size in bytes, shape, dtype, CRC-32 and the CRC-32
  of a sample of blocks (format 2). A directory is reused only when its manifest matches the
  request. :class:`PackedDataset` checks every array's size, shape, dtype and block sample on
  open (the full CRC-32 with ``verify=True``); format 1 directories open unchecked.

With ``format="bridge"`` the directory holds Megatron-Bridge's packed parquet instead of the
arrays: ``training_<size>.idx.parquet`` (one row per pack: ``input_ids``, the label-aligned
``loss_mask`` int8, ``seq_start_id``; each sequence padded with the tokenizer's eos so that the
``L - 1`` tokens Bridge feeds of it are a multiple of ``pad_seq_to_mult``), Bridge's
``<size>_metadata.jsonl`` (counted in those fed tokens) and the manifest (recording the
parquet's size and CRC-32). Packs then hold at most ``packed_sequence_size`` fed tokens.

One module per concern: ``spec`` (what is asked and reported), ``inputs`` (JSONL lines to
tokens), ``build`` (:func:`pack_offline`), ``bridge`` (Bridge's parquet), ``manifest`` (reuse
and integrity checks), ``reader`` (:class:`PackedDataset`).
"""

from energon_pack.offline.build import pack_offline
from energon_pack.offline.reader import PackedDataset
from energon_pack.offline.spec import (
    FORMATS,
    Algorithm,
    OfflineFormat,
    OfflinePackResult,
    PackingSpec,
    PackMetadata,
)

__all__ = [
    "FORMATS",
    "Algorithm",
    "OfflineFormat",
    "OfflinePackResult",
    "PackMetadata",
    "PackedDataset",
    "PackingSpec",
    "pack_offline",
]
