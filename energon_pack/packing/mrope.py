"""mRoPE (3-D) position ids for the Qwen-VL models, per sequence and for packed THD rows.

Qwen-VL models rotate with three position streams (temporal, height, width). Text tokens carry
the same position on all three; the tokens of an image or video block (the pad tokens after a
``<|vision_start|>``) carry their merged-grid coordinates offset by the position where the block
starts, and text after a block continues past it. In a packed row every segment is computed
on its own, from position 0 and with the grids of its own images, so the ids equal what
transformers' ``get_rope_index`` gives for each sequence alone (transformers versions differ in
one rule for videos, see :attr:`MRopeConfig.text_after_vision`). Qwen3-VL, Qwen3-VL-MoE and
Qwen3.5 write a video as one block per temporal patch, each behind its timestamp text, and
position each block as a one-frame grid (:attr:`MRopeConfig.rule`).

Gaps (alignment padding after a segment's real tokens, including the tail absorbed by the last
segment) continue counting on all three streams from the segment's largest position + 1:
gap token ``k`` (0-based) of segment ``i`` gets ``max_position_i + 1 + k``, which is also
``local index + rope_delta_i``, the position transformers gives tokens appended to a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from energon_pack.checks import check_config, check_int, check_number
from energon_pack.media.tokens import SpecialTokens, special_token_id
from energon_pack.packing.row import first_true

TextAfterVision = Literal["max", "spatial"]
MRopeRule = Literal["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
_RULES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

_TEXT, _IMAGE, _VIDEO = 0, 1, 2
_KIND_NAMES = {_IMAGE: "image", _VIDEO: "video"}


@dataclass(frozen=True)
class MRopeConfig:
    """Token ids and grid settings of the mRoPE computation.

    ``tokens_per_second`` set (Qwen2.5-VL, e.g. 2 or 25) spaces the temporal index of video
    frames by ``tokens_per_second * second_per_grid_t``; None (Qwen2-VL) uses the temporal
    patch index. Images always have temporal offset 0.

    ``text_after_vision`` says where text resumes after a vision block:

    * ``"max"`` (default): the block's largest position + 1 on any stream. This is Qwen's
      reference rule (transformers 4.x to 5.2, vLLM, Megatron), which the released checkpoints
      were trained with;
    * ``"spatial"``: block start + ``max(h, w) / merge``, the rule of transformers >= 5.3.

    The two agree for images, and for videos whose temporal span stays below their spatial one.

    ``rule`` is the model family's position rule (a family preset's ``rope``); it says how a
    video's placeholders map to its ``video_grid_thw`` row ``(t, h, w)``:

    * ``"qwen2_vl"`` (default) and ``"qwen2_5_vl"``: one block of ``t*h*w / merge**2`` pads,
      frames spaced as above; ``"qwen2_5_vl"`` requires ``tokens_per_second``;
    * ``"qwen3_vl"`` (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5): ``t`` blocks of ``h*w / merge**2`` pads,
      one per temporal patch (time is carried by the timestamp text between them), each
      positioned as a grid ``(1, h, w)``. ``tokens_per_second`` must be None and
      ``second_per_grid_ts`` is not read.
    """

    vision_start_token_id: int
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int = 2
    tokens_per_second: float | None = None
    text_after_vision: TextAfterVision = "max"
    rule: MRopeRule = "qwen2_vl"

    def __post_init__(self) -> None:
        for name, token in (
            ("vision_start_token_id", "<|vision_start|>"),
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
        ):
            check_int(
                f"MRopeConfig.{name}",
                getattr(self, name),
                minimum=0,
                fix=f"pass the tokenizer's id of {token} (MRopeConfig.from_tokenizer reads it)",
            )
        check_int(
            "MRopeConfig.spatial_merge_size",
            self.spatial_merge_size,
            fix="Qwen2-VL and Qwen2.5-VL use 2",
        )
        check_number(
            "MRopeConfig.tokens_per_second",
            self.tokens_per_second,
            none_ok=True,
            fix="Qwen2.5-VL uses vision_config.tokens_per_second (2 or 25), Qwen2-VL None",
        )
        if self.text_after_vision not in ("max", "spatial"):
            raise ValueError(
                f"text_after_vision must be 'max' or 'spatial', got {self.text_after_vision!r}"
            )
        if self.rule not in _RULES:
            raise ValueError(
                f"MRopeConfig.rule must be 'qwen2_vl', 'qwen2_5_vl' or 'qwen3_vl' (Qwen3-VL, "
                f"Qwen3-VL-MoE, Qwen3.5), got {self.rule!r}"
            )
        if self.rule == "qwen2_5_vl" and self.tokens_per_second is None:
            raise ValueError(
                "MRopeConfig(rule='qwen2_5_vl') needs tokens_per_second (the model's "
                "vision_config.tokens_per_second, e.g. 2)"
            )
        if self.rule == "qwen3_vl" and self.tokens_per_second is not None:
            raise ValueError(
                f"MRopeConfig(rule='qwen3_vl') takes no tokens_per_second (got "
                f"{self.tokens_per_second}): Qwen3-VL carries time in timestamp text, not in the "
                "temporal position; leave tokens_per_second None"
            )
        ids = (self.vision_start_token_id, self.image_token_id, self.video_token_id)
        if len(set(ids)) != 3:
            raise ValueError(
                f"vision_start/image/video token ids must differ, got {ids}; pass the ids of "
                "<|vision_start|>, <|image_pad|> and <|video_pad|>"
            )

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: SpecialTokens,
        tokens_per_second: float | None = None,
        spatial_merge_size: int = 2,
        text_after_vision: TextAfterVision = "max",
        rule: MRopeRule = "qwen2_vl",
    ) -> MRopeConfig:
        """The config with the ids of ``<|vision_start|>``, ``<|image_pad|>``, ``<|video_pad|>``."""
        return cls(
            vision_start_token_id=special_token_id(tokenizer, "<|vision_start|>"),
            image_token_id=special_token_id(tokenizer, "<|image_pad|>"),
            video_token_id=special_token_id(tokenizer, "<|video_pad|>"),
            spatial_merge_size=spatial_merge_size,
            tokens_per_second=tokens_per_second,
            text_after_vision=text_after_vision,
            rule=rule,
        )


PositionIds = Literal["1d", "mrope"]


class _MergeSize(Protocol):
    @property
    def merge_size(self) -> int: ...


class _RopeFamily(Protocol):
    """What the position code reads of a model family (:class:`~energon_pack.ModelFamily`)."""

    @property
    def rope(self) -> MRopeRule: ...
    @property
    def tokens_per_second(self) -> float | None: ...
    @property
    def media(self) -> _MergeSize: ...


def mrope_setting(
    position_ids: PositionIds | MRopeConfig,
    mrope: MRopeConfig | None,
    tokenizer: SpecialTokens,
    family: _RopeFamily | None = None,
) -> MRopeConfig | None:
    """The mRoPE config a packer uses for its ``position_ids`` option (None for ``"1d"``):
    ``position_ids`` itself when it is an :class:`MRopeConfig`; for ``"mrope"``, ``mrope`` (the
    deprecated keyword) if given, else the ``family``'s rule (its ``rope``,
    ``tokens_per_second`` and merge size), else Qwen2-VL behaviour, with the tokenizer's
    special-token ids. An ``mrope`` given with ``"1d"`` is a ValueError (it would be
    ignored)."""
    check_config("mrope", mrope, MRopeConfig)
    if isinstance(position_ids, MRopeConfig):
        return position_ids
    if position_ids not in ("1d", "mrope"):
        raise ValueError(
            f"position_ids must be '1d', 'mrope' or an MRopeConfig, got {position_ids!r}"
        )
    if position_ids == "1d":
        if mrope is not None:
            raise ValueError(
                f"mrope=MRopeConfig(rule={mrope.rule!r}, ...) is set but position_ids='1d' "
                "computes no mRoPE ids, so batches would carry 1-D positions only; pass "
                "position_ids=MRopeConfig(...) (or leave mrope unset for a text model)"
            )
        return None
    if mrope is not None:
        return mrope
    if family is None:
        return MRopeConfig.from_tokenizer(tokenizer)
    return MRopeConfig.from_tokenizer(
        tokenizer,
        tokens_per_second=family.tokens_per_second,
        spatial_merge_size=family.media.merge_size,
        rule=family.rope,
    )


def mrope_position_ids(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
    config: MRopeConfig,
) -> tuple[torch.Tensor, int]:
    """Position ids ``[3, L]`` long and the rope delta (max position + 1 - L) of one sequence.

    ``input_ids`` is ``[L]`` (no batch dim, no padding); the grids are those of its images and
    videos in placeholder order. Errors name segment 0.
    """
    ids = _as_long_1d(input_ids, "input_ids")
    bounds = torch.tensor([0, ids.numel()], dtype=torch.long)
    positions, deltas = packed_mrope_position_ids(
        ids, bounds, bounds, image_grid_thw, video_grid_thw, second_per_grid_ts, config
    )
    return positions, int(deltas[0])


def packed_mrope_position_ids(
    row_input_ids: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    cu_seqlens: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
    config: MRopeConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mRoPE ids ``[3, T]`` long and rope deltas ``[N]`` long of a packed row of ``N`` segments.

    Segment ``i`` holds row tokens ``[cu_seqlens_padded[i], cu_seqlens_padded[i] + length_i)``
    with ``length_i = cu_seqlens[i+1] - cu_seqlens[i]``; the rest of its physical span is gap.
    Each segment restarts at 0. The row's grids (and ``second_per_grid_ts``, one per video,
    1.0 s each when None as in transformers; not read under rule ``"qwen3_vl"``) are in segment
    order and go to the vision blocks in token order (under ``"qwen3_vl"`` a video grid goes to
    its ``t`` blocks, one frame each). Empty static slots (repeated last boundary) get delta 0.
    Gap positions are described in the module docstring.

    All tensors are CPU tensors (this runs in the data loader). Raises ValueError if the
    boundaries do not describe the row, a pad-token run does not follow
    ``<|vision_start|>``, the block count differs from the grid count, or a block's pad count is
    not ``t*h*w / spatial_merge_size**2`` (``h*w / ...`` per video block under ``"qwen3_vl"``).
    """
    ids = _as_long_1d(row_input_ids, "row_input_ids")
    total = ids.numel()
    offsets, lengths = _segments(cu_seqlens_padded, cu_seqlens, total)
    n_seg = lengths.numel()
    spans = offsets[1:] - offsets[:-1]

    def per_token(values: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(values, spans, output_size=total)

    seg_idx = per_token(torch.arange(n_seg))
    local = torch.arange(total) - per_token(offsets[:-1])
    real = local < per_token(lengths)
    kind = (ids == config.image_token_id).long() * _IMAGE
    kind += (ids == config.video_token_id).long() * _VIDEO
    kind *= real
    in_vision = kind != _TEXT

    # Pad-token runs (blocks), never crossing a segment start.
    fresh = torch.ones(total, dtype=torch.bool)
    fresh[1:] = kind[1:] != kind[:-1]
    run_start = in_vision & (fresh | (local == 0))
    starts = run_start.nonzero().flatten()
    run_end = torch.ones(total, dtype=torch.bool)
    run_end[:-1] = run_start[1:] | ~in_vision[1:]
    ends = (in_vision & run_end).nonzero().flatten() + 1
    block_kind = kind[starts]
    block_seg = seg_idx[starts]
    block_len = ends - starts
    _check_vision_start(ids, starts, local, block_seg, block_kind, config)

    grids, interval = _block_grids(
        block_kind, block_seg, n_seg, image_grid_thw, video_grid_thw, second_per_grid_ts, config
    )
    merge = config.spatial_merge_size
    grid_h, grid_w = grids[:, 1] // merge, grids[:, 2] // merge
    _check_block_lengths(block_len, grids, block_kind, block_seg, starts, local, config)

    # Offsets (temporal, row, column) of every vision token inside its block.
    n_vis = int(block_len.sum())

    def per_vision_token(values: torch.Tensor) -> torch.Tensor:
        return torch.repeat_interleave(values, block_len, output_size=n_vis)

    block_start = per_vision_token(starts)
    index = torch.arange(n_vis) - per_vision_token(_exclusive_cumsum(block_len))
    plane, width = per_vision_token(grid_h * grid_w), per_vision_token(grid_w)
    frame = (index // plane).to(interval.dtype)
    vision_offsets = torch.zeros((3, total), dtype=torch.long)
    vision_offsets[:, block_start + index] = torch.stack(
        (
            (frame * per_vision_token(interval)).long(),
            (index % plane) // width,
            index % width,
        )
    )

    # 1-D cursor: +1 per text token; the last token of a block advances past the block.
    if config.text_after_vision == "max":
        last_t = ((grids[:, 0] - 1).to(interval.dtype) * interval).long()
        advance = torch.maximum(last_t, torch.maximum(grid_h, grid_w) - 1) + 1
    else:
        advance = torch.maximum(grid_h, grid_w)
    step = (real & ~in_vision).long()
    step[ends - 1] = advance
    cursor = torch.cat((step.new_zeros(1), torch.cumsum(step, 0)))  # [T+1], before each token
    positions = (cursor[:-1] - per_token(cursor[offsets[:-1]])) + vision_offsets

    seg_max = torch.full((n_seg,), -1, dtype=torch.long)
    seg_max.scatter_reduce_(0, seg_idx, torch.where(real, positions.amax(0), -1), "amax")
    deltas = torch.where(lengths > 0, seg_max + 1 - lengths, 0)
    positions = torch.where(real, positions, local + per_token(deltas))
    return positions, deltas


def _as_long_1d(value: torch.Tensor, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.ndim != 1 or tensor.is_floating_point() or tensor.dtype == torch.bool:
        raise ValueError(
            f"{name} must be a 1-D integer tensor [L], got shape {tuple(tensor.shape)} and "
            f"dtype {tensor.dtype}; pass one unbatched token sequence"
        )
    return tensor.long()


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


def _segments(
    cu_seqlens_padded: torch.Tensor, cu_seqlens: torch.Tensor, total: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical offsets ``[N+1]`` and real lengths ``[N]``, checked against the row."""
    offsets = _as_long_1d(cu_seqlens_padded, "cu_seqlens_padded")
    cumulative = _as_long_1d(cu_seqlens, "cu_seqlens")
    if offsets.numel() < 2 or offsets.numel() != cumulative.numel():
        raise ValueError(
            f"cu_seqlens_padded ({offsets.numel()} entries) and cu_seqlens "
            f"({cumulative.numel()} entries) must both be [N+1] with N >= 1; pass the row's own "
            "boundaries"
        )
    spans = offsets[1:] - offsets[:-1]
    lengths = cumulative[1:] - cumulative[:-1]
    if int(offsets[0]) != 0 or int(cumulative[0]) != 0 or int(offsets[-1]) != total:
        raise ValueError(
            f"cu_seqlens_padded must run from 0 to the row length {total} and cu_seqlens start "
            f"at 0, got {offsets.tolist()} and {cumulative.tolist()}; pass the boundaries of "
            "this row"
        )
    if (i := first_true((lengths < 0) | (lengths > spans))) is not None:
        raise ValueError(
            f"segment {i}: real length {int(lengths[i])} (from cu_seqlens) must be between 0 "
            f"and its physical span {int(spans[i])} (from cu_seqlens_padded); pass cu_seqlens "
            "as cumulative real lengths and cu_seqlens_padded as cumulative physical ones"
        )
    return offsets, lengths


def _first_bad(bad: torch.Tensor, block_kind: torch.Tensor) -> tuple[int, str] | None:
    """The first vision block flagged in ``bad`` and its kind's name, or None."""
    j = first_true(bad)
    return None if j is None else (j, _KIND_NAMES[int(block_kind[j])])


def _check_vision_start(
    ids: torch.Tensor,
    starts: torch.Tensor,
    local: torch.Tensor,
    block_seg: torch.Tensor,
    block_kind: torch.Tensor,
    config: MRopeConfig,
) -> None:
    previous = ids[(starts - 1).clamp(min=0)]
    found = _first_bad(
        (local[starts] == 0) | (previous != config.vision_start_token_id), block_kind
    )
    if found is not None:
        j, name = found
        raise ValueError(
            f"segment {int(block_seg[j])}: <|{name}_pad|> tokens at token "
            f"{int(local[starts[j]])} do not follow <|vision_start|> (id "
            f"{config.vision_start_token_id}); every block must be <|vision_start|> + pads, "
            "check the token ids in MRopeConfig"
        )


def _block_grids(
    block_kind: torch.Tensor,
    block_seg: torch.Tensor,
    n_seg: int,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
    config: MRopeConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid ``[B, 3]`` and temporal step ``[B]`` (float) of each block, in token order."""
    grids = torch.zeros((block_kind.numel(), 3), dtype=torch.long)
    dtype = torch.float32
    if second_per_grid_ts is not None and second_per_grid_ts.is_floating_point():
        dtype = second_per_grid_ts.dtype
    interval = torch.ones(block_kind.numel(), dtype=dtype)
    for code, given in ((_IMAGE, image_grid_thw), (_VIDEO, video_grid_thw)):
        name = _KIND_NAMES[code]
        table = _grid_table(given, name, config)
        per_frame = code == _VIDEO and config.rule == "qwen3_vl"
        if per_frame:
            table = _frames(table)
        mine = block_kind == code
        _check_block_count(block_seg[mine], n_seg, table.shape[0], name, per_frame=per_frame)
        grids[mine] = table
        if code == _VIDEO and config.tokens_per_second is not None:
            interval[mine] = _video_seconds(second_per_grid_ts, table.shape[0], dtype) * (
                config.tokens_per_second
            )
    return grids, interval


def _grid_table(given: torch.Tensor | None, name: str, config: MRopeConfig) -> torch.Tensor:
    if given is None:
        return torch.zeros((0, 3), dtype=torch.long)
    table = torch.as_tensor(given)
    if table.ndim != 2 or table.shape[1] != 3 or table.is_floating_point():
        raise ValueError(
            f"{name}_grid_thw must be an integer tensor [n, 3] of (t, h, w) patch grids, got "
            f"shape {tuple(table.shape)} and dtype {table.dtype}"
        )
    table = table.long()
    merge = config.spatial_merge_size
    bad = (table < 1).any(1) | (table[:, 1] % merge != 0) | (table[:, 2] % merge != 0)
    if (g := first_true(bad)) is not None:
        raise ValueError(
            f"{name}_grid_thw[{g}] = {table[g].tolist()}: t, h, w must be >= 1 and h, w "
            f"multiples of spatial_merge_size={merge}; pass the grids the vision processor made"
        )
    return table


def _frames(table: torch.Tensor) -> torch.Tensor:
    """Each video grid ``(t, h, w)`` as ``t`` one-frame grids ``(1, h, w)`` (Qwen3-VL rule)."""
    frames = torch.repeat_interleave(table, table[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def _check_block_count(
    block_seg: torch.Tensor, n_seg: int, grid_count: int, name: str, *, per_frame: bool
) -> None:
    block_count = block_seg.numel()
    if block_count == grid_count:
        return
    per_segment = torch.bincount(block_seg, minlength=n_seg)
    reached = torch.cumsum(per_segment, 0)
    segment = int((reached > grid_count).nonzero()[0, 0]) if block_count > grid_count else n_seg - 1
    if per_frame:
        grids = (
            f"video_grid_thw holds {grid_count} temporal patches (its t summed; "
            "MRopeConfig(rule='qwen3_vl') reads one block per temporal patch)"
        )
        hint = "; ids with one block per video need MRopeConfig(rule='qwen2_vl')"
    else:
        grids = f"{name}_grid_thw has {grid_count} rows"
        hint = ""
        if name == "video":
            hint = (
                "; ids with one block per temporal patch (Qwen3-VL) need "
                "MRopeConfig(rule='qwen3_vl')"
            )
    raise ValueError(
        f"segment {segment}: the tokens up to this segment hold {int(reached[segment])} {name} "
        f"blocks but {grids} (blocks per segment: {per_segment.tolist()}); pass one grid per "
        f"<|vision_start|> + <|{name}_pad|> block, in segment order, with the media of exactly "
        f"the row's samples{hint}"
    )


def _video_seconds(
    second_per_grid_ts: torch.Tensor | None, videos: int, dtype: torch.dtype
) -> torch.Tensor:
    if second_per_grid_ts is None:
        return torch.ones(videos, dtype=dtype)
    seconds = torch.as_tensor(second_per_grid_ts).to(dtype).flatten()
    if seconds.numel() != videos:
        raise ValueError(
            f"second_per_grid_ts has {seconds.numel()} values but there are {videos} videos; "
            "pass one value (seconds per temporal patch) per video_grid_thw row"
        )
    return seconds


def _check_block_lengths(
    block_len: torch.Tensor,
    grids: torch.Tensor,
    block_kind: torch.Tensor,
    block_seg: torch.Tensor,
    starts: torch.Tensor,
    local: torch.Tensor,
    config: MRopeConfig,
) -> None:
    merge = config.spatial_merge_size
    expected = grids[:, 0] * (grids[:, 1] // merge) * (grids[:, 2] // merge)
    found = _first_bad(block_len != expected, block_kind)
    if found is not None:
        j, name = found
        raise ValueError(
            f"segment {int(block_seg[j])}: the {name} block at token {int(local[starts[j]])} has "
            f"{int(block_len[j])} <|{name}_pad|> tokens but its grid {grids[j].tolist()} needs "
            f"t*h*w/{merge}**2 = {int(expected[j])}; the grids are out of step with the "
            "placeholders (media order or count) or spatial_merge_size is wrong"
        )
