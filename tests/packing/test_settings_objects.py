"""Settings as objects: ``BufferConfig`` and ``VisionBudget`` accepted by the packer, the task
encoder, the collator, tune and the topology check; the keywords of earlier releases still work
with a warning naming the new spelling; a keyword given twice is refused by name; the choosers
the budget picks; the packer's one "does it fit" answer."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import (
    BufferConfig,
    MediaConfig,
    MRopeConfig,
    OnlineBinPacker,
    PackingTaskEncoder,
    RowLayout,
    VisionBudget,
    VLMPackingCollator,
    make_encoder,
)
from energon_pack.encoding.chatml import ByteTokenizer
from energon_pack.packing.bins import aligned_length
from energon_pack.packing.choosers import BalancedChooser, CappedChooser, TokenChooser
from energon_pack.packing.topology import TrainingSetup
from energon_pack.tune import TuneSettings

CONSTRUCTORS = (OnlineBinPacker, PackingTaskEncoder, VLMPackingCollator)


@pytest.mark.parametrize("cls", CONSTRUCTORS, ids=lambda c: c.__name__)
def test_the_constructors_take_at_most_twelve_parameters(cls: type) -> None:
    params = [
        p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
    ]
    assert len(params) <= 12, [p.name for p in params]


def _items(seed: int, count: int = 200) -> list[tuple[int, int, int]]:
    """(length, vision tokens, media) of a seeded VLM-like stream."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        media = rng.choice([0, 0, 0, 1, 2, 4])
        vision = sum(rng.randint(64, 900) for _ in range(media))
        out.append((vision + rng.randint(20, 1500), vision, media))
    return out


def _bins(packer: OnlineBinPacker, items: list[tuple[int, int, int]]) -> list[tuple[Any, ...]]:
    bins = []
    for key, (length, vision, media) in enumerate(items):
        bins += packer.push(key, length, vision_tokens=vision, media=media)
    bins += packer.flush()
    return [b.keys for b in bins]


OLD_AND_NEW: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"max_wait": 8, "min_fill": 0.95}, {"buffer": BufferConfig(max_wait=8, min_fill=0.95)}),
    ({"max_bytes": 30_000}, {"buffer": BufferConfig(max_bytes=30_000)}),
    ({"max_vision_tokens": 3000}, {"vision": VisionBudget(max_vision_tokens=3000)}),
    (
        {"max_media": 5, "vision_balance": True, "max_wait": None},
        {"vision": VisionBudget(max_media=5, balance=True), "buffer": BufferConfig(max_wait=None)},
    ),
]


@pytest.mark.parametrize(("old", "new"), OLD_AND_NEW)
def test_old_keywords_pack_exactly_as_the_objects_and_warn_with_the_new_spelling(
    old: dict[str, Any], new: dict[str, Any]
) -> None:
    items = _items(seed=len(old))
    with pytest.warns(DeprecationWarning, match="is deprecated") as caught:
        legacy = OnlineBinPacker(8192, 16, overlong="skip", **old)
    message = str(caught[0].message)
    for group, value in new.items():
        assert f"{group}={type(value).__name__}(" in message
    current = OnlineBinPacker(8192, 16, overlong="skip", **new)
    assert legacy.settings() == current.settings()
    assert _bins(legacy, items) == _bins(current, items)


