"""``energon-pack tune`` measures the steady state: each run repeats the dataset until it has
``--min-packs`` packs, shows its pack count and a confidence note, warns when a run rests on too
few packs, times throughput over wall time only where there are enough packs, suggests larger
sizes while fill still rises, and titles its plots truly."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from helpers import text_dataset

from energon_pack.cli import build_parser, main
from energon_pack.cli.tune_plots import results_figures
from energon_pack.packing.packed import Decode
from energon_pack.tune import (
    TIMED_PACKS,
    TUNE_HEADERS,
    TuneResult,
    TuneSettings,
    still_rising_notes,
    tokenizer_label,
)

SAMPLES = 40
SEQ_LENGTH = 2048


@pytest.fixture(scope="module")
def short_turns(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 text conversations of 100-600 tokens: one epoch makes 7 rows of 2048 tokens."""
    lengths = [int(n) for n in np.random.default_rng(1).integers(100, 601, size=SAMPLES)]
    return text_dataset(tmp_path_factory.mktemp("short_turns"), lengths)


def tune(dataset: Path, out: Path, *extra: str) -> list[str]:
    return [
        "tune", str(dataset), "--seq-length", str(SEQ_LENGTH), "--buffer-sizes", "64",
        "--num-workers", "0", "--out", str(out), *extra,
    ]  # fmt: skip


def table_row(out: str) -> dict[str, str]:
    """The table's one row, by column header."""
    (line,) = [line for line in out.splitlines() if line.lstrip().startswith("lazy  ")]
    return dict(zip(TUNE_HEADERS, re.split(r"\s{2,}", line.strip()), strict=True))


def test_the_tune_flags_and_their_defaults() -> None:
    args = build_parser().parse_args(["tune"])
    assert (args.min_packs, args.one_epoch, args.max_samples) == (200, False, None)
    args = build_parser().parse_args(["tune", "--min-packs", "30", "--one-epoch"])
    assert (args.min_packs, args.one_epoch) == (30, True)


