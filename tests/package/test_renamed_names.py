"""Public names renamed to say what they are (``energon_pack._moved.RENAMED``): each old name
still reads, from every module that exported it, as the object under its new name, with a
``DeprecationWarning`` naming the new name."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import pytest

import energon_pack
from energon_pack._moved import RENAMED, renamed

OLD_PATHS = ("energon_pack.binpack", "energon_pack.bridge_batch", "energon_pack.topology")
"""Module paths from before the regrouping (``energon_pack._moved.MOVED``) that had an old name."""
OLD_NAMES = [
    ("energon_pack", "PackerStats"),
    ("energon_pack.packing", "PackerStats"),
    ("energon_pack.packing.packer_state", "PackerStats"),
    ("energon_pack.packing.online", "PackerStats"),
    ("energon_pack.binpack", "PackerStats"),
    ("energon_pack", "PackingConfig"),
    ("energon_pack.packing", "PackingConfig"),
    ("energon_pack.packing.topology", "PackingConfig"),
    ("energon_pack.topology", "PackingConfig"),
    ("energon_pack", "VisualInputs"),
    ("energon_pack.train", "VisualInputs"),
    ("energon_pack.train.bridge", "VisualInputs"),
    ("energon_pack.bridge_batch", "VisualInputs"),
    ("energon_pack.media", "VisionInputs"),
    ("energon_pack.media.assembly", "VisionInputs"),
]
"""(module, old name): every module that exported the old name."""
HOME = {"MediaTensors": "energon_pack.media"}
"""Where a new name that is not in ``energon_pack`` is public."""


def _params() -> list[object]:
    return [pytest.param(module, old) for module, old in OLD_NAMES]


def _module(name: str) -> ModuleType:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # an old module path warns too
        return importlib.import_module(name)


def _new_object(old: str) -> object:
    new = RENAMED[old]
    return getattr(importlib.import_module(HOME.get(new, "energon_pack")), new)


@pytest.mark.parametrize(("module_name", "old"), _params())
def test_an_old_name_gives_the_new_object_with_a_warning_naming_it(
    module_name: str, old: str
) -> None:
    module = _module(module_name)
    new = RENAMED[old]
    with pytest.warns(DeprecationWarning, match=rf"\b{old} is renamed {new}\b") as caught:
        value = getattr(module, old)
    assert value is _new_object(old)
    if module_name not in OLD_PATHS:  # (an old path's module reads it for the caller)
        assert caught[0].filename == __file__, "the warning points at the reader's line"


@pytest.mark.parametrize(("module_name", "old"), _params())
def test_an_old_name_imports_with_from(module_name: str, old: str) -> None:
    _module(module_name)
    namespace: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"from {module_name} import {old}", namespace)
    assert namespace[old] is _new_object(old)
    assert any(
        issubclass(w.category, DeprecationWarning) and f"renamed {RENAMED[old]}" in str(w.message)
        for w in caught
    )


def test_old_names_are_not_public_and_other_names_stay_missing() -> None:
    assert not set(RENAMED) & set(energon_pack.__all__)
    for module_name, old in OLD_NAMES:
        if module_name in OLD_PATHS:
            continue
        module = _module(module_name)
        public = getattr(module, "__all__", None)
        if public is not None:  # the new name takes the old one's place
            assert old not in public, module_name
            assert RENAMED[old] in public, module_name
        with pytest.raises(AttributeError, match="no_such_name"):
            module.no_such_name  # noqa: B018


@pytest.mark.parametrize(
    "new",
    list(RENAMED.values()),
)
def test_the_classes_carry_their_new_names(new: str) -> None:
    cls = getattr(importlib.import_module(HOME.get(new, "energon_pack")), new)
    assert cls.__qualname__ == new  # what a pickle and a repr name


def test_renamed_refuses_a_name_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="NotRenamed"):
        renamed(__name__, "NotRenamed")
