"""The ``energon-pack`` command line.

Every error ends in one line on stderr, ``energon-pack: error: ...``, naming the flag or path,
and the exit status says what failed: 1 rule violations (``check-config``), 2 a bad argument,
input or setting, 3 a failed read or write (full disk, file-size limit, read-only or missing
folder, a file where a folder is expected or the reverse, no permission), 130 Ctrl-C (``tune``).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import NoReturn

import psutil
import yaml
from tqdm import tqdm

from energon_pack.binpack import OnlineBinPacker, best_fit_decreasing, groups_fill
from energon_pack.family import model_family
from energon_pack.memory import (
    MB,
    SUMMARY_HEADERS,
    load_report,
    plot_report,
    summarize,
    summary_rows,
)
from energon_pack.offline import FORMATS, PackingSpec, name_os_errors, pack_offline
from energon_pack.packed import Decode
from energon_pack.synthetic import DISTRIBUTIONS, lengths_for
from energon_pack.tables import format_table
from energon_pack.topology import MODES, PackingConfig
from energon_pack.tune import (
    TUNE_HEADERS,
    TuneError,
    TuneResult,
    TuneSettings,
    default_dataset,
    describe_tokenizer,
    load_tokenizer,
    plot_results,
    projected_rss_mb,
    recommend,
    run_once,
    tune_row,
    worker_total_mb,
)

EXIT_VIOLATIONS = 1
EXIT_USAGE = 2
EXIT_IO = 3


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``energon-pack: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"energon-pack: error: {message} (see {self.prog} --help)\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _output_file(text: str) -> Path:
    """A file to write: not a directory, in an existing directory."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; name the file to write")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"{path.parent} is not an existing directory; create it or choose another path"
        )
    return path


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return values


def _cmd_demo(args: argparse.Namespace) -> int:
    distributions = DISTRIBUTIONS if args.distribution == "all" else (args.distribution,)
    results = []
    for distribution in distributions:
        lengths = lengths_for(distribution, args.samples, seed=args.seed, cap=args.capacity)
        offline = groups_fill(best_fit_decreasing(lengths, args.capacity), lengths, args.capacity)
        rows = []
        for buffer_size in args.buffer_sizes:
            packer = OnlineBinPacker(args.capacity, buffer_size)
            for index, length in enumerate(lengths):
                packer.push(index, length)
            packer.flush()
            stats = packer.stats
            rows.append(
                [buffer_size, stats.bin_fill, offline, stats.items_per_bin, stats.mean_wait]
            )
            results.append(
                {
                    "distribution": distribution,
                    "buffer_size": buffer_size,
                    "bin_fill": stats.bin_fill,
                    "offline_bfd_bin_fill": offline,
                    "items_per_bin": stats.items_per_bin,
                    "mean_wait": stats.mean_wait,
                    "max_wait": stats.max_wait,
                }
            )
        mean = sum(lengths) / len(lengths)
        print(
            f"\n{distribution}: {len(lengths)} samples, mean length {mean:.0f}, "
            f"capacity {args.capacity}"
        )
        headers = ["buffer", "bin fill", "offline BFD", "items/bin", "mean wait"]
        print(format_table(headers, rows))
    if args.json:
        with name_os_errors(args.json):
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


_FAMILY_HELP = (
    "model family preset (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, ...) or a "
    "model directory with its processor JSON files: the media settings to use"
)

# check-config flags: (flag, PackingConfig field, type); type None marks an on/off flag.
_CONFIG_FLAGS: tuple[tuple[str, str, Callable[[str], int] | type[str] | None], ...] = (
    ("--seq-length", "seq_length", _positive_int),
    ("--mode", "mode", str),
    ("--mbs", "micro_batch_size", _positive_int),
    ("--gbs", "global_batch_size", _positive_int),
    ("--dp", "data_parallel_size", _positive_int),
    ("--tp", "tp", _positive_int),
    ("--cp", "cp", _positive_int),
    ("--sp", "sp", None),
    ("--pp", "pp", _positive_int),
    ("--eval-cp", "eval_cp", _positive_int),
    ("--mtp", "mtp", _non_negative_int),
    ("--cuda-graphs", "cuda_graphs", None),
    ("--cuda-graph-scope", "cuda_graph_scope", str),
    ("--calculate-per-token-loss", "calculate_per_token_loss", None),
    ("--average-in-collective", "average_in_collective", None),
    ("--pad-to-max-length", "pad_to_max_length", None),
    ("--pad-cu-seqlens", "pad_cu_seqlens", None),
    ("--packing-buffer-size", "packing_buffer_size", _non_negative_int),
    ("--finetuning", "finetuning", None),
    ("--kernel-multiple", "kernel_multiple", _positive_int),
)


