"""The ``energon-pack`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from energon_pack.binpack import OnlineBinPacker, best_fit_decreasing, groups_fill
from energon_pack.offline import PackingSpec, pack_offline
from energon_pack.synthetic import DISTRIBUTIONS, lengths_for
from energon_pack.tables import format_table
from energon_pack.topology import MODES, PackingConfig


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
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


# check-config flags: (flag, PackingConfig field, type); type None marks an on/off flag.
_CONFIG_FLAGS: tuple[tuple[str, str, type[int] | type[str] | None], ...] = (
    ("--seq-length", "seq_length", int),
    ("--mode", "mode", str),
    ("--mbs", "micro_batch_size", int),
    ("--gbs", "global_batch_size", int),
    ("--dp", "data_parallel_size", int),
    ("--tp", "tp", int),
    ("--cp", "cp", int),
    ("--sp", "sp", None),
    ("--pp", "pp", int),
    ("--eval-cp", "eval_cp", int),
    ("--mtp", "mtp", int),
    ("--cuda-graphs", "cuda_graphs", None),
    ("--calculate-per-token-loss", "calculate_per_token_loss", None),
    ("--average-in-collective", "average_in_collective", None),
    ("--pad-to-max-length", "pad_to_max_length", None),
    ("--pad-cu-seqlens", "pad_cu_seqlens", None),
    ("--packing-buffer-size", "packing_buffer_size", int),
    ("--finetuning", "finetuning", None),
    ("--kernel-multiple", "kernel_multiple", int),
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


def _cmd_check_config(args: argparse.Namespace) -> int:
    config = _load_config(args)
    derived = config.derived()
    print(
        format_table(
            ["derived", "value"],
            [
                ["packing mode", derived.mode],
                ["pad_seq_to_mult", derived.pad_seq_to_mult],
                ["token slots per step", f"{derived.token_slots_per_step:,}"],
                ["micro batches per step", derived.micro_batches_per_step],
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
    return 1


def _offline_spec(args: argparse.Namespace) -> PackingSpec:
    settings = {
        "pad_to_max_length": args.pad_to_max_length,
        "pad_cu_seqlens": args.pad_cu_seqlens,
        "algorithm": args.algorithm,
        "overlong": args.overlong,
        "seed": args.seed,
        "max_segments": args.max_segments,
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
    result = pack_offline(args.input, args.out_dir, spec, force=args.force)
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
    print(f"{action} {result.out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="energon-pack", description="Online sequence packing for Megatron-Energon."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="stream synthetic sample lengths through the online packer; bin fill vs buffer size",
    )
    demo.add_argument("--distribution", choices=[*DISTRIBUTIONS, "all"], default="all")
    demo.add_argument("--capacity", type=int, default=8192, help="seq_length (default 8192)")
    demo.add_argument("--samples", type=int, default=20000)
    demo.add_argument("--buffer-sizes", type=_int_list, default=[4, 8, 16, 32, 64, 128])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", help="also write the results to this JSON file")
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
        else:
            check.add_argument(flag, dest=field, type=kind, metavar="N", help=f"sets {field}")
    check.set_defaults(run=_cmd_check_config)

    offline = commands.add_parser(
        "offline",
        help="tokenise and pack a JSONL file of text SFT samples into a packed dataset directory",
        description="Input lines: {'input', 'output'} pairs, {'conversations'} or pre-tokenised "
        "{'input_ids', 'loss_mask'}; tokenised with the built-in byte tokenizer. An up-to-date "
        "OUT_DIR is reused; a stale one is refused unless --force. Exit status 2 on bad input "
        "or settings.",
    )
    offline.add_argument("input", type=Path, metavar="INPUT.jsonl")
    offline.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    offline.add_argument("--size", type=int, required=True, help="packed_sequence_size (tokens)")
    offline.add_argument("--tp", type=int, metavar="N", help="tensor parallel size (default 1)")
    offline.add_argument("--cp", type=int, metavar="N", help="context parallel size (default 1)")
    offline.add_argument("--sp", action="store_true", help="sequence parallelism on")
    offline.add_argument("--eval-cp", type=int, metavar="N", help="context parallel size of eval")
    offline.add_argument(
        "--pad-seq-to-mult", type=int, metavar="N", help="padding multiple (instead of topology)"
    )
    offline.add_argument("--pad-to-max-length", action="store_true", help="fixed-width rows")
    offline.add_argument(
        "--pad-cu-seqlens",
        action="store_true",
        help="static cu_seqlens shapes for CUDA graphs (needs --pad-to-max-length)",
    )
    offline.add_argument("--max-segments", type=int, metavar="N", help="most sequences per pack")
    offline.add_argument("--algorithm", choices=["bfd", "ffd"], default="bfd")
    offline.add_argument("--overlong", choices=["error", "skip", "truncate"], default="error")
    offline.add_argument("--seed", type=int, default=0, help="seed of the pack order shuffle")
    offline.add_argument("--force", action="store_true", help="rebuild a stale OUT_DIR")
    offline.set_defaults(run=_cmd_offline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``energon-pack``."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except ValueError as error:
        print(f"energon-pack: error: {error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