def test_a_run_repeats_the_dataset_until_it_has_min_packs(
    short_turns: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The steady state: the run goes past the end of the epoch (no flush) to 30 packs, and
    fills more than one epoch with its flush does."""
    assert main(tune(short_turns, tmp_path / "steady", "--min-packs", "30")) == 0
    report = json.loads((tmp_path / "steady" / "tune.json").read_text())
    assert (report["settings"]["min_packs"], report["settings"]["one_epoch"]) == (30, False)
    (run,) = report["results"]
    assert run["packs"] == 30
    assert run["samples"] > SAMPLES  # the dataset repeated
    assert report["warnings"] == []
    out = capsys.readouterr().out
    row = table_row(out)
    assert (row["packs"], row["confidence"]) == ("30", "ok")
    assert "bin fill over the steady state: each run repeats the dataset until it has 30 packs" in (
        out
    )
    assert "low confidence" not in out
    # Throughput over the run's wall time, the first pack's latency included: never a rate
    # read from a burst of packs that arrived together.
    assert 0 < run["samples_per_second"] <= run["samples"] / run["first_pack_seconds"]
    assert row["samples/s"] == f"{run['samples_per_second']:.1f}"
    # The packer's own time per sample: part of the loader's time per sample, never all of it.
    assert 0 < run["pack_us_per_sample"] * 1e-6 < 0.5 / run["samples_per_second"]
    assert row["pack µs"] == f"{run['pack_us_per_sample']:.1f}"

    assert main(tune(short_turns, tmp_path / "epoch", "--one-epoch")) == 0
    epoch = json.loads((tmp_path / "epoch" / "tune.json").read_text())["results"][0]
    assert epoch["samples"] == SAMPLES
    assert epoch["bin_fill"] < run["bin_fill"] - 0.01  # the flush's part-filled last row


def test_a_run_of_too_few_packs_is_flagged_with_what_ended_it(
    short_turns: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(tune(short_turns, tmp_path, "--one-epoch")) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    (run,) = report["results"]
    packs = run["packs"]
    assert packs < TIMED_PACKS
    assert (run["samples"], run["unaccounted"]) == (SAMPLES, 0)
    assert run["samples_per_second"] is None  # too few packs to time
    out = capsys.readouterr().out
    row = table_row(out)
    assert (row["packs"], row["confidence"], row["samples/s"]) == (
        str(packs),
        f"low: {packs} packs",
        "-",
    )
    assert f"samples/s '-': a run of fewer than {TIMED_PACKS} packs is too short to time" in out
    assert "bin fill over one epoch per run (--one-epoch), its end-of-epoch flush included" in out
    warning = (
        f"warning: lazy buffer 64: bin fill {run['bin_fill']:.3f} rests on {packs} packs, fewer "
        "than --min-packs 200, so it is uncertain: one epoch of this dataset makes no more"
    )
    (line,) = [line for line in out.splitlines() if line.startswith("warning: ")]
    assert line.startswith(warning)
    assert "drop --one-epoch" in line
    assert report["warnings"] == [line]
    assert f"(low confidence: {packs} packs)" in out

    assert main(tune(short_turns, tmp_path, "--max-samples", "10")) == 0
    out = capsys.readouterr().out
    assert "--max-samples 10 ended it; raise or drop it" in out
    assert "until it has 200 packs (--min-packs) or --max-samples 10" in out


def result(
    size: int, fill: float, decode: Decode = "lazy", *, rss: float = 0.0, interrupted: bool = False
) -> TuneResult:
    """A completed run of 200 packs (``interrupted``: one cut short)."""
    return TuneResult(
        size, decode, bin_fill=fill, packs=200, peak_worker_rss_mb=rss, interrupted=interrupted
    )


def test_fill_still_rising_at_the_largest_size_suggests_larger_ones() -> None:
    rising = [result(16, 0.80), result(32, 0.90), result(64, 0.95)]
    (note,) = still_rising_notes(rising)
    assert note.startswith("lazy buffer 64: bin fill still rises at the largest size tried")
    assert "(0.900 at 32, 0.950 at 64)" in note
    assert note.endswith("try --buffer-sizes 64,128,256")
    assert still_rising_notes([result(32, 0.90), result(64, 0.902)]) == []  # flat
    assert still_rising_notes([result(32, 0.90), result(64, 0.996)]) == []  # full already
    assert still_rising_notes([result(64, 0.95)]) == []  # one size: nothing to compare
    interrupted = result(128, 0.99, interrupted=True)
    assert still_rising_notes([result(32, 0.95), result(64, 0.95), interrupted]) == []
    eager = [result(8, 0.5, "eager"), result(16, 0.7, "eager")]
    (note,) = still_rising_notes([result(32, 0.95), result(64, 0.95), *eager])
    assert note.startswith("eager buffer 16:")


def test_the_tokenizer_label_is_its_class_and_where_it_came_from() -> None:
    """A tokenizer saved in a folder named ``tokenizer`` is not "tokenizer tokenizer"."""
    local = {"name": "/models/qwen2-vl/tokenizer", "class": "Qwen2TokenizerFast"}
    assert (
        tokenizer_label(local | {"encoding": "chatml"}) == "Qwen2TokenizerFast (qwen2-vl/tokenizer)"
    )
    byte = {"name": "byte", "class": "ByteTokenizer", "encoding": "chatml"}
    assert tokenizer_label(byte) == "ByteTokenizer (one token per byte)"
    processor = {"name": "the qwen2_vl processor's", "class": "Qwen2TokenizerFast"}
    assert tokenizer_label(processor | {"encoding": "processor"}) == (
        "the qwen2_vl processor's Qwen2TokenizerFast"
    )


def test_the_plots_title_and_legends_say_what_was_measured() -> None:
    """The over-budget cross and the low-confidence ring are in the legend only where a run
    is over the budget or rests on too few packs; the title names the measurement."""
    settings = TuneSettings("/data/short-turns", num_workers=2)
    tokenizer = {"name": "/models/qwen/tokenizer", "class": "Qwen2TokenizerFast", "encoding": "x"}
    runs = [result(16, 0.9, rss=300.0), result(64, 0.99, rss=400.0)]

    def legends(budget: float, runs: list[TuneResult]) -> dict[str, list[str]]:
        figures = results_figures(
            runs, settings, tokenizer=tokenizer, rss_budget_mb=budget, best=runs[0]
        )
        titles = {figure.axes[0].get_title() for figure in figures.values()}
        assert titles == {
            "short-turns: seq_length 8192, 2 workers, tokens: Qwen2TokenizerFast "
            "(qwen/tokenizer)\nsteady state: dataset repeated to 200 packs per run"
        }
        shown = {
            name: [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
            for name, figure in figures.items()
        }
        plt.close("all")
        return shown

    fits = legends(10_000.0, runs)
    assert fits["bin_fill"] == ["lazy", "recommended: 16 (lazy)"]
    over = legends(700.0, runs)  # 2 workers x 400 MiB
    assert over["bin_fill"] == ["lazy", "over the budget 700 MiB", "recommended: 16 (lazy)"]
    few = legends(10_000.0, [runs[0], replace(runs[1], packs=12)])
    assert few["bin_fill"] == [
        "lazy",
        "under 200 packs: low confidence",
        "recommended: 16 (lazy)",
    ]
