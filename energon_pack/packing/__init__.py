"""The packing core: pure bin packing (offline and online), the row layout, THD row assembly,
mRoPE position ids and the topology rules. Nothing here reads files or decodes media.

* ``bins``: offline first/best fit decreasing, the fewest rows of a micro-batch, shared rules;
* ``online``: :class:`OnlineBinPacker`, the bounded carry-over packer, and ``packer_state``,
  what it holds (:class:`PackerCounters`) and the check of its saved state;
* ``buffer``: :class:`BufferConfig`, when a pack may leave the candidate buffer;
* ``vision_budget``: :class:`VisionBudget`, caps on vision tokens and media per row, and the
  balance rule;
* ``subset_sums``: subset sums as big-integer bitsets (the online packer's search);
* ``micro_batch``: the rows of one collator micro-batch within every budget;
* ``row_layout``: :class:`RowLayout`, every row rule checked once;
* ``row``: :class:`PackedRow` and :func:`build_packed_row` (THD form, ``cu_seqlens``);
* ``packed``: :class:`EncodedSample` in, :class:`PackedSample` (row + media) out;
* ``mrope``: Qwen-VL multimodal rotary position ids, per segment;
* ``topology``: ``pad_seq_to_mult`` and :class:`TrainingSetup`, the check of a training run's
  settings against packing;
* ``synthetic``: length mixes for the demo and the benchmarks.
"""

from typing import TYPE_CHECKING

from energon_pack._moved import lazy

if TYPE_CHECKING:  # the public names, for type checkers (read lazily below)
    from energon_pack.packing.bins import Bin, best_fit_decreasing, first_fit_decreasing
    from energon_pack.packing.buffer import BufferConfig
    from energon_pack.packing.mrope import (
        MRopeConfig,
        mrope_position_ids,
        packed_mrope_position_ids,
    )
    from energon_pack.packing.online import OnlineBinPacker
    from energon_pack.packing.packed import (
        EncodedSample,
        PackedSample,
        mrope_for_packed,
        pack_samples,
    )
    from energon_pack.packing.packer_state import PackerCounters
    from energon_pack.packing.row import IGNORE_INDEX, PackedRow, build_packed_row, unpack
    from energon_pack.packing.row_layout import PackingWarning, RowLayout
    from energon_pack.packing.topology import (
        DerivedValues,
        TokenSlotRow,
        TrainingSetup,
        equal_token_slot_table,
        pad_seq_to_mult,
    )
    from energon_pack.packing.vision_budget import VisionBudget, straggler_floor, straggler_ratio

_HOMES: dict[str, str] = {
    name: module
    for module, names in {
        "energon_pack.packing.bins": ("Bin", "best_fit_decreasing", "first_fit_decreasing"),
        "energon_pack.packing.buffer": ("BufferConfig",),
        "energon_pack.packing.mrope": (
            "MRopeConfig",
            "mrope_position_ids",
            "packed_mrope_position_ids",
        ),
        "energon_pack.packing.online": ("OnlineBinPacker",),
        "energon_pack.packing.packed": (
            "EncodedSample",
            "PackedSample",
            "mrope_for_packed",
            "pack_samples",
        ),
        "energon_pack.packing.packer_state": ("PackerCounters",),
        "energon_pack.packing.row": ("IGNORE_INDEX", "PackedRow", "build_packed_row", "unpack"),
        "energon_pack.packing.row_layout": ("PackingWarning", "RowLayout"),
        "energon_pack.packing.topology": (
            "DerivedValues",
            "TokenSlotRow",
            "TrainingSetup",
            "equal_token_slot_table",
            "pad_seq_to_mult",
        ),
        "energon_pack.packing.vision_budget": (
            "VisionBudget",
            "straggler_floor",
            "straggler_ratio",
        ),
    }.items()
    for name in names
}
"""Public name -> the module it is imported from on its first read (PEP 562)."""

__all__ = [
    "IGNORE_INDEX",
    "Bin",
    "BufferConfig",
    "DerivedValues",
    "EncodedSample",
    "MRopeConfig",
    "OnlineBinPacker",
    "PackedRow",
    "PackedSample",
    "PackerCounters",
    "PackingWarning",
    "RowLayout",
    "TokenSlotRow",
    "TrainingSetup",
    "VisionBudget",
    "best_fit_decreasing",
    "build_packed_row",
    "equal_token_slot_table",
    "first_fit_decreasing",
    "mrope_for_packed",
    "mrope_position_ids",
    "pack_samples",
    "packed_mrope_position_ids",
    "pad_seq_to_mult",
    "straggler_floor",
    "straggler_ratio",
    "unpack",
]

if TYPE_CHECKING:  # the old names, for type checkers
    PackerStats = PackerCounters
    PackingConfig = TrainingSetup
    __all__ += ["PackerStats", "PackingConfig"]
else:  # every public name on its first read, and the old names with a DeprecationWarning
    __getattr__, __dir__ = lazy(__name__, _HOMES, "PackerStats", "PackingConfig")
