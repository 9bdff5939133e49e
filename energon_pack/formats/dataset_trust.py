"""What a dataset's description may name before energon_pack's commands let Energon load it.

Energon builds a dataset from its ``.nv-meta/dataset.yaml`` (or a metadataset ``.yaml``): a
mapping with ``__module__`` and ``__class__`` (or ``__function__``) is imported and called,
whatever module it names, and ``sample_loader`` / ``part_filter`` strings name Python files in
the dataset that are run. So a dataset can run code when it is opened (``__module__: os``,
``__function__: system``). :func:`check_dataset_code` reads the description with Energon's own
YAML reader, follows a metadataset's references to other datasets, and refuses, with a
``ValueError`` naming the file, the entry and the fix, anything but a class defined in
``megatron.energon`` or ``energon_pack`` (and Megatron-Bridge's ``ChatMLWebdataset``), found in
a module those packages have already imported. Nothing the description names is imported
before it passes. ``energon-pack tune`` calls it unless ``--trust-dataset-code`` is given;
Energon's own Python API (``get_train_dataset``) keeps Energon's rules.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

__all__ = ["TRUSTED_CLASSES", "TRUSTED_PACKAGES", "check_dataset_code"]

TRUSTED_PACKAGES: tuple[str, ...] = ("megatron.energon", "energon_pack")
"""Packages whose classes a dataset description may name without trust."""

TRUSTED_CLASSES: frozenset[tuple[str, str]] = frozenset(
    {("megatron.bridge.data.energon.task_encoder_utils", "ChatMLWebdataset")}
)
"""Classes outside those packages a description may name: Megatron-Bridge's sample type, as
its converters write it (it is imported only if Bridge is installed)."""

_CODE_STRINGS = ("sample_loader", "part_filter")
_MAIN_FOLDER = ".nv-meta"
_MAX_REFERENCES = 1000


def check_dataset_code(path: str | Path, dataset_config: str | None = None) -> None:
    """Raise ``ValueError`` if the dataset at ``path`` (a prepared dataset folder, its
    description ``.nv-meta/<dataset_config>``, default ``dataset.yaml``; or a metadataset
    ``.yaml`` and the datasets it references) names code outside the trusted sample types
    (see the module docstring). A JSONL dataset, or a folder without a description, passes."""
    try:
        _Checker().dataset(Path(path), dataset_config)
    except RecursionError:
        raise ValueError(
            f"the description of the dataset {path} is nested too deeply to be checked; "
            "pass --trust-dataset-code to open it unchecked"
        ) from None


class _Checker:
    def __init__(self) -> None:
        self.seen: set[Path] = set()

    def dataset(self, path: Path, dataset_config: str | None) -> None:
        if path.is_file():
            if path.suffix == ".yaml":
                self.description(path, metadataset=True)
            return
        description = path / _MAIN_FOLDER / (dataset_config or "dataset.yaml")
        if description.is_file():
            self.description(description, metadataset=False)

    def description(self, file: Path, *, metadataset: bool) -> None:
        resolved = file.resolve()
        if resolved in self.seen:
            return
        if len(self.seen) >= _MAX_REFERENCES:
            raise ValueError(
                f"{file}: a metadataset that references more than {_MAX_REFERENCES} "
                "descriptions is not checked; pass --trust-dataset-code to open it unchecked"
            )
        self.seen.add(resolved)
        from megatron.energon.eyaml import load_yaml  # the reader Energon loads it with

        try:
            tree = load_yaml(file.read_bytes())
        except Exception as error:  # OSError, ryml's parse errors, undecodable text
            raise ValueError(
                f"cannot read the dataset description {file} ({type(error).__name__}: "
                f"{error}); fix the file, or prepare the dataset again with energon prepare"
            ) from None
        self.walk(tree, file, "root", metadataset)

    def walk(self, node: Any, file: Path, where: str, metadataset: bool) -> None:
        if isinstance(node, list):
            for index, item in enumerate(node):
                self.walk(item, file, f"{where}[{index}]", metadataset)
            return
        if not isinstance(node, dict):
            return
        if "__module__" in node or "__class__" in node or "__function__" in node:
            _check_entry(node, file, where)
        for name in _CODE_STRINGS:
            if isinstance(node.get(name), str):
                raise _refusal(
                    file,
                    f"{where}.{name}",
                    f"the Python file {node[name]!r} of the dataset, which Energon runs",
                )
        for key, value in node.items():
            self.walk(value, file, f"{where}.{key}", metadataset)
        reference = node.get("path")
        if metadataset and isinstance(reference, str):
            if "://" in reference:
                raise ValueError(
                    f"{file}: {where}.path is the remote dataset {reference!r}, whose "
                    "description energon-pack cannot check; pass --trust-dataset-code to open "
                    "it unchecked, or use a local copy"
                )
            config = node.get("dataset_config")
            self.dataset(file.parent / reference, config if isinstance(config, str) else None)


def _check_entry(node: dict[str, Any], file: Path, where: str) -> None:
    module, name = node.get("__module__"), node.get("__class__")
    function = node.get("__function__")
    if function is not None:
        raise _refusal(file, where, f"the function {module}.{function}")
    if module is None:  # Energon then uses the expected type; nothing is imported
        return
    if not isinstance(module, str) or not isinstance(name, str):
        raise _refusal(file, where, f"__module__ {module!r} and __class__ {name!r}")
    if (module, name) in TRUSTED_CLASSES:
        if not _importable(module):
            raise ValueError(
                f"{file}: {where} names {module}.{name}, Megatron-Bridge's sample type, and "
                "Bridge is not installed; install Megatron-Bridge, or read the shards through "
                "a description naming an Energon type (e.g. --dataset-config crude.yaml with "
                "__module__: megatron.energon, __class__: CrudeWebdataset)"
            )
        return
    if not any(module == p or module.startswith(p + ".") for p in TRUSTED_PACKAGES):
        raise _refusal(file, where, f"{module}.{name}, outside {' and '.join(TRUSTED_PACKAGES)}")
    for package in TRUSTED_PACKAGES:
        importlib.import_module(package)
    loaded = sys.modules.get(module)
    if loaded is None or "__main__" in module.split("."):
        raise _refusal(file, where, f"the module {module}, which Energon does not load itself")
    found = getattr(loaded, name, None)
    if not isinstance(found, type):
        raise ValueError(
            f"{file}: {where} names {module}.{name}, which is "
            f"{'no class' if found is not None else 'not there'} (a typo or another Energon "
            "version?); name one of Energon's sample types, e.g. __module__: "
            "megatron.energon, __class__: CrudeWebdataset, or prepare the dataset again with "
            "energon prepare"
        )
    home = found.__module__
    if not any(home == p or home.startswith(p + ".") for p in TRUSTED_PACKAGES):
        raise _refusal(file, where, f"{module}.{name}, defined in {home}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _refusal(file: Path, where: str, what: str) -> ValueError:
    return ValueError(
        f"{file}: {where} names {what}: code outside Energon's and energon_pack's sample "
        "types, which energon-pack does not run from a dataset; name an Energon sample type "
        "(e.g. __module__: megatron.energon, __class__: CrudeWebdataset), or pass "
        "--trust-dataset-code if you trust this dataset's code (docs: security)"
    )
