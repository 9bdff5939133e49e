"""The check of a dataset path before Energon opens it: Energon's ``get_train_dataset`` answers
a wrong path with a bare ``Invalid dataset at PATH`` before a task encoder sees anything, so
:func:`check_dataset_path` (which ``energon-pack tune`` calls too) says what is wrong and the
fix."""

from __future__ import annotations

from pathlib import Path

__all__ = ["check_dataset_path"]


def check_dataset_path(path: str | Path) -> Path:
    """``path`` as a :class:`~pathlib.Path` if Energon can open it (a folder prepared with
    ``energon prepare``, holding ``.nv-meta/``; a metadataset ``.yaml``; a ``.jsonl`` file),
    else a ``ValueError`` naming what is there and the fix."""
    path = Path(path)
    if path.is_file():
        if path.suffix in (".yaml", ".jsonl"):
            return path
        raise ValueError(
            f"{path} is a file but neither a metadataset .yaml nor a .jsonl dataset; pass the "
            "folder of a dataset prepared with 'energon prepare'"
        )
    if not path.exists():
        raise ValueError(
            f"{path} does not exist; pass the folder of a dataset prepared with 'energon prepare'"
        )
    if not (path / ".nv-meta").is_dir():
        raise ValueError(
            f"{path} is not a prepared Energon dataset (no .nv-meta/); prepare it with "
            "'energon prepare' or pass the path of one"
        )
    return path
