"""Import shims that let Megatron-Bridge 0.6.2's data and batch code run on Python 3.11 / CPU.

Bridge declares Python >= 3.12 and CUDA-only dependencies. Its data and batch paths need only
three things this environment lacks: ``typing.override`` (new in 3.12), an importable
``transformer_engine`` (nothing on those paths calls it) and ``torchvision``'s two operator
schemas that the CPU torch wheel does not define. ``install()`` provides them, once.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
import typing

_INSTALLED = False


def _typing_override() -> None:
    if not hasattr(typing, "override"):
        import typing_extensions

        typing.override = typing_extensions.override  # type: ignore[attr-defined]


def _torchvision_schemas() -> None:
    """Define ``torchvision::nms``/``qnms`` so that torchvision imports against CPU torch
    (only where torchvision is installed)."""
    if importlib.util.find_spec("torchvision") is None:
        return
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018
        return
    except (AttributeError, RuntimeError):
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)


_KEEP: list[object] = []


class _StubType(type):
    """A class whose every missing attribute is another stub class (names only, no behaviour)."""

    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _StubType(name, (), {"__module__": cls.__module__})
        setattr(cls, name, child)
        return child


class _StubModule(types.ModuleType):
    """A module whose every missing attribute is a stub class."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        child = _StubType(name, (), {"__module__": self.__name__})
        setattr(self, name, child)
        return child


def _stub_module(name: str) -> types.ModuleType:
    module = _StubModule(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    module.__path__ = []
    module.__version__ = "0.0.0"  # type: ignore[attr-defined]
    return module


def _transformer_engine_stub() -> None:
    """Register a names-only ``transformer_engine`` after megatron.core has imported for real.

    megatron.core probes for Transformer Engine at import and falls back when it is missing;
    a few Bridge modules name its classes at import (annotations, base classes) on paths that
    the data and batch code never calls. Version 0.0.0 keeps megatron.core on its local layers.
    """
    import megatron.core  # noqa: F401  (must see the real absence first)

    if "transformer_engine" in sys.modules:
        return
    names = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.common")
    for name in names:
        sys.modules[name] = _stub_module(name)
    for name in names[1:]:
        setattr(sys.modules["transformer_engine"], name.split(".")[1], sys.modules[name])


def install() -> None:
    """Install every shim (idempotent); ImportError, touching nothing, where Megatron-Bridge
    is not installed (the main test environment)."""
    global _INSTALLED
    if _INSTALLED:
        return
    if importlib.util.find_spec("megatron.bridge") is None:
        raise ImportError(
            "megatron-bridge is not installed here; build its test environment with "
            "bash scripts/bridge_env.sh and run bash scripts/test_bridge.sh"
        )
    _typing_override()
    _torchvision_schemas()
    _transformer_engine_stub()
    _INSTALLED = True


def require_bridge() -> None:
    """Install the shims, or skip the calling test module with the reason (for the main
    suite, where Megatron-Bridge is not installed)."""
    import pytest

    try:
        install()
    except ImportError as error:
        pytest.skip(f"Megatron-Bridge tests: {error}", allow_module_level=True)


def bridge_version() -> str:
    """The installed megatron-bridge version."""
    return importlib.metadata.version("megatron-bridge")
