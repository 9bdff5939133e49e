"""Unpickling of media lists from datasets without running code from them, within a memory bound.

Megatron-Bridge's WebDataset layouts store media as pickled lists: numpy arrays (its Qwen-VL
converter) or the bytes of image files (its ChatML layouts, e.g. the Mantis converter). A pickle
can name any importable callable, so :func:`load_arrays` uses an unpickler that resolves only
the few numpy names an array's pickle needs; anything else (``os.system``, ``builtins.eval``, a
class of the dataset's) is refused before it is looked up. The result must then be a (nested)
list of arrays of an allowed dtype, or of bytes where the caller allows them.

A pickle can also claim memory it does not hold: an array shape of a billion elements in a few
bytes, a memo index of 2**31, a length field past its end, or a list that names one frame
100,000 times. Before anything is unpickled, the opcodes are scanned (no object is built): only
the opcodes of lists, tuples, dicts, integers, strings, bytes and the numpy constructors are
allowed, every length and memo index must lie within the pickle, and each opcode is charged
:data:`OPCODE_BYTES`. While unpickling, each array's size (shape times item size) is charged
before numpy allocates it; after, each array and file is charged again at every place it has
in the list (what a caller that stacks the frames allocates), and each list entry
:data:`OPCODE_BYTES`. Either tally above the bound, by default the pickle's own size plus
:data:`PICKLE_SLACK_BYTES`, is a ``too_large`` :class:`~energon_pack.media.MediaError`: a real
array's data is in the pickle, so only claims larger than the pickle itself are refused.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from energon_pack.media.errors import MediaError

__all__ = ["ALLOWED_DTYPES", "OPCODE_BYTES", "PICKLE_SLACK_BYTES", "load_arrays", "pickle_bound"]

ALLOWED_DTYPES: frozenset[str] = frozenset({"uint8", "float16", "float32", "float64"})
"""Pixel dtypes accepted from a pickle (floats hold 0-255 values, as qwen_vl_utils gives)."""

PICKLE_SLACK_BYTES = 64 * 2**20
"""What a pickle may allocate beyond its own size (see :func:`pickle_bound`)."""

OPCODE_BYTES = 64
"""What each opcode (and each list entry of the result) is charged: about the largest object
one opcode builds (an empty list or dict, a memo slot, a tuple entry)."""

_KINDS = frozenset((np.dtype(name).kind, np.dtype(name).itemsize) for name in ALLOWED_DTYPES)
_ARRAY = "an array of shape {} and dtype {}"

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

_RECONSTRUCT: Callable[..., Any] = np.zeros(0).__reduce__()[0]  # type: ignore[assignment]
_FROMBUFFER: Callable[..., Any] = np.zeros(1).__reduce_ex__(5)[0]  # type: ignore[assignment]

# Opcodes allowed in a pickle, by the form of their argument: none, a fixed number of bytes, a
# length of 1, 4 or 8 bytes followed by that many bytes, or lines ending in "\n".
_NO_ARG = frozenset(b".(]ael)t\x85\x86\x87N\x88\x89}dsuRb\x93\x94")
_FIXED = {ord(c): n for c, n in zip("\x80KMJ\x95hj", (1, 1, 2, 4, 8, 1, 4), strict=True)}
_MEMO_PUT = {ord("q"): ("<B", 1), ord("r"): ("<I", 4)}
_COUNTED = {
    ord("\x8a"): ("<B", 1),  # LONG1
    ord("C"): ("<B", 1),  # SHORT_BINBYTES
    ord("\x8c"): ("<B", 1),  # SHORT_BINUNICODE
    ord("B"): ("<I", 4),  # BINBYTES
    ord("X"): ("<I", 4),  # BINUNICODE
    ord("\x8e"): ("<Q", 8),  # BINBYTES8
    ord("\x8d"): ("<Q", 8),  # BINUNICODE8
    ord("\x96"): ("<Q", 8),  # BYTEARRAY8
}
_LINES = {ord("I"): 1, ord("L"): 1, ord("V"): 1, ord("g"): 1, ord("p"): 1, ord("c"): 2}
_PUT, _MEMOIZE, _FRAME = ord("p"), ord("\x94"), ord("\x95")
_OPCODE_NAMES = {op.code: op.name for op in pickletools.opcodes}


def pickle_bound(data_bytes: int) -> int:
    """The default bound of :func:`load_arrays` for a pickle of ``data_bytes`` bytes: its size
    plus :data:`PICKLE_SLACK_BYTES`."""
    return data_bytes + PICKLE_SLACK_BYTES


class _Budget:
    """What a pickle is charged, against its bound; over it raises a ``too_large`` error."""

    def __init__(self, key: str, member: str, size: int, limit: int) -> None:
        self.key, self.member, self.size, self.limit = key, member, size, limit
        self.used = 0

    def charge(self, amount: int, what: str, *args: Any) -> None:
        """Add ``amount``; over the bound, raise naming ``what.format(*args)`` (formatted only
        then: the normal path pays for no message)."""
        self.used += amount
        if self.used > self.limit:
            what = what.format(*args)
            default = self.limit == pickle_bound(self.size)
            bound = f"its size + {PICKLE_SLACK_BYTES} bytes" if default else "max_bytes"
            raise MediaError(
                self.key,
                self.member,
                "too_large",
                f"pickle of {self.size} bytes claims {self.used} bytes in all (last: {what}), more "
                f"than the bound of {self.limit} bytes ({bound}), so it is not read; store each "
                "image or frame once in the list (a repeated one is stacked at each place), or "
                "store the media as image / video files",
            )


class _Ndarray:
    """What ``numpy.ndarray`` resolves to: only an argument of ``_reconstruct``, never called."""

    def __call__(self, *args: Any) -> None:
        raise pickle.UnpicklingError("numpy.ndarray is only passed to _reconstruct, never called")


_NDARRAY = _Ndarray()


class _PendingDtype:
    """What ``numpy.dtype`` returns: a dtype of :data:`ALLOWED_DTYPES` whose ``__setstate__``
    (the pickle's BUILD) only takes the state numpy writes for it (a byte order), so numpy's
    own dtype state code (fields, flags, sizes) never runs on data."""

    def __init__(self, dtype: np.dtype[Any]) -> None:
        self.dtype = dtype

    def __setstate__(self, state: Any) -> None:
        for order in "<>|=":
            candidate = self.dtype.newbyteorder(order)  # type: ignore[arg-type]
            if candidate.__reduce__()[2] == state:
                self.dtype = candidate
                return
        raise pickle.UnpicklingError(f"not the state of a plain {self.dtype} dtype: {state!r:.80}")


class _PendingArray:
    """What ``_reconstruct`` returns: its ``__setstate__`` (the pickle's BUILD) checks the
    shape and dtype it is given before numpy allocates the array."""

    def __init__(self, budget: _Budget, dtype: np.dtype[Any]) -> None:
        self.budget = budget
        self.array: np.ndarray[Any, Any] = _RECONSTRUCT(np.ndarray, (0,), dtype)

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, tuple) or len(state) not in (4, 5):
            raise pickle.UnpicklingError("an array's state must be a tuple of 4 or 5 items")
        shape, dtype = state[-4], _resolved(state[-3])
        self.budget.charge(_claim(shape, dtype), _ARRAY, shape, dtype)
        self.array.__setstate__((*state[:-3], dtype, *state[-2:]))


def _allowed(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is one of :data:`ALLOWED_DTYPES` (any byte order; no ``.name``: slow)."""
    return (dtype.kind, dtype.itemsize) in _KINDS


def _resolved(dtype: Any) -> np.dtype[Any]:
    if not isinstance(dtype, _PendingDtype):
        raise pickle.UnpicklingError(f"an array's dtype is a {type(dtype).__name__}")
    return dtype.dtype


def _claim(shape: Any, dtype: np.dtype[Any]) -> int:
    """Bytes an array of ``shape`` and ``dtype`` holds (at least one per element)."""
    if not isinstance(shape, tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise pickle.UnpicklingError(f"an array's shape must be a tuple of sizes, not {shape!r}")
    return math.prod(shape) * max(dtype.itemsize, 1)


def _holds(key: str, member: str, kind: str, allow_bytes: bool) -> MediaError:
    also = " or bytes" if allow_bytes else ""
    return MediaError(
        key,
        member,
        "bad_sample",
        f"pickle holds {kind}; expected lists of arrays of {sorted(ALLOWED_DTYPES)}{also}",
    )


class _Builders:
    """The callables a pickle's names resolve to. They hold the budget, not the unpickler: a
    cycle through the memo would keep a pickle's objects alive until the next collection."""

    def __init__(self, budget: _Budget, allow_bytes: bool) -> None:
        self.budget = budget
        self.where = (budget.key, budget.member)
        self.allow_bytes = allow_bytes

    def dtype(self, code: Any, align: Any = False, copy: Any = True) -> _PendingDtype:
        """``numpy.dtype`` of a type code, as numpy pickles it; only :data:`ALLOWED_DTYPES`."""
        dtype = _code_dtype(code)
        if not _allowed(dtype):
            raise _holds(*self.where, dtype.name, self.allow_bytes)
        return _PendingDtype(dtype)

    def reconstruct(self, subtype: Any, shape: Any, code: Any) -> _PendingArray:
        if subtype is not _NDARRAY:
            raise pickle.UnpicklingError("_reconstruct builds numpy.ndarray only")
        dtype = _code_dtype(code)
        if dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None:
            raise _holds(*self.where, dtype.name, self.allow_bytes)
        self.budget.charge(_claim(shape, dtype), _ARRAY, shape, dtype)
        pending = _PendingArray(self.budget, dtype)
        if shape != (0,):
            pending.array = _RECONSTRUCT(np.ndarray, shape, dtype)
        return pending

    def frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any, *axis: Any) -> Any:
        descr = _resolved(dtype)
        if not isinstance(buf, (bytes, bytearray)):
            raise pickle.UnpicklingError("_frombuffer takes bytes")
        if _claim(shape, descr) != len(buf):
            raise pickle.UnpicklingError(f"shape {shape} of {descr} does not fit {len(buf)} bytes")
        self.budget.charge(len(buf), _ARRAY, shape, descr)
        return _FROMBUFFER(buf, descr, shape, order, *axis)


class _ArrayUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, budget: _Budget, allow_bytes: bool) -> None:
        super().__init__(io.BytesIO(data))
        self._where = (budget.key, budget.member)
        builders = _Builders(budget, allow_bytes)
        self._names: dict[str, Any] = {
            "ndarray": _NDARRAY,
            "dtype": builders.dtype,
            "_reconstruct": builders.reconstruct,
            "_frombuffer": builders.frombuffer,
        }

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
        return self._names[name]

    def persistent_load(self, pid: Any) -> Any:
        raise MediaError(*self._where, "unsupported", "pickle uses persistent ids")


def _code_dtype(code: Any) -> np.dtype[Any]:
    """A new ``numpy.dtype`` of a short type code (``"u1"``, ``b"b"``...), never a shared one."""
    if not isinstance(code, (str, bytes)) or len(code) > 16:
        raise pickle.UnpicklingError(f"a dtype must be a short type code, not {code!r:.40}")
    return np.dtype(code.decode("latin1") if isinstance(code, bytes) else code, copy=True)


def _latin1(text: Any, encoding: Any) -> bytes:
    """Protocol-2 pickles spell bytes as ``_codecs.encode(str, "latin1")``; nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("only latin1 text may be encoded to bytes")
    return text.encode("latin1")


def _scan(data: bytes, budget: _Budget) -> None:
    """Check the opcodes of ``data`` without building anything (see the module docstring)."""
    size = len(data)
    pos = ops = memo = 0
    key, member = budget.key, budget.member
    no_arg, fixed = _NO_ARG, _FIXED
    while pos < size:
        code = data[pos]
        start, pos = pos, pos + 1
        ops += 1
        if code in no_arg:
            memo += code == _MEMOIZE
            if code == 0x2E:  # STOP
                break
        elif code in fixed:
            pos += fixed[code]
            if code == _FRAME and pos <= size:
                _within(struct.unpack_from("<Q", data, pos - 8)[0], pos, size, key, member)
        elif code in _MEMO_PUT:
            fmt, width = _MEMO_PUT[code]
            if pos + width <= size:
                _memo_index(struct.unpack_from(fmt, data, pos)[0], memo, start, key, member)
            memo, pos = memo + 1, pos + width
        elif code in _COUNTED:
            fmt, width = _COUNTED[code]
            if pos + width > size:
                break  # truncated: the unpickler says so
            length = struct.unpack_from(fmt, data, pos)[0]
            pos += width
            _within(length, pos, size, key, member)
            pos += length
        elif code in _LINES:
            for _ in range(_LINES[code]):
                end = data.find(b"\n", pos)
                if end < 0:
                    break
                if code == _PUT:
                    text = data[pos:end]
                    index = int(text) if text.isdigit() and len(text) < 12 else -1
                    _memo_index(index, memo, start, key, member)
                    memo += 1
                pos = end + 1
        elif chr(code) in _OPCODE_NAMES:
            raise MediaError(
                key,
                member,
                "unsupported",
                f"pickle uses opcode {_OPCODE_NAMES[chr(code)]} at byte {start}; only lists, "
                "tuples, dicts, integers, strings, bytes and numpy arrays are read from a pickle",
            )
        else:
            raise MediaError(
                key,
                member,
                "unreadable",
                f"not a readable pickle: byte {start} ({bytes([code])!r}) is no pickle opcode",
            )
    budget.charge(ops * OPCODE_BYTES, "{} opcodes at {} bytes each", ops, OPCODE_BYTES)


def _within(length: int, pos: int, size: int, key: str, member: str) -> None:
    if length > size - pos:
        raise MediaError(
            key,
            member,
            "unreadable",
            f"pickle claims {length} bytes at byte {pos} but holds {size - pos} more; it is "
            "truncated or forged, and is not read",
        )


def _memo_index(index: int, memo: int, pos: int, key: str, member: str) -> None:
    if not 0 <= index <= memo:
        raise MediaError(
            key,
            member,
            "unreadable",
            f"pickle stores memo entry {index} at byte {pos} after {memo} entries; a pickler "
            "numbers them in order, so it is forged, and is not read",
        )


def load_arrays(
    data: bytes,
    key: str = "?",
    member: str = "?",
    *,
    allow_bytes: bool = False,
    max_bytes: int | None = None,
) -> list[Any]:
    """The list pickled in ``data``: arrays of :data:`ALLOWED_DTYPES`, or lists of such arrays;
    with ``allow_bytes``, ``bytes`` items (encoded files) too, at either level.

    ``max_bytes`` bounds what the pickle may allocate (see the module docstring; default
    :func:`pickle_bound` of its size). Raises :class:`~energon_pack.media.MediaError` for a
    pickle that names anything but numpy's array constructors (without running it), claims
    more than the bound (``too_large``, before allocating it), is malformed, or holds another
    structure.
    """
    if not isinstance(data, (bytes, bytearray)):
        raise MediaError(key, member, "bad_sample", f"member is {type(data).__name__}, not bytes")
    data = bytes(data)
    limit = pickle_bound(len(data)) if max_bytes is None else max_bytes
    budget = _Budget(key, member, len(data), limit)
    try:
        _scan(data, budget)
        value = _ArrayUnpickler(data, budget, allow_bytes).load()
    except MediaError:
        raise
    except Exception as exc:  # any malformed pickle: UnpicklingError, EOFError, ValueError...
        raise MediaError(key, member, "unreadable", f"not a readable pickle: {exc!r}") from exc
    if isinstance(value, _PendingArray):
        value = value.array
    if not isinstance(value, list):
        raise MediaError(
            key, member, "bad_sample", f"pickle holds a {type(value).__name__}, not a list"
        )
    places = _Budget(key, member, len(data), limit)
    return _check(value, key, member, 2, allow_bytes, places)


def _check(
    value: list[Any], key: str, member: str, depth: int, allow_bytes: bool, places: _Budget
) -> list[Any]:
    """``value`` with its arrays built, each item checked and charged at each of its places."""
    out: list[Any] = []
    for item in value:
        places.charge(OPCODE_BYTES, "{} bytes per list entry", OPCODE_BYTES)
        if isinstance(item, _PendingArray):
            item = item.array
        if isinstance(item, list) and depth > 1:
            out.append(_check(item, key, member, depth - 1, allow_bytes, places))
            continue
        if allow_bytes and isinstance(item, bytes):
            places.charge(len(item), "each file counted at each place in the list")
        elif not isinstance(item, np.ndarray) or not _allowed(item.dtype):
            kind = item.dtype.name if isinstance(item, np.ndarray) else type(item).__name__
            raise _holds(key, member, kind, allow_bytes)
        else:
            places.charge(item.nbytes, "each array counted at each place in the list")
        out.append(item)
    return out
