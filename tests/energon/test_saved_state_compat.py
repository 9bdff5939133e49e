"""Loader states committed in ``fixtures/saved_state/`` (saved by an earlier energon_pack, see
``fixtures/make_saved_state.py``) restore with this code and deliver the recorded packs: the
settings fingerprint and the saved-state layout stay compatible across versions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from helpers import load_script

from energon_pack.energon import restore_state_rank


@pytest.fixture(scope="module")
def maker(fixtures_dir: Path) -> ModuleType:
    """``fixtures/make_saved_state.py``: builds the dataset and the loader the states came from."""
    return load_script(fixtures_dir / "make_saved_state.py")


@pytest.fixture(scope="module")
def expected(fixtures_dir: Path) -> dict[str, Any]:
    text = (fixtures_dir / "saved_state" / "expected.json").read_text()
    loaded: dict[str, Any] = json.loads(text)
    return loaded


@pytest.fixture(scope="module")
def dataset(
    tmp_path_factory: pytest.TempPathFactory, maker: ModuleType, expected: dict[str, Any]
) -> Path:
    """The dataset the states were saved over, rebuilt byte for byte."""
    root = tmp_path_factory.mktemp("saved_state") / "dataset"
    spec = expected["dataset"]
    shards = maker.build_dataset(root, samples=spec["samples"])
    assert {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in shards} == (
        spec["shards"]
    ), "the rebuilt shards differ from those the states were saved over"
    return root


def saved_state(fixtures_dir: Path, run: dict[str, Any]) -> Any:
    # A committed file of this repository (Energon's state dataclasses, numpy and torch RNG
    # states), not data from outside, so a full unpickle is fine.
    return torch.load(fixtures_dir / "saved_state" / run["state"], weights_only=False)


RUNS = ["workers0", "workers2"]


@pytest.mark.parametrize("name", RUNS)
def test_a_state_saved_by_an_earlier_version_resumes_exactly(
    fixtures_dir: Path, maker: ModuleType, expected: dict[str, Any], dataset: Path, name: str
) -> None:
    run = expected["runs"][name]
    loader = maker.make_loader(dataset, expected["settings"], run["num_workers"])
    restore_state_rank(loader, saved_state(fixtures_dir, run))
    after = maker.packs(iter(loader))
    assert after == run["after"]
    delivered = [key for pack in run["before"] + after for key in pack["__keys__"]]
    assert sorted(delivered) == sorted(expected["dataset"]["keys"]), "not every sample once"
    assert len(delivered) == len(set(delivered))


@pytest.mark.parametrize("name", RUNS)
def test_a_committed_state_restores_twice_and_stays_unchanged(
    fixtures_dir: Path, maker: ModuleType, expected: dict[str, Any], dataset: Path, name: str
) -> None:
    run = expected["runs"][name]
    state = saved_state(fixtures_dir, run)
    for _ in range(2):
        loader = maker.make_loader(dataset, expected["settings"], run["num_workers"])
        restore_state_rank(loader, state)
        assert maker.packs(iter(loader), 1) == run["after"][:1]


@pytest.mark.parametrize("name", RUNS)
@pytest.mark.parametrize(
    ("setting", "change"),
    [
        ("seq_length", {"encoder": {"seq_length": 4096}}),
        ("pad_to_multiple_of", {"encoder": {"pad_to_multiple_of": 16}}),
        ("media.max_pixels", {"encoder": {"media": {"max_pixels": 28 * 28 * 32}}}),
        ("packing_buffer_size", {"loader": {"packing_buffer_size": 5}}),
    ],
)
def test_a_committed_state_is_refused_under_a_changed_setting(
    fixtures_dir: Path,
    maker: ModuleType,
    expected: dict[str, Any],
    dataset: Path,
    name: str,
    setting: str,
    change: dict[str, Any],
) -> None:
    run = expected["runs"][name]
    settings = json.loads(json.dumps(expected["settings"]))
    for part, values in change.items():
        for key, value in values.items():
            if isinstance(value, dict):
                settings[part][key].update(value)
            else:
                settings[part][key] = value
    loader = maker.make_loader(dataset, settings, run["num_workers"])
    with pytest.raises(ValueError, match=rf"\b{setting}: saved .*, now .*start a fresh run"):
        restore_state_rank(loader, saved_state(fixtures_dir, run))


def test_a_committed_state_is_refused_with_another_number_of_workers(
    fixtures_dir: Path, maker: ModuleType, expected: dict[str, Any], dataset: Path
) -> None:
    run = expected["runs"]["workers2"]
    loader = maker.make_loader(dataset, expected["settings"], 0)
    with pytest.raises(
        ValueError, match=r"saved with num_workers=2, this loader has num_workers=0"
    ):
        restore_state_rank(loader, saved_state(fixtures_dir, run))


@pytest.mark.parametrize("name", RUNS)
def test_a_committed_state_resumes_only_at_the_rank_and_topology_it_was_saved_at(
    fixtures_dir: Path, maker: ModuleType, expected: dict[str, Any], dataset: Path, name: str
) -> None:
    """These states predate the global worker in the fingerprint: they cannot say which global
    worker they belong to, so another world size (even with the same per-rank worker count) is
    refused, naming where they were saved."""
    run = expected["runs"][name]
    settings = json.loads(json.dumps(expected["settings"]))
    settings["loader"]["world_size"] = 2
    loader = maker.make_loader(dataset, settings, run["num_workers"])
    workers = run["num_workers"]
    with pytest.raises(
        ValueError,
        match=(
            rf"saved by an earlier energon_pack with world_size=1, num_workers={workers}, rank=0, "
            r"before packing states recorded their global worker.* not at world_size=2"
        ),
    ):
        restore_state_rank(loader, saved_state(fixtures_dir, run))
