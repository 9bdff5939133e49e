"""Vision budget per pack: caps on vision tokens and media, and balance across data-parallel ranks.

Three seeded VLM mixes (energon_pack.packing.synthetic.vision_mix; Qwen2-VL / Qwen2.5-VL token
counts, 28-px cells): 12% of samples carry 1-8 images of 640-1280 px, and the text is lognormal
with a median of 150 tokens (short-turns: short VLM turns) or 550 (long-turns: the conversation
lengths of text_sft_lengths); in small-images (text median 380) the samples without large images
carry 0-4 small images of 224-448 px (median 1): many samples with a few small images and a
heavy tail of large ones. Each data-parallel rank r packs its own samples r, r+DP, r+2*DP, ... with
its own packer. For each sequence length and buffer size (AUTO: the loaders' default buffer,
growing from 16 samples):

  none           OnlineBinPacker, packs chosen by LLM tokens alone
  caps           max_vision_tokens = V, max_media = K
  caps+balance   the caps and balance=True
  caps+balance+share  the same, with vision_share: the stream's vision tokens per token as
                 `energon-pack tune` would report it, read from the stream's first TUNED samples
  balance        balance=True alone
  greedy         an InternVL-style greedy packer under the same caps: each sample joins the first
                 open pack it fits (tokens, V, K); a pack leaves once 99% full or at a cap; when
                 the buffer holds `buffer` samples the fullest pack leaves (at AUTO, once it
                 also holds BUDGET_MIN_ROWS rows' worth, as the capped online packer)

V = 1.5x the uncapped mean vision tokens per pack and K = ceil(1.5x its mean media per pack).
Figures: bin fill, vision tokens per pack (mean, max), the share of packs above 1.5x the
uncapped mean, whether every pack is within the caps, and the straggler ratio at 8 and 64 ranks:
per step the most loaded rank's vision tokens over the ranks' mean, averaged over steps (steps
where every rank has a pack). Whole samples cannot be split, so its floor is the same ratio with
every pack at the mean, or at its largest single sample's vision tokens when that is more. Read
as written ("mean" floor) it adds vision tokens the stream does not have wherever packs hold a
sample above the mean; the "even" floor (energon_pack.straggler_floor) puts
every pack at the level that spreads the packs' own total as evenly as whole samples allow. The
balance goals are printed against the even floor; both floors are printed.
The figures are those of a stream in steady state: packs emitted by the end-of-stream flush (a
few per rank, under-filled by nature) are left out of every scheme's figures, and the samples
still held then count as neither packed nor skipped.
Then the packer's cost per item of each stream at seq 8192 and buffers 16, 64 and 256, with and
without caps (interleaved rounds, median ratio).

Usage: python benchmarks/vision_budget.py [--samples N] [--streams a,b] [--seq-lengths a,b]
       [--buffers a,b (0: AUTO)] [--no-cost | --cost-only] [--out results/vision_budget.json]
       python benchmarks/vision_budget.py --profile small-images/256   (caps + balance, by phase)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import math
import pstats
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypedDict

from energon_pack import (
    BufferConfig,
    OnlineBinPacker,
    PackingWarning,
    VisionBudget,
    straggler_floor,
    straggler_ratio,
)
from energon_pack.cli.tables import format_table
from energon_pack.packing.online import BUDGET_MIN_ROWS
from energon_pack.packing.synthetic import VisionSample, vision_mix

SEQ_LENGTHS = (8192, 16384)
AUTO = 0
"""The buffer the loaders choose by default: :class:`BufferConfig`'s growth from AUTO_START."""
AUTO_START = 16
BUFFERS = (16, 64, 256, AUTO)
COUNT_BOUND = BufferConfig(min_rows=None)
"""Each other buffer exactly the size named (by default a buffer of short samples grows)."""


class Mix(TypedDict, total=False):
    """Keywords of :func:`energon_pack.packing.synthetic.vision_mix` that name a stream."""

    text_median: int
    small_images: int


STREAMS: dict[str, Mix] = {
    "short-turns": {"text_median": 150},
    "long-turns": {"text_median": 550},
    "small-images": {"text_median": 380, "small_images": 4},
}
"""The mixes (keywords of energon_pack.packing.synthetic.vision_mix)."""
RANKS = (8, 64)
COST_BUFFERS = (16, 64, 256)
TUNED = 2000
"""Samples the vision share of ``caps+balance+share`` is read from (the stream's first)."""

Pack = list[int]
"""Indices into the stream of one pack."""
Packer = Callable[[Sequence[VisionSample], int, int], tuple[list[Pack], int]]
"""Packs a stream (samples, seq_length, buffer): its packs and how many samples it skipped."""


