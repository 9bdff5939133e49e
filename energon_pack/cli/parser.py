"""The ``energon-pack`` argument parser (:func:`build_parser`) and entry point (:func:`main`)."""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from energon_pack.cli.args import (
    CONFIG_FLAGS,
    FAMILY_HELP,
    TOKENIZER_HELP,
    int_list,
    integer,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
)
from energon_pack.cli.commands import (
    EXIT_IO,
    EXIT_USAGE,
    cmd_check_config,
    cmd_demo,
    cmd_offline,
    cmd_redist,
    cmd_report,
    cmd_tune,
)
from energon_pack.offline.spec import FORMATS
from energon_pack.packing.synthetic import DISTRIBUTIONS
from energon_pack.packing.topology import MODES


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``energon-pack: error: ...``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"energon-pack: error: {message} (see {self.prog} --help)\n")


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
        "--capacity", type=positive_int, default=8192, help="seq_length (default 8192)"
    )
    demo.add_argument("--samples", type=positive_int, default=20000)
    demo.add_argument("--buffer-sizes", type=int_list, default=[4, 8, 16, 32, 64, 128])
    demo.add_argument("--seed", type=integer, default=0)
    demo.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write the results to this file"
    )
    demo.set_defaults(run=cmd_demo)

    check = commands.add_parser(
        "check-config",
        help="check packing / parallelism settings; print derived values and every violation",
        description="Flags override the keys of --from-yaml (YAML keys = TrainingSetup fields). "
        "Exit status 1 when any rule is violated, 2 on unreadable settings.",
    )
    check.add_argument("--from-yaml", metavar="FILE", help="YAML mapping of TrainingSetup fields")
    for flag, field, kind in CONFIG_FLAGS:
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
    check.add_argument("--family", metavar="NAME|DIR", help=FAMILY_HELP)
    check.set_defaults(run=cmd_check_config)

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
        "--size", type=positive_int, required=True, help="packed_sequence_size (tokens)"
    )
    offline.add_argument(
        "--tp", type=positive_int, metavar="N", help="tensor parallel size (default 1)"
    )
    offline.add_argument(
        "--cp", type=positive_int, metavar="N", help="context parallel size (default 1)"
    )
    offline.add_argument("--sp", action="store_true", help="sequence parallelism on")
    offline.add_argument(
        "--eval-cp", type=positive_int, metavar="N", help="context parallel size of eval"
    )
    offline.add_argument(
        "--pad-seq-to-mult",
        type=positive_int,
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
        "--max-segments", type=positive_int, metavar="N", help="most sequences per pack"
    )
    offline.add_argument("--algorithm", choices=["bfd", "ffd"], default="bfd")
    offline.add_argument("--overlong", choices=["error", "skip", "truncate"], default="error")
    offline.add_argument("--seed", type=integer, default=0, help="seed of the pack order shuffle")
    offline.add_argument(
        "--format",
        choices=FORMATS,
        default="energon_pack",
        help="energon_pack: .npy arrays for PackedDataset (default); bridge: "
        "training_<size>.idx.parquet and <size>_metadata.jsonl for Megatron-Bridge",
    )
    offline.add_argument("--tokenizer", metavar="PATH", help=TOKENIZER_HELP)
    offline.add_argument(
        "--train-newline-after-im-end",
        action="store_true",
        help="also train the newline after each trained <|im_end|> (Megatron-Bridge's chat "
        "convention; default: the chat templates' assistant masks, which end at <|im_end|>)",
    )
    offline.add_argument("--force", action="store_true", help="rebuild a stale OUT_DIR")
    offline.set_defaults(run=cmd_offline)

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
    tune.add_argument("--buffer-sizes", type=int_list, default=[4, 8, 16, 32, 64])
    tune.add_argument("--seq-length", type=positive_int, default=8192)
    tune.add_argument("--pad-to-multiple-of", type=positive_int, default=1)
    tune.add_argument(
        "--num-workers",
        type=non_negative_int,
        default=2,
        help="loader workers per rank (0: load in the main process)",
    )
    tune.add_argument(
        "--max-samples", type=positive_int, help="samples per run (default: one epoch)"
    )
    tune.add_argument(
        "--rss-budget-mb",
        type=positive_float,
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
    tune.add_argument("--tokenizer", metavar="PATH", help=TOKENIZER_HELP)
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
    tune.add_argument("--family", metavar="NAME|DIR", help=FAMILY_HELP)
    tune.add_argument(
        "--max-vision-tokens",
        type=int_list,
        metavar="V1,V2,...",
        help="also sweep the cap on vision tokens per pack: one run per value and buffer size, "
        "with fill and vision tokens per pack in the table and vision_caps.png",
    )
    tune.add_argument(
        "--max-media", type=positive_int, metavar="K", help="most images + videos per pack"
    )
    tune.add_argument(
        "--vision-balance",
        action="store_true",
        help="keep each pack's vision tokens near the stream's mean (vision_balance=True)",
    )
    tune.add_argument(
        "--trust-dataset-code",
        action="store_true",
        help="open a dataset whose .nv-meta description names code outside Energon's and "
        "energon_pack's sample types (a __module__ elsewhere, a __function__, a sample_loader "
        "file); refused without it",
    )
    tune.add_argument("--out", default="tune-out", help="directory for JSON, plots, reports")
    tune.set_defaults(run=cmd_tune)

    report = commands.add_parser(
        "report", help="summarise a memory report directory and plot RSS over time"
    )
    report.add_argument("report_dir")
    report.add_argument(
        "--png",
        type=output_file,
        metavar="FILE",
        help="plot path, written as PNG whatever its suffix (default: REPORT_DIR/rss.png)",
    )
    report.set_defaults(run=cmd_report)

    redist = commands.add_parser(
        "redist",
        help="move per-rank Energon loader states to a new data-parallel world size "
        "(Energon's `energon checkpoint redist`, checked)",
        description="Reads the rank files with a restricted loader (no code runs), then calls "
        "Energon's redistribution after checking that NEW divides world_size x num_workers, "
        "that the states were saved with worker processes and that the files are every rank "
        "of one save (same step and settings); creates OUT_DIR, which must not hold the input "
        "or other rank files. Exit status 2 on a refused checkpoint (naming the file), 3 when "
        "a file cannot be read or written.",
    )
    redist.add_argument("files", type=Path, nargs="+", metavar="STATE.pt", help="one per rank")
    redist.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    redist.add_argument(
        "--new-world-size", type=positive_int, required=True, metavar="NEW", help="ranks"
    )
    redist.set_defaults(run=cmd_redist)
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
