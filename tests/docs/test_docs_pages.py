"""The documentation's promises, checked without building Sphinx.

- The API reference (docs/reference/api.md) documents every name of ``energon_pack.__all__``
  with an autodoc directive for ``energon_pack.<name>``, and names nothing else.
- A Python block of README.md or docs/**/*.md is skipped only with a reason a reader can check
  (it needs a GPU, a multi-node cluster, or Megatron-Bridge), and at most 10% of the blocks are.
- Every relative link (pages, images, other files) in those pages resolves to a file.
- docs/index.md's toctrees list every page under docs/ and only pages that exist.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import energon_pack

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
# Folders of docs/ that hold no pages: Sphinx's output and the pages' shared helpers.
NOT_PAGES = ("_build", "_fixtures")

ALLOWED_SKIP_REASONS = (
    "needs a GPU",
    "needs a multi-node cluster",
    "needs Megatron-Bridge",
)
MAX_SKIPPED_SHARE = 0.10

FENCE = re.compile(r"^\s*(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<action>\w+)\s*(?P<arguments>.*?)\s*-->\s*$")
INVISIBLE_START = re.compile(r"^\s*<!--\s*invisible-code-block:\s*python\b")
AUTODOC = re.compile(
    r"(?:^\s*\.\.\s+|^\s*`{3,}\{)auto(?:class|function|data|exception|attribute|method|module)"
    r"(?:::|\})\s+(?P<target>[\w.]+)",
    re.MULTILINE,
)
LINK = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"(`+).*?\1")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/ (not its build or helper folders)."""
    found = [
        path
        for path in sorted(DOCS.rglob("*.md"))
        if not any(part in NOT_PAGES for part in path.relative_to(DOCS).parts)
    ]
    return [ROOT / "README.md", *found]


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


@dataclass
class Scan:
    """What one page holds: its Python blocks, its skip directives and its prose lines."""

    visible: int = 0  # Python blocks a reader sees
    skipped: int = 0  # of those, how many a skip directive skips
    skips: list[tuple[int, str, str]] = field(default_factory=list)  # (line, action, arguments)
    prose: list[tuple[int, str]] = field(default_factory=list)  # lines outside code and comments


def is_python(info: str) -> bool:
    info = info.strip()
    if not info:
        return False
    words = info.split()
    return words[0] == "python" or (
        words[0] in ("{code-block}", "{code}") and words[1:2] == ["python"]
    )


def scan(path: Path) -> Scan:
    """Read ``path`` as Sybil's MyST parsers do: code fences, invisible blocks, skip comments."""
    result = Scan()
    lines = path.read_text(encoding="utf-8").splitlines()
    skip_next = False
    skipping_range = False
    index = 0
    while index < len(lines):
        line = lines[index]
        number = index + 1
        opened = FENCE.match(line)
        if opened:
            fence = opened["fence"]
            python = is_python(opened["info"])
            index += 1
            while index < len(lines):
                closing = lines[index].strip()
                if closing.startswith(fence[0] * len(fence)) and not closing.strip(fence[0]):
                    break
                index += 1
            index += 1
            if python:
                result.visible += 1
                if skip_next or skipping_range:
                    result.skipped += 1
                skip_next = False
            continue
        if INVISIBLE_START.match(line):
            while index < len(lines) and "-->" not in lines[index]:
                index += 1
            index += 1
            skip_next = False  # a hidden block is an example too: `skip: next` skips it
            continue
        skip = SKIP.match(line)
        if skip:
            action, arguments = skip["action"], skip["arguments"]
            result.skips.append((number, action, arguments))
            if action == "next":
                skip_next = True
            elif action == "start":
                skipping_range = True
            elif action == "end":
                skipping_range = False
            index += 1
            continue
        result.prose.append((number, line))
        index += 1
    return result


def skip_reason(arguments: str) -> str | None:
    """The reason of a skip directive's arguments: ``"reason"`` or ``if(cond, reason="...")``."""
    arguments = arguments.strip()
    if not arguments:
        return None
    try:
        if arguments.startswith("if"):
            call = ast.parse(arguments.replace("if", "skip_if", 1), mode="eval").body
            if not isinstance(call, ast.Call):
                return None
            for keyword in call.keywords:
                if keyword.arg == "reason" and isinstance(keyword.value, ast.Constant):
                    return str(keyword.value.value)
            return None
        value = ast.literal_eval(arguments)
    except (SyntaxError, ValueError):
        return None
    return value if isinstance(value, str) else None