def online(**budget: object) -> Packer:
    """The online packer with ``budget`` keywords (buffer AUTO: the default growing buffer from
    AUTO_START samples)."""

    def run(samples: Sequence[VisionSample], seq: int, buffer: int) -> tuple[list[Pack], int]:
        size, bound = (AUTO_START, BufferConfig()) if buffer == AUTO else (buffer, COUNT_BOUND)
        packer = OnlineBinPacker(
            seq,
            size,
            overlong="skip",
            buffer=bound,
            vision=VisionBudget(**budget),  # type: ignore[arg-type]
        )
        packs: list[Pack] = []
        for index, s in enumerate(samples):
            bins = packer.push(index, s.length, vision_tokens=s.vision_tokens, media=s.media)
            packs += [[int(k) for k in b.keys] for b in bins]
        return packs, packer.stats.rejected  # the end-of-stream flush is left out

    return run


def greedy(vision_cap: int, media_cap: int) -> Packer:
    """InternVL-style greedy packing under the caps (see the module docstring)."""

    def run(samples: Sequence[VisionSample], seq: int, buffer: int) -> tuple[list[Pack], int]:
        open_packs: list[list[int]] = []  # per pack: [tokens, vision, media, *indices]
        packs: list[Pack] = []
        held = held_tokens = skipped = 0
        size = AUTO_START if buffer == AUTO else buffer
        # at AUTO, the online packer's growth under a vision budget (the caps are one)
        rows = max(BufferConfig().min_rows or 0, BUDGET_MIN_ROWS) if buffer == AUTO else None
        most = BufferConfig().max_size

        def full(p: list[int]) -> bool:
            return p[0] >= 0.99 * seq or p[1] >= 0.99 * vision_cap or p[2] >= media_cap

        def leave(p: list[int]) -> None:
            nonlocal held, held_tokens
            open_packs.remove(p)
            packs.append(p[3:])
            held -= len(p) - 3
            held_tokens -= p[0]

        for index, s in enumerate(samples):
            if s.vision_tokens > vision_cap or s.media > media_cap:
                skipped += 1  # as the online packer does with overlong="skip"
                continue
            for p in open_packs:
                if (
                    p[0] + s.length <= seq
                    and p[1] + s.vision_tokens <= vision_cap
                    and p[2] + s.media <= media_cap
                ):
                    break
            else:
                p = [0, 0, 0]
                open_packs.append(p)
            p[0] += s.length
            p[1] += s.vision_tokens
            p[2] += s.media
            p.append(index)
            held += 1
            held_tokens += s.length
            if full(p):
                leave(p)
            # the same bound as the online packer's buffer (growing to rows' worth at AUTO)
            while held >= size and (rows is None or held_tokens >= rows * seq or held >= most):
                leave(max(open_packs, key=lambda q: q[0]))
        return packs, skipped  # the packs still open at the end are left out, as the flush

    return run


def vision_share(samples: Sequence[VisionSample]) -> float:
    """Vision tokens per token of the stream's first :data:`TUNED` samples, to 3 decimals (as
    ``energon-pack tune`` prints it)."""
    head = samples[:TUNED]
    return round(sum(s.vision_tokens for s in head) / sum(s.length for s in head), 3)


def rank_packs(
    packer: Packer, samples: Sequence[VisionSample], seq: int, buffer: int, ranks: int
) -> tuple[list[list[Pack]], int]:
    """Each rank's packs, in order, of its own share of the stream; samples skipped."""
    out, skipped = [], 0
    for rank in range(ranks):
        mine = list(range(rank, len(samples), ranks))
        packs, dropped = packer([samples[i] for i in mine], seq, buffer)
        out.append([[mine[i] for i in pack] for pack in packs])
        skipped += dropped
    return out, skipped


def figures(
    per_rank: list[list[Pack]], samples: Sequence[VisionSample], seq: int, reference: float
) -> dict[str, float]:
    """Fill, vision per pack, share over 1.5x ``reference`` and the straggler ratio (+ floor)."""
    packs = [p for rank in per_rank for p in rank]
    vision = [sum(samples[i].vision_tokens for i in p) for p in packs]
    media = [sum(samples[i].media for i in p) for p in packs]
    tokens = sum(samples[i].length for p in packs for i in p)
    mean = statistics.fmean(vision)
    steps = min(len(rank) for rank in per_rank)

    def load(pack: Pack) -> int:
        return sum(samples[i].vision_tokens for i in pack)

    def largest(pack: Pack) -> int:
        return max(samples[i].vision_tokens for i in pack)

    loads = [[load(rank[s]) for rank in per_rank] for s in range(steps)]
    largests = [[largest(rank[s]) for rank in per_rank] for s in range(steps)]
    floors = [[max(mean, v) for v in step] for step in largests]
    return {
        "fill": tokens / (len(packs) * seq),
        "packs": len(packs),
        "vision_mean": mean,
        "vision_max": max(vision),
        "media_mean": statistics.fmean(media),
        "media_max": max(media),
        "over_1.5x": sum(v > 1.5 * reference for v in vision) / len(packs),
        "straggler": straggler_ratio(loads),
        "floor": straggler_ratio(floors),
        "even_floor": straggler_floor(largests, loads),
    }


