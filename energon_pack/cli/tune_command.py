"""``energon-pack tune``: one run per buffer size (and decode mode, vision cap) through the real
Energon loader, or the loader of a plan's directory; the table, notes, recommendation, plots
and ``tune.json`` it writes. Torch, Energon and transformers are imported where a run needs
them."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from tqdm import tqdm

from energon_pack.cli.args import vision_budget
from energon_pack.cli.tables import format_table
from energon_pack.sources.files import name_os_errors

if TYPE_CHECKING:
    from energon_pack.packing.packed import Decode
    from energon_pack.tune import CtrlC, TuneResult, TuneSettings


def _vision_budget_note(settings: TuneSettings) -> str:
    """``, max_media 6, vision_balance, vision_share 0.31`` where the tune sets them."""
    vision = settings.vision
    note = "" if vision.max_media is None else f", max_media {vision.max_media}"
    note += ", vision_balance" if vision.balance else ""
    return note + ("" if vision.vision_share is None else f", vision_share {vision.vision_share}")


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
    vision_caps: Sequence[int | None],
    out: Path,
    results: list[TuneResult],
    ctrl_c: CtrlC,
) -> None:
    """Run every (decode, buffer size, vision cap), appending to ``results``; a Ctrl-C leaves
    its run's row marked as interrupted and propagates."""
    from energon_pack.tune import TuneResult, run_once

    for decode in decodes:
        for buffer_size in buffer_sizes:
            for cap in vision_caps:
                # Stands for the run until it returns, so a Ctrl-C at any point marks this row.
                results.append(TuneResult(buffer_size, decode, cap, interrupted=True))
                name = f"{decode}-buffer{buffer_size}" + ("" if cap is None else f"-vision{cap}")
                report_dir = out / "reports" / name
                shutil.rmtree(report_dir, ignore_errors=True)
                description = f"{decode} buffer {buffer_size}" + (
                    "" if cap is None else f" vision cap {cap}"
                )
                total = None if settings.one_epoch else settings.min_packs
                with tqdm(desc=description, unit=" packs", total=total) as bar:
                    results[-1] = run_once(
                        settings, buffer_size, decode, report_dir, ctrl_c.checked(bar.update), cap
                    )
                if results[-1].interrupted:
                    raise KeyboardInterrupt


def cmd_tune(args: argparse.Namespace) -> int:
    from energon_pack.cli.tune_plots import plot_results, plot_vision_caps
    from energon_pack.encoding.describe import encoding_line
    from energon_pack.encoding.family import model_family
    from energon_pack.formats.dataset_trust import check_dataset_code
    from energon_pack.memory.monitor import MB
    from energon_pack.tune import (
        TUNE_HEADERS,
        CtrlC,
        TuneError,
        TuneSettings,
        buffer_bound_note,
        default_dataset,
        describe_tokenizer,
        measurement_note,
        projected_rss_mb,
        recommend,
        still_rising_notes,
        too_few_packs_note,
        tune_row,
        untimed_note,
        vision_share_note,
        worker_total_mb,
    )
    from energon_pack.tune.plan_run import is_plan

    dataset = Path(args.dataset) if args.dataset else default_dataset()
    if is_plan(dataset):
        return _tune_plan(args, dataset)
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
        min_packs=args.min_packs,
        min_rows=args.min_rows,
        one_epoch=args.one_epoch,
        pixel_dtype=args.pixel_dtype,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        overlong=args.overlong,
        dataset_config=args.dataset_config,
        family=args.family,
        vision=vision_budget(args),
        trust_dataset_code=args.trust_dataset_code,
    )
    # Ctrl-C: the first one ends the measuring, the later ones (and any while writing) only
    # make the exit status 130; what was measured is always printed and written.
    with CtrlC() as ctrl_c:
        try:
            if not settings.trust_dataset_code:  # before anything is loaded: one line, exit 2
                check_dataset_code(dataset, args.dataset_config)
            # A bad family fails here, early.
            family = model_family(args.family) if args.family else None
            # Forked loader workers use the tokenizer after the main process did: no Rust pool.
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
            tokenizer = describe_tokenizer(settings.tokenizer, family, settings.chat_template)
            budget = args.rss_budget_mb or psutil.virtual_memory().total / MB / 2
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
        except KeyboardInterrupt:
            print("\ninterrupted (Ctrl-C) before the first run: nothing was measured")
            return 130
        results: list[TuneResult] = []
        try:
            with _log_to(out / "tune.log"):
                caps = args.max_vision_tokens or [None]
                _measure(settings, decodes, args.buffer_sizes, caps, out, results, ctrl_c)
        except KeyboardInterrupt:
            pass
        except TuneError as error:
            ctrl_c.hold()
            log = out / "tune-error.log"
            with name_os_errors(log):
                log.write_text(error.details)
            raise ValueError(f"{error} (traceback: {log})") from None
        ctrl_c.hold()
        interrupted = next((r for r in results if r.interrupted), None)
        print(
            f"\n{dataset}: seq_length {settings.seq_length}, {settings.num_workers} workers, "
            f"{settings.pixel_dtype} pixels, tokenizer {tokenizer['name']} ({tokenizer['class']}, "
            f"{tokenizer['vocab_size']} tokens), overlong samples: {settings.overlong}, "
            f"model family: {family.name if family else 'none (MediaConfig defaults)'}"
            + _vision_budget_note(settings)
            + f"\nencoding: {encoding_line(tokenizer)}"
        )
        print(format_table(TUNE_HEADERS, [tune_row(r, settings.min_packs) for r in results]))
        print(f"\n{measurement_note(settings)}")
        too_few = [note for r in results if (note := too_few_packs_note(r, settings))]
        for note in filter(None, [untimed_note(results), *too_few]):
            print(note)
        for note in filter(None, map(buffer_bound_note, results)):
            print(f"\n{note}")
        for note in still_rising_notes(results):
            print(f"\n{note}")
        if note := vision_share_note(results):
            print(f"\n{note}")
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
            low = best.packs < settings.min_packs
            print(
                f"\nrecommended: packing_buffer_size={best.buffer_size} ({best.decode} decode): "
                f"bin fill {best.bin_fill:.4f}, {args.num_workers} workers x "
                f"{worker_total_mb(best):.0f} MiB (worker + decoder) = {projected:.0f} MiB of "
                f"{budget:.0f} MiB" + (f" (low confidence: {best.packs} packs)" if low else "")
            )
        elif any(not r.interrupted for r in results):
            print(
                f"\nno measured buffer fits {budget:.0f} MiB for {args.num_workers} workers; "
                "lower --num-workers or the image/video pixel limits"
            )
        else:
            print("\nno run completed, so there is no recommendation")
        with name_os_errors(out):
            plots = plot_results(
                results, out, settings, tokenizer=tokenizer, rss_budget_mb=budget, best=best
            )
            if args.max_vision_tokens and any(not r.interrupted for r in results):
                plots.append(plot_vision_caps(results, out, settings))
        report = {
            "settings": settings.record(),
            "tokenizer": tokenizer,
            "rss_budget_mb": budget,
            "results": [asdict(r) for r in results],
            "recommendation": None if best is None else asdict(best),
            "interrupted": interrupted is not None,
            "warnings": too_few,
            "plots": [str(p) for p in plots],
        }
        with name_os_errors(out / "tune.json"):
            (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out / 'tune.json'} and {', '.join(str(p) for p in plots)}")
        return 130 if interrupted is not None or ctrl_c.count else 0


