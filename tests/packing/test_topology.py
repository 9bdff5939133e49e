"""Tests of topology helpers and packing config validation (energon_pack.packing.topology)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from energon_pack.packing import (
    DerivedValues,
    TokenSlotRow,
    TrainingSetup,
    equal_token_slot_table,
    pad_seq_to_mult,
)


@pytest.mark.parametrize(
    ("tp", "cp", "sp", "expected"),
    [(1, 1, False, 1), (4, 1, True, 4), (1, 2, False, 4), (4, 2, True, 8), (4, 1, False, 1)],
)
def test_pad_seq_to_mult_table(tp: int, cp: int, sp: bool, expected: int) -> None:
    assert pad_seq_to_mult(tp, cp, sp) == expected


def test_pad_seq_to_mult_with_eval_cp() -> None:
    assert pad_seq_to_mult(1, 2, False, eval_cp=4) == 8  # lcm(4, 8)
    assert pad_seq_to_mult(4, 2, True, eval_cp=1) == 8  # lcm(8, 4)
    assert pad_seq_to_mult(2, 3, True, eval_cp=2) == 12  # lcm(lcm(6, 6), lcm(4, 4))


def test_pad_seq_to_mult_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="cp must be a positive int, got 0"):
        pad_seq_to_mult(1, 0, False)


def test_equal_token_slot_table() -> None:
    assert equal_token_slot_table() == [
        TokenSlotRow(2048, 32, 65536),
        TokenSlotRow(4096, 16, 65536),
        TokenSlotRow(8192, 8, 65536),
    ]
    with pytest.raises(ValueError, match="token_slots=1000 is not a multiple of seq_length=3"):
        equal_token_slot_table(1000, (8, 3))


def valid(**overrides: Any) -> TrainingSetup:
    """A valid online config, with overrides."""
    settings: dict[str, Any] = {
        "seq_length": 8192,
        "mode": "online",
        "global_batch_size": 8,
        "data_parallel_size": 8,
        "packing_buffer_size": 16,
        "calculate_per_token_loss": True,
    }
    settings.update(overrides)
    return TrainingSetup(**settings)


def test_valid_configs_have_no_violations() -> None:
    assert valid().validate() == []
    assert valid(mode="collate", micro_batch_size=2, global_batch_size=16).validate() == []
    assert valid(mode="offline", packing_buffer_size=0).validate() == []
    assert TrainingSetup(seq_length=100).validate() == []
    valid().raise_if_invalid()


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"micro_batch_size": 2, "global_batch_size": 16}, r"micro_batch_size=2: online .*=1"),
        ({"packing_buffer_size": 0}, r"packing_buffer_size=0: online packing needs .* > 0"),
        # Megatron Core 0.19 rolls MTP targets inside each packed segment: MTP is allowed.
        ({"mtp": True}, None),
        ({"mtp": 2}, None),
        (
            {"calculate_per_token_loss": False},
            r"calculate_per_token_loss=False: online packing .* set calculate_per_token_loss=True",
        ),
        (
            {"average_in_collective": True},
            r"average_in_collective=True: with online packing .* set average_in_collective=False",
        ),
        ({"cuda_graphs": True}, r"cuda_graphs=True: online packing .* disable cuda_graphs"),
        ({"pp": 2}, r"pp=2: online packing does not support pipeline parallelism; set pp=1"),
        ({"mode": "collate"}, r"micro_batch_size=1: collate-time packing .* > 1"),
        (
            {"mode": "offline", "micro_batch_size": 2, "global_batch_size": 16},
            r"micro_batch_size=2: offline packed data .* set micro_batch_size=1",
        ),
        (
            {"mode": "offline", "global_batch_size": 12},
            r"global_batch_size=12: offline packing needs it to be a multiple of "
            r"data_parallel_size=8",
        ),
        (
            {"global_batch_size": 12},
            r"global_batch_size=12 is not a multiple of micro_batch_size \* data_parallel_size",
        ),
        (
            {"online_packing": True, "offline_packing": True, "mode": "none"},
            r"packing modes are mutually exclusive: online_packing=True, offline_packing=True "
            r"select online, offline",
        ),
        (
            {"seq_length": 8194, "cp": 2, "finetuning": False, "eval_cp": 1},
            r"seq_length=8194: context parallelism cp=2 .* multiple of 4",
        ),
        (
            {"cp": 2, "finetuning": True, "calculate_per_token_loss": False},
            r"calculate_per_token_loss=False with cp=2 and finetuning: .* set "
            r"calculate_per_token_loss=True",
        ),
        (
            {"cp": 2, "finetuning": True, "calculate_per_token_loss": True},
            None,
        ),
        (
            {
                "cp": 2,
                "finetuning": True,
                "calculate_per_token_loss": True,
                "average_in_collective": True,
            },
            r"average_in_collective=True with cp=2 and finetuning: .* set "
            r"average_in_collective=False",
        ),
        (
            {"seq_length": 8196, "tp": 8, "sp": True},
            r"seq_length=8196 is not a multiple of pad_seq_to_mult=8 \(tp=8, cp=1, sp=True",
        ),
        (
            {"kernel_multiple": 128, "seq_length": 8000},
            r"seq_length=8000 is not a multiple of kernel_multiple=128; round seq_length",
        ),
        (
            {"pad_cu_seqlens": True},
            r"pad_cu_seqlens=True .* requires fixed-width rows; set pad_to_max_length=True",
        ),
        (
            {"mode": "offline", "cuda_graphs": True, "pad_to_max_length": True},
            r"cuda_graphs=True with cuda_graph_scope='full' captures attention, which reads "
            r"cu_seqlens: .* set pad_cu_seqlens=True",
        ),
        (
            {"mode": "offline", "cuda_graphs": True, "cuda_graph_scope": "mlp,attn"},
            r"cuda_graph_scope='mlp,attn' captures attention",
        ),
        (
            {"mode": "offline", "cuda_graphs": True, "cuda_graph_scope": "mlp"},
            r"cuda_graphs=True with offline packing: a graph replays one token width, so rows "
            r"must be fixed-width; set pad_to_max_length=True",
        ),
        # MLP-only graphs read no cu_seqlens (Megatron-Bridge 0.6.2 agrees).
        (
            {
                "mode": "offline",
                "cuda_graphs": True,
                "cuda_graph_scope": "mlp,moe",
                "pad_to_max_length": True,
            },
            None,
        ),
        (
            {
                "mode": "collate",
                "micro_batch_size": 2,
                "global_batch_size": 16,
                "cuda_graphs": True,
                "cuda_graph_scope": "mlp",
                "pad_to_max_length": True,
            },
            None,
        ),
        (
            {
                "mode": "collate",
                "micro_batch_size": 2,
                "global_batch_size": 16,
                "cuda_graphs": True,
                "pad_to_max_length": True,
                "pad_cu_seqlens": True,
            },
            None,
        ),
        (
            {
                "mode": "collate",
                "micro_batch_size": 2,
                "global_batch_size": 16,
                "cuda_graphs": True,
                "pad_to_max_length": True,
            },
            r"captures attention, .* must be static \(Megatron-Bridge 0.6.2 checks this for "
            r"offline packs only; .*\); set pad_cu_seqlens=True",
        ),
        # Offline rows without pad_to_max_length are only as wide as their aligned segments.
        ({"mode": "offline", "seq_length": 4098, "tp": 4, "sp": True}, None),
        (
            {"mode": "offline", "seq_length": 4098, "tp": 4, "sp": True, "pad_to_max_length": True},
            r"seq_length=4098 is not a multiple of pad_seq_to_mult=4 \(tp=4, .*; "
            r"pad_to_max_length=True makes every row seq_length wide",
        ),
        ({"seq_length": 4098, "tp": 4, "sp": True}, r"seq_length=4098 is not a multiple of"),
    ],
)
def test_each_rule(overrides: dict[str, Any], pattern: str | None) -> None:
    config = valid(**overrides)
    if pattern is None:
        assert config.validate() == []
    else:
        assert any(re.search(pattern, p) for p in config.validate())
        with pytest.raises(ValueError, match=pattern):
            config.raise_if_invalid()


def test_offline_gbs_smaller_than_dp_reports_both_rules() -> None:
    problems = valid(mode="offline", global_batch_size=4).validate()
    assert len(problems) == 2
    assert "global_batch_size=4: offline packing needs it to be a multiple" in problems[0]
    assert "global_batch_size=4 is smaller than data_parallel_size=8" in problems[1]


def test_cp_seq_length_reported_by_both_cp_and_mult_rules() -> None:
    problems = valid(seq_length=8190, cp=2).validate()
    assert [p.split(":")[0].split(" ")[0] for p in problems] == [
        "seq_length=8190",
        "seq_length=8190",
    ]
    assert "eval_cp" in problems[1]


def test_legacy_flag_agreeing_with_mode_is_fine() -> None:
    config = valid(online_packing=True)
    assert config.validate() == []
    assert config.selected_modes() == ["online"]
    legacy = TrainingSetup(seq_length=4096, collate_packing=True, micro_batch_size=2)
    assert legacy.selected_modes() == ["collate"]
    assert legacy.derived().mode == "collate"


def test_mode_and_contradicting_legacy_flag() -> None:
    problems = valid(collate_packing=True).validate()
    assert problems[0].startswith(
        "packing modes are mutually exclusive: mode='online', collate_packing=True"
    )
    # the rules of every selected mode apply
    assert any("collate-time packing" in p for p in problems)


def test_validate_collects_every_violation() -> None:
    config = valid(
        micro_batch_size=2,
        global_batch_size=16,
        packing_buffer_size=0,
        mtp=1,
        cuda_graphs=True,
        pp=4,
        cp=2,
        seq_length=8190,
        finetuning=True,
        average_in_collective=True,
        pad_cu_seqlens=True,
        kernel_multiple=64,
    )
    problems = config.validate()
    assert len(problems) == 10
    with pytest.raises(ValueError, match=r"10 packing config violation\(s\):\n  - micro_batch"):
        config.raise_if_invalid()


def test_long_context_preset_validates_clean() -> None:
    config = TrainingSetup.long_context_preset()
    assert config.seq_length == 16384
    assert config.cp == 2
    assert config.validate() == []
    assert config.derived() == DerivedValues(
        mode="online", pad_seq_to_mult=8, token_slots_per_step=16384 * 8, micro_batches_per_step=8
    )
    assert TrainingSetup.long_context_preset(average_in_collective=True).validate() != []


def test_derived_values() -> None:
    derived = valid(
        mode="collate", micro_batch_size=2, global_batch_size=32, tp=4, sp=True
    ).derived()
    assert derived == DerivedValues(
        mode="collate", pad_seq_to_mult=4, token_slots_per_step=8192 * 32, micro_batches_per_step=2
    )


# --- construction and loading ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"seq_length": 0}, "seq_length must be a positive int, got 0"),
        ({"tp": "4"}, "tp must be a positive int, got '4'"),
        ({"sp": 1}, "sp must be true or false, got 1"),
        ({"cp": True}, "cp must be a positive int, got True"),
        ({"mode": "greedy"}, "mode must be one of online, collate, offline, none, got 'greedy'"),
        ({"mtp": -1}, "mtp must be a bool or a number of MTP layers >= 0, got -1"),
        ({"packing_buffer_size": -2}, r"packing_buffer_size must be an int >= 0 \(0 = no buffer\)"),
        ({"eval_cp": 0}, "eval_cp must be a positive int or null, got 0"),
        (
            {"cuda_graph_scope": "attention"},
            r"cuda_graph_scope must be 'full' or a comma-separated list of attn, mlp, .* got "
            r"'attention'",
        ),
    ],
)
def test_wrong_types_are_rejected(overrides: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        valid(**overrides)


def test_wrong_types_are_all_listed() -> None:
    with pytest.raises(ValueError, match=r"tp must be .*; sp must be .*; pp must be"):
        TrainingSetup(seq_length=8, tp=0, pp=0, sp="yes")  # type: ignore[arg-type]


def test_from_mapping_rejects_unknown_keys() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown packing config key\(s\) 'seq_len', 'tpp'; valid keys: seq_length, mode,",
    ):
        TrainingSetup.from_mapping({"seq_len": 8, "tpp": 2})


def test_from_mapping_needs_seq_length() -> None:
    with pytest.raises(ValueError, match="packing config needs seq_length"):
        TrainingSetup.from_mapping({"tp": 2})


def test_from_yaml_text() -> None:
    text = """
seq_length: 16384
mode: online
micro_batch_size: 1
global_batch_size: 8
tp: 4
cp: 2
sp: true
packing_buffer_size: 16
finetuning: true
calculate_per_token_loss: true
eval_cp: null
"""
    config = TrainingSetup.from_mapping(yaml.safe_load(text))
    assert config.cp == 2
    assert config.sp is True
    assert config.eval_cp is None
    assert config.validate() == []
    with pytest.raises(ValueError, match="sp must be true or false, got 'on'"):
        TrainingSetup.from_mapping(yaml.safe_load("seq_length: 8\nsp: 'on'\n"))