def cost_per_item(
    samples: Sequence[VisionSample], seq: int, buffer: int, budgets: dict[str, dict[str, object]]
) -> dict[str, float]:
    """Median microseconds per item of each budget, and of each one's ratio to the first, over
    rounds that run every budget in turn (interleaved)."""
    times: dict[str, list[float]] = {name: [] for name in budgets}
    for _ in range(7):
        for name, budget in budgets.items():
            run = online(**budget)
            start = time.perf_counter()
            run(samples, seq, buffer)
            times[name].append((time.perf_counter() - start) / len(samples) * 1e6)
    first = next(iter(budgets))
    out = {name: statistics.median(values) for name, values in times.items()}
    for name, values in times.items():
        ratios = [value / base for value, base in zip(values, times[first], strict=True)]
        out[f"{name}/{first}"] = statistics.median(ratios)
    return out


def goals(records: dict[str, dict[str, float]]) -> dict[str, bool]:
    """The acceptance figures of one configuration (see docs/concepts/vision-budget.md)."""
    none, kept = records["none"], records["none (kept samples)"]
    out = {}
    for name in ("caps", "caps+balance", "caps+balance+share"):
        got = records[name]
        out[f"{name}: within caps"] = bool(got["within_caps@8"] and got["within_caps@64"])
        out[f"{name}: fill >= 0.99x uncapped (same samples)"] = (
            got["fill@8"] >= 0.99 * kept["fill@8"]
        )
        out[f"{name}: fill >= greedy"] = got["fill@8"] >= records["greedy"]["fill@8"]
    for name in ("caps+balance", "caps+balance+share", "balance"):
        got = records[name]
        reference = none if name == "balance" else kept
        out[f"{name}: fill >= 0.99x uncapped"] = got["fill@8"] >= 0.99 * reference["fill@8"]
        for ranks, slack, least in ((8, 0.10, 1.10), (64, 0.20, 1.20)):
            goal = max(least, got[f"even_floor@{ranks}"] + slack)
            written = max(least, got[f"floor@{ranks}"] + slack)
            out[f"{name}: straggler@{ranks} <= {goal:.3f} (mean floor: {written:.3f})"] = (
                got[f"straggler@{ranks}"] <= goal
            )
    return out


def configuration(
    samples: Sequence[VisionSample], seq: int, buffer: int
) -> tuple[list[dict[str, object]], dict[str, bool], str]:
    """Every scheme's record at one sequence length and buffer size, the goals, and the table."""
    base = rank_packs(online(), samples, seq, buffer, 1)[0][0]
    mean_vision = statistics.fmean(sum(samples[i].vision_tokens for i in p) for p in base)
    mean_media = statistics.fmean(sum(samples[i].media for i in p) for p in base)
    cap_v, cap_k = int(1.5 * mean_vision), math.ceil(1.5 * mean_media)
    caps = {"max_vision_tokens": cap_v, "max_media": cap_k}
    kept = [s for s in samples if s.vision_tokens <= cap_v and s.media <= cap_k]
    schemes: dict[str, tuple[Packer, Sequence[VisionSample]]] = {
        "none": (online(), samples),
        "none (kept samples)": (online(), kept),
        "caps": (online(**caps), samples),
        "caps+balance": (online(**caps, balance=True), samples),
        "caps+balance+share": (
            online(**caps, balance=True, vision_share=vision_share(samples)),
            samples,
        ),
        "balance": (online(balance=True), samples),
        "greedy": (greedy(cap_v, cap_k), samples),
    }
    records: list[dict[str, object]] = []
    by_name: dict[str, dict[str, float]] = {}
    rows = []
    for name, (packer, stream) in schemes.items():
        record: dict[str, object] = {
            "seq_length": seq,
            "buffer": buffer,
            "scheme": name,
            "max_vision_tokens": cap_v,
            "max_media": cap_k,
        }
        for ranks in RANKS:
            per_rank, skipped = rank_packs(packer, stream, seq, buffer, ranks)
            got = figures(per_rank, stream, seq, mean_vision)
            got["skipped"] = skipped / len(stream)
            got["within_caps"] = got["vision_max"] <= cap_v and got["media_max"] <= cap_k
            record.update({f"{k}@{ranks}": v for k, v in got.items()})
        records.append(record)
        by_name[name] = record  # type: ignore[assignment]
        rows.append(
            [
                name,
                f"{record['fill@8']:.4f}",
                f"{record['skipped@8']:.1%}",
                f"{record['vision_mean@8']:.0f}",
                f"{record['vision_max@8']:.0f}",
                f"{record['media_max@8']:.0f}",
                f"{record['over_1.5x@8']:.1%}",
                "yes" if record["within_caps@8"] and record["within_caps@64"] else "no",
                *(
                    f"{record[f'straggler@{r}']:.3f} ({record[f'even_floor@{r}']:.3f}, "
                    f"{record[f'floor@{r}']:.3f})"
                    for r in RANKS
                ),
            ]
        )
    headers = [
        *("scheme", "fill", "skipped", "vision mean", "max", "media max"),
        *(">1.5x mean", "within caps"),
        *(f"straggler@{r} (even floor, mean floor)" for r in RANKS),
    ]
    table = (
        f"seq {seq}, buffer {buffer_name(buffer)}: V={cap_v} vision tokens, K={cap_k} media "
        f"({len(samples)} samples, {len(samples) // RANKS[-1]} per rank at {RANKS[-1]} ranks)\n"
        + format_table(headers, rows)
    )
    return records, goals(by_name), table


