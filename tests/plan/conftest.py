"""Fixtures of the plan tests: one local Ray for the session, and the shipped demo dataset's
rows as chat rows with media files (:mod:`plan_rows`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from plan_rows import ChatRows, write_chat_rows


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray of 2 CPUs, started once (``plan_dataset`` uses a Ray already started)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def chat_rows(tmp_path_factory: pytest.TempPathFactory) -> ChatRows:
    return write_chat_rows(tmp_path_factory.mktemp("chat_rows"))
