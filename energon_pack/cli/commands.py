"""What each ``energon-pack`` subcommand does (``demo``, ``check-config``, ``offline``,
``plan``, ``report``, ``redist``, ``verify``; ``tune`` is
:mod:`~energon_pack.cli.tune_command`), and the exit statuses (:mod:`~energon_pack.cli.exits`)
they return. Each command imports torch, transformers, Megatron-Energon or Ray itself, where it
needs them, so that ``check-config`` and the parser stay light.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from energon_pack.cli.args import CONFIG_FLAGS
from energon_pack.cli.exits import EXIT_VIOLATIONS
from energon_pack.cli.tables import format_table
from energon_pack.offline.spec import PackingSpec
from energon_pack.packing.bins import best_fit_decreasing, groups_fill
from energon_pack.packing.synthetic import DISTRIBUTIONS, lengths_for
from energon_pack.packing.topology import TrainingSetup
from energon_pack.sources.files import name_os_errors

if TYPE_CHECKING:  # the commands import torch, transformers and Energon where they run
    from energon_pack.offline.spec import PackMetadata


def cmd_demo(args: argparse.Namespace) -> int:
    from energon_pack.packing.online import OnlineBinPacker

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


def _load_config(args: argparse.Namespace) -> TrainingSetup:
    settings: dict[str, object] = {}
    if args.from_yaml:
        try:
            loaded = yaml.safe_load(Path(args.from_yaml).read_text())
        except (OSError, yaml.YAMLError) as error:
            raise ValueError(f"cannot read --from-yaml {args.from_yaml}: {error}") from None
        if not isinstance(loaded, dict):
            raise ValueError(
                f"{args.from_yaml}: expected a mapping of TrainingSetup fields at the top level, "
                f"got {type(loaded).__name__}"
            )
        settings.update(loaded)
    for _, field, _ in CONFIG_FLAGS:
        value = getattr(args, field)
        if value is not None:
            settings[field] = value
    if "seq_length" not in settings:
        raise ValueError("check-config needs --seq-length (or seq_length in --from-yaml)")
    return TrainingSetup.from_mapping(settings)


def _family_rows(source: str) -> list[list[object]]:
    """The settings of a model family preset (a bad name or directory raises ValueError)."""
    from energon_pack.encoding.families import ProcessorFamily
    from energon_pack.encoding.family import model_family

    family = model_family(source)
    if isinstance(family, ProcessorFamily):
        return [
            ["model family", f"{family.name} (through {type(family.processor).__name__})"],
            ["packing", family.packing if family.refusal is None else f"refused: {family.refusal}"],
        ]
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


def cmd_check_config(args: argparse.Namespace) -> int:
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
                *_vision_budget_rows(config),
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


def _vision_budget_rows(config: TrainingSetup) -> list[list[object]]:
    """The vision budget's row of the derived table, where one is set."""
    names = ("max_vision_tokens", "max_media", "vision_balance")
    budget = [f"{n}={getattr(config, n)}" for n in names if getattr(config, n) not in (None, False)]
    return [["vision budget per row", ", ".join(budget)]] if budget else []


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


def _metadata_rows(meta: PackMetadata) -> list[list[object]]:
    """Every field of ``meta`` with its value (floats to 2 decimals, the efficiency in %)."""
    units = {"packing_efficiency": " %"}
    return [
        [name, f"{value:.2f}{units.get(name, '')}" if isinstance(value, float) else value]
        for name, value in asdict(meta).items()
    ]


