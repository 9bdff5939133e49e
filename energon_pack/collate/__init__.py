"""Collate-time packing: a picklable ``collate_fn`` that packs each micro-batch into THD rows.

:class:`VLMPackingCollator` takes the items a ``torch.utils.data.DataLoader`` batches together
(encoded samples, raw WebDataset samples, chat rows as ``transformers`` / TRL trainers hand them
over, or an already padded HF batch dict) and returns a
:class:`CollatedBatch`: ``R`` rows of ``T`` tokens in the Megatron Core / Transformer Engine THD
form, with the media of all rows concatenated in row-then-segment order. Every row is built by
:func:`~energon_pack.pack_samples`.

* A micro-batch that fits ``seq_length`` (and the vision caps) becomes one row (``R == 1``), the
  samples in micro-batch order (Megatron-Bridge's in-batch packing), as wide as its samples
  (``pad_to_max_length=False``, the default) or exactly ``seq_length`` wide.
* One that does not is split into the fewest rows (an exact search for small micro-batches,
  bounded by a fixed node budget, else best-fit decreasing), each ``seq_length`` wide with
  ``pad_to_max_length=True``, else as wide as the widest. Within a row the samples keep their
  micro-batch order; rows are ordered by their first sample.

The collator keeps no state across batches (its output depends on the micro-batch alone), so
resuming a ``DataLoader`` is exact by construction. Nothing is dropped silently: samples skipped by
the ``overlong`` / ``on_media_error`` policies are listed in :attr:`CollatedBatch.skipped_keys` and
logged (``energon_pack.collate``) with their key.
"""

from energon_pack.collate.batch import CollatedBatch
from energon_pack.collate.collator import CollateItem, OnMediaError, Output, VLMPackingCollator

__all__ = ["CollateItem", "CollatedBatch", "OnMediaError", "Output", "VLMPackingCollator"]