def buffer_name(buffer: int) -> str:
    return f"auto ({AUTO_START}, growing)" if buffer == AUTO else str(buffer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64 * 500)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument(
        "--streams", default=",".join(STREAMS), help="a,b,... of " + ", ".join(STREAMS)
    )
    parser.add_argument("--seq-lengths", default=",".join(map(str, SEQ_LENGTHS)))
    parser.add_argument(
        "--buffers",
        default=",".join(map(str, BUFFERS)),
        help=f"a,b,...; {AUTO}: the growing default",
    )
    parser.add_argument("--no-cost", action="store_true", help="leave out the cost per item")
    parser.add_argument("--cost-only", action="store_true", help="only the cost per item")
    parser.add_argument(
        "--profile",
        metavar="STREAM/BUFFER",
        help="only where caps + balance spend their time on one stream and buffer (cProfile: by "
        "phase of a push, and the functions that take the most time of their own)",
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "vision_budget.json")
    )
    args = parser.parse_args()
    logging.getLogger("energon_pack.packing").setLevel(logging.ERROR)  # skips are counted here
    warnings.simplefilter("ignore", PackingWarning)  # buffers of 16 are measured on purpose
    if args.profile:
        stream, buffer = args.profile.split("/")
        profile(stream, int(buffer), args.seed)
        return
    streams = args.streams.split(",")
    seqs = [int(v) for v in args.seq_lengths.split(",")]
    buffers = [int(v) for v in args.buffers.split(",")]

    records: list[dict[str, object]] = []
    checks = {}
    for stream in [] if args.cost_only else streams:
        for seq in seqs:
            samples = vision_mix(args.samples, seed=args.seed, cap=seq, **STREAMS[stream])
            for buffer in buffers:
                got, met, table = configuration(samples, seq, buffer)
                records += [{"stream": stream, **r} for r in got]
                checks[f"{stream}/{seq}/{buffer_name(buffer)}"] = met
                print(f"\n{stream}, {table}")
                for goal, ok in met.items():
                    print(f"  {'met ' if ok else 'MISS'} {goal}")
    cost: dict[str, dict[int, dict[str, float]]] = {}
    if not args.no_cost:
        cost = {stream: packer_cost(stream, args.seed) for stream in streams}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"packs": records, "goals": checks, "us_per_item": cost}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


def cost_stream(stream: str, seed: int) -> tuple[list[VisionSample], dict[str, object]]:
    """The 20,000 samples the cost is measured on, and their caps at seq 8192."""
    samples = vision_mix(20000, seed=seed, cap=8192, **STREAMS[stream])
    base = rank_packs(online(), samples, 8192, 64, 1)[0][0]
    vision = statistics.fmean(sum(samples[i].vision_tokens for i in p) for p in base)
    media = statistics.fmean(sum(samples[i].media for i in p) for p in base)
    return samples, {"max_vision_tokens": int(1.5 * vision), "max_media": math.ceil(1.5 * media)}


