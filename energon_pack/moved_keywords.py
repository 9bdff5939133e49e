"""Keywords from before the settings objects, accepted for one more release.

A constructor that took a group's settings one by one (``max_vision_tokens=``, ``max_wait=``,
``pad_to_max_length=``, ...) now takes the group as one object (``vision=VisionBudget(...)``,
``buffer=BufferConfig(...)``, ``layout=RowLayout(...)``). It lists its old keywords in a table of
:class:`Moved` entries and passes what it got to :func:`regroup`, which warns with the new
spelling and hands back each group's fields. An old keyword given with its group's new one is a
``ValueError`` naming both; an unknown keyword is a ``TypeError``, as Python's own.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Moved", "regroup"]


@dataclass(frozen=True)
class Moved:
    """Where an old keyword lives now: ``group=Setting(field=...)``."""

    group: str
    """The parameter that holds it now (``"vision"``)."""
    setting: str
    """The settings class of that parameter (``"VisionBudget"``)."""
    field: str | None
    """Its field there (``"max_vision_tokens"``); None: the value is the new parameter itself
    (``mrope=config`` is ``position_ids=config``)."""
    leading: str = ""
    """What the new spelling's call starts with (``"seq_length, "`` for ``RowLayout``)."""


def regroup(
    owner: str,
    given: Mapping[str, Any],
    moves: Mapping[str, Moved],
    groups: Mapping[str, object],
) -> dict[str, dict[str, Any]]:
    """The old keywords in ``given`` as ``{group: {field: value}}``, with one
    ``DeprecationWarning`` naming the new spelling of each. ``groups`` holds the new parameters
    as the caller got them (None: not given)."""
    unknown = sorted(set(given) - set(moves))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    out: dict[str, dict[str, Any]] = {}
    for old, value in given.items():
        move = moves[old]
        if groups.get(move.group) is not None:
            raise ValueError(
                f"{owner}: {old}= and {move.group}= are both given, and {old} is part of "
                f"{move.group} now; pass {_spelling(moves, {old: value})} instead of {old}="
            )
        out.setdefault(move.group, {})[move.field or old] = value
    if given:
        by_group: dict[str, dict[str, Any]] = {}
        for old, value in given.items():
            by_group.setdefault(moves[old].group, {})[old] = value
        spellings = ", ".join(_spelling(moves, olds) for olds in by_group.values())
        warnings.warn(
            f"{owner}({', '.join(f'{old}=' for old in given)}) is deprecated and will be removed "
            f"in the next release; pass {spellings}",
            DeprecationWarning,
            stacklevel=3,
        )
    return out


def _spelling(moves: Mapping[str, Moved], olds: Mapping[str, Any]) -> str:
    """The new spelling of the old keywords ``olds``, all of one group."""
    move = moves[next(iter(olds))]
    if move.field is None:
        return f"{move.group}={next(iter(olds.values()))!r}"
    fields = ", ".join(f"{moves[old].field}={value!r}" for old, value in olds.items())
    return f"{move.group}={move.setting}({move.leading}{fields})"
