"""Public names read lazily (PEP 562): ``energon_pack``, ``energon_pack.packing`` and
``energon_pack.offline`` import a name's module on its first read, so ``import energon_pack``
(and the ``energon-pack`` command) imports no torch, transformers or Megatron-Energon. Each
package's table (``_HOMES``) is the imports it shows type checkers, every name reads as its
module's object, and ``dir()`` lists them."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LAZY = ("energon_pack", "energon_pack.packing", "energon_pack.offline")
ROOT = Path(__file__).resolve().parents[2]


def _checked_imports(package: str) -> dict[str, str]:
    """Name -> module of the imports under ``if TYPE_CHECKING:`` at the top of ``package``."""
    path = importlib.import_module(package).__file__
    assert path is not None
    found: dict[str, str] = {}
    for node in ast.parse(Path(path).read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for child in node.body:
                if isinstance(child, ast.ImportFrom) and child.module is not None:
                    found.update({alias.name: child.module for alias in child.names})
    return found


@pytest.mark.parametrize("package", LAZY)
def test_the_table_is_what_type_checkers_see(package: str) -> None:
    assert _checked_imports(package) == importlib.import_module(package)._HOMES


@pytest.mark.parametrize("package", LAZY)
def test_every_name_reads_as_its_module_object(package: str) -> None:
    module = importlib.import_module(package)
    for name, home in module._HOMES.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_importing_the_packages_imports_no_torch_until_a_name_needs_it() -> None:
    code = (
        "import json, sys\n"
        "import energon_pack, energon_pack.packing, energon_pack.offline\n"
        "from energon_pack import TrainingSetup, pad_seq_to_mult\n"
        "before = [m for m in ('torch', 'transformers', 'megatron.energon') if m in sys.modules]\n"
        "energon_pack.PackingTaskEncoder\n"
        "print(json.dumps([before, 'megatron.energon' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    before, after = json.loads(done.stdout.splitlines()[-1])
    assert before == [], f"import energon_pack imported {before}"
    assert after, "reading PackingTaskEncoder imports Megatron-Energon"
