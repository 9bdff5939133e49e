"""The package's shape: folders by stage of the data flow, imports flowing one way, small
modules, the module paths from before the regrouping still importable, and the tests in folders
by the same stages."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

import energon_pack
from energon_pack._moved import MOVED

PACKAGE = Path(energon_pack.__file__).resolve().parent
TESTS = Path(__file__).resolve().parents[1]

STAGES = (
    "checks",
    "_moved",
    "moved_keywords",
    "media",
    "formats",
    "memory",
    "packing",
    "encoding",
    "train",
    "collate",
    "energon",
    "sources",
    "offline",
    "plan",
    "tune",
    "verify",
    "cli",
    "__init__",
)
"""The package root's modules and folders, lowest first: each imports only from itself and
from those above it in this list."""

MAX_ROOT_MODULES = 8
MAX_MODULE_LINES = 600

TEST_FOLDERS_BESIDE_STAGES = {
    "docs": "the documentation's checks",
    "package": "the package as a whole (this file)",
    "bridge": "Megatron-Bridge's own code, in its environment",
}
"""Folders of ``tests/`` that hold tests but are not a stage of the package."""
SUPPORT = "support"
"""The one folder of the shared helper modules: no tests in it."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(("energon_pack", *parts))] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every energon_pack module ``path`` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.startswith("energon_pack")
        ):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("energon_pack"))
    return found


def _stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def test_every_root_module_and_folder_has_a_stage() -> None:
    entries = {
        p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert entries == set(STAGES), f"stages unknown to STAGES: {sorted(entries ^ set(STAGES))}"


def test_few_modules_at_the_root() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= MAX_ROOT_MODULES, root


def test_no_module_is_long() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_imports_flow_down_the_stages() -> None:
    order = {stage: index for index, stage in enumerate(STAGES)}
    climbing = [
        f"{module} imports {target}"
        for module, targets in _graph().items()
        for target in targets
        if order[_stage(target)] > order[_stage(module)]
    ]
    assert not climbing, "\n".join(climbing)


def test_no_import_circle() -> None:
    graph = _graph()
    # A package's __init__ re-exports its modules; a module importing its own package's
    # __init__ is the circle this looks for.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not circles, circles


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_imports_with_a_warning_naming_the_new_one(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match="moved to") as caught:
        module = importlib.import_module(old)
    message = str(caught[0].message)
    targets = MOVED[old]
    assert all(target in message for target in targets), message
    for target in reversed(targets):  # names are looked up in the targets' order
        new = importlib.import_module(target)
        for name in (n for n in vars(new) if not n.startswith("_")):
            first = next(t for t in targets if hasattr(importlib.import_module(t), name))
            assert getattr(module, name) is getattr(importlib.import_module(first), name)


def test_the_old_paths_the_docs_named_give_the_same_objects() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from energon_pack.bridge_batch import bridge_batch
        from energon_pack.encode import ByteTokenizer, EncodedSample
        from energon_pack.layout import PackedRow
        from energon_pack.media_config import MediaConfig, MediaError
        from energon_pack.packed import SkippedSample, pack_samples
        from energon_pack.sample import parse_sample
    from energon_pack.memory import MonitorConfig
    from energon_pack.packing.packed import SkippedSample as skipped_now

    assert bridge_batch is energon_pack.bridge_batch
    assert ByteTokenizer is energon_pack.ByteTokenizer
    assert EncodedSample is energon_pack.EncodedSample
    assert PackedRow is energon_pack.PackedRow
    assert pack_samples is energon_pack.pack_samples
    assert parse_sample is energon_pack.parse_sample
    assert SkippedSample is skipped_now
    assert MonitorConfig is energon_pack.MonitorConfig
    assert (MediaConfig, MediaError) == (energon_pack.MediaConfig, energon_pack.MediaError)


def test_a_name_an_old_path_never_had_is_an_error_naming_the_new_paths() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = importlib.import_module("energon_pack.binpack")
    with pytest.raises(
        AttributeError, match=r"energon_pack\.packing\.bins and energon_pack\.packing\.online"
    ):
        module.no_such_name  # noqa: B018


def test_every_test_file_is_in_a_stage_folder() -> None:
    """``tests/`` mirrors the package: a test file sits in ``tests/<stage>/``, ``<stage>`` a
    folder or root module of the package (or one of :data:`TEST_FOLDERS_BESIDE_STAGES`), never
    flat in ``tests/`` or among the helpers of ``tests/support/``; file names are unique, as
    pytest imports each by its bare name."""
    stages = {p.stem for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    stages |= {p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    allowed = stages | set(TEST_FOLDERS_BESIDE_STAGES)
    files = sorted({*TESTS.rglob("test_*.py"), *TESTS.rglob("*_test.py")})
    assert len(files) > len(stages), f"found only {len(files)} test files under {TESTS}"
    misplaced = [
        str(path.relative_to(TESTS))
        for path in files
        if len(path.relative_to(TESTS).parts) < 2 or path.relative_to(TESTS).parts[0] not in allowed
    ]
    assert not misplaced, (
        f"test files outside a stage folder of tests/ (one of {sorted(allowed)}; shared "
        f"helpers go in tests/{SUPPORT}/): {misplaced}"
    )
    flat = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert not flat, f"modules flat in tests/ (helpers go in tests/{SUPPORT}/): {flat}"
    names = [path.name for path in files if path.relative_to(TESTS).parts[0] != "bridge"]
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"test file names used twice under tests/: {repeated}"
