"""Shared pytest fixtures: paths to the shipped datasets."""

from __future__ import annotations

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
