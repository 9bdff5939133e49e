"""Memory monitor, warnings, report and ``energon-pack tune`` on the shipped fixtures."""

from __future__ import annotations

import json
import statistics
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from helpers import SMALL_MEDIA, batches, image_bytes, train_dataset

from energon_pack import media
from energon_pack.cli import main
from energon_pack.media import MediaConfig
from energon_pack.media.guard import helper_pid
from energon_pack.memory.monitor import (
    KEEP_READINGS,
    MB,
    BufferMemoryWarning,
    BufferSnapshot,
    MonitorConfig,
    RSSMonitor,
    advice,
    suggest_buffer_size,
)
from energon_pack.memory.report import load_report, summarize


def run_loader(path: Path, monitor: MonitorConfig | None, **encoder: Any) -> list[list[str]]:
    dataset = train_dataset(path, 16, monitor=monitor, **{"media": MediaConfig(), **encoder})
    return [list(batch.__keys__) for batch in batches(dataset)]


def buffer_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, BufferMemoryWarning)]


def test_buffer_warning_fires_once_and_names_worker_and_keys(vlm_demo_path: Path) -> None:
    monitor = MonitorConfig(warn_buffer_mb=5, warn_growth=None, every_samples=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_loader(vlm_demo_path, monitor, decode="eager")
    messages = buffer_warnings(caught)
    assert len(messages) == 1
    message = messages[0]
    assert message.startswith("rank 0 worker 0: buffered samples hold")
    assert "above warn_buffer_mb=5" in message
    assert "largest: demo" in message
    assert "To fix: decode media lazily (decode='lazy')" in message
    assert "a packing_buffer_size of" in message


def test_no_warning_under_the_thresholds(vlm_demo_path: Path) -> None:
    monitor = MonitorConfig(warn_buffer_mb=5, warn_rss_mb=100_000, every_samples=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_loader(vlm_demo_path, monitor, media=SMALL_MEDIA)  # lazy: compressed bytes only
    assert buffer_warnings(caught) == []


def test_rss_warning_fires_once(vlm_demo_path: Path) -> None:
    monitor = MonitorConfig(warn_rss_mb=1, warn_growth=None, every_samples=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_loader(vlm_demo_path, monitor, media=SMALL_MEDIA)
    messages = buffer_warnings(caught)
    assert len(messages) == 1
    assert "passed warn_rss_mb=1" in messages[0]


def test_growth_warning_on_real_allocation() -> None:
    monitor = RSSMonitor(MonitorConfig(warn_growth=1.2))
    full = BufferSnapshot(count=8, capacity=8, bytes=8 * MB, decoded_bytes=0)
    first = monitor.read(full, samples=8, packs=1, bin_fill=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monitor.read(full, samples=9, packs=1, bin_fill=1.0)
        ballast = np.ones(int(first.rss * 0.4) // 8)  # written, so resident
        monitor.read(full, samples=10, packs=1, bin_fill=1.0)
        monitor.read(full, samples=11, packs=1, bin_fill=1.0)
        del ballast
    messages = buffer_warnings(caught)
    assert len(messages) == 1
    assert "grew over 1.2x the first full-buffer reading" in messages[0]


def test_readings_count_the_decoder_process(tmp_path: Path) -> None:
    """The decoder process (media.guard) holds memory of its own: readings and the report
    carry its RSS, and report lines written without it still load."""
    media.process_image(image_bytes(64, 64))  # starts this process's decoder
    pid = helper_pid()
    assert pid is not None
    monitor = RSSMonitor(MonitorConfig(report_dir=str(tmp_path)))
    buffer = BufferSnapshot(count=1, capacity=8, bytes=MB, decoded_bytes=0)
    reading = monitor.read(buffer, samples=1, packs=0, bin_fill=0.0)
    assert reading.decoder_rss is not None
    assert reading.decoder_rss == pytest.approx(psutil.Process(pid).memory_info().rss, rel=0.2)
    report = tmp_path / "rss-rank0-worker0.jsonl"
    old_line = {k: v for k, v in json.loads(report.read_text()).items() if k != "decoder_rss"}
    report.write_text(report.read_text() + json.dumps(old_line) + "\n")
    (summary,) = summarize(load_report(tmp_path))
    assert summary.peak_decoder_rss == reading.decoder_rss


def test_suggested_buffer_size() -> None:
    buffer = BufferSnapshot(count=10, capacity=16, bytes=100 * MB, decoded_bytes=100 * MB)
    assert suggest_buffer_size(buffer, 35 * MB) == 3
    assert suggest_buffer_size(buffer, 10_000 * MB) == 16
    assert suggest_buffer_size(buffer, 0) == 1


def snapshot(count: int, mib: float, *, decoded: bool, max_bytes: int | None) -> BufferSnapshot:
    size = int(mib * MB)
    return BufferSnapshot(16, 16, size, size if decoded else 0, max_bytes=max_bytes)


def test_advice_fits_the_configuration() -> None:
    eager = advice(snapshot(16, 160, decoded=True, max_bytes=None), 40 * MB)
    assert eager.startswith("decode media lazily (decode='lazy'): 160.0 MiB")
    assert "a packing_buffer_size of 4 would fit" in eager

    lazy = advice(snapshot(16, 160, decoded=False, max_bytes=None), 40 * MB)
    assert lazy == (
        f"a packing_buffer_size of 4 would fit, with BufferConfig(max_bytes={40 * MB}) (which "
        "also bounds a buffer grown for short samples)"
    )

    bounded = advice(snapshot(16, 160, decoded=False, max_bytes=200 * MB), 40 * MB)
    assert bounded == f"lower BufferConfig(max_bytes=...) from {200 * MB} to {40 * MB}"

    # Lazy, small buffer, memory elsewhere: neither a smaller buffer nor lazy decoding helps.
    elsewhere = advice(snapshot(16, 0.5, decoded=False, max_bytes=MB), -300 * MB)
    assert "packing_buffer" not in elsewhere
    assert "lazily" not in elsewhere
    assert "is not what fills memory" in elsewhere
    assert "max_pixels" in elsewhere


def test_rss_warning_on_a_lazy_byte_bounded_buffer_points_elsewhere() -> None:
    monitor = RSSMonitor(MonitorConfig(warn_rss_mb=1, warn_growth=None))
    with pytest.warns(BufferMemoryWarning) as caught:
        monitor.read(snapshot(16, 0.5, decoded=False, max_bytes=MB), samples=1, packs=0, bin_fill=0)
    (message,) = [str(w.message) for w in caught]
    assert "passed warn_rss_mb=1" in message
    assert "packing_buffer_size of" not in message
    assert "lazily" not in message
    assert "is not what fills memory" in message


def test_monitor_keeps_a_bounded_window_and_running_summaries() -> None:
    monitor = RSSMonitor(MonitorConfig(every_samples=1, warn_growth=None))
    buffer = snapshot(4, 1, decoded=False, max_bytes=None)
    taken = [monitor.observe(lambda: buffer, samples=i, packs=0, bin_fill=0) for i in range(600)]
    readings = [reading for reading in taken if reading is not None]
    assert len(readings) == 600
    assert len(monitor.readings) == KEEP_READINGS
    assert list(monitor.readings) == readings[-KEEP_READINGS:]
    assert monitor.count == 600
    assert monitor.peak_rss == max(r.rss for r in readings)


def test_monitoring_does_not_change_the_packs(vlm_demo_path: Path, tmp_path: Path) -> None:
    plain = run_loader(vlm_demo_path, None, media=SMALL_MEDIA)
    monitor = MonitorConfig(report_dir=str(tmp_path), every_samples=1, warn_growth=1.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BufferMemoryWarning)
        watched = run_loader(vlm_demo_path, monitor, media=SMALL_MEDIA)
    assert watched == plain


def test_report_files_summary_and_plot(
    vlm_demo_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # No time-based readings: on a slow machine they would come on top of the counted ones.
    monitor = MonitorConfig(report_dir=str(tmp_path), every_samples=5, every_seconds=1e9)
    run_loader(vlm_demo_path, monitor, media=SMALL_MEDIA)
    lines = (tmp_path / "rss-rank0-worker0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 60  # 300 samples, one reading every 5
    assert {"time", "rss", "uss", "buffer_count", "buffer_bytes", "packs", "bin_fill"} <= set(
        records[0]
    )
    (summary,) = summarize(load_report(tmp_path))
    rss = [r["rss"] for r in records]
    assert summary.readings == 60
    assert summary.peak_rss == max(rss)
    assert summary.steady_rss == statistics.median_high(rss[30:])
    assert summary.growth == pytest.approx(max(rss) / rss[0])
    assert summary.peak_buffer_bytes == max(r["buffer_bytes"] for r in records)

    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"{max(rss) / MB:.1f}" in out
    assert (tmp_path / "rss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_of_an_empty_directory_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "no rss-rank*-worker*.jsonl files" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"every_samples": 0}, "every_samples must be >= 1"),
        ({"warn_rss_mb": 0}, "warn_rss_mb must be None or > 0"),
        ({"warn_growth": 1.0}, "warn_growth must be None or > 1"),
    ],
)
def test_bad_monitor_settings(settings: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MonitorConfig(**settings)


def test_tune_runs_and_recommends_within_budget(
    vlm_demo_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["tune", str(vlm_demo_path), "--buffer-sizes", "4,16", "--num-workers", "1"]
    args += ["--min-rows", "none"]  # each buffer exactly its size, so 16 fills more than 4
    args += ["--max-samples", "40", "--out", str(tmp_path), "--rss-budget-mb", "100000"]
    assert main(args) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    fields = {
        "buffer_size", "decode", "samples", "packs", "bin_fill", "token_efficiency",
        "first_pack_seconds", "packs_per_second", "samples_per_second", "peak_worker_rss_mb",
        "steady_worker_rss_mb", "peak_buffer_mb", "peak_decoder_rss_mb", "skipped", "unaccounted",
        "interrupted", "max_vision_tokens", "vision_tokens_mean", "vision_tokens_max", "media_max",
        "vision_share", "buffer_full_share", "capped_share", "audio_tokens_mean",
        "audio_tokens_max", "pack_us_per_sample",
    }  # fmt: skip
    assert [r["buffer_size"] for r in report["results"]] == [4, 16]
    for result in report["results"]:
        assert set(result) == fields
        assert result["samples"] >= 40
        assert 0 < result["bin_fill"] <= 1
        assert result["pack_us_per_sample"] > 0  # the worker's packer, timed in the worker
        assert result["peak_worker_rss_mb"] > 50
        # the decoder process is counted: loaded without torch, far smaller than its worker
        assert 20 < result["peak_decoder_rss_mb"] < result["peak_worker_rss_mb"]
    best = report["recommendation"]
    assert best["buffer_size"] == 16
    total = best["peak_worker_rss_mb"] + best["peak_decoder_rss_mb"]
    assert total * 1 <= report["rss_budget_mb"]
    for name in ("bin_fill.png", "rss.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert "recommended: packing_buffer_size=16" in capsys.readouterr().out

    assert main([*args[:-2], "--rss-budget-mb", "1"]) == 0
    assert json.loads((tmp_path / "tune.json").read_text())["recommendation"] is None
    assert "no measured buffer fits 1 MiB" in capsys.readouterr().out


def test_tune_with_uint8_pixels(
    vlm_demo_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["tune", str(vlm_demo_path), "--buffer-sizes", "8", "--num-workers", "1"]
    args += ["--max-samples", "16", "--out", str(tmp_path), "--pixel-dtype", "uint8"]
    assert main(args) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["settings"]["pixel_dtype"] == "uint8"
    assert report["results"][0]["samples"] >= 16
    assert "1 workers, uint8 pixels" in capsys.readouterr().out


def test_tune_refuses_an_unprepared_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tune", str(tmp_path)]) == 2
    assert "is not a prepared Energon dataset" in capsys.readouterr().err
