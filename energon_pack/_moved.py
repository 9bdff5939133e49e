"""Module paths from before the package was grouped by stage, still importable.

``import energon_pack.layout`` (and every other moved path below) gives a module whose names
come from where they live now, with a ``DeprecationWarning`` naming the new path. Pickles and
scripts that name an old path keep working; new code imports from :mod:`energon_pack` or from
the stage packages.

Renamed public names (:data:`RENAMED`) stay readable the same way: a module that exported an old
name sets ``__getattr__ = renamed(__name__, "OldName", ...)``, so ``module.OldName`` (and
``from module import OldName``) gives the object under its new name, with a
``DeprecationWarning`` naming it.

A package's public names can also be read lazily: ``__getattr__, __dir__ = lazy(__name__,
{name: module, ...}, "OldName", ...)`` imports a name's module on its first read, so importing
the package (or the ``energon-pack`` command, which needs few of them) stays light.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable, Mapping, Sequence

MOVED: dict[str, tuple[str, ...]] = {
    "energon_pack.binpack": ("energon_pack.packing.bins", "energon_pack.packing.online"),
    "energon_pack.bridge_batch": ("energon_pack.train.bridge",),
    "energon_pack.encode": ("energon_pack.encoding.chatml", "energon_pack.packing.packed"),
    "energon_pack.family": ("energon_pack.encoding.family",),
    "energon_pack.fingerprint": ("energon_pack.encoding.fingerprint",),
    "energon_pack.hf": ("energon_pack.train.hf",),
    "energon_pack.layout": ("energon_pack.packing.row",),
    "energon_pack.loss": ("energon_pack.train.loss",),
    "energon_pack.media_config": ("energon_pack.media.config", "energon_pack.media.errors"),
    "energon_pack.media_decode": ("energon_pack.media.decode", "energon_pack.media.config"),
    "energon_pack.media_guard": ("energon_pack.media.guard", "energon_pack.media.errors"),
    "energon_pack.packed": ("energon_pack.packing.packed",),
    "energon_pack.rope": ("energon_pack.packing.mrope",),
    "energon_pack.row_layout": ("energon_pack.packing.row_layout",),
    "energon_pack.sample": ("energon_pack.formats.native", "energon_pack.formats.raw"),
    "energon_pack.synthetic": ("energon_pack.packing.synthetic",),
    "energon_pack.tables": ("energon_pack.cli.tables",),
    "energon_pack.template_encoder": ("energon_pack.encoding.template",),
    "energon_pack.topology": ("energon_pack.packing.topology",),
    "energon_pack.trainers": ("energon_pack.train.trainers",),
}
"""Old module path -> the modules its names live in now (looked up in this order)."""

RENAMED: dict[str, str] = {
    "PackerStats": "PackerCounters",
    "PackingConfig": "TrainingSetup",
    "VisionInputs": "MediaTensors",
    "VisualInputs": "BridgeVisualInputs",
}
"""Old public name -> its new name; the old names go in the next release."""


def renamed(module: str, *old: str) -> Callable[[str], object]:
    """A module-level ``__getattr__`` for ``module`` (its ``__name__``) that gives each of the
    ``old`` names of :data:`RENAMED` as ``module``'s object under the new name, with a
    ``DeprecationWarning`` naming that name; any other missing name is an ``AttributeError``."""
    return lazy(module, {}, *old)[0]


def lazy(
    module: str, homes: Mapping[str, str], *old: str
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module-level ``__getattr__`` and ``__dir__`` for ``module`` (its ``__name__``): each
    name of ``homes`` (name -> the module that defines it) is imported from its module on its
    first read and kept in ``module``; the ``old`` names read as in :func:`renamed`."""
    unknown = [name for name in old if name not in RENAMED]
    if unknown:
        raise ValueError(f"{unknown} are not old names of RENAMED")
    names = {name: RENAMED[name] for name in old}

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is not None:
            value = getattr(importlib.import_module(home), name)
            setattr(sys.modules[module], name, value)
            return value
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is renamed {new}: use {module}.{new}; the old name goes in the "
            "next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(sys.modules[module], new)

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[module]), *homes})

    return __getattr__, __dir__


class _MovedModule(types.ModuleType):
    """An old module path: every attribute is read from the modules it moved to."""

    def __init__(self, name: str, targets: Sequence[str]) -> None:
        super().__init__(name, f"Moved to {', '.join(targets)}.")
        self._targets = tuple(targets)

    def __getattr__(self, attribute: str) -> object:
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        new = RENAMED.get(attribute)
        for name in (attribute,) if new is None else (new, attribute):  # a renamed one: new first
            for target in self._targets:
                module = importlib.import_module(target)
                if not hasattr(module, name):
                    continue
                if new is not None:
                    warnings.warn(
                        f"{self.__name__}.{attribute} is renamed {new}, and {self.__name__} moved "
                        f"to {' and '.join(self._targets)}: import {new} from there or from "
                        "energon_pack; the old name goes in the next release",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                return getattr(module, name)
        raise AttributeError(
            f"module {self.__name__!r} moved to {' and '.join(self._targets)}, and neither has "
            f"{attribute!r}: import it from energon_pack or its stage package"
        )

    def __dir__(self) -> list[str]:
        names: set[str] = set()
        for target in self._targets:
            names.update(dir(importlib.import_module(target)))
        return sorted(names)


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and loads each as a :class:`_MovedModule`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _MovedModule(spec.name, MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        targets = MOVED[module.__name__]
        warnings.warn(
            f"{module.__name__} moved to {' and '.join(targets)}: import from there or from "
            "energon_pack",
            DeprecationWarning,
            stacklevel=2,
        )


class _Package(types.ModuleType):
    """The ``energon_pack`` module's class: importing an old path that is also a public name
    (``energon_pack.bridge_batch``, the function) leaves the public name as it is, where the
    import system would set the package's attribute to the old module."""

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, _MovedModule) and name in getattr(self, "__all__", ()):
            return
        super().__setattr__(name, value)


def install(package: types.ModuleType) -> None:
    """Make the old paths importable under ``package`` (once per process)."""
    package.__class__ = _Package
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
