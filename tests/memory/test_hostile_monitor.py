"""The memory monitor and ``energon-pack report`` on hostile inputs (issue #35, item 7).

A full disk is real here: each worker's report file is a symlink to ``/dev/full``, whose writes
fail with ENOSPC. The monitor then warns once and stops writing, and the run delivers every
pack it delivers without a monitor, in the main process and in loader workers. ``report`` names
the file, the line and the field of a line with wrong types, and skips a last line cut short.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from helpers import batches, text_dataset, train_dataset

from energon_pack.cli import main
from energon_pack.memory.monitor import (
    BufferMemoryWarning,
    BufferSnapshot,
    MonitorConfig,
    ReportWriteWarning,
    RSSMonitor,
)
from energon_pack.memory.report import load_report

FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full (Linux)")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_dataset(
        tmp_path_factory.mktemp("monitor"), [60 + (i * 97) % 340 for i in range(24)]
    )


def full_disk(folder: Path, workers: int = 1) -> Path:
    """A report folder whose worker files are on a full disk."""
    folder.mkdir()
    for worker in range(workers):
        (folder / f"rss-rank0-worker{worker}.jsonl").symlink_to(FULL)
    return folder


def report_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ReportWriteWarning)]


BUFFER = BufferSnapshot(count=1, capacity=4, bytes=10, decoded_bytes=0)


@pytest.mark.parametrize("where", ["full disk", "folder under a file"])
def test_a_report_that_cannot_be_written_warns_once_and_reading_goes_on(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    if where == "full disk":
        folder = full_disk(tmp_path / "report")
    else:  # mkdir fails: a file stands where the folder would be
        (tmp_path / "file").write_text("")
        folder = tmp_path / "file" / "report"
    monitor = RSSMonitor(MonitorConfig(report_dir=str(folder), warn_growth=None))
    with (
        warnings.catch_warnings(record=True) as caught,
        caplog.at_level(logging.WARNING, logger="energon_pack"),
    ):
        warnings.simplefilter("always")
        for index in range(5):
            monitor.read(BUFFER, samples=index, packs=index, bin_fill=0.5)
    assert monitor.count == 5
    assert len(monitor.readings) == 5
    (message,) = report_warnings(caught)
    assert message.startswith(
        f"rank 0 worker 0: cannot write the memory report {folder / 'rss-rank0-worker0.jsonl'} ("
    )
    assert "training goes on. To fix: free space on that disk, or point" in message
    assert [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()] == [message]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_full_disk_under_the_report_never_stops_the_run(
    data: Path, tmp_path: Path, workers: int
) -> None:
    def packs(monitor: MonitorConfig | None) -> list[list[str]]:
        dataset = train_dataset(data, 4, workers=workers, seq_length=512, monitor=monitor)
        return [list(batch.__keys__) for batch in batches(dataset)]

    plain = packs(None)
    folder = full_disk(tmp_path / "report", max(workers, 1))
    config = MonitorConfig(report_dir=str(folder), every_samples=1, warn_growth=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched = packs(config)
    assert watched == plain
    assert sorted(key for pack in watched for key in pack) == [f"t{i:05d}" for i in range(24)]
    if not workers:  # in the main process the warning is seen here, once
        assert len(report_warnings(caught)) == 1
    assert all(path.is_symlink() for path in folder.iterdir())


LINE: dict[str, Any] = {
    "time": 1.0,
    "rank": 0,
    "worker": 0,
    "pid": 1,
    "rss": 100 * 2**20,
    "uss": None,
    "buffer_count": 1,
    "buffer_bytes": 2,
    "buffer_decoded_bytes": 0,
    "samples": 3,
    "packs": 1,
    "bin_fill": 0.5,
    "decoder_rss": None,
}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({**LINE, "rss": "big"}, 'rss="big" is not an int >= 1'),
        ({**LINE, "rss": 0}, "rss=0 is not an int >= 1"),
        ({**LINE, "rss": -5}, "rss=-5 is not an int >= 1"),
        ({**LINE, "rss": 1.5}, "rss=1.5 is not an int >= 1"),
        ({**LINE, "rank": True}, "rank=true is not an int >= 0"),
        ({**LINE, "packs": None}, "packs=null is not an int >= 0"),
        ({**LINE, "time": None}, "time=null is not a number"),
        ({**LINE, "time": "now"}, 'time="now" is not a number'),
        ({**LINE, "bin_fill": {"a": 1}}, 'bin_fill={"a": 1} is not a number'),
        ({**LINE, "uss": [1]}, "uss=[1] is not null or an int >= 0"),
        ({**LINE, "decoder_rss": "x"}, 'decoder_rss="x" is not null or an int >= 0'),
        ({k: v for k, v in LINE.items() if k != "rss"}, "no 'rss'"),
        ({**LINE, "extra": 1}, "unknown field 'extra'"),
        ([1, 2], "a JSON list, not an object"),
        (3, "a JSON int, not an object"),
    ],
)
def test_report_names_the_file_line_and_field_of_a_bad_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: Any, message: str
) -> None:
    path = tmp_path / "rss-rank0-worker0.jsonl"
    path.write_text(json.dumps(LINE) + "\n" + json.dumps(line) + "\n")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"energon-pack: error: {path}:2: not a report line ({message}); a report holds the "
        "lines an RSSMonitor wrote: remove this line or point to the report_dir of a run\n"
    )
    assert not (tmp_path / "rss.png").exists()


def test_report_skips_a_cut_last_line_and_refuses_other_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rss-rank0-worker0.jsonl"
    second = {**LINE, "time": 2.0, "rss": 120 * 2**20}
    path.write_text(json.dumps(LINE) + "\n" + json.dumps(second) + "\n" + json.dumps(LINE)[:30])
    with caplog.at_level(logging.WARNING, logger="energon_pack"):
        assert [r.rss for r in load_report(tmp_path)] == [LINE["rss"], second["rss"]]
    assert any(f"{path}:3: skipping the cut last line" in r.getMessage() for r in caplog.records)
    assert main(["report", str(tmp_path)]) == 0
    assert "120.0" in capsys.readouterr().out
    path.write_text(json.dumps(LINE)[:30] + "\n" + json.dumps(LINE) + "\n")  # cut, then more
    assert main(["report", str(tmp_path)]) == 2
    assert f"{path}:1: not a report line" in capsys.readouterr().err
    path.write_bytes(b"\xff\xfe binary")
    assert main(["report", str(tmp_path)]) == 2
    assert f"energon-pack: error: {path}: not a report (not UTF-8 text" in capsys.readouterr().err


def test_buffer_warnings_still_come_with_a_full_report_disk(tmp_path: Path) -> None:
    folder = full_disk(tmp_path / "report")
    monitor = RSSMonitor(
        MonitorConfig(report_dir=str(folder), warn_buffer_mb=1e-6, warn_growth=None)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.read(BUFFER, samples=1, packs=0, bin_fill=0.5)
        monitor.read(BUFFER, samples=2, packs=0, bin_fill=0.5)
    kinds = [w.category for w in caught]
    assert kinds.count(ReportWriteWarning) == 1
    assert kinds.count(BufferMemoryWarning) == 1
