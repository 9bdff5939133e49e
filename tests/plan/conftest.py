"""Fixtures of the plan tests: the shipped demo dataset's rows as chat rows with media files
(:mod:`plan_rows`); the session's local Ray is ``ray_cluster`` (``tests/conftest.py``)."""

from __future__ import annotations

import pytest
from plan_rows import ChatRows, write_chat_rows


@pytest.fixture(scope="session")
def chat_rows(tmp_path_factory: pytest.TempPathFactory) -> ChatRows:
    return write_chat_rows(tmp_path_factory.mktemp("chat_rows"))
