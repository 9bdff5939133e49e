"""``energon-pack tune`` on a prepared dataset with overlong and bad samples, a local tokenizer,
errors from loader workers, and Ctrl-C."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import fixture_maker, image_bytes
from interrupted import assert_interrupted_exit, interrupt_cli, losing
from PIL import Image

from energon_pack.cli import main
from energon_pack.cli.tune_plots import rss_axis
from energon_pack.encoding.chatml import SPECIAL_TOKENS
from energon_pack.tune import TuneResult, buffer_bound_note, vision_share_note

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["the", "cat", "sat", "on", "mat", "dog", "ran", "far"]
SEQ_LENGTH = 512
SAMPLES = 60
# Positions in the stream; each worker of two reads one half, and each half has packs after these.
OVERLONG = {3, 9, 16, 33, 39, 46}  # ~800 bytes: over SEQ_LENGTH in bytes, under it in words
BAD_JSON = {12, 42}
EMPTY_IMAGE = {20}


def sentence(rng: np.random.Generator, words: int) -> str:
    return " ".join(str(w) for w in rng.choice(WORDS, size=words))


def sample_members(index: int) -> dict[str, bytes]:
    rng = np.random.default_rng(index)
    if index in BAD_JSON:
        return {"json": b'{"conversations": [{"from": "human"'}
    words = 200 if index in OVERLONG else int(rng.integers(10, 80))
    image = index % 4 == 0 or index in EMPTY_IMAGE
    human = ("<image>\n" if image else "") + sentence(rng, 6)
    turns = [{"from": "human", "value": human}, {"from": "gpt", "value": sentence(rng, words)}]
    members = {"json": json.dumps({"conversations": turns}).encode()}
    if image:
        members["0.png"] = b"" if index in EMPTY_IMAGE else image_bytes(56, 56, seed=index)
    return members


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared Energon dataset: text and image conversations, some overlong, some broken."""
    maker = fixture_maker()
    root = tmp_path_factory.mktemp("user_data")
    members = [
        (f"s{index:03d}.{name}", data)
        for index in range(SAMPLES)
        for name, data in sample_members(index).items()
    ]
    shard = root / "data-000000.tar"
    maker.write_tar(shard, members)
    maker.prepare_energon(root, [shard])
    return root


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer with the Qwen2-VL special tokens, saved like a downloaded one."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "user": 1, "assistant": 2, "\n": 3}
    vocab |= {word: 4 + index for index, word in enumerate(WORDS)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(r"\n|\w+"), behavior="isolated"
    )
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    hf.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    path = tmp_path_factory.mktemp("tokenizer") / "words-v1"
    hf.save_pretrained(path)
    return path


def tune(dataset: Path, out: Path, *extra: str) -> list[str]:
    return [
        "tune", str(dataset), "--seq-length", str(SEQ_LENGTH), "--buffer-sizes", "8,32",
        "--num-workers", "2", "--out", str(out), *extra,
    ]  # fmt: skip