def test_a_keyword_given_twice_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"max_wait= and buffer= are both given"):
        OnlineBinPacker(100, 4, buffer=BufferConfig(), max_wait=3)
    with pytest.raises(ValueError, match=r"max_media= and vision= are both given"):
        PackingTaskEncoder(seq_length=64, vision=VisionBudget(), max_media=2)
    with pytest.raises(ValueError, match=r"pad_to_max_length= and layout= are both given"):
        VLMPackingCollator(layout=RowLayout(64), pad_to_max_length=True)
    mrope = MRopeConfig.from_tokenizer(ByteTokenizer())
    with pytest.raises(ValueError, match=r"mrope= and position_ids= are both given"):
        VLMPackingCollator(64, position_ids=mrope, mrope=mrope)
    encoder = make_encoder()
    with pytest.raises(ValueError, match=r"system_prompt= and encoder= are both given"):
        PackingTaskEncoder(seq_length=64, encoder=encoder, system_prompt="hi")


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_wiat'"):
        OnlineBinPacker(100, 4, max_wiat=3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'seqlen'"):
        VLMPackingCollator(64, seqlen=3)


def test_the_task_encoder_keeps_its_fingerprint_under_either_spelling() -> None:
    monitor_free = {"max_wait": 8, "min_fill": 0.9, "packing_buffer_bytes": 10**6}
    with pytest.warns(DeprecationWarning, match="PackingTaskEncoder"):
        legacy = PackingTaskEncoder(
            seq_length=256,
            pad_to_max_length=True,
            max_vision_tokens=100,
            vision_balance=True,
            decode="eager",
            system_prompt="Be brief.",
            **monitor_free,
        )
    current = PackingTaskEncoder(
        encoder=make_encoder(None, system_prompt="Be brief."),
        layout=RowLayout(256, pad_to_max_length=True, pad_token_id=legacy.layout.pad_token_id),
        buffer=BufferConfig(max_wait=8, min_fill=0.9, max_bytes=10**6, decode="eager"),
        vision=VisionBudget(max_vision_tokens=100, balance=True),
    )
    assert legacy.packing_settings(16) == current.packing_settings(16)
    assert legacy._make_packer(16)().settings() == current._make_packer(16)().settings()


def test_the_task_encoder_refuses_an_encoder_whose_media_differ() -> None:
    with pytest.raises(ValueError, match=r"media= that differs from encoder\.media"):
        PackingTaskEncoder(
            seq_length=64, encoder=make_encoder(), media=MediaConfig(max_pixels=28 * 28 * 4)
        )
    with pytest.raises(ValueError, match="tokenizer= and encoder="):
        PackingTaskEncoder(ByteTokenizer(), seq_length=64, encoder=make_encoder())


def test_the_collator_takes_the_layout_and_the_budget_as_objects() -> None:
    layout = RowLayout(128, pad_to_max_length=True, pad_cu_seqlens=True, max_segments=4)
    budget = VisionBudget(max_vision_tokens=50, over_cap="skip")
    collator = VLMPackingCollator(layout=layout, vision=budget)
    assert collator.layout is layout
    assert collator.budget == budget
    with pytest.raises(ValueError, match="not both"):
        VLMPackingCollator(128, layout=layout)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = MRopeConfig.from_tokenizer(ByteTokenizer(), tokens_per_second=2)
        mrope = VLMPackingCollator(128, position_ids=config)
    assert mrope.mrope == config


def test_over_cap_is_its_own_setting() -> None:
    strict_tokens = OnlineBinPacker(100, 4, vision=VisionBudget(max_media=1, over_cap="skip"))
    assert strict_tokens.push("many", 50, vision_tokens=20, media=3) == []  # skipped
    assert strict_tokens.stats.rejected == 1
    with pytest.raises(ValueError, match="above seq_length=100"):
        strict_tokens.push("long", 101)  # overlong is still "error"
    lenient = OnlineBinPacker(100, 4, overlong="skip", vision=VisionBudget(max_media=1))
    assert lenient.push("many", 50, vision_tokens=20, media=3) == []  # follows overlong
    strict_cap = OnlineBinPacker(
        100, 4, overlong="skip", vision=VisionBudget(max_media=1, over_cap="error")
    )
    with pytest.raises(ValueError, match="above max_media=1"):
        strict_cap.push("many", 50, vision_tokens=20, media=3)
    assert VisionBudget(max_media=1, over_cap="skip").settings()["over_cap"] == "skip"
    assert "over_cap" not in VisionBudget(max_media=1).settings()  # states saved before restore
    assert VisionBudget().over_cap_policy("truncate") == "skip"
    with pytest.raises(ValueError, match="over_cap must be"):
        VisionBudget(over_cap="truncate")  # type: ignore[arg-type]


def test_buffer_config_names_the_setting_value_and_fix() -> None:
    with pytest.raises(ValueError, match=r"max_wait must be None or >= 0.*pass e.g. max_wait=64"):
        BufferConfig(max_wait=-1)
    with pytest.raises(ValueError, match=r"min_fill.*pass e.g. min_fill=0.999"):
        BufferConfig(min_fill=1.5)
    with pytest.raises(ValueError, match=r"max_bytes \(packing_buffer_bytes\)"):
        BufferConfig(max_bytes=0)
    with pytest.raises(ValueError, match="decode"):
        BufferConfig(decode="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer must be None or a BufferConfig"):
        PackingTaskEncoder(seq_length=64, buffer={"max_wait": 3})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("budget", "chooser"),
    [
        (VisionBudget(), TokenChooser),
        (VisionBudget(max_media=3), CappedChooser),
        (VisionBudget(max_vision_tokens=500), CappedChooser),
        (VisionBudget(balance=True), BalancedChooser),
        (VisionBudget(max_media=3, balance=True), BalancedChooser),
    ],
)
def test_the_budget_picks_the_chooser(budget: VisionBudget, chooser: type) -> None:
    assert type(OnlineBinPacker(100, 4, vision=budget)._chooser) is chooser


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=8),
    align=st.sampled_from([1, 4, 7, 64]),
    capacity=st.integers(64, 1024),
)
def test_fits_and_refusal_agree_with_aligned_lengths(
    lengths: list[int], align: int, capacity: int
) -> None:
    packer = OnlineBinPacker(capacity, 4, align=align)
    used = sum(aligned_length(length, align) for length in lengths)
    assert packer.fits(lengths) == (used <= capacity)
    for length in lengths:
        refused = packer.refusal("k", length) is not None
        assert refused == (aligned_length(length, align) > capacity)


def test_held_sizes_are_what_was_pushed() -> None:
    packer = OnlineBinPacker(1000, 8, vision=VisionBudget(max_media=4))
    packer.push("a", 300, vision_tokens=100, media=1)
    packer.push("b", 200)
    assert [(h.key, h.length, h.vision_tokens, h.media) for h in packer.held_sizes()] == [
        ("a", 300, 100, 1),
        ("b", 200, 0, 0),
    ]


def test_tune_and_the_topology_check_take_the_budget() -> None:
    budget = VisionBudget(max_vision_tokens=4000, max_media=6, balance=True)
    setup = TrainingSetup(seq_length=8192, mode="online", vision=budget)
    assert (setup.max_vision_tokens, setup.max_media, setup.vision_balance) == (4000, 6, True)
    assert setup.vision_budget() == budget
    with pytest.raises(ValueError, match="vision= and max_media are both given"):
        TrainingSetup(seq_length=8192, mode="online", vision=budget, max_media=6)
    record = TuneSettings("data", vision=budget).record()
    assert (record["max_media"], record["vision_balance"]) == (6, True)
    assert "vision" not in record  # the tune report keeps its keys
    known = VisionBudget(max_media=6, balance=True, vision_share=0.3)
    assert TrainingSetup(seq_length=8192, mode="online", vision=known).vision_budget() == known
    assert TuneSettings("data", vision=known).record()["vision_share"] == 0.3
