"""Type and range rules of settings, checked where a settings object is built (no torch: the
decoder process loads this with the media settings).

Every check raises a ``ValueError`` naming the setting, the value, the rule and the fix. An int
is an int (never a bool, a float or a str); a number is a finite int or float (never a bool).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Integral, Real
from typing import TypeGuard

__all__ = [
    "check_choice",
    "check_config",
    "check_int",
    "check_number",
    "check_numbers",
    "check_type",
]


def check_int(
    name: str, value: object, *, minimum: int = 1, none_ok: bool = False, fix: str = ""
) -> None:
    """``value`` is an int >= ``minimum`` (or None where ``none_ok``)."""
    if (none_ok and value is None) or (_is_int(value) and value >= minimum):
        return
    rule = f">= {minimum} (an int)"
    raise ValueError(_message(name, value, rule, none_ok, fix or f"pass an int >= {minimum}"))


def check_number(
    name: str,
    value: object,
    *,
    above: float = 0.0,
    at_most: float | None = None,
    none_ok: bool = False,
    fix: str = "",
) -> None:
    """``value`` is a finite number > ``above`` (and <= ``at_most``), or None where ``none_ok``."""
    if none_ok and value is None:
        return
    if _is_number(value) and value > above and (at_most is None or value <= at_most):
        return
    bound = f"> {above:g}" if at_most is None else f"in ({above:g}, {at_most:g}]"
    rule = f"{bound} (a finite number)"
    raise ValueError(_message(name, value, rule, none_ok, fix or f"pass a number {bound}"))


def check_numbers(
    name: str, value: object, *, length: int, above: float | None = None, fix: str = ""
) -> None:
    """``value`` is a tuple of ``length`` finite numbers (each > ``above`` where given)."""
    if (
        isinstance(value, tuple)
        and len(value) == length
        and all(_is_number(v) and (above is None or v > above) for v in value)
    ):
        return
    each = "a finite number" if above is None else f"a finite number > {above:g}"
    rule = f"a tuple of {length} numbers, each {each}"
    raise ValueError(_message(name, value, rule, False, fix or f"pass a tuple of {length}"))


def check_type(
    name: str, value: object, kind: type | tuple[type, ...], what: str, *, fix: str = ""
) -> None:
    """``value`` is None or an instance of ``kind`` (described as ``what``)."""
    if value is None or isinstance(value, kind):
        return
    raise ValueError(_message(name, value, what, True, fix or f"pass {what}"))


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices`` (a setting's Literal values)."""
    if value in choices:
        return
    listed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}"
    raise ValueError(f"{name} must be {listed}, got {value!r}")


def check_config(name: str, value: object, kind: type) -> None:
    """``value`` is None or a ``kind`` settings object; a mapping is refused with the fix of
    building the object from it."""
    cls = kind.__name__
    fix = f"build the object: {name}={cls}(**settings)" if isinstance(value, Mapping) else ""
    check_type(name, value, kind, f"a {cls}", fix=fix or f"pass {name}={cls}(...)")


def shown(value: object, limit: int = 200) -> str:
    """``repr(value)`` for an error message, cut after ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(value: object) -> TypeGuard[int]:
    return not isinstance(value, bool) and isinstance(value, Integral)


def _is_number(value: object) -> TypeGuard[float]:
    return not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)


def _message(name: str, value: object, rule: str, none_ok: bool, fix: str) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    either = "None or " if none_ok else ""
    return f"{name} must be {either}{rule}, got {shown} ({type(value).__name__}); {fix}"