def _load_config(args: argparse.Namespace) -> PackingConfig:
    settings: dict[str, object] = {}
    if args.from_yaml:
        try:
            loaded = yaml.safe_load(Path(args.from_yaml).read_text())
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"cannot read --from-yaml {args.from_yaml}: {error}") from None
        if not isinstance(loaded, dict):
            raise ValueError(
                f"{args.from_yaml}: expected a mapping of PackingConfig fields at the top level, "
                f"got {type(loaded).__name__}"
            )
        settings.update(loaded)
    for _, field, _ in _CONFIG_FLAGS:
        value = getattr(args, field)
        if value is not None:
            settings[field] = value
    if "seq_length" not in settings:
        raise ValueError("check-config needs --seq-length (or seq_length in --from-yaml)")
    return PackingConfig.from_mapping(settings)


def _family_rows(source: str) -> list[list[object]]:
    """The settings of a model family preset (a bad name or directory raises ValueError)."""
    family = model_family(source)
    media = family.media
    return [
        ["model family", f"{family.name} (rope rule {family.rope})"],
        [
            "patch / merge / temporal",
            f"{media.patch_size} / {media.merge_size} / {media.temporal_patch_size}",
        ],
        ["image pixels", f"{media.min_pixels:,} - {media.max_pixels:,}"],
        [
            "video rule",
            f"{media.video_rule}, {media.video_fps:g} fps, frames "
            f"{media.video_min_frames}-{media.video_max_frames}",
        ],
        ["video pixels", f"{media.video_min_pixels:,} - {media.video_total_pixels:,} (total)"],
    ]


def _cmd_check_config(args: argparse.Namespace) -> int:
    config = _load_config(args)
    family = _family_rows(args.family) if args.family else []
    derived = config.derived()
    print(
        format_table(
            ["derived", "value"],
            [
                ["packing mode", derived.mode],
                ["pad_seq_to_mult", derived.pad_seq_to_mult],
                ["token slots per step", f"{derived.token_slots_per_step:,}"],
                ["micro batches per step", derived.micro_batches_per_step],
                *family,
            ],
        )
    )
    problems = config.validate()
    if not problems:
        print("\nOK: no violations")
        return 0
    print(f"\n{len(problems)} violation(s):")
    for number, problem in enumerate(problems, 1):
        print(f"  {number}. {problem}")
    return EXIT_VIOLATIONS


def _offline_spec(args: argparse.Namespace) -> PackingSpec:
    settings = {
        "pad_to_max_length": args.pad_to_max_length,
        "pad_cu_seqlens": args.pad_cu_seqlens,
        "algorithm": args.algorithm,
        "overlong": args.overlong,
        "seed": args.seed,
        "max_segments": args.max_segments,
        "train_newline_after_im_end": args.train_newline_after_im_end,
    }
    topology = {"tp": args.tp, "cp": args.cp, "eval_cp": args.eval_cp}
    given = [f"--{name.replace('_', '-')}" for name, value in topology.items() if value is not None]
    given += ["--sp"] if args.sp else []
    if args.pad_seq_to_mult is not None:
        if given:
            raise ValueError(
                f"--pad-seq-to-mult={args.pad_seq_to_mult} and {', '.join(given)} both set the "
                "padding multiple; pass either the topology (--tp/--cp/--sp) or --pad-seq-to-mult"
            )
        return PackingSpec(args.size, pad_seq_to_mult=args.pad_seq_to_mult, **settings)
    return PackingSpec.for_topology(
        args.size,
        tp=args.tp or 1,
        cp=args.cp or 1,
        sp=args.sp,
        eval_cp=args.eval_cp,
        **settings,
    )