def cmd_offline(args: argparse.Namespace) -> int:
    from energon_pack.encoding.describe import encoding_line
    from energon_pack.offline.build import pack_offline
    from energon_pack.tune import tokenizer_of

    spec = _offline_spec(args)
    tokenizer = tokenizer_of(args.tokenizer, args.chat_template)
    _check_energon_code(args.input, args.trust_dataset_code)
    result = pack_offline(
        args.input,
        args.out_dir,
        spec,
        tokenizer,
        force=args.force,
        format=args.format,
        split=args.split,
        engine="ray" if args.ray or args.ray_address else "local",
        ray_address=args.ray_address,
        progress=sys.stderr.isatty(),  # a bar on a terminal, never in a log
    )
    print(format_table(["metadata", "value"], _metadata_rows(result.metadata)))
    print(
        f"\n{result.samples} samples -> {result.sequences} sequences in {result.packs} packs "
        f"({result.skipped} skipped, {result.truncated} truncated as overlong; "
        f"pad_seq_to_mult={spec.pad_seq_to_mult})"
    )
    action = "reused the up-to-date pack in" if result.reused else "wrote"
    print(f"{action} {result.out_dir}: {', '.join(path.name for path in result.files)}")
    print(f"encoding: {encoding_line(result.tokenizer)}")
    if result.format == "bridge":
        data, metadata = result.files
        print(
            "Megatron-Bridge: PackedSequenceSpecs(packed_sequence_size="
            f"{spec.packed_sequence_size}, packed_train_data_path='{data}', "
            f"packed_metadata_path='{metadata}', pad_seq_to_mult={spec.pad_seq_to_mult}, "
            f"pad_cu_seqlens={spec.pad_cu_seqlens})"
        )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from energon_pack.encoding.family import model_family
    from energon_pack.packing.row_layout import RowLayout
    from energon_pack.packing.vision_budget import VisionBudget
    from energon_pack.plan import PlanSpec, plan_dataset
    from energon_pack.tune.tokenizers import encoder_of

    spec = PlanSpec(
        RowLayout(args.seq_length, args.pad_to_multiple_of),
        VisionBudget(args.max_vision_tokens, args.max_media, args.vision_balance),
        data_parallel_size=args.data_parallel_size,
        global_batch_size=args.global_batch_size,
        seed=args.seed,
        overlong=args.overlong,
    )
    family = model_family(args.family) if args.family else None
    encoder = encoder_of(args.tokenizer, args.chat_template, family)
    _check_energon_code(args.source, args.trust_dataset_code)
    if args.local and args.ray_address:
        raise ValueError(
            "--local with --ray-address: measure in this process or on that cluster; drop one"
        )
    plan = plan_dataset(
        args.source,
        args.out_dir,
        spec,
        encoder,
        media_root=args.media_root,
        split=args.split,
        engine="local" if args.local else "ray",
        ray_address=args.ray_address,
        force=args.force,
        progress=sys.stderr.isatty(),  # a bar on a terminal, never in a log
    )
    action = "reused the up-to-date plan in" if plan.reused else "wrote"
    print(plan.summary())
    print(f"{action} {plan.out_dir}")
    return 0


def _check_energon_code(source: Path, trusted: bool) -> None:
    """Refuse an Energon dataset whose description names code outside the known sample types
    (``check_dataset_code``), unless ``trusted`` (``--trust-dataset-code``)."""
    from energon_pack.formats.dataset_trust import check_dataset_code
    from energon_pack.sources.energon import is_energon_dataset

    if is_energon_dataset(source) and not trusted:
        check_dataset_code(source)


def cmd_report(args: argparse.Namespace) -> int:
    from energon_pack.memory.report import (
        SUMMARY_HEADERS,
        load_report,
        plot_report,
        summarize,
        summary_rows,
    )

    readings = load_report(args.report_dir)
    png = args.png or Path(args.report_dir) / "rss.png"
    print(format_table(SUMMARY_HEADERS, summary_rows(summarize(readings))))
    with name_os_errors(png):
        plot_report(readings, png)
    print(f"wrote {png}")
    return 0


def cmd_redist(args: argparse.Namespace) -> int:
    from energon_pack.energon.redist import redistribute  # imports Energon and torch

    written = redistribute(args.files, args.out_dir, args.new_world_size)
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    import torch

    from energon_pack.verify import verify_packing  # imports transformers and the model code

    report = verify_packing(
        args.model,
        data=args.data,
        attn_implementations=args.attn,
        samples=args.samples,
        max_tokens=args.max_tokens,
        seed=args.seed,
        dtype=getattr(torch, args.dtype),
        device=args.device,
        chat_template=args.chat_template,
    )
    print(report.table())
    if args.json is not None:
        with name_os_errors(args.json):
            report.write_json(args.json)
        print(f"wrote {args.json}")
    return report.exit_status