def profile(stream: str, buffer: int, seed: int) -> None:
    """Where the packer with caps + balance spends its time on ``stream`` at ``buffer`` (seq
    8192): why its packs left, how many candidates it holds on average (against caps alone:
    the searches and the subset sums rebuilt after each pack grow with them), the time of each
    phase of a push (:data:`PHASES`), and the functions that take the most time of their own."""
    samples, caps = cost_stream(stream, seed)
    size, bound = (AUTO_START, BufferConfig()) if buffer == AUTO else (buffer, COUNT_BOUND)

    def new_packer(balance: bool) -> OnlineBinPacker:
        budget = VisionBudget(**caps, balance=balance)  # type: ignore[arg-type]
        return OnlineBinPacker(8192, size, overlong="skip", buffer=bound, vision=budget)

    def held_on_average(packer: OnlineBinPacker) -> float:
        held = 0
        for index, s in enumerate(samples):
            packer.push(index, s.length, vision_tokens=s.vision_tokens, media=s.media)
            held += len(packer.candidates)
        return held / len(samples)

    balanced = new_packer(balance=True)
    profiler = cProfile.Profile()
    profiler.enable()
    held = held_on_average(balanced)
    profiler.disable()
    stats = balanced.stats
    print(
        f"{stream}, buffer {buffer_name(buffer)}, caps + balance ({caps}): {stats.bins} packs "
        f"of {len(samples)} samples; left because {stats.emitted_by}; longest wait "
        f"{stats.max_wait} packs (max_wait {bound.max_wait}); {held:.0f} candidates held on "
        f"average after a push ({held_on_average(new_packer(balance=False)):.0f} with caps alone)"
    )
    stats_of = pstats.Stats(profiler)
    print(phase_table(stats_of, len(samples)))
    stats_of.sort_stats("tottime").print_stats(15)


PHASES = {
    "early packs tried (the fill rule)": ("_next_subset", "push"),
    "packs that must leave (full buffer)": ("_next_subset", "_leaving"),
    "packs that must leave (deadline)": ("_most_urgent_subset", "push"),
    "after a pack (subset sums rebuilt, counters)": ("_emit", None),
    "deadline bins of new samples": ("_deadline_bin_for", None),
    "new samples into the chooser's index": ("added", None),
}
"""Phases of OnlineBinPacker.push: (the packer's or chooser's function, its caller or None for
all callers)."""


def phase_table(stats_of: pstats.Stats, samples: int) -> str:
    """Time per sample in each of :data:`PHASES` (cumulative, under the profiler), with calls."""
    profiled = stats_of.stats  # type: ignore[attr-defined]
    total = sum(ct for (_, _, name), (_, _, _, ct, _) in profiled.items() if name == "push")
    rows = []
    for phase, (function, caller) in PHASES.items():
        calls = seconds = 0.0
        for (_, _, name), (_, _, _, cumulative, callers) in profiled.items():
            if name != function:
                continue
            if caller is None:
                calls += sum(record[0] for record in callers.values())
                seconds += cumulative
                continue
            for (_, _, by), record in callers.items():
                if by == caller:
                    calls += record[0]
                    seconds += record[3]
        rows.append(
            [phase, f"{int(calls)}", f"{seconds / samples * 1e6:.1f}", f"{seconds / total:.0%}"]
        )
    rows.append(["push, in all", str(samples), f"{total / samples * 1e6:.1f}", "100%"])
    headers = ["phase", "calls", "us per sample (profiled)", "share"]
    return format_table(headers, rows)


def packer_cost(stream: str, seed: int) -> dict[int, dict[str, float]]:
    """Cost per item of each budget on ``stream`` at seq 8192 and buffers 16-256, printed."""
    samples, caps = cost_stream(stream, seed)
    budgets: dict[str, dict[str, object]] = {
        "none": {},
        "caps": caps,
        "caps+balance": {**caps, "balance": True},
        "caps+balance+share": {**caps, "balance": True, "vision_share": vision_share(samples)},
    }
    cost = {buffer: cost_per_item(samples, 8192, buffer, budgets) for buffer in COST_BUFFERS}
    print(f"\n{stream}: packer cost per item (us; medians of 7 interleaved rounds, seq 8192)")
    ratios = ("caps/none", "caps+balance/none", "caps+balance+share/none")
    cost_rows = [
        [buffer, *(f"{c[name]:.1f}" for name in budgets), *(f"{c[r]:.2f}x" for r in ratios)]
        for buffer, c in cost.items()
    ]
    print(format_table(["buffer", *budgets, *ratios], cost_rows))
    return cost


if __name__ == "__main__":
    main()
