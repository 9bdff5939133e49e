"""Parallel topology helpers and packing configuration checks. Pure logic, no I/O.

:func:`pad_seq_to_mult` gives the multiple every packed segment (and ``seq_length``) must be
padded to under tensor / context / sequence parallelism. :class:`TrainingSetup` holds the settings
that interact with sequence packing; :meth:`TrainingSetup.validate` lists every violated rule at
once, each message naming the setting, its value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from energon_pack._moved import renamed
from energon_pack.packing.row_layout import fixed_width_problem, multiple_problem
from energon_pack.packing.vision_budget import VisionBudget

Mode = Literal["online", "collate", "offline", "none"]
MODES: tuple[Mode, ...] = ("online", "collate", "offline", "none")

CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
"""Per-layer CUDA graph modules (Megatron Core's ``cuda_graph_modules`` names); ``full`` (the
whole layer or the full iteration) is the other ``cuda_graph_scope``."""

# Legacy one-boolean-per-mode settings accepted next to ``mode``; contradictions are violations.
LEGACY_MODE_FLAGS: dict[str, Mode] = {
    "online_packing": "online",
    "collate_packing": "collate",
    "offline_packing": "offline",
}


def _mult_for(tp: int, cp: int, sp: bool) -> int:
    return math.lcm(2 * cp if cp > 1 else 1, cp * tp if sp and tp > 1 else 1)


def pad_seq_to_mult(tp: int, cp: int, sp: bool, eval_cp: int | None = None) -> int:
    """Multiple that each packed segment's physical length must be padded to.

    ``lcm(2*cp if cp > 1 else 1, cp*tp if sp and tp > 1 else 1)``; with ``eval_cp`` the lcm of
    the train and eval results, so one padding serves both.
    """
    for name, value in (("tp", tp), ("cp", cp), ("eval_cp", eval_cp)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    mult = _mult_for(tp, cp, sp)
    if eval_cp is not None:
        mult = math.lcm(mult, _mult_for(tp, eval_cp, sp))
    return mult


@dataclass(frozen=True)
class DerivedValues:
    """Values that follow from a :class:`TrainingSetup`."""

    mode: Mode
    pad_seq_to_mult: int
    token_slots_per_step: int
    """``seq_length * global_batch_size``."""
    micro_batches_per_step: int
    """Gradient-accumulation steps: ``global_batch_size // (micro_batch_size * dp)``."""


@dataclass(frozen=True)
class TokenSlotRow:
    """One row of :func:`equal_token_slot_table`."""

    seq_length: int
    global_batch_size: int
    token_slots: int


