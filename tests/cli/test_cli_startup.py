"""``energon-pack`` starts light: ``--help`` (of every subcommand), ``check-config`` and argument
errors answer without importing torch, transformers or Megatron-Energon (checked in a child
process, whose ``sys.modules`` is read after the command ran); every ``--help`` shows the
defaults; a mistyped flag points to its subcommand's ``--help``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from energon_pack.cli import EXIT_USAGE, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "megatron.energon")
"""What a light command must not import."""
CHILD = """
import json, runpy, sys
sys.argv = ["energon-pack", *sys.argv[1:]]
try:
    runpy.run_module("energon_pack.cli", run_name="__main__")
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""
"""Runs ``energon-pack ARGV`` and prints its exit status and the modules it imported."""


def run_light(argv: list[str]) -> tuple[int, list[str], str]:
    """Exit status, the heavy libraries imported and stderr of ``energon-pack ARGV``."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(done.stdout.splitlines()[-1])
    heavy = [name for name in HEAVY if name in result["modules"]]
    return result["code"], heavy, done.stderr


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Subcommand name -> its parser."""
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


COMMANDS = ("demo", "check-config", "offline", "plan", "tune", "report", "redist", "verify")
LIGHT = [
    pytest.param(["--help"], 0, id="--help"),
    *(pytest.param([name, "--help"], 0, id=f"{name} --help") for name in COMMANDS),
    pytest.param(["check-config", "--seq-length", "8192", "--tp", "2", "--sp"], 0, id="ok"),
    pytest.param(["check-config", "--seq-length", "8190", "--cp", "2"], 1, id="violations"),
    pytest.param(["tune", "--bufer-sizes", "4"], EXIT_USAGE, id="unknown flag"),
    pytest.param(["offline", "in.jsonl", "out", "--size", "0"], EXIT_USAGE, id="bad value"),
    pytest.param(["no-such-command"], EXIT_USAGE, id="unknown command"),
]


@pytest.mark.parametrize(("argv", "code"), LIGHT)
def test_light_commands_import_no_torch_transformers_or_energon(argv: list[str], code: int) -> None:
    status, heavy, err = run_light(argv)
    assert status == code, err
    assert heavy == [], f"energon-pack {' '.join(argv)} imported {heavy}"


def test_every_subcommand_is_checked_light() -> None:
    assert set(COMMANDS) == set(_commands())


def test_a_command_that_needs_torch_still_gets_it() -> None:
    """The dispatch imports a command's own needs (``redist`` reads states with torch)."""
    status, heavy, err = run_light(["redist", "missing.pt", "out", "--new-world-size", "1"])
    assert status != 0
    assert "torch" in heavy, err


def _help_blocks(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each argument's lines of ``parser.format_help()``, by its first flag (or metavar)."""
    blocks: dict[str, str] = {}
    current = None
    for line in parser.format_help().splitlines():
        stripped = line.strip()
        if line.startswith("  ") and not line.startswith("   ") and stripped:
            current = stripped.split()[0].rstrip(",")
            blocks[current] = stripped
        elif current is not None and line.startswith("   "):
            blocks[current] += " " + stripped
        else:
            current = None
    return blocks


@pytest.mark.parametrize("name", list(_commands()))
def test_every_help_shows_the_defaults(name: str) -> None:
    parser = _commands()[name]
    blocks = _help_blocks(parser)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        first = action.option_strings[0] if action.option_strings else action.metavar
        block = blocks.get(str(first if first is not None else action.dest))
        assert block is not None, f"{name}: {first} has no help"
        assert len(block.split()) > 1 + bool(action.option_strings), f"{name}: {first} no help"
        if action.default not in (None, False):
            default = action.default
            shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
            assert "default" in block, f"{name} --help: {first} does not show its default"
            if "(default: " in block:
                assert f"(default: {shown})" in block, block


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["tune", "--bufer-sizes", "4"], "did you mean --buffer-sizes?"),
        (["check-config", "--seq-lenght", "8192"], "did you mean --seq-length?"),
        (["demo", "--samples", "10", "extra"], None),
    ],
)
def test_a_mistyped_flag_points_to_the_subcommand_help(
    argv: list[str], hint: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == EXIT_USAGE
    line = capsys.readouterr().err.strip()
    assert line.startswith("energon-pack: error: unrecognized arguments: "), line
    assert line.endswith(f"(see energon-pack {argv[0]} --help)"), line
    assert (hint in line) if hint else ("did you mean" not in line), line
