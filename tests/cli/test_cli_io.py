"""``energon-pack`` on bad arguments and failing reads and writes: one line on stderr naming the
flag or path, exit status 2 (bad argument) or 3 (I/O failure), no traceback. The failures are
real: a full and a read-only tmpfs (mounted as root; skipped where mounting fails), /dev/full,
a file-size limit in a child process, regular files where folders are expected and back."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from energon_pack.cli import EXIT_IO, EXIT_USAGE, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def error_line(err: str) -> str:
    """The one line of ``err``, checked to be our error line and the only output."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("energon-pack: error: "), err
    return lines[0]


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit status and error line of ``energon-pack ARGV`` run in-process."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = int(exit_.code or 0)
    return code, error_line(capsys.readouterr().err)


def run_child(argv: list[str], cwd: Path, file_limit: int | None = None) -> tuple[int, str]:
    """Exit status and error line of ``energon-pack ARGV`` in a child process, optionally under
    ``RLIMIT_FSIZE`` (SIGXFSZ ignored, so a write past it fails with EFBIG)."""

    def limit() -> None:
        if file_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    done = subprocess.run(
        [sys.executable, "-m", "energon_pack.cli", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=limit,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, error_line(done.stderr)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """400 pre-tokenised samples of 199 tokens: about 400 KB of temporary token files and as
    much of arrays."""
    path = tmp_path / "in.jsonl"
    record = json.dumps({"input_ids": list(range(1, 200)), "loss_mask": [1] * 199})
    path.write_text((record + "\n") * 400)
    return path


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a folder\n")
    return path


def mount_tmpfs(where: Path, options: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@pytest.fixture(
    params=[("64k", ".input_ids.tmp"), ("600k", "input_ids.npy")],
    ids=["full-in-pass-1", "full-in-the-arrays"],
)
def full_disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A tmpfs too small for the temporary token files (64k) or for the final arrays (600k),
    and the file whose write fails."""
    size, failing = request.param
    for where in mount_tmpfs(tmp_path / "small", f"size={size}"):
        yield where, failing


@pytest.fixture
def read_only(tmp_path: Path) -> Iterator[Path]:
    yield from mount_tmpfs(tmp_path / "ro", "ro,size=64k")


@pytest.fixture
def report_dir(tmp_path: Path) -> Path:
    """A memory report of one worker, three readings."""
    path = tmp_path / "report"
    path.mkdir()
    reading = {
        "rank": 0, "worker": 0, "pid": 1, "rss": 100 << 20, "uss": None, "buffer_count": 4,
        "buffer_bytes": 1 << 20, "buffer_decoded_bytes": 0, "samples": 8, "packs": 2,
        "bin_fill": 0.9,
    }  # fmt: skip
    lines = [json.dumps({**reading, "time": float(t)}) for t in range(3)]
    (path / "rss-rank0-worker0.jsonl").write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- bad arguments
OFFLINE = ["offline", "in.jsonl", "out", "--size", "64"]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["demo", "--samples", "0"], "--samples"),
        (["demo", "--capacity", "-1"], "--capacity"),
        (["demo", "--buffer-sizes", "4,0"], "--buffer-sizes"),
        (["demo", "--seed", "x"], "--seed"),
        ([*OFFLINE, "--tp", "0"], "--tp"),
        ([*OFFLINE, "--cp", "-2"], "--cp"),
        ([*OFFLINE, "--eval-cp", "0"], "--eval-cp"),
        ([*OFFLINE, "--pad-seq-to-mult", "0"], "--pad-seq-to-mult"),
        ([*OFFLINE, "--max-segments", "0"], "--max-segments"),
        (["offline", "in.jsonl", "out", "--size", "0"], "--size"),
        (["tune", "--max-samples", "0"], "--max-samples"),
        (["tune", "--max-samples", "-5"], "--max-samples"),
        (["tune", "--rss-budget-mb", "-5"], "--rss-budget-mb"),
        (["tune", "--rss-budget-mb", "nan"], "--rss-budget-mb"),
        (["tune", "--num-workers", "-1"], "--num-workers"),
        (["tune", "--seq-length", "0"], "--seq-length"),
        (["tune", "--pad-to-multiple-of", "0"], "--pad-to-multiple-of"),
        (["check-config", "--seq-length", "8192", "--tp", "0"], "--tp"),
        (["check-config", "--seq-length", "8192", "--packing-buffer-size", "-1"], "--packing"),
        (["check-config", "--seq-length", "8192", "--mtp", "-1"], "--mtp"),
    ],
)
def test_bad_numbers_are_refused_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = cli(argv, capsys)
    assert code == EXIT_USAGE
    assert line.startswith(f"energon-pack: error: argument {flag}")


def test_zero_where_zero_means_something() -> None:
    parser = build_parser()
    assert parser.parse_args(["tune", "--num-workers", "0"]).num_workers == 0
    args = parser.parse_args(["check-config", "--packing-buffer-size", "0", "--mtp", "0"])
    assert (args.packing_buffer_size, args.mtp) == (0, 0)


def test_a_real_process_prints_one_line(tmp_path: Path) -> None:
    code, line = run_child(["offline", "in.jsonl", "out", "--size", "64", "--tp", "0"], tmp_path)
    assert code == EXIT_USAGE
    assert "argument --tp: expected a positive int, got '0'" in line


# -------------------------------------------------------------------------------- demo --json
@pytest.mark.parametrize("where", ["missing/out.json", "a_file/out.json", "."])
def test_demo_json_needs_a_file_in_a_folder(
    where: str, a_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / where
    code, line = cli(["demo", "--samples", "10", "--json", str(path)], capsys)
    assert code == EXIT_USAGE
    assert line.startswith("energon-pack: error: argument --json: ")
    assert str(path if where == "." else path.parent) in line


def test_demo_json_on_a_full_device(capsys: pytest.CaptureFixture[str]) -> None:
    code, line = cli(["demo", "--samples", "10", "--json", "/dev/full"], capsys)
    assert code == EXIT_IO
    assert line == "energon-pack: error: /dev/full: No space left on device (ENOSPC)"


# ------------------------------------------------------------------------------- report --png
def test_report_png_writes_exactly_the_named_path(
    report_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "plot"  # no suffix: matplotlib alone would write plot.png
    assert main(["report", str(report_dir), "--png", str(plot)]) == 0
    assert f"wrote {plot}\n" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot.with_suffix(".png").exists()


@pytest.mark.parametrize("where", ["missing/rss.png", "a_file/rss.png", "."])
def test_report_png_needs_a_file_in_a_folder(
    where: str, report_dir: Path, a_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / where
    code, line = cli(["report", str(report_dir), "--png", str(path)], capsys)
    assert code == EXIT_USAGE
    assert line.startswith("energon-pack: error: argument --png: ")
    assert str(path if where == "." else path.parent) in line
    assert not list(tmp_path.glob("*.png"))


def test_report_png_on_a_full_device(report_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = cli(["report", str(report_dir), "--png", "/dev/full"], capsys)
    assert code == EXIT_IO
    assert line == "energon-pack: error: /dev/full: No space left on device (ENOSPC)"


def test_report_default_png_is_a_directory(
    report_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (report_dir / "rss.png").mkdir()
    code, line = cli(["report", str(report_dir)], capsys)
    assert code == EXIT_IO
    assert line.startswith(f"energon-pack: error: {report_dir / 'rss.png'}: ")
    assert line.endswith("(EISDIR)")


# ---------------------------------------------------------------------------- offline output
@pytest.mark.parametrize("force", [[], ["--force"]])
def test_offline_out_dir_is_a_file(
    force: list[str], source: Path, a_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = cli(["offline", str(source), str(a_file), "--size", "256", *force], capsys)
    assert code == EXIT_IO
    assert line == f"energon-pack: error: {a_file}: Not a directory (ENOTDIR)"
    assert a_file.read_text() == "not a folder\n"


def test_offline_out_dir_under_a_file(
    source: Path, a_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = cli(["offline", str(source), str(a_file / "out"), "--size", "256"], capsys)
    assert code == EXIT_IO
    assert line == f"energon-pack: error: {a_file / 'out'}: Not a directory (ENOTDIR)"


def test_offline_input_is_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, line = cli(["offline", str(tmp_path), str(tmp_path / "out"), "--size", "256"], capsys)
    assert code == EXIT_USAGE
    assert f"source {tmp_path} is a folder but neither an Energon dataset" in line


def test_offline_on_a_full_disk(
    source: Path, full_disk: tuple[Path, str], capsys: pytest.CaptureFixture[str]
) -> None:
    out = full_disk[0] / "out"
    code, line = cli(["offline", str(source), str(out), "--size", "256"], capsys)
    assert code == EXIT_IO
    assert line == f"energon-pack: error: {out / full_disk[1]}: No space left on device (ENOSPC)"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temp files
    assert not (out / "manifest.json").exists()  # incomplete: never reused


def test_offline_on_a_read_only_file_system(
    source: Path, read_only: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, line = cli(["offline", str(source), str(read_only / "out"), "--size", "256"], capsys)
    assert code == EXIT_IO
    assert line == f"energon-pack: error: {read_only / 'out'}: Read-only file system (EROFS)"


def test_offline_past_the_file_size_limit(source: Path, tmp_path: Path) -> None:
    argv = ["offline", str(source), str(tmp_path / "out"), "--size", "256"]
    code, line = run_child(argv, tmp_path, file_limit=100_000)
    assert code == EXIT_IO
    assert line.startswith(f"energon-pack: error: {tmp_path / 'out'}/")
    assert line.endswith(": File too large (EFBIG)")


def test_offline_manifest_without_spec(
    source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["offline", str(source), str(tmp_path / "out"), "--size", "256"]
    assert main(argv) == 0
    manifest = tmp_path / "out" / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["spec"]
    manifest.write_text(json.dumps(data))
    capsys.readouterr()
    code, line = cli(argv, capsys)
    assert code == EXIT_USAGE
    assert f"{manifest} is malformed: it has no spec (JSON object)" in line