def _cmd_offline(args: argparse.Namespace) -> int:
    spec = _offline_spec(args)
    tokenizer = None if args.tokenizer is None else load_tokenizer(args.tokenizer)
    result = pack_offline(
        args.input, args.out_dir, spec, tokenizer, force=args.force, format=args.format
    )
    meta = result.metadata
    print(
        format_table(
            ["metadata", "value"],
            [
                ["dataset_max_seqlen", meta.dataset_max_seqlen],
                ["max_samples_per_bin", meta.max_samples_per_bin],
                ["packing_factor", f"{meta.packing_factor:.2f}"],
                ["packing_efficiency", f"{meta.packing_efficiency:.2f} %"],
                ["pack_size", meta.pack_size],
                ["min_packed_seqlen", meta.min_packed_seqlen],
            ],
        )
    )
    print(
        f"\n{result.samples} samples -> {result.sequences} sequences in {result.packs} packs "
        f"({result.skipped} skipped, {result.truncated} truncated as overlong; "
        f"pad_seq_to_mult={spec.pad_seq_to_mult})"
    )
    action = "reused the up-to-date pack in" if result.reused else "wrote"
    print(f"{action} {result.out_dir}: {', '.join(path.name for path in result.files)}")
    if result.format == "bridge":
        data, metadata = result.files
        print(
            "Megatron-Bridge: PackedSequenceSpecs(packed_sequence_size="
            f"{spec.packed_sequence_size}, packed_train_data_path='{data}', "
            f"packed_metadata_path='{metadata}', pad_seq_to_mult={spec.pad_seq_to_mult}, "
            f"pad_cu_seqlens={spec.pad_cu_seqlens})"
        )
    return 0