def equal_token_slot_table(
    token_slots: int = 65536, seq_lengths: tuple[int, ...] = (2048, 4096, 8192)
) -> list[TokenSlotRow]:
    """Global batch sizes giving every ``seq_length`` the same token slots per step.

    The default gives 2K/GBS32, 4K/GBS16 and 8K/GBS8, 65,536 slots each, so runs at different
    sequence lengths compare at equal tokens per step.
    """
    rows = []
    for seq_length in seq_lengths:
        if seq_length < 1 or token_slots % seq_length:
            raise ValueError(
                f"token_slots={token_slots} is not a multiple of seq_length={seq_length}; "
                "choose token_slots divisible by every seq_length in the table"
            )
        rows.append(TokenSlotRow(seq_length, token_slots // seq_length, token_slots))
    return rows


@dataclass(frozen=True)
class TrainingSetup:
    """Settings that interact with sequence packing (YAML keys are these field names).

    ``mode`` picks one packing path: ``online`` (Energon buffer, MBS 1), ``collate``
    (collate-time packing, MBS > 1), ``offline`` (pre-packed SFT data) or ``none``. The legacy
    booleans ``online_packing`` / ``collate_packing`` / ``offline_packing`` may select a mode
    too; selecting more than one mode is a violation. ``mtp`` is a bool or the number of MTP
    layers (0 = off). ``cuda_graph_scope`` is what ``cuda_graphs`` capture: ``"full"`` (whole
    layers or the full iteration) or a comma-separated list of :data:`CUDA_GRAPH_MODULES`; only
    graphs that capture attention read ``cu_seqlens``. Construction checks types;
    :meth:`validate` checks the rules.
    """

    seq_length: int
    mode: Mode = "none"
    micro_batch_size: int = 1
    global_batch_size: int = 1
    data_parallel_size: int = 1
    tp: int = 1
    cp: int = 1
    sp: bool = False
    pp: int = 1
    eval_cp: int | None = None
    mtp: bool | int = False
    cuda_graphs: bool = False
    cuda_graph_scope: str = "full"
    calculate_per_token_loss: bool = False
    average_in_collective: bool = False
    pad_to_max_length: bool = False
    pad_cu_seqlens: bool = False
    packing_buffer_size: int = 0
    finetuning: bool = False
    kernel_multiple: int | None = None
    max_vision_tokens: int | None = None
    max_media: int | None = None
    vision_balance: bool = False
    online_packing: bool = False
    collate_packing: bool = False
    offline_packing: bool = False
    vision: VisionBudget | None = dataclasses.field(default=None, compare=False, repr=False)
    """The vision budget as one object, instead of ``max_vision_tokens``, ``max_media`` and
    ``vision_balance`` (the YAML keys, set from it)."""

    def __post_init__(self) -> None:
        if self.vision is not None:
            self._take_vision(self.vision)
        problems = [p for f in dataclasses.fields(self) if (p := self._type_problem(f.name))]
        if problems:
            raise ValueError("invalid TrainingSetup: " + "; ".join(problems))

    def _take_vision(self, vision: object) -> None:
        """Set the vision budget's fields from ``vision`` (a :class:`VisionBudget`)."""
        if not isinstance(vision, VisionBudget):
            raise ValueError(
                f"invalid TrainingSetup: vision must be a VisionBudget, got {type(vision).__name__}"
            )
        given = [name for name in _VISION_FIELDS if getattr(self, name) not in (None, False)]
        if given:
            raise ValueError(
                f"invalid TrainingSetup: vision= and {', '.join(given)} are both given; pass "
                "the vision budget once (vision=VisionBudget(...), or its fields)"
            )
        object.__setattr__(self, "max_vision_tokens", vision.max_vision_tokens)
        object.__setattr__(self, "max_media", vision.max_media)
        object.__setattr__(self, "vision_balance", vision.balance)

    def vision_budget(self) -> VisionBudget:
        """The vision caps and balance these settings give (``over_cap`` is a loader's)."""
        share = None if self.vision is None else self.vision.vision_share
        return VisionBudget(
            self.max_vision_tokens, self.max_media, self.vision_balance, vision_share=share
        )

    def _type_problem(self, name: str) -> str | None:
        value = getattr(self, name)
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if name in _POSITIVE_INTS and not (is_int and value >= 1):
            return f"{name} must be a positive int, got {value!r}"
        if name == "packing_buffer_size" and not (is_int and value >= 0):
            return f"{name} must be an int >= 0 (0 = no buffer), got {value!r}"
        if name in _OPTIONAL_POSITIVE_INTS and value is not None and not (is_int and value >= 1):
            return f"{name} must be a positive int or null, got {value!r}"
        if name in _BOOLS and not isinstance(value, bool):
            return f"{name} must be true or false, got {value!r}"
        if name == "mtp" and not (isinstance(value, bool) or (is_int and value >= 0)):
            return f"mtp must be a bool or a number of MTP layers >= 0, got {value!r}"
        if name == "mode" and value not in MODES:
            return f"mode must be one of {', '.join(MODES)}, got {value!r}"
        if name == "cuda_graph_scope":
            return _scope_problem(value)
        return None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> TrainingSetup:
        """Build from a mapping (e.g. parsed YAML); unknown keys and wrong types raise."""
        valid = [f.name for f in dataclasses.fields(cls) if f.name != "vision"]
        unknown = sorted(str(k) for k in data if k not in valid)
        if unknown:
            raise ValueError(
                f"unknown packing config key(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: {', '.join(valid)}"
            )
        if "seq_length" not in data:
            raise ValueError("packing config needs seq_length (the row capacity in tokens)")
        return cls(**data)

    @classmethod
    def long_context_preset(cls, **overrides: Any) -> TrainingSetup:
        """16K-token online packing with CP 2, TP 4 + SP, finetuning loss settings for CP."""
        settings: dict[str, Any] = {
            "seq_length": 16384,
            "mode": "online",
            "micro_batch_size": 1,
            "global_batch_size": 8,
            "data_parallel_size": 1,
            "tp": 4,
            "cp": 2,
            "sp": True,
            "packing_buffer_size": 16,
            "finetuning": True,
            "calculate_per_token_loss": True,
            "average_in_collective": False,
            "pad_to_max_length": True,
        }
        settings.update(overrides)
        return cls.from_mapping(settings)

    def selected_modes(self) -> list[Mode]:
        """Every packing mode the settings select (more than one is a violation)."""
        modes: list[Mode] = [] if self.mode == "none" else [self.mode]
        for flag, mode in LEGACY_MODE_FLAGS.items():
            if getattr(self, flag) and mode not in modes:
                modes.append(mode)
        return modes

    def graph_captures_attention(self) -> bool:
        """Whether the CUDA graphs (if on) capture attention, the only part reading cu_seqlens."""
        modules = self.cuda_graph_scope.split(",")
        return self.cuda_graph_scope == "full" or "attn" in modules

    def pad_seq_to_mult(self) -> int:
        """:func:`pad_seq_to_mult` for this topology."""
        return pad_seq_to_mult(self.tp, self.cp, self.sp, self.eval_cp)

    def derived(self) -> DerivedValues:
        """Derived values; the mode is ``none`` when no mode or several are selected."""
        modes = self.selected_modes()
        return DerivedValues(
            mode=modes[0] if len(modes) == 1 else "none",
            pad_seq_to_mult=self.pad_seq_to_mult(),
            token_slots_per_step=self.seq_length * self.global_batch_size,
            micro_batches_per_step=self.global_batch_size
            // (self.micro_batch_size * self.data_parallel_size),
        )

    def validate(self) -> list[str]:
        """Every violated rule, one message each (empty when the config is valid)."""
        out: list[str] = []
        modes = self.selected_modes()
        if len(modes) > 1:
            sources = [f"mode={self.mode!r}"] if self.mode != "none" else []
            sources += [f"{flag}=True" for flag in LEGACY_MODE_FLAGS if getattr(self, flag)]
            out.append(
                f"packing modes are mutually exclusive: {', '.join(sources)} select "
                f"{', '.join(modes)}; keep exactly one (set mode and drop the legacy booleans)"
            )
        mbs = self.micro_batch_size
        gbs, dp = self.global_batch_size, self.data_parallel_size
        if "online" in modes:
            if mbs != 1:
                out.append(
                    f"micro_batch_size={mbs}: online packing emits one packed row per micro "
                    "batch, so it needs micro_batch_size=1; set micro_batch_size=1 (a packed "
                    "row already holds several samples)"
                )
            if self.packing_buffer_size <= 0:
                out.append(
                    f"packing_buffer_size={self.packing_buffer_size}: online packing needs a "
                    "candidate buffer > 0; set packing_buffer_size (e.g. 16)"
                )
            if not self.calculate_per_token_loss:
                out.append(
                    "calculate_per_token_loss=False: online packing gives each row a different "
                    "number of target tokens, so the loss must be normalised per token (as "
                    "Megatron-Bridge requires for Energon native packing); set "
                    "calculate_per_token_loss=True"
                )
            if self.average_in_collective:
                out.append(
                    "average_in_collective=True: with online packing the per-token loss is "
                    "summed, not averaged, across data-parallel ranks (as Megatron-Bridge "
                    "requires for Energon native packing); set average_in_collective=False"
                )
            if self.cuda_graphs:
                out.append(
                    "cuda_graphs=True: online packing gives variable shapes that CUDA graphs "
                    "cannot capture; disable cuda_graphs or use collate/offline packing with "
                    "pad_to_max_length and pad_cu_seqlens"
                )
            if self.pp > 1:
                out.append(
                    f"pp={self.pp}: online packing does not support pipeline parallelism; "
                    "set pp=1 or use offline packing"
                )
        if "collate" in modes and mbs <= 1:
            out.append(
                f"micro_batch_size={mbs}: collate-time packing packs each micro batch, so it "
                "needs micro_batch_size > 1; raise micro_batch_size or use online packing"
            )
        if "offline" in modes:
            if mbs != 1:
                out.append(
                    f"micro_batch_size={mbs}: offline packed data holds one packed row per "
                    "sample, so it needs micro_batch_size=1; set micro_batch_size=1"
                )
            if gbs % dp:
                out.append(
                    f"global_batch_size={gbs}: offline packing needs it to be a multiple of "
                    f"data_parallel_size={dp}; set global_batch_size to a multiple of {dp}"
                )
            if gbs < dp:
                out.append(
                    f"global_batch_size={gbs} is smaller than data_parallel_size={dp}: offline "
                    f"packing gives every data-parallel rank a row; set global_batch_size >= {dp}"
                )
        elif gbs % (mbs * dp):
            out.append(
                f"global_batch_size={gbs} is not a multiple of micro_batch_size * "
                f"data_parallel_size = {mbs} * {dp} = {mbs * dp}; set global_batch_size to a "
                f"multiple of {mbs * dp}"
            )
        if self.cp > 1:
            if self.seq_length % (2 * self.cp):
                out.append(
                    f"seq_length={self.seq_length}: context parallelism cp={self.cp} splits "
                    f"each sequence in 2*cp={2 * self.cp} chunks, so seq_length must be a "
                    f"multiple of {2 * self.cp}; round seq_length to a multiple of {2 * self.cp}"
                )
            if self.finetuning and not self.calculate_per_token_loss:
                out.append(
                    f"calculate_per_token_loss=False with cp={self.cp} and finetuning: the "
                    "loss must be summed per token across CP ranks; set "
                    "calculate_per_token_loss=True"
                )
            if self.finetuning and self.average_in_collective:
                out.append(
                    f"average_in_collective=True with cp={self.cp} and finetuning: averaging in "
                    "the collective breaks per-token loss normalisation; set "
                    "average_in_collective=False"
                )
        problems = (
            self._seq_length_mult_problem(modes),
            self.kernel_multiple
            and multiple_problem(
                "seq_length", self.seq_length, "kernel_multiple", self.kernel_multiple
            ),
            fixed_width_problem(self.pad_cu_seqlens, self.pad_to_max_length),
        )
        out += [problem for problem in problems if problem]
        out += self._cuda_graph_problems(modes)
        out += self._vision_budget_problems(modes)
        return out

    def _vision_budget_problems(self, modes: list[Mode]) -> list[str]:
        """The vision caps and balance: only where packs hold media, within a row."""
        out: list[str] = []
        budget = [
            f"{name}={getattr(self, name)!r}"
            for name in _VISION_FIELDS
            if getattr(self, name) not in (None, False)
        ]
        if budget and not {"online", "collate"} & set(modes):
            out.append(
                f"{', '.join(budget)} with packing mode {modes[0] if modes else 'none'}: the "
                "vision budget is applied by online and collate packing (offline packs hold "
                "text only); use mode online or collate, or drop it"
            )
        cap = self.max_vision_tokens
        if cap is not None and cap > self.seq_length:
            out.append(
                f"max_vision_tokens={cap} is above seq_length={self.seq_length}: vision tokens "
                "are among a row's tokens, so the cap never binds; set max_vision_tokens below "
                "seq_length (e.g. what the vision encoder fits in memory) or drop it"
            )
        if self.vision_balance and modes == ["collate"] and not self.pad_to_max_length:
            out.append(
                "vision_balance=True with collate packing and pad_to_max_length=False: each "
                "micro batch is one row, so there is nothing to balance; set "
                "pad_to_max_length=True (rows split within the caps) or drop vision_balance"
            )
        return out

    def _seq_length_mult_problem(self, modes: list[Mode]) -> str | None:
        """seq_length against the padding multiple. Offline rows without pad_to_max_length are
        only as wide as their aligned segments (at most seq_length rounded down to the
        multiple), so there, as in Megatron-Bridge, seq_length itself may be any length."""
        mult = self.pad_seq_to_mult()
        because = f"tp={self.tp}, cp={self.cp}, sp={self.sp}, eval_cp={self.eval_cp}"
        if modes == ["offline"]:
            if not self.pad_to_max_length:
                return None
            because += (
                "; pad_to_max_length=True makes every row seq_length wide and the parallel "
                "split needs the row width to be a multiple (Megatron-Bridge 0.6.2 does not "
                "check this for offline packs, the split fails at run time)"
            )
        return multiple_problem(
            "seq_length", self.seq_length, "pad_seq_to_mult", mult, because=because
        )

    def _cuda_graph_problems(self, modes: list[Mode]) -> list[str]:
        """CUDA graphs with collate or offline packs (online is refused above): every graph
        needs a static token width; graphs that capture attention also need static
        cu_seqlens shapes. MLP-only graphs do not read cu_seqlens."""
        packed = [mode for mode in modes if mode in ("collate", "offline")]
        if not self.cuda_graphs or not packed:
            return []
        scope = f"cuda_graph_scope={self.cuda_graph_scope!r}"
        stricter = (
            " (Megatron-Bridge 0.6.2 checks this for offline packs only; a collate batch's "
            "shapes change with its samples just the same)"
            if packed == ["collate"]
            else ""
        )
        out = []
        if not self.pad_to_max_length:
            out.append(
                f"cuda_graphs=True with {packed[0]} packing: a graph replays one token width, "
                f"so rows must be fixed-width{stricter}; set pad_to_max_length=True"
            )
        if self.graph_captures_attention() and not self.pad_cu_seqlens:
            out.append(
                f"cuda_graphs=True with {scope} captures attention, which reads cu_seqlens: "
                f"their shapes must be static{stricter}; set pad_cu_seqlens=True (and "
                "pad_to_max_length=True), or capture only modules without attention "
                "(e.g. cuda_graph_scope='mlp')"
            )
        return out

    def raise_if_invalid(self) -> None:
        """Raise one ``ValueError`` listing every violation; return quietly when valid."""
        problems = self.validate()
        if problems:
            listing = "\n".join(f"  - {p}" for p in problems)
            raise ValueError(f"{len(problems)} packing config violation(s):\n{listing}")


def _scope_problem(value: object) -> str | None:
    modules = value.split(",") if isinstance(value, str) else []
    if value == "full" or (modules and all(m in CUDA_GRAPH_MODULES for m in modules)):
        return None
    return (
        f"cuda_graph_scope must be 'full' or a comma-separated list of "
        f"{', '.join(CUDA_GRAPH_MODULES)}, got {value!r}"
    )


_VISION_FIELDS = ("max_vision_tokens", "max_media", "vision_balance")
_POSITIVE_INTS = frozenset(
    {"seq_length", "micro_batch_size", "global_batch_size", "data_parallel_size", "tp", "cp", "pp"}
)
_OPTIONAL_POSITIVE_INTS = frozenset(
    {"eval_cp", "kernel_multiple", "max_vision_tokens", "max_media"}
)
_BOOLS = frozenset(
    {
        "sp",
        "cuda_graphs",
        "calculate_per_token_loss",
        "average_in_collective",
        "pad_to_max_length",
        "pad_cu_seqlens",
        "finetuning",
        "vision_balance",
        *LEGACY_MODE_FLAGS,
    }
)


if TYPE_CHECKING:  # the old name, for type checkers
    PackingConfig = TrainingSetup
else:  # the old name, with a DeprecationWarning
    __getattr__ = renamed(__name__, "PackingConfig")