def test_tune_counts_skipped_samples_by_kind(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(tune(dataset, tmp_path, "--one-epoch")) == 0  # every sample once, accounted
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["settings"]["overlong"] == "skip"
    assert report["tokenizer"] == {
        "name": "byte",
        "class": "ByteTokenizer",
        "vocab_size": 263,
        "encoding": "chatml",
        "system_prompt": None,
    }
    assert report["interrupted"] is False
    expected_skips = {"bad_sample": 2, "empty": 1, "overlong": 6}
    assert [r["buffer_size"] for r in report["results"]] == [8, 32]
    for result in report["results"]:
        assert result["skipped"] == expected_skips
        assert result["unaccounted"] == 0
        assert result["samples"] == SAMPLES - 9
        assert 0 < result["bin_fill"] <= 1
        assert 0 <= result["buffer_full_share"] <= 1
        assert result["peak_worker_rss_mb"] > 0
        assert result["interrupted"] is False
    best = report["recommendation"]
    fills = {r["buffer_size"]: round(r["bin_fill"], 3) for r in report["results"]}
    assert best["buffer_size"] == (32 if fills[32] > fills[8] else 8)
    out = capsys.readouterr().out
    assert "tokenizer byte (ByteTokenizer, 263 tokens), overlong samples: skip" in out
    assert "bad_sample 2, empty 1, overlong 6" in out
    assert f"recommended: packing_buffer_size={best['buffer_size']} (lazy decode)" in out
    log = (tmp_path / "tune.log").read_text()
    for index in sorted(OVERLONG | BAD_JSON | EMPTY_IMAGE):
        assert f"'s{index:03d}'" in log
    for name in ("bin_fill.png", "rss.png"):
        assert str(tmp_path / name) in report["plots"]
        assert Image.open(tmp_path / name).size == (700, 450)


def test_tune_counts_tokens_with_the_given_tokenizer(
    dataset: Path, word_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = tune(dataset, tmp_path, "--tokenizer", str(word_tokenizer), "--rss-budget-mb", "1e5")
    args.append("--one-epoch")
    assert main(args) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    tokenizer = report["tokenizer"]
    assert tokenizer["name"] == str(word_tokenizer)
    assert tokenizer["vocab_size"] == 4 + len(WORDS) + len(SPECIAL_TOKENS)
    assert report["settings"]["tokenizer"] == str(word_tokenizer)
    for result in report["results"]:
        # One token per word: the samples that are overlong in bytes now fit.
        assert result["skipped"] == {"bad_sample": 2, "empty": 1}
        assert result["samples"] == SAMPLES - 3
    assert f"tokenizer {word_tokenizer} (" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "cannot be loaded offline"),
        (lambda tmp: "no-such-org/no-such-tokenizer", "cannot be loaded offline"),
    ],
)
def test_a_tokenizer_that_does_not_load_offline_is_one_clear_line(
    make: Any, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = str(make(tmp_path))
    assert main(["tune", str(ROOT / "fixtures" / "vlm_demo"), "--tokenizer", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"--tokenizer {name!r} {message}" in err[0]
    assert "save_pretrained" in err[0]


def test_a_tokenizer_without_the_template_tokens_is_refused(
    word_tokenizer: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    plain = transformers.AutoTokenizer.from_pretrained(word_tokenizer, local_files_only=True)
    plain.save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "tokenizer.json").read_text())
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] == "[UNK]"]
    (tmp_path / "plain" / "tokenizer.json").write_text(json.dumps(config))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "plain" / name).unlink(missing_ok=True)
    args = ["tune", str(ROOT / "fixtures" / "vlm_demo"), "--tokenizer", str(tmp_path / "plain")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "has no special tokens ['<|endoftext|>', '<|im_start|>'" in err
    assert "add_special_tokens" in err


def test_an_error_in_a_worker_is_one_line_with_the_fix(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(tune(dataset, tmp_path, "--overlong", "error")) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("energon-pack")]
    assert line.startswith("energon-pack: error: lazy buffer 8: sample 's")
    assert [line for line in err.splitlines() if line.strip()][-1] == line
    assert f"above --seq-length={SEQ_LENGTH}" in line
    assert "raise --seq-length" in line
    assert "--overlong skip" in line
    assert f"(traceback: {tmp_path / 'tune-error.log'})" in line
    assert "DataLoader worker process" in (tmp_path / "tune-error.log").read_text()


# The progress bar on stderr counts the packs the main process has received.
RECEIVED = r"lazy buffer 8:.*?\b[1-9]\d*(?:/\d+ | packs)"  # n/total or n
ENDLESS = ("--min-packs", "100000000")  # far beyond the data: repeat it until interrupted


def interrupt_tune(
    dataset: Path,
    out: Path,
    *extra: str,
    when: tuple[str, str],
    again: bool = False,
    path: tuple[Path, ...] = (),
) -> tuple[int | None, float, str, str]:
    """:func:`interrupt_cli` on ``energon-pack tune`` over ``dataset`` (buffers 8 and 32)."""
    args = tune(dataset, out, "--rss-budget-mb", "100000", *extra)
    return interrupt_cli(args, when=when, again=again, path=path)


def test_ctrl_c_exits_130_and_marks_the_interrupted_run(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Interrupt once the run has received a pack (before it a run has measured nothing).
    status, seconds, stdout, stderr = interrupt_tune(
        dataset, out, *ENDLESS, when=("stderr", RECEIVED)
    )
    assert_interrupted_exit(status, seconds, stderr)
    report = json.loads((out / "tune.json").read_text())
    assert report["interrupted"] is True
    (run,) = report["results"]  # buffer 32 never started
    assert (run["buffer_size"], run["interrupted"]) == (8, True)
    assert run["samples"] > 0
    assert report["recommendation"] is None
    assert "interrupted (Ctrl-C) during the lazy buffer 8 run" in stdout
    (row,) = [line for line in stdout.splitlines() if line.split()[:2] == ["lazy", "8"]]
    assert row.endswith(" interrupted")
    assert "no run completed" in stdout
    assert "no measured buffer fits" not in stdout


@pytest.mark.parametrize(
    ("phase", "extra", "when", "again"),
    [
        # The bar is up: the run opens the dataset and starts its workers.
        ("starting", ENDLESS, ("stderr", r"lazy buffer 8:"), False),
        ("packing, pressed twice", ENDLESS, ("stderr", RECEIVED), True),
        # Both runs are done: the table is printed, the plots and tune.json being written.
        ("writing", ("--max-samples", "10"), ("stdout", r"recommended: "), False),
    ],
)
def test_ctrl_c_in_every_phase_exits_130_within_seconds(
    dataset: Path,
    tmp_path: Path,
    phase: str,
    extra: tuple[str, ...],
    when: tuple[str, str],
    again: bool,
) -> None:
    """Ctrl-C stops the workers (and their decoder processes), a second one is ignored, and one
    while writing lets the writing finish: always exit 130, the report of what was measured,
    no traceback."""
    out = tmp_path / "out"
    status, seconds, stdout, stderr = interrupt_tune(dataset, out, *extra, when=when, again=again)
    assert_interrupted_exit(status, seconds, stderr)
    report = json.loads((out / "tune.json").read_text())
    runs = [(r["buffer_size"], r["interrupted"]) for r in report["results"]]
    if phase == "writing":
        assert runs == [(8, False), (32, False)]
        assert report["recommendation"] is not None
        assert all((out / name).is_file() for name in ("bin_fill.png", "rss.png"))
    else:
        assert runs == [(8, True)]
        assert report["interrupted"] is True
        assert "interrupted (Ctrl-C) during the lazy buffer 8 run" in stdout


SLOW_DECODER_START = """
import sys, time
if "energon_pack.media" in " ".join(sys.orig_argv):  # a media decoder process, not the rest
    print("decoder process starting", file=sys.stderr, flush=True)
    time.sleep(60)
"""


def test_ctrl_c_stops_decoder_processes_that_are_still_starting(
    dataset: Path, tmp_path: Path
) -> None:
    """A decoder process that takes long to start (a loaded machine) holds its loader worker in
    the pack it is making: Ctrl-C still exits within seconds, and neither the worker nor the
    decoder process outlives it (one that sleeps 60 s before it starts, and would read the end
    of its input only then)."""
    slow = tmp_path / "slow_start"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_DECODER_START)
    when = ("stderr", r"(?s)decoder process starting.*decoder process starting")  # both workers
    status, seconds, stdout, stderr = interrupt_tune(
        dataset, tmp_path / "out", *ENDLESS, when=when, path=(slow,)
    )
    assert_interrupted_exit(status, seconds, stderr)
    assert "interrupted (Ctrl-C) during the lazy buffer 8 run" in stdout


def test_a_ctrl_c_whose_interrupt_is_lost_still_ends_the_run(dataset: Path, tmp_path: Path) -> None:
    """The KeyboardInterrupt a Ctrl-C raises can be cleared by code it lands in (a C extension's
    module init, as tune imports numpy.random while a run starts): the run still ends at its
    next pack, and tune exits 130 within seconds, leaving no process."""
    status, seconds, stdout, stderr = interrupt_tune(
        dataset, tmp_path / "out", *ENDLESS, when=("stderr", RECEIVED), path=(losing(tmp_path),)
    )
    assert_interrupted_exit(status, seconds, stderr)
    assert "interrupted (Ctrl-C) during the lazy buffer 8 run" in stdout


def test_tune_reads_a_bridge_dataset_through_another_description(tmp_path: Path) -> None:
    """``--dataset-config crude.yaml``: a ChatMLWebdataset's shards, tuned without Bridge."""
    mantis = ROOT / "fixtures" / "bridge_layouts" / "mantis"
    args = ["tune", str(mantis), "--dataset-config", "crude.yaml", "--buffer-sizes", "4"]
    args.append("--one-epoch")
    assert main([*args, "--num-workers", "0", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["settings"]["dataset_config"] == "crude.yaml"
    (result,) = report["results"]
    assert result["samples"] == 12
    assert result["skipped"] == {}
    assert result["unaccounted"] == 0


def test_tune_takes_a_model_family(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--family`` gives the runs the family's media settings (recorded), a bad one fails
    before any run."""
    args = tune(dataset, tmp_path, "--family", "qwen3_vl", "--num-workers", "0")
    args[args.index("--buffer-sizes") + 1] = "8"
    assert main(args) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["settings"]["family"] == "qwen3_vl"
    assert "model family: qwen3_vl" in capsys.readouterr().out
    args[args.index("--family") + 1] = "qwen9"
    assert main(args) == 2
    assert "unknown model family 'qwen9'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("values", "budget", "shown"),
    [
        ([900.0, 950.0, 1400.0], 100_000.0, False),  # budget far above the runs
        ([5000.0, 5100.0], 10.0, False),  # far below them
        ([900.0, 950.0, 1400.0], 1500.0, True),  # just above
        ([900.0, 950.0, 1400.0], 10.0, True),  # below, but the axis starts at 0 anyway
        ([1200.0, 1210.0], 1205.0, True),  # among them
        ([50.0], 60_000.0, False),  # one run
    ],
)
def test_the_rss_axis_keeps_the_runs_readable(
    values: list[float], budget: float, shown: bool
) -> None:
    """The RSS plot's y range holds every run; it holds the budget line only where the runs
    still span a good part of the plot, so a far budget never squashes them flat."""
    bottom, top, budget_shown = rss_axis(values, budget)
    assert budget_shown == shown
    assert 0 <= bottom <= min(values) <= max(values) <= top
    assert (bottom <= budget <= top) == shown
    spread = max(values) - min(values)
    if not shown and spread:
        assert spread >= 0.25 * (top - bottom)


def test_tune_names_a_buffer_too_small_to_fill_a_row(
    vlm_demo_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two samples cannot fill an 8192-token row: tune says so for that buffer only."""
    args = ["tune", str(vlm_demo_path), "--seq-length", "8192", "--buffer-sizes", "2,32"]
    args += ["--one-epoch", "--min-rows", "none"]  # a buffer that does not grow
    assert main([*args, "--num-workers", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tune.json").read_text())
    assert report["settings"]["min_rows"] is None
    results = {r["buffer_size"]: r for r in report["results"]}
    assert results[2]["buffer_full_share"] > 0.9
    assert results[2]["bin_fill"] < 0.5
    assert results[32]["buffer_full_share"] < 0.1
    assert results[32]["bin_fill"] > 0.95
    out = capsys.readouterr().out
    assert re.search(
        r"lazy buffer 2: bin fill 0\.\d+ with \d+% of packs leaving because the buffer was full",
        out,
    )
    assert not re.search(r"buffer 32: bin fill \S+ with", out)


def test_tune_names_the_caps_where_they_hold_the_fill(
    vlm_demo_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At most 2 images per row, and most of the demo's samples carry one: rows leave the full
    buffer a quarter full, and tune names the caps, not the buffer."""
    args = ["tune", str(vlm_demo_path), "--seq-length", "8192", "--buffer-sizes", "32"]
    args += ["--one-epoch", "--max-media", "2", "--num-workers", "1", "--out", str(tmp_path)]
    assert main(args) == 0
    (result,) = json.loads((tmp_path / "tune.json").read_text())["results"]
    assert result["bin_fill"] < 0.5
    assert result["capped_share"] > 0.5
    out = capsys.readouterr().out
    assert "the caps, not the buffer, hold the fill at this mix" in out
    assert "a larger packing_buffer_size fills more" not in out


def test_buffer_bound_note_needs_both_a_full_buffer_and_a_low_fill() -> None:
    def run(share: float, fill: float) -> TuneResult:
        return TuneResult(16, "lazy", bin_fill=fill, buffer_full_share=share, packs=10)

    assert buffer_bound_note(run(0.8, 0.7)) is not None
    assert "packing_buffer_size" in str(buffer_bound_note(run(0.8, 0.7)))
    assert buffer_bound_note(run(0.8, 0.96)) is None  # balance keeps rows waiting, yet they fill
    assert buffer_bound_note(run(0.4, 0.7)) is None
    interrupted = TuneResult(16, "lazy", bin_fill=0.7, buffer_full_share=0.8, interrupted=True)
    assert buffer_bound_note(interrupted) is None  # a partial run says nothing of its buffer
    capped = TuneResult(16, "lazy", bin_fill=0.7, buffer_full_share=0.8, capped_share=0.4)
    assert "the caps, not the buffer" in str(buffer_bound_note(capped))
    assert "packing_buffer_size" not in str(buffer_bound_note(capped))
    few_capped = TuneResult(16, "lazy", bin_fill=0.7, buffer_full_share=0.8, capped_share=0.3)
    assert "packing_buffer_size" in str(buffer_bound_note(few_capped))


def test_vision_share_note_reads_the_longest_completed_run() -> None:
    def run(samples: int, share: float, *, interrupted: bool = False) -> TuneResult:
        return TuneResult(16, "lazy", samples=samples, vision_share=share, interrupted=interrupted)

    note = vision_share_note(
        [run(400, 0.31234), run(900, 0.2961), run(2000, 0.5, interrupted=True)]
    )
    assert note is not None
    assert note.startswith("vision share 0.296: ")
    assert "VisionBudget(balance=True, vision_share=0.296)" in note
    assert vision_share_note([run(400, 0.0)]) is None  # no vision tokens: nothing to balance
    assert vision_share_note([run(400, 0.3, interrupted=True)]) is None


@pytest.mark.parametrize(
    ("error", "reported"),
    [(ConnectionResetError, False), (EOFError, False), (BrokenPipeError, False), (OSError, True)],
)
def test_a_worker_reports_no_connection_the_main_process_dropped(
    error: type[BaseException], reported: bool
) -> None:
    """A Ctrl-C can close the main process's end of a worker's sharing connection, reset or
    halfway through its handshake (an EOFError in the worker's sharing thread): the worker's
    excepthook stays quiet on those, and reports anything else."""
    from energon_pack.tune.runs import _quiet_on_reset

    seen: list[type[BaseException]] = []
    _quiet_on_reset(lambda kind, *rest: seen.append(kind), error, error(), None)
    assert seen == ([error] if reported else [])