def _tune_plan(args: argparse.Namespace, plan_dir: Path) -> int:
    """``tune`` on a plan: its packs read as training reads them (:func:`run_plan`)."""
    from energon_pack.tune import CtrlC, TuneError, TuneSettings
    from energon_pack.tune.plan_run import run_plan
    from energon_pack.tune.table import PLAN_HEADERS, plan_row

    online_only = [
        flag
        for flag, given in (
            ("--max-vision-tokens", args.max_vision_tokens),
            ("--max-media", args.max_media),
            ("--vision-balance", args.vision_balance),
            ("--vision-share", args.vision_share is not None),
            ("--eager", args.eager),
        )
        if given
    ]
    if online_only:
        raise ValueError(
            f"{', '.join(online_only)}: a plan's packs and budgets are fixed when it is planned "
            f"({plan_dir}); tune its source online with them, or plan again"
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = TuneSettings(
        dataset=str(plan_dir),
        num_workers=args.num_workers,
        max_samples=args.max_samples,
        min_packs=args.min_packs,
        one_epoch=args.one_epoch,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        family=args.family,
    )
    out = Path(args.out)
    with name_os_errors(out):
        out.mkdir(parents=True, exist_ok=True)
    report_dir = out / "reports" / "plan"
    shutil.rmtree(report_dir, ignore_errors=True)
    with CtrlC() as ctrl_c:
        total = None if settings.one_epoch else settings.min_packs
        try:
            with _log_to(out / "tune.log"), tqdm(desc="plan", unit=" packs", total=total) as bar:
                result = run_plan(settings, report_dir, ctrl_c.checked(bar.update))
        except TuneError as error:
            ctrl_c.hold()
            log = out / "tune-error.log"
            with name_os_errors(log):
                log.write_text(error.details)
            raise ValueError(f"{error} (traceback: {log})") from None
        ctrl_c.hold()
    print(f"\n{plan_dir}: a plan's packs, {settings.num_workers} workers")
    print(format_table(PLAN_HEADERS, [plan_row(result, settings.min_packs)]))
    print(
        f"\nbin fill of the packs read (the plan's, repeated until --min-packs "
        f"{settings.min_packs} unless --one-epoch); samples/s over the wall time from the "
        "loader's start; worker memory from an RSS monitor in each worker "
        f"({report_dir}: energon-pack report)"
    )
    print(
        "compare with the online loader on the plan's source and settings: energon-pack tune "
        f"SOURCE --num-workers {settings.num_workers} (with the plan's --seq-length and budgets)"
    )
    if result.skipped:
        print(f"\nmembers that could not be read are logged with their keys in {out / 'tune.log'}")
    report = {"settings": settings.record(), "plan": str(plan_dir), "results": [asdict(result)]}
    with name_os_errors(out / "tune.json"):
        (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'tune.json'}")
    return 130 if result.interrupted or ctrl_c.count else 0