@contextlib.contextmanager
def _log_to(path: Path) -> Iterator[None]:
    """Send the package's log (one line per skipped sample) to ``path`` instead of stderr."""
    handler = logging.FileHandler(path, mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    package = logging.getLogger("energon_pack")
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
        handler.close()


def _measure(
    settings: TuneSettings,
    decodes: Sequence[Decode],
    buffer_sizes: Sequence[int],
    out: Path,
    results: list[TuneResult],
) -> None:
    """Run every (decode, buffer size), appending to ``results``; a Ctrl-C leaves its run's row
    marked as interrupted and propagates."""
    for decode in decodes:
        for buffer_size in buffer_sizes:
            # Stands for the run until it returns, so a Ctrl-C at any point marks this row.
            results.append(TuneResult(buffer_size, decode, interrupted=True))
            report_dir = out / "reports" / f"{decode}-buffer{buffer_size}"
            shutil.rmtree(report_dir, ignore_errors=True)
            description = f"{decode} buffer {buffer_size}"
            with tqdm(desc=description, unit=" samples", total=settings.max_samples) as bar:
                results[-1] = run_once(settings, buffer_size, decode, report_dir, bar.update)
            if results[-1].interrupted:
                raise KeyboardInterrupt


def _cmd_tune(args: argparse.Namespace) -> int:
    dataset = Path(args.dataset) if args.dataset else default_dataset()
    if not (dataset / ".nv-meta").is_dir():
        raise ValueError(
            f"{dataset} is not a prepared Energon dataset (no .nv-meta/); prepare it with "
            "'energon prepare' or pass the path of one"
        )
    decodes: list[Decode] = ["lazy"] if args.lazy or not args.eager else []
    if args.eager:
        decodes.append("eager")
    settings = TuneSettings(
        dataset=str(dataset),
        seq_length=args.seq_length,
        pad_to_multiple_of=args.pad_to_multiple_of,
        num_workers=args.num_workers,
        max_samples=args.max_samples,
        pixel_dtype=args.pixel_dtype,
        tokenizer=args.tokenizer,
        overlong=args.overlong,
        dataset_config=args.dataset_config,
        family=args.family,
    )
    family = model_family(args.family) if args.family else None  # a bad one fails here, early
    # Forked loader workers use the tokenizer after the main process did: no Rust thread pool.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer = describe_tokenizer(settings.tokenizer)
    budget = args.rss_budget_mb or psutil.virtual_memory().total / MB / 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: list[TuneResult] = []
    try:
        with _log_to(out / "tune.log"):
            _measure(settings, decodes, args.buffer_sizes, out, results)
    except KeyboardInterrupt:
        pass
    except TuneError as error:
        log = out / "tune-error.log"
        with name_os_errors(log):
            log.write_text(error.details)
        raise ValueError(f"{error} (traceback: {log})") from None
    interrupted = next((r for r in results if r.interrupted), None)
    print(
        f"\n{dataset}: seq_length {settings.seq_length}, {settings.num_workers} workers, "
        f"{settings.pixel_dtype} pixels, tokenizer {tokenizer['name']} ({tokenizer['class']}, "
        f"{tokenizer['vocab_size']} tokens), overlong samples: {settings.overlong}, "
        f"model family: {family.name if family else 'none (MediaConfig defaults)'}"
    )
    print(format_table(TUNE_HEADERS, [tune_row(r) for r in results]))
    if any(r.skipped for r in results):
        print(f"\nskipped samples are logged with their keys in {out / 'tune.log'}")
    if interrupted is not None:
        print(
            f"\ninterrupted (Ctrl-C) during the {interrupted.decode} buffer "
            f"{interrupted.buffer_size} run: its row holds what was measured until then and is "
            "not used for the recommendation; runs after it were not measured"
        )
    best = recommend(results, num_workers=args.num_workers, rss_budget_mb=budget)
    if best is not None:
        projected = projected_rss_mb(best, args.num_workers)
        print(
            f"\nrecommended: packing_buffer_size={best.buffer_size} ({best.decode} decode): "
            f"bin fill {best.bin_fill:.4f}, {args.num_workers} workers x "
            f"{worker_total_mb(best):.0f} MiB (worker + decoder) = {projected:.0f} MiB of "
            f"{budget:.0f} MiB"
        )
    elif any(not r.interrupted for r in results):
        print(
            f"\nno measured buffer fits {budget:.0f} MiB for {args.num_workers} workers; "
            "lower --num-workers or the image/video pixel limits"
        )
    else:
        print("\nno run completed, so there is no recommendation")
    with name_os_errors(out):
        plots = plot_results(results, out, settings, rss_budget_mb=budget, best=best)
    report = {
        "settings": asdict(settings),
        "tokenizer": tokenizer,
        "rss_budget_mb": budget,
        "results": [asdict(r) for r in results],
        "recommendation": None if best is None else asdict(best),
        "interrupted": interrupted is not None,
        "plots": [str(p) for p in plots],
    }
    with name_os_errors(out / "tune.json"):
        (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'tune.json'} and {', '.join(str(p) for p in plots)}")
    return 130 if interrupted is not None else 0


def _cmd_report(args: argparse.Namespace) -> int:
    readings = load_report(args.report_dir)
    png = args.png or Path(args.report_dir) / "rss.png"
    print(format_table(SUMMARY_HEADERS, summary_rows(summarize(readings))))
    with name_os_errors(png):
        plot_report(readings, png)
    print(f"wrote {png}")
    return 0


def _cmd_redist(args: argparse.Namespace) -> int:
    from energon_pack.energon.redist import redistribute  # imports Energon and torch

    written = redistribute(args.files, args.out_dir, args.new_world_size)
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="energon-pack",
        description="Online sequence packing for Megatron-Energon.",
        epilog="Exit status: 0 done, 1 rule violations (check-config), 2 a bad argument, input "
        "or setting, 3 a failed read or write (disk full, read-only, missing folder, ...), 130 "
        "interrupted (tune). Errors are one line on stderr naming the flag or path.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="stream synthetic sample lengths through the online packer; bin fill vs buffer size",
    )
    demo.add_argument("--distribution", choices=[*DISTRIBUTIONS, "all"], default="all")
    demo.add_argument(
        "--capacity", type=_positive_int, default=8192, help="seq_length (default 8192)"
    )
    demo.add_argument("--samples", type=_positive_int, default=20000)
    demo.add_argument("--buffer-sizes", type=_int_list, default=[4, 8, 16, 32, 64, 128])
    demo.add_argument("--seed", type=_int, default=0)
    demo.add_argument(
        "--json", type=_output_file, metavar="FILE", help="also write the results to this file"
    )
    demo.set_defaults(run=_cmd_demo)

    check = commands.add_parser(
        "check-config",
        help="check packing / parallelism settings; print derived values and every violation",
        description="Flags override the keys of --from-yaml (YAML keys = PackingConfig fields). "
        "Exit status 1 when any rule is violated, 2 on unreadable settings.",
    )
    check.add_argument("--from-yaml", metavar="FILE", help="YAML mapping of PackingConfig fields")
    for flag, field, kind in _CONFIG_FLAGS:
        if kind is None:
            check.add_argument(
                flag, dest=field, action=argparse.BooleanOptionalAction, help=f"sets {field}"
            )
        elif field == "mode":
            check.add_argument(flag, dest=field, choices=MODES, help="packing mode")
        elif field == "cuda_graph_scope":
            check.add_argument(
                flag,
                dest=field,
                metavar="SCOPE",
                help="what the CUDA graphs capture: full (default) or modules, e.g. attn,mlp",
            )
        else:
            check.add_argument(flag, dest=field, type=kind, metavar="N", help=f"sets {field}")
    check.add_argument("--family", metavar="NAME|DIR", help=_FAMILY_HELP)
    check.set_defaults(run=_cmd_check_config)

    offline = commands.add_parser(
        "offline",
        help="tokenise and pack a JSONL file of text SFT samples into a packed dataset directory",
        description="Input lines: {'input', 'output'} pairs, {'conversations'} or pre-tokenised "
        "{'input_ids', 'loss_mask'}; tokenised with --tokenizer (default: the built-in byte "
        "tokenizer). --format bridge writes Megatron-Bridge's packed parquet. An up-to-date "
        "OUT_DIR is reused; a stale one is refused unless --force. Exit status 2 on bad input "
        "or settings, 3 when a file cannot be read or written.",
    )
    offline.add_argument("input", type=Path, metavar="INPUT.jsonl")
    offline.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    offline.add_argument(
        "--size", type=_positive_int, required=True, help="packed_sequence_size (tokens)"
    )
    offline.add_argument(
        "--tp", type=_positive_int, metavar="N", help="tensor parallel size (default 1)"
    )
    offline.add_argument(
        "--cp", type=_positive_int, metavar="N", help="context parallel size (default 1)"
    )
    offline.add_argument("--sp", action="store_true", help="sequence parallelism on")
    offline.add_argument(
        "--eval-cp", type=_positive_int, metavar="N", help="context parallel size of eval"
    )
    offline.add_argument(
        "--pad-seq-to-mult",
        type=_positive_int,
        metavar="N",
        help="padding multiple (instead of topology)",
    )
    offline.add_argument("--pad-to-max-length", action="store_true", help="fixed-width rows")
    offline.add_argument(
        "--pad-cu-seqlens",
        action="store_true",
        help="static cu_seqlens shapes for CUDA graphs (needs --pad-to-max-length)",
    )
    offline.add_argument(
        "--max-segments", type=_positive_int, metavar="N", help="most sequences per pack"
    )
    offline.add_argument("--algorithm", choices=["bfd", "ffd"], default="bfd")
    offline.add_argument("--overlong", choices=["error", "skip", "truncate"], default="error")
    offline.add_argument("--seed", type=_int, default=0, help="seed of the pack order shuffle")
    offline.add_argument(
        "--format",
        choices=FORMATS,
        default="energon_pack",
        help="energon_pack: .npy arrays for PackedDataset (default); bridge: "
        "training_<size>.idx.parquet and <size>_metadata.jsonl for Megatron-Bridge",
    )
    offline.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="transformers tokenizer directory (AutoTokenizer.from_pretrained(PATH), loaded "
        "offline); default: the built-in byte tokenizer",
    )
    offline.add_argument(
        "--train-newline-after-im-end",
        action="store_true",
        help="also train the newline after each trained <|im_end|> (Megatron-Bridge's chat "
        "convention; default: the chat templates' assistant masks, which end at <|im_end|>)",
    )
    offline.add_argument("--force", action="store_true", help="rebuild a stale OUT_DIR")
    offline.set_defaults(run=_cmd_offline)

    tune = commands.add_parser(
        "tune",
        help="measure bin fill, worker RSS and throughput per packing_buffer_size on a dataset",
        description="Exit status 2 on an error (one line; the traceback goes to "
        "OUT/tune-error.log), 3 when a file cannot be read or written, 130 when interrupted "
        "with Ctrl-C (the runs measured so far are reported, the interrupted one marked).",
    )
    tune.add_argument(
        "dataset", nargs="?", help="prepared Energon dataset (default: the shipped fixtures)"
    )
    tune.add_argument("--buffer-sizes", type=_int_list, default=[4, 8, 16, 32, 64])
    tune.add_argument("--seq-length", type=_positive_int, default=8192)
    tune.add_argument("--pad-to-multiple-of", type=_positive_int, default=1)
    tune.add_argument(
        "--num-workers",
        type=_non_negative_int,
        default=2,
        help="loader workers per rank (0: load in the main process)",
    )
    tune.add_argument(
        "--max-samples", type=_positive_int, help="samples per run (default: one epoch)"
    )
    tune.add_argument(
        "--rss-budget-mb",
        type=_positive_float,
        help="worker memory budget (default: half of this RAM)",
    )
    tune.add_argument("--lazy", action="store_true", help="decode media after selection")
    tune.add_argument("--eager", action="store_true", help="decode media before the buffer")
    tune.add_argument(
        "--pixel-dtype",
        choices=["float32", "uint8"],
        default="float32",
        help="dtype of the batches' pixels (uint8: 4x smaller, normalise in the training step)",
    )
    tune.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="transformers tokenizer directory or cached name, loaded offline, for every token "
        "count (default: the built-in byte tokenizer)",
    )
    tune.add_argument(
        "--overlong",
        choices=["skip", "error"],
        default="skip",
        help="samples longer than --seq-length: count and skip them (default), or stop",
    )
    tune.add_argument(
        "--dataset-config",
        metavar="NAME",
        help="the dataset's description file in .nv-meta (default: dataset.yaml), e.g. "
        "crude.yaml to read a Megatron-Bridge ChatMLWebdataset's shards without Bridge",
    )
    tune.add_argument("--family", metavar="NAME|DIR", help=_FAMILY_HELP)
    tune.add_argument("--out", default="tune-out", help="directory for JSON, plots, reports")
    tune.set_defaults(run=_cmd_tune)

    report = commands.add_parser(
        "report", help="summarise a memory report directory and plot RSS over time"
    )
    report.add_argument("report_dir")
    report.add_argument(
        "--png",
        type=_output_file,
        metavar="FILE",
        help="plot path, written as PNG whatever its suffix (default: REPORT_DIR/rss.png)",
    )
    report.set_defaults(run=_cmd_report)

    redist = commands.add_parser(
        "redist",
        help="move per-rank Energon loader states to a new data-parallel world size "
        "(Energon's `energon checkpoint redist`, checked)",
        description="Calls Energon's redistribution after checking that NEW divides "
        "world_size x num_workers, that the states were saved with worker processes and that "
        "the files are every rank of one checkpoint; creates OUT_DIR. Exit status 2 on a "
        "refused checkpoint, 3 when a file cannot be read or written.",
    )
    redist.add_argument("files", type=Path, nargs="+", metavar="STATE.pt", help="one per rank")
    redist.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    redist.add_argument(
        "--new-world-size", type=_positive_int, required=True, metavar="NEW", help="ranks"
    )
    redist.set_defaults(run=_cmd_redist)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``energon-pack``."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except ValueError as error:
        print(f"energon-pack: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as error:
        print(f"energon-pack: error: {_os_error_line(error)}", file=sys.stderr)
        return EXIT_IO
    return code


def _os_error_line(error: OSError) -> str:
    """``PATH: reason (ENAME)`` of a failed read or write."""
    name = errno.errorcode.get(error.errno) if error.errno is not None else None
    reason = f"{error.strerror} ({name})" if error.strerror and name else str(error)
    if error.filename is None:
        return f"I/O failure: {reason}"
    path = str(error.filename)
    if error.filename2 is not None:
        path += f" -> {error.filename2}"
    return f"{path}: {reason}"


if __name__ == "__main__":
    sys.exit(main())
