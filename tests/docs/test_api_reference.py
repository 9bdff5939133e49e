"""The API reference (docs/reference/api.md) follows ``energon_pack.API_GROUPS``.

- The groups and ``__all__`` agree: ``__all__`` is the groups' names, group after group, no
  name in two groups and none left out.
- The page has one ``##`` section per group, titled as the group and in the groups' order, then
  a "Renamed" section; each section documents (with an autodoc directive) exactly its group's
  names, so a name documented under another group's heading fails.
- The "Renamed" table lists every renamed public name (``energon_pack._moved.RENAMED``), each
  old name outside ``__all__``.
"""

from __future__ import annotations

import re
from pathlib import Path

import energon_pack
from energon_pack._moved import RENAMED

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md"
RENAMED_TITLE = "Renamed"
AUTODOC = re.compile(
    r"^\s*\.\.\s+auto(?:class|function|data|exception|attribute|method)::\s+(?P<target>[\w.]+)",
    re.MULTILINE,
)
TABLE_ROW = re.compile(r"^\|\s*`(?P<old>\w+)`\s*\|\s*`(?P<new>\w+)`\s*\|", re.MULTILINE)


def sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of each ``##`` section of ``text``, in order (fenced blocks skipped)."""
    found: list[tuple[str, list[str]]] = []
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            found.append((line[3:].strip(), []))
        elif found:
            found[-1][1].append(line)
    return [(title, "\n".join(body)) for title, body in found]


def documented(body: str) -> list[str]:
    """The public names a section documents: its autodoc targets ``energon_pack.<Name>``."""
    return [m["target"].removeprefix("energon_pack.") for m in AUTODOC.finditer(body)]


def test_groups_hold_every_public_name_once_in_the_order_of_all() -> None:
    grouped = [name for names in energon_pack.API_GROUPS.values() for name in names]
    twice = sorted({name for name in grouped if grouped.count(name) > 1})
    assert not twice, f"names in more than one group (or twice in one): {twice}"
    assert grouped == list(energon_pack.__all__), (
        "energon_pack.__all__ must be the names of API_GROUPS, group after group; "
        f"only in __all__: {sorted(set(energon_pack.__all__) - set(grouped))}, "
        f"only in a group: {sorted(set(grouped) - set(energon_pack.__all__))}"
    )
    empty = [title for title, names in energon_pack.API_GROUPS.items() if not names]
    assert not empty, f"empty groups: {empty}"
    assert next(iter(energon_pack.API_GROUPS)) == "Entry points"
    for name in grouped:
        assert hasattr(energon_pack, name), f"energon_pack.{name} is in a group but not defined"


def test_the_page_has_one_section_per_group_in_order() -> None:
    titles = [title for title, _ in sections(API_PAGE.read_text(encoding="utf-8"))]
    assert titles == [*energon_pack.API_GROUPS, RENAMED_TITLE], (
        f"{API_PAGE.name}: its ## sections must be the groups of energon_pack.API_GROUPS in "
        f"order, then {RENAMED_TITLE!r}"
    )


def test_each_name_is_documented_under_its_group_and_nowhere_else() -> None:
    page = dict(sections(API_PAGE.read_text(encoding="utf-8")))
    problems = []
    for title, names in energon_pack.API_GROUPS.items():
        here = documented(page[title])
        for name in sorted(set(names) - set(here)):
            elsewhere = [t for t, body in page.items() if name in documented(body)]
            where = f"under {elsewhere}" if elsewhere else "nowhere"
            problems.append(f"{name} (group {title!r}) is documented {where}")
        problems += [
            f"{name} is documented under {title!r}, not its group's heading"
            for name in sorted(set(here) - set(names))
        ]
        problems += [
            f"{name} is documented twice under {title!r}" for name in names if here.count(name) > 1
        ]
    assert not documented(page[RENAMED_TITLE]), f"{RENAMED_TITLE!r} documents no object"
    assert not problems, f"{API_PAGE.name}:\n" + "\n".join(problems)


def test_the_renamed_table_lists_every_old_name() -> None:
    table = dict(sections(API_PAGE.read_text(encoding="utf-8")))[RENAMED_TITLE]
    rows = {m["old"]: m["new"] for m in TABLE_ROW.finditer(table)}
    assert rows == RENAMED, f"{API_PAGE.name}: the {RENAMED_TITLE!r} table must list RENAMED"
    assert not set(RENAMED) & set(energon_pack.__all__), "an old name is still in __all__"
