"""Offline packing of text SFT data: tokenise once, pack once, train with micro-batch 1.

:func:`pack_offline` turns a JSONL file (or a file holding one JSON array of samples, a Parquet
file, a saved ``datasets`` folder, a Megatron-Energon dataset of text samples) into a packed
dataset directory, tokenising in this process or on Ray Data, and :class:`PackedDataset` reads
it back as :class:`~energon_pack.PackedRow` objects.

Input, one JSON object per line of a JSONL file (blank lines are ignored), the items of one
JSON array (a file starting with ``[``, read whole), or the rows of the other sources; forms
may be mixed:

* ``{"input": str, "output": str}`` (optional ``"system"``): a prompt/answer pair, encoded as a
  user turn and an assistant turn by :func:`~energon_pack.make_encoder`'s encoder for the
  tokenizer (its chat template when it has one, else ChatML); the loss covers the answer only;
* any text conversation :func:`~energon_pack.formats.parse_any` reads, as the collator reads
  it: a chat row ``{"messages": [...]}`` or ``{"conversations": [...]}`` (optional
  ``"system"``, ``"tools"``), or a WebDataset sample's ``{"json": ...}``; same encoder;
* ``{"input_ids": [...], "loss_mask": [...]}``: pre-tokenised, used as is.

Samples are named ``<file name>:<line number>`` (JSONL), ``<file name>[<index>]`` (a JSON
array, a Parquet file, a saved folder) or by their ``__key__`` (Energon) in errors and logs; a
sample with media is refused (offline packing is text-only).

Packed directory (all arrays are ``.npy`` files, read memory-mapped):

* ``input_ids.npy`` int32 ``[tokens]``: every packed sequence's tokens, concatenated in pack
  order, without padding; ``loss_mask.npy`` uint8 ``[tokens]`` aligned with it (1 = target);
* ``seq_starts.npy`` int64 ``[S]`` and ``seq_lengths.npy`` int32 ``[S]``: where each sequence
  lies in those arrays; ``seq_lines.npy`` int64 ``[S]``: its input line number (elsewhere:
  its position in the source, from 1);
* ``pack_starts.npy`` int64 ``[P + 1]``: pack ``p`` holds sequences
  ``pack_starts[p]:pack_starts[p + 1]`` (in input order within the pack);
* ``metadata.json``: a list with one dict of :class:`PackMetadata` keys, as Megatron-Bridge
  writes its packing metadata;
* ``manifest.json`` (written last, so only a complete directory has one): format version,
  package version, the :class:`PackingSpec`, the tokenizer identity and which encoder counted
  the tokens (``tokenizer.encoding``: ``"template"`` or ``"chatml"``, and ``system_prompt``),
  the input's sha256 (a folder's: of its data files' digests), the build statistics and, per
  array file, its size in bytes, shape, dtype, CRC-32 and the CRC-32 of a sample of blocks
  (format 2). A directory is reused only when its manifest matches the request.
  :class:`PackedDataset` checks every array's size, shape, dtype and block sample on open (the
  full CRC-32 with ``verify=True``); format 1 directories open unchecked.

With ``format="bridge"`` the directory holds Megatron-Bridge's packed parquet instead of the
arrays: ``training_<size>.idx.parquet`` (one row per pack: ``input_ids``, the label-aligned
``loss_mask`` int8, ``seq_start_id``; each sequence padded with the tokenizer's eos so that the
``L - 1`` tokens Bridge feeds of it are a multiple of ``pad_seq_to_mult``), Bridge's
``<size>_metadata.jsonl`` (counted in those fed tokens) and the manifest (recording the
parquet's size and CRC-32). Packs then hold at most ``packed_sequence_size`` fed tokens.

One module per concern: ``spec`` (what is asked and reported), ``inputs`` (input samples to
tokens), ``tokenise`` (a source's partition to tokens), ``build`` (:func:`pack_offline`),
``bridge`` (Bridge's parquet), ``manifest`` (reuse and integrity checks), ``reader``
(:class:`PackedDataset`).
"""

from typing import TYPE_CHECKING

from energon_pack._moved import lazy

if TYPE_CHECKING:  # the public names, for type checkers (read lazily below)
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

_HOMES: dict[str, str] = {
    name: module
    for module, names in {
        "energon_pack.offline.build": ("pack_offline",),
        "energon_pack.offline.reader": ("PackedDataset",),
        "energon_pack.offline.spec": (
            "FORMATS",
            "Algorithm",
            "OfflineFormat",
            "OfflinePackResult",
            "PackingSpec",
            "PackMetadata",
        ),
    }.items()
    for name in names
}
"""Public name -> the module it is imported from on its first read (PEP 562)."""

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

if not TYPE_CHECKING:  # every public name on its first read
    __getattr__, __dir__ = lazy(__name__, _HOMES)
