"""The vision budget in the command line: ``tune --max-vision-tokens`` sweeps the cap on the
shipped fixture (real images and videos); ``check-config`` takes the caps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from energon_pack.cli import main
from energon_pack.packing import TrainingSetup

ROOT = Path(__file__).resolve().parents[2]


def test_tune_sweeps_the_vision_cap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "tune", str(ROOT / "fixtures" / "vlm_demo"), "--buffer-sizes", "16",
        "--max-vision-tokens", "300,600", "--max-media", "8", "--vision-balance",
        "--vision-share", "0.3", "--pad-to-multiple-of", "64", "--num-workers", "1", "--one-epoch",
        "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    runs = {r["max_vision_tokens"]: r for r in report["results"]}
    assert set(runs) == {300, 600}
    for cap, run in runs.items():
        assert 0 < run["vision_tokens_mean"] <= run["vision_tokens_max"] <= cap
        assert run["media_max"] <= 8
        assert run["peak_worker_rss_mb"] > 0
        assert run["unaccounted"] == 0  # skipped samples are counted, by kind
        real_per_pack = run["bin_fill"] * run["token_efficiency"] * 8192
        assert run["vision_share"] == pytest.approx(run["vision_tokens_mean"] / real_per_pack)
    assert runs[300]["skipped"]["over_max_vision_tokens"] > runs[600]["skipped"].get(
        "over_max_vision_tokens", 0
    )
    assert report["settings"]["max_media"] == 8
    assert report["settings"]["vision_balance"] is True
    assert report["settings"]["vision_share"] == 0.3
    assert (tmp_path / "vision_caps.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "max_media 8, vision_balance, vision_share 0.3" in out
    assert "vision cap" in out
    longest = max(runs.values(), key=lambda r: r["samples"])
    share = round(longest["vision_share"], 3)
    assert f"vision share {share}: " in out
    assert f"VisionBudget(balance=True, vision_share={share})" in out


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--vision-share", "1.5"], "expected a number in [0, 1], got '1.5'"),
        (["--vision-share", "0.3"], "vision_share=0.3 is where balance starts its target"),
    ],
)
def test_tune_names_a_bad_vision_share(
    extra: list[str], error: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["tune", str(ROOT / "fixtures" / "vlm_demo"), "--out", str(tmp_path), *extra]
    try:
        code = main(args)
    except SystemExit as exit_:  # argparse's own usage error
        code = exit_.code
    assert code != 0
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "violation"),
    [
        (["--max-vision-tokens", "9000"], "max_vision_tokens=9000 is above seq_length=8192"),
        (["--mode", "offline", "--max-media", "4"], "max_media=4 with packing mode offline"),
        (
            ["--mode", "collate", "--mbs", "4", "--gbs", "4", "--vision-balance"],
            "vision_balance=True with collate packing and pad_to_max_length=False",
        ),
    ],
)
def test_check_config_names_a_vision_budget_that_cannot_work(
    extra: list[str], violation: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["check-config", "--seq-length", "8192", "--mode", "online", "--packing-buffer-size",
            "16", "--calculate-per-token-loss"]  # fmt: skip
    assert main([*base, *extra]) == 1
    assert violation in capsys.readouterr().out


def test_check_config_shows_a_valid_vision_budget(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check-config", "--seq-length", "8192", "--mode", "online", "--packing-buffer-size",
            "16", "--calculate-per-token-loss", "--max-vision-tokens", "4096", "--max-media",
            "8", "--vision-balance"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "max_vision_tokens=4096, max_media=8, vision_balance=True" in out


def test_a_bad_cap_in_yaml_is_one_clear_line() -> None:
    with pytest.raises(ValueError, match="max_media must be a positive int or null, got 0"):
        TrainingSetup(seq_length=8192, max_media=0)
