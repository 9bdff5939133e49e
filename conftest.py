"""Runs every Python block of README.md and ``docs/**/*.md`` as a test, page by page.

Each page is one namespace: its blocks run top to bottom, as a reader would paste them into one
interpreter. A page runs in a fresh temporary folder that holds ``fixtures/`` (the shipped
datasets, linked read-only), so relative paths in a snippet resolve as they do in a checkout
and whatever a snippet writes stays out of the tree. Hidden set-up goes in an
``<!-- invisible-code-block: python ... -->`` comment; a block that cannot run here is preceded
by ``<!-- skip: next "reason" -->`` (tests/docs/test_docs_pages.py bounds and checks those).
Set-up helpers that several pages share (a tiny model built from its config, a tokenizer saved
into the page's folder) live in ``docs/_fixtures/`` and are importable from a page; they reuse
the test suite's builders (on the path too, see :data:`TEST_PATHS`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sybil import Sybil
from sybil.parsers.myst import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent
TESTS = ROOT / "tests"
TEST_PATHS = [
    TESTS / "support",
    *sorted(
        folder
        for folder in TESTS.iterdir()
        if folder.is_dir()
        and folder.name not in ("support", "bridge")
        and not folder.name.startswith(("_", "."))
    ),
]
"""Imported by bare name: ``tests/support/`` (the shared helpers: ``from helpers import ...``)
first, then every stage folder of ``tests/``, whose test modules other tests, the pages'
helpers and the benchmarks import builders from (``import test_family_gemma3``), whichever
files a run collects. Test file names are unique across the folders
(``tests/package/test_package_layout.py`` checks). ``tests/bridge`` is a package of its own."""
sys.path[:0] = [str(ROOT / "docs" / "_fixtures"), *map(str, TEST_PATHS)]


@pytest.fixture(scope="module")
def docs_workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A page's working folder: a temporary directory with ``fixtures/`` linked into it."""
    workdir = tmp_path_factory.mktemp("page")
    (workdir / "fixtures").symlink_to(ROOT / "fixtures", target_is_directory=True)
    before = Path.cwd()
    os.chdir(workdir)
    try:
        yield workdir
    finally:
        os.chdir(before)


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md", "docs/*/*.md"],
    fixtures=["docs_workdir"],
    excludes=["docs/_build/**"],
).pytest()
