"""The docs blocks that the main suite skips with "needs Megatron-Bridge" run here.

Each page that has such a block runs top to bottom in one namespace, every Python block of it
(hidden set-up and skipped blocks included), as a reader with Megatron-Bridge would run it: in a
fresh folder holding ``fixtures/``, with the pages' shared helpers importable. This machine has
no CUDA, so ``Tensor.cuda`` is a no-op here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sybil import Sybil
from sybil.parsers.myst import PythonCodeBlockParser

from tests.bridge.shims import require_bridge

require_bridge()

ROOT = Path(__file__).resolve().parents[2]
MARK = '<!-- skip: next "needs Megatron-Bridge'
PAGES = sorted(
    path
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    if "_build" not in path.parts and MARK in path.read_text()
)


def test_the_docs_have_bridge_blocks() -> None:
    assert PAGES, f"no page has a block marked {MARK!r}"


@pytest.mark.parametrize("page", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_a_page_with_bridge_blocks_runs_whole(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures", target_is_directory=True)
    # The pages' helpers import the test suite's shared helpers (tests/support); the test
    # modules they take builders from are on the path by the root conftest.py (TEST_PATHS).
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "support"))
    monkeypatch.syspath_prepend(str(ROOT / "docs" / "_fixtures"))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    document = Sybil(parsers=[PythonCodeBlockParser()]).parse(page)
    examples = list(document)
    assert examples
    for example in examples:
        example.evaluate()
