"""The ``energon-pack`` argument parser (:func:`build_parser`) and entry point (:func:`main`).

Light on purpose: ``--help``, ``check-config`` and argument errors answer without importing
torch, transformers or Megatron-Energon; :func:`main` imports ``commands`` only once the
arguments parsed, and each command imports what it needs.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from energon_pack.cli.args import (
    CHAT_TEMPLATE_HELP,
    CONFIG_FLAGS,
    FAMILY_HELP,
    TOKENIZER_HELP,
    int_list,
    integer,
    name_list,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
    rows_or_none,
    share,
)
from energon_pack.cli.exits import EXIT_IO, EXIT_USAGE
from energon_pack.offline.spec import FORMATS
from energon_pack.packing.synthetic import DISTRIBUTIONS
from energon_pack.packing.topology import MODES


class _HelpFormatter(argparse.HelpFormatter):
    """Help that ends each flag's line with its default, ``(default: 8192)`` (a list as
    ``4,8,16``), unless the help already names it; flags that are off or unset show none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        default = action.default
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``energon-pack: error: ...``, pointing to
    the ``--help`` of the subcommand at fault, and whose help shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self.commands: Mapping[str, argparse.ArgumentParser] = {}
        """Subcommand name -> its parser (set by :func:`build_parser` on the top-level one)."""

    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
        """Parse; an argument a subcommand does not know is that subcommand's error."""
        parsed, extra = super().parse_known_args(args, namespace)
        command = self.commands.get(getattr(parsed, "command", None) or "")
        if extra and command is not None:
            flags = [flag for action in command._actions for flag in action.option_strings]
            close = difflib.get_close_matches(extra[0], flags, n=1)
            hint = f" (did you mean {close[0]}?)" if close and extra[0].startswith("-") else ""
            command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return parsed, extra

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"energon-pack: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``energon-pack`` and its subcommands; ``args.command`` names the one to
    run (``check-config`` runs ``commands.cmd_check_config``)."""
    parser = _Parser(
        prog="energon-pack",
        description="Online sequence packing for Megatron-Energon.",
        epilog="Exit status: 0 done, 1 rule violations (check-config) or packing that leaks "
        "(verify), 2 a bad argument, input or setting, 3 a failed read or write (disk full, "
        "read-only, missing folder, ...), 130 interrupted (tune). Errors are one line on "
        "stderr naming the flag or path.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="stream synthetic sample lengths through the online packer; bin fill vs buffer size",
    )
    demo.add_argument(
        "--distribution",
        choices=[*DISTRIBUTIONS, "all"],
        default="all",
        help="the synthetic length mix (all: each in turn)",
    )
    demo.add_argument("--capacity", type=positive_int, default=8192, help="seq_length")
    demo.add_argument("--samples", type=positive_int, default=20000, help="samples per mix")
    demo.add_argument(
        "--buffer-sizes",
        type=int_list,
        default=[4, 8, 16, 32, 64, 128],
        metavar="N1,N2,...",
        help="packing_buffer_size of each run",
    )
    demo.add_argument("--seed", type=integer, default=0, help="seed of the synthetic lengths")
    demo.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write the results to this file"
    )

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

    offline = commands.add_parser(
        "offline",
        help="tokenise and pack text SFT samples (JSONL, JSON, Parquet, a saved datasets folder "
        "or an Energon dataset) into a packed dataset directory",
        description="SOURCE: a JSONL file (one sample per line), a JSON file holding one array "
        "of samples, a .parquet file whose columns are the samples' fields, a folder "
        "datasets' save_to_disk wrote, or an Energon dataset (read as the loaders read it); "
        "samples are {'input', 'output'} pairs, chat rows {'messages'} or {'conversations'} "
        "(as the collator reads them, text only) or pre-tokenised {'input_ids', 'loss_mask'}; "
        "tokenised with --tokenizer (default: the built-in byte tokenizer) through its chat "
        "template or --chat-template, else ChatML (the encoding is printed and in the "
        "manifest), in this process or with --ray on Ray Data, with a progress bar on a terminal. "
        "--format bridge writes Megatron-Bridge's packed parquet. An up-to-date "
        "OUT_DIR is reused; a stale one is refused unless --force. Exit status 2 on bad input "
        "or settings, 3 when a file cannot be read or written.",
    )
    offline.add_argument("input", type=Path, metavar="SOURCE", help="the samples to pack")
    offline.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the packed directory")
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
    offline.add_argument(
        "--algorithm",
        choices=["bfd", "ffd"],
        default="bfd",
        help="best fit or first fit decreasing",
    )
    offline.add_argument(
        "--overlong",
        choices=["error", "skip", "truncate"],
        default="error",
        help="what a sample longer than --size gets",
    )
    offline.add_argument("--seed", type=integer, default=0, help="seed of the pack order shuffle")
    offline.add_argument(
        "--format",
        choices=FORMATS,
        default="energon_pack",
        help="energon_pack: .npy arrays for PackedDataset (default); bridge: "
        "training_<size>.idx.parquet and <size>_metadata.jsonl for Megatron-Bridge",
    )
    offline.add_argument("--tokenizer", metavar="PATH", help=TOKENIZER_HELP)
    offline.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP)
    offline.add_argument(
        "--train-newline-after-im-end",
        action="store_true",
        help="also train the newline after each trained <|im_end|> (Megatron-Bridge's chat "
        "convention; default: the chat templates' assistant masks, which end at <|im_end|>)",
    )
    offline.add_argument(
        "--split",
        default="train",
        metavar="PART",
        help="the split part of an Energon dataset, or the split of a saved DatasetDict",
    )
    offline.add_argument(
        "--trust-dataset-code",
        action="store_true",
        help="open an Energon dataset whose .nv-meta description names code outside Energon's "
        "and energon_pack's sample types; refused without it",
    )
    offline.add_argument(
        "--ray",
        action="store_true",
        help="tokenise on Ray Data (a local Ray with every core, or --ray-address); the same "
        "packs as without it",
    )
    offline.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="a running Ray cluster to tokenise on (e.g. auto, ray://host:10001; implies --ray)",
    )
    offline.add_argument("--force", action="store_true", help="rebuild a stale OUT_DIR")

    plan = commands.add_parser(
        "plan",
        help="plan every pack of a dataset before training, on Ray Data (exact counts, the "
        "vision caps, balanced steps)",
        description="Measures every sample of SOURCE (an Energon dataset, read as the loaders "
        "read it; or rows: a JSONL file, a JSON file holding one array, a .parquet file or a "
        "folder datasets' save_to_disk wrote, holding chat rows with media, prompt/answer "
        "pairs or pre-tokenised ids) with the encoder the loaders use (media probed from "
        "their headers), on Ray Data: a local Ray with every core, or --ray-address, with a "
        "progress bar on a terminal. Then packs "
        "all rows at once and lays the packs out as steps over the data-parallel ranks. Writes "
        "OUT_DIR/plan.parquet (one row per pack) and OUT_DIR/plan.json, and prints one "
        "summary line. An up-to-date OUT_DIR is reused; one built from another source or with "
        "other settings is refused unless --force. Exit status 2 on bad input or settings, 3 "
        "when a file cannot be read or written.",
    )
    plan.add_argument("source", type=Path, metavar="SOURCE", help="the dataset or rows to plan")
    plan.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the plan directory")
    plan.add_argument(
        "--seq-length", type=positive_int, required=True, help="tokens per packed row"
    )
    plan.add_argument(
        "--pad-to-multiple-of",
        type=positive_int,
        default=1,
        metavar="N",
        help="each sample's span in a row is a multiple of this (pad_seq_to_mult)",
    )
    plan.add_argument("--tokenizer", metavar="PATH", help=TOKENIZER_HELP)
    plan.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP)
    plan.add_argument("--family", metavar="NAME|DIR", help=FAMILY_HELP)
    plan.add_argument(
        "--media-root",
        type=Path,
        metavar="DIR",
        help="media paths in the rows are read inside this folder (default: SOURCE's folder)",
    )
    plan.add_argument(
        "--split",
        default="train",
        metavar="PART",
        help="the split part of an Energon dataset, or the split of a saved DatasetDict",
    )
    plan.add_argument(
        "--trust-dataset-code",
        action="store_true",
        help="open an Energon dataset whose .nv-meta description names code outside Energon's "
        "and energon_pack's sample types; refused without it",
    )
    plan.add_argument(
        "--max-vision-tokens", type=positive_int, metavar="V", help="most vision tokens per pack"
    )
    plan.add_argument("--max-media", type=positive_int, metavar="K", help="most media per pack")
    plan.add_argument(
        "--vision-balance",
        action="store_true",
        help="give the ranks of each step packs of even vision tokens",
    )
    plan.add_argument(
        "--data-parallel-size", type=positive_int, default=1, metavar="D", help="ranks"
    )
    plan.add_argument(
        "--global-batch-size",
        type=positive_int,
        metavar="G",
        help="packs per optimizer step, a multiple of D (default D)",
    )
    plan.add_argument("--seed", type=non_negative_int, default=0, help="seed of the step order")
    plan.add_argument(
        "--overlong",
        choices=["skip", "error"],
        default="skip",
        help="a row that fits no pack (or alone over a vision cap): listed in plan.json, or stop",
    )
    plan.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="a running Ray cluster to measure on (e.g. auto, ray://host:10001); default: "
        "start a local Ray with every core and stop it when done",
    )
    plan.add_argument(
        "--local",
        action="store_true",
        help="measure in this process, without Ray (a small source, or no ray extra); the same "
        "plan",
    )
    plan.add_argument("--force", action="store_true", help="rebuild a stale OUT_DIR")

    tune = commands.add_parser(
        "tune",
        help="measure bin fill, worker RSS and throughput per packing_buffer_size on a dataset",
        description="Exit status 2 on an error (one line; the traceback goes to "
        "OUT/tune-error.log), 3 when a file cannot be read or written, 130 when interrupted "
        "with Ctrl-C (the runs measured so far are reported, the interrupted one marked).",
    )
    tune.add_argument(
        "dataset",
        nargs="?",
        help="prepared Energon dataset (default: the shipped fixtures), or a plan's directory "
        "(energon-pack plan): its loader's samples/s and worker RSS",
    )
    tune.add_argument(
        "--buffer-sizes",
        type=int_list,
        default=[4, 8, 16, 32, 64],
        metavar="N1,N2,...",
        help="packing_buffer_size of each run",
    )
    tune.add_argument("--seq-length", type=positive_int, default=8192, help="tokens per row")
    tune.add_argument(
        "--pad-to-multiple-of",
        type=positive_int,
        default=1,
        help="each sample's padding multiple (pad_seq_to_mult)",
    )
    tune.add_argument(
        "--num-workers",
        type=non_negative_int,
        default=2,
        help="loader workers per rank (0: load in the main process)",
    )
    tune.add_argument(
        "--min-packs",
        type=positive_int,
        default=200,
        metavar="N",
        help="packs each run measures: the dataset repeats until a run has N, so bin fill is the "
        "steady state's, with no end-of-epoch flush in it; a run with fewer is flagged",
    )
    tune.add_argument(
        "--min-rows",
        type=rows_or_none,
        default=2.0,  # BufferConfig's DEFAULT_MIN_ROWS (importing it would pull in torch)
        metavar="ROWS",
        help="BufferConfig.min_rows: the buffer grows past --buffer-sizes while its samples hold "
        "less than ROWS rows' worth of tokens; 'none' bounds it by its size alone",
    )
    tune.add_argument(
        "--one-epoch",
        action="store_true",
        help="stream one epoch per run instead, without repeating: the end-of-epoch flush is in "
        "the bin fill, and every sample is accounted for (unaccounted)",
    )
    tune.add_argument(
        "--max-samples", type=positive_int, help="stop each run after this many samples"
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
    tune.add_argument("--chat-template", metavar="FILE", help=CHAT_TEMPLATE_HELP)
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
        "--vision-share",
        type=share,
        metavar="S",
        help="with --vision-balance: the dataset's vision tokens per token, where every "
        "worker's balance target starts (VisionBudget(vision_share=S); tune prints it)",
    )
    tune.add_argument(
        "--trust-dataset-code",
        action="store_true",
        help="open a dataset whose .nv-meta description names code outside Energon's and "
        "energon_pack's sample types (a __module__ elsewhere, a __function__, a sample_loader "
        "file); refused without it",
    )
    tune.add_argument("--out", default="tune-out", help="directory for JSON, plots, reports")

    report = commands.add_parser(
        "report", help="summarise a memory report directory and plot RSS over time"
    )
    report.add_argument(
        "report_dir", help="the report_dir of MonitorConfig or tune's OUT/reports/RUN"
    )
    report.add_argument(
        "--png",
        type=output_file,
        metavar="FILE",
        help="plot path, written as PNG whatever its suffix (default: REPORT_DIR/rss.png)",
    )

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
    redist.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="where the new files go")
    redist.add_argument(
        "--new-world-size", type=positive_int, required=True, metavar="NEW", help="ranks"
    )
    verify = commands.add_parser(
        "verify",
        help="prove that packed rows train a model as its samples one by one, per attention "
        "implementation (a cut copy of the model on CPU; no weights)",
        description="Builds the model of --model's config.json cut to a few layers (one of "
        "each layer type) with random weights, packs the first samples of --data in one row "
        "and compares loss, each sample's logits and every gradient with the samples run "
        "alone; then changes one sample to see whether the others move. Exit status 0 when "
        "every implementation that ran is exact, 1 when one leaks (or none could run), 2 on "
        "a bad argument, model directory or source, 3 when a file cannot be read or written.",
    )
    verify.add_argument(
        "--model",
        type=Path,
        required=True,
        metavar="DIR",
        help="model directory: config.json and the tokenizer (and processor files for media)",
    )
    verify.add_argument(
        "--data",
        type=Path,
        metavar="SOURCE",
        help="an Energon/WebDataset directory or a JSON/JSONL file of rows (default: the "
        "shipped fixtures/vlm_demo)",
    )
    verify.add_argument(
        "--attn",
        type=name_list,
        metavar="IMPL1,IMPL2,...",
        help="attention implementations to check (e.g. eager,sdpa,flex_attention,"
        "flash_attention_2; default: eager,sdpa on a CPU, and on a GPU also flex_attention "
        "and each installed FlashAttention); one that cannot run here says why",
    )
    verify.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja chat template file that replaces the tokenizer's (as in training)",
    )
    verify.add_argument(
        "--samples", type=positive_int, default=4, help="samples packed in the row (>= 2)"
    )
    verify.add_argument(
        "--max-tokens", type=positive_int, default=4096, help="longest sample taken (tokens)"
    )
    verify.add_argument("--seed", type=integer, default=0, help="seed of the random weights")
    verify.add_argument(
        "--dtype",
        choices=["float64", "float32", "bfloat16", "float16"],
        default="float64",
        help="model dtype (tolerances per dtype in the docs)",
    )
    verify.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    verify.add_argument(
        "--json", type=output_file, metavar="FILE", help="also write the report to this file"
    )
    parser.commands = commands.choices
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``energon-pack``."""
    args = build_parser().parse_args(argv)
    # only now: each command imports what it runs
    if args.command == "tune":
        import energon_pack.cli.tune_command as commands
    else:
        import energon_pack.cli.commands as commands  # type: ignore[no-redef]

    run: Callable[[argparse.Namespace], int] = getattr(
        commands, "cmd_" + args.command.replace("-", "_")
    )
    try:
        code = run(args)
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
