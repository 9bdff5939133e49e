"""Shared pytest fixtures: paths to the shipped datasets; loader workers stopped after each
test. Here at the top of ``tests/`` so that every stage folder sees them; the shared helper
modules are in ``tests/support/``, importable by bare name (the root ``conftest.py`` puts it
and the stage folders on ``sys.path``)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The committed ``fixtures/`` folder."""
    return FIXTURES


@pytest.fixture(scope="session")
def vlm_demo_path() -> Path:
    """The prepared ``fixtures/vlm_demo`` dataset (Energon CrudeWebdataset)."""
    return FIXTURES / "vlm_demo"


@pytest.fixture(scope="session")
def broken_path() -> Path:
    """The prepared ``fixtures/broken`` dataset; outcomes in ``expected.json``."""
    return FIXTURES / "broken"


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray of 2 CPUs, started once for the session (``plan_dataset`` and
    ``pack_offline(engine="ray")`` use a Ray already started)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def _stop_loader_workers() -> Iterator[None]:
    """After each test, stop the workers of the loaders ``helpers.savable_loader`` made (in it or
    in its fixtures) that are still running; a test that never imported helpers made none."""
    yield
    helpers = sys.modules.get("helpers")
    if helpers is not None:
        helpers.stop_loaders()
