"""Unpickling of media lists from datasets without running code from them.

Megatron-Bridge's WebDataset layouts store media as pickled lists: numpy arrays (its Qwen-VL
converter) or the bytes of image files (its ChatML layouts, e.g. the Mantis converter). A pickle
can name any importable callable, so :func:`load_arrays` uses an unpickler that resolves only
the few numpy names an array's pickle needs; anything else (``os.system``, ``builtins.eval``, a
class of the dataset's) is refused before it is looked up. The result must then be a (nested)
list of arrays of an allowed dtype, or of bytes where the caller allows them.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np

from energon_pack.media.errors import MediaError

__all__ = ["ALLOWED_DTYPES", "load_arrays"]

ALLOWED_DTYPES: frozenset[str] = frozenset({"uint8", "float16", "float32", "float64"})
"""Pixel dtypes accepted from a pickle (floats hold 0-255 values, as qwen_vl_utils gives)."""

_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
    }
)


class _ArrayUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, key: str, member: str) -> None:
        super().__init__(io.BytesIO(data))
        self._where = (key, member)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):  # protocol 2 writes bytes this way
            return _latin1
        if (module, name) not in _GLOBALS:
            raise MediaError(
                *self._where,
                "unsupported",
                f"pickle refers to {module}.{name}; only numpy arrays (and lists of them) are "
                "read from a pickle, nothing in it is run",
            )
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise MediaError(*self._where, "unsupported", "pickle uses persistent ids")


def _latin1(text: Any, encoding: Any) -> bytes:
    """Protocol-2 pickles spell bytes as ``_codecs.encode(str, "latin1")``; nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("only latin1 text may be encoded to bytes")
    return text.encode("latin1")


def load_arrays(
    data: bytes, key: str = "?", member: str = "?", *, allow_bytes: bool = False
) -> list[Any]:
    """The list pickled in ``data``: arrays of :data:`ALLOWED_DTYPES`, or lists of such arrays;
    with ``allow_bytes``, ``bytes`` items (encoded files) too, at either level.

    Raises :class:`~energon_pack.media.MediaError` for a pickle that names anything but numpy's
    array constructors (without running it), a malformed pickle, or another structure.
    """
    if not isinstance(data, (bytes, bytearray)):
        raise MediaError(key, member, "bad_sample", f"member is {type(data).__name__}, not bytes")
    try:
        value = _ArrayUnpickler(bytes(data), key, member).load()
    except MediaError:
        raise
    except Exception as exc:  # any malformed pickle: UnpicklingError, EOFError, ValueError...
        raise MediaError(key, member, "unreadable", f"not a readable pickle: {exc!r}") from exc
    if not isinstance(value, list):
        raise MediaError(
            key, member, "bad_sample", f"pickle holds a {type(value).__name__}, not a list"
        )
    _check(value, key, member, 2, allow_bytes)
    return value


def _check(value: list[Any], key: str, member: str, depth: int, allow_bytes: bool) -> None:
    for item in value:
        if isinstance(item, list) and depth > 1:
            _check(item, key, member, depth - 1, allow_bytes)
        elif allow_bytes and isinstance(item, bytes):
            continue
        elif not isinstance(item, np.ndarray) or item.dtype.name not in ALLOWED_DTYPES:
            kind = item.dtype.name if isinstance(item, np.ndarray) else type(item).__name__
            also = " or bytes" if allow_bytes else ""
            raise MediaError(
                key,
                member,
                "bad_sample",
                f"pickle holds {kind}; expected lists of arrays of {sorted(ALLOWED_DTYPES)}{also}",
            )