def test_api_reference_documents_every_public_name() -> None:
    api = DOCS / "reference" / "api.md"
    targets = [match["target"] for match in AUTODOC.finditer(api.read_text(encoding="utf-8"))]
    documented = {target.removeprefix("energon_pack.") for target in targets}
    missing = [n for n in energon_pack.__all__ if n not in documented]
    assert not missing, f"{name(api)} has no autodoc directive for " + ", ".join(
        f"energon_pack.{n}" for n in missing
    )
    internal = [t for t in targets if t.count(".") != 1 or not t.startswith("energon_pack.")]
    assert not internal, (
        f"{name(api)} documents {internal}: document public names as energon_pack.<Name>; "
        "the module paths inside the package are internal and move"
    )
    unknown = sorted(documented - set(energon_pack.__all__))
    assert not unknown, f"{name(api)} documents names outside energon_pack.__all__: {unknown}"
    repeated = sorted({t for t in targets if targets.count(t) > 1})
    assert not repeated, f"{name(api)} documents these more than once: {repeated}"


def test_skips_have_a_checkable_reason_and_stay_rare() -> None:
    total = skipped = 0
    per_page = []
    for page in pages():
        result = scan(page)
        total += result.visible
        skipped += result.skipped
        if result.skipped:
            per_page.append(f"{name(page)}: {result.skipped} of {result.visible}")
        for line, action, arguments in result.skips:
            where = f"{name(page)}:{line}"
            assert action in ("next", "start", "end"), f"{where}: unknown skip action {action!r}"
            if action == "end":
                continue
            reason = skip_reason(arguments)
            assert reason is not None, (
                f"{where}: `skip: {action}` without a reason; write "
                f'<!-- skip: {action} "needs a GPU" --> (or a multi-node cluster, Megatron-Bridge)'
            )
            assert reason.startswith(ALLOWED_SKIP_REASONS), (
                f"{where}: skip reason {reason!r} is not one a reader can check; allowed: "
                f"{', '.join(ALLOWED_SKIP_REASONS)}"
            )
    assert total > 0, "no Python blocks found in README.md and docs/"
    assert skipped <= MAX_SKIPPED_SHARE * total, (
        f"{skipped} of {total} Python blocks are skipped (at most "
        f"{MAX_SKIPPED_SHARE:.0%}): {'; '.join(per_page)}"
    )


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link or image in the prose of ``page`` that is not a URL."""
    found = []
    for line, text in scan(page).prose:
        for match in LINK.finditer(INLINE_CODE.sub("", text)):
            target = match["target"].strip("<>")
            if target.startswith("#") or SCHEME.match(target):
                continue
            found.append((line, target))
    return found


def test_relative_links_resolve() -> None:
    broken = []
    for page in pages():
        for line, target in relative_links(page):
            path = target.split("#", 1)[0].split("?", 1)[0]
            if not (page.parent / path).is_file():
                broken.append(f"{name(page)}:{line}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def toctree_entries(index: Path) -> list[str]:
    """The pages listed in the toctrees of ``index``, as paths relative to docs/ without .md."""
    entries = []
    lines = index.read_text(encoding="utf-8").splitlines()
    inside = None
    for line in lines:
        if inside is None:
            opened = FENCE.match(line)
            if opened and opened["info"].strip().startswith("{toctree}"):
                inside = opened["fence"]
            continue
        stripped = line.strip()
        if stripped.startswith(inside) and not stripped.strip(inside[0]):
            inside = None
        elif stripped and not stripped.startswith(":"):
            explicit = re.match(r"^.*<(?P<target>[^>]+)>$", stripped)
            entry = explicit["target"] if explicit else stripped
            entries.append(entry.removesuffix(".md"))
    return entries


def test_index_lists_every_page_once() -> None:
    index = DOCS / "index.md"
    entries = toctree_entries(index)
    on_disk = {str(page.relative_to(DOCS).with_suffix("")) for page in pages()[1:] if page != index}
    repeated = sorted({e for e in entries if entries.count(e) > 1})
    assert not repeated, f"{name(index)} lists these pages more than once: {repeated}"
    missing = sorted(on_disk - set(entries))
    absent = sorted(set(entries) - on_disk)
    problems = []
    if missing:
        problems.append(f"do not list these pages: {missing}")
    if absent:
        problems.append(f"list these pages that do not exist: {absent}")
    assert not problems, f"{name(index)}'s toctrees " + "; ".join(problems)
