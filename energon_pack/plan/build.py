"""Building a plan: :func:`plan_dataset` measures every row on Ray Data, packs them all at
once, lays the packs out as training steps and writes the plan directory."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from energon_pack.checks import check_choice
from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.encoding.describe import encoding_record
from energon_pack.encoding.fingerprint import tokenizer_identity
from energon_pack.offline.manifest import tokenizer_content
from energon_pack.plan.measure import SKIP_KINDS, measure_partitions
from energon_pack.plan.pack import lay_out_steps, pack_rows
from energon_pack.plan.spec import PlanSpec
from energon_pack.plan.store import (
    FORMAT_VERSION,
    PACKS_FILE,
    PLAN_FILE,
    ROWS_FILE,
    Plan,
    differences,
    read_record,
    write_packs,
    write_record,
    write_rows,
)
from energon_pack.sources.energon import EnergonSource
from energon_pack.sources.engine import ENGINES, Engine
from energon_pack.sources.rows import JsonSource, open_source

logger = logging.getLogger("energon_pack.plan")


def plan_dataset(
    source: str | Path,
    out_dir: str | Path,
    spec: PlanSpec,
    encoder: SampleEncoder,
    *,
    media_root: str | Path | None = None,
    split: str = "train",
    engine: Engine = "ray",
    ray_address: str | None = None,
    force: bool = False,
    progress: bool = False,
) -> Plan:
    """Plan every pack of ``source`` and write the plan to ``out_dir``
    (:mod:`energon_pack.plan.store`). The source is a Megatron-Energon dataset (its ``split``
    part, read by Energon as the loaders read it), or rows (chat rows with their media,
    prompt/answer pairs, pre-tokenised ids) in a JSONL file, a JSON file holding one array of
    them, a ``.parquet`` file whose columns are the rows' fields, or a folder ``datasets``
    saved (``save_to_disk``; its ``split`` when it holds a ``DatasetDict``).

    Each row is measured by ``encoder`` (the encoder the loaders use, e.g.
    ``make_encoder(tokenizer)`` or ``make_encoder(family=processor)``; media paths are read
    under ``media_root``, by default the source's folder, probed from their headers), on Ray
    Data (``engine="ray"``: a local Ray with every core, or the cluster at ``ray_address``) or
    in this process (``engine="local"``, for a small source or where Ray is not installed).
    The rows are then
    packed at once by first fit decreasing within ``spec.layout`` and ``spec.vision``'s caps
    and laid out as steps of ``spec.global_batch_size`` packs over ``spec.data_parallel_size``
    ranks (balanced for the vision encoder with ``spec.vision.balance``). ``progress`` shows a
    progress bar on stderr while the rows are measured.

    A row that is no sample, has media that cannot be probed, fits no row or is alone over a
    vision cap is left out, counted by kind and listed with its reason in ``plan.json``
    (``spec.overlong="error"``: an overlong row stops the build instead). An up-to-date plan
    in ``out_dir`` is reused; one built from another source or with other settings is refused
    with a ValueError naming what differs, unless ``force``.
    """
    check_choice("engine", engine, ENGINES)
    out_dir = Path(out_dir)
    rows = open_source(source, media_root, split)
    asked: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "source": rows.fingerprint(),
        "spec": spec.to_json(),
        "encoder": encoder_identity(encoder),
    }
    existing = None if force else read_record(out_dir)
    if existing is not None:
        changed = differences(existing, asked)
        if changed:
            raise ValueError(
                f"plan dir {out_dir} holds a plan built otherwise: {'; '.join(changed)}; "
                "rebuild it with --force (force=True) or choose a new directory"
            )
        logger.info("reusing the up-to-date plan in %s", out_dir)
        return Plan(out_dir, existing, reused=True)
    if not force and out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(
            f"out dir {out_dir} is not empty and has no {PLAN_FILE}; pass force=True (--force) "
            "to build there, or choose an empty or new directory"
        )
    if len(rows) == 0:
        raise ValueError(f"source {rows.path} holds no rows; check the file")
    columns = measure_partitions(
        rows.partitions(),
        encoder,
        spec,
        rows.media_root,
        engine,
        ray_address,
        progress=len(rows) if progress else None,
    )
    if isinstance(rows, EnergonSource):
        columns = rows.complete(columns)
    if spec.overlong == "error":
        _refuse_overlong(columns)
    kept = np.flatnonzero(columns["skip"] == "")
    if kept.size == 0:
        raise ValueError(
            f"source {rows.path}: every one of its {len(columns['index'])} rows was left out "
            f"({_skip_counts(columns)}), the first because {columns['reason'][0]}; fix the "
            "rows or the settings"
        )
    length, vision, media = (columns[name][kept] for name in ("length", "vision_tokens", "media"))
    local = pack_rows(length.tolist(), vision.tolist(), media.tolist(), spec)
    groups = [[int(kept[i]) for i in group] for group in local]
    pack_vision = [int(columns["vision_tokens"][group].sum()) for group in groups]
    pack_largest = [int(columns["vision_tokens"][group].max()) for group in groups]
    steps = lay_out_steps(pack_vision, pack_largest, spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / PLAN_FILE).unlink(missing_ok=True)  # incomplete until the record is back
    write_packs(out_dir / PACKS_FILE, groups, columns, steps.step, steps.rank, steps.micro)
    if isinstance(rows, JsonSource) and rows.index is not None:
        write_rows(out_dir / ROWS_FILE, rows.index)
    padded = sum(spec.layout.aligned(int(n)) for n in length)
    skipped = [
        {"key": str(columns["key"][i]), "kind": str(columns["skip"][i]), "reason": reason}
        for i, reason in enumerate(columns["reason"])
        if reason
    ]
    if skipped:
        logger.warning(
            "%d row(s) left out of the plan (%s), each listed in %s; the first: %s",
            len(skipped),
            ", ".join(f"{n} {kind}" for kind, n in _skip_counts(columns).items() if n),
            out_dir / PLAN_FILE,
            skipped[0]["reason"],
        )
    per_step = spec.steps_of
    record = {
        **asked,
        "energon_pack_version": importlib.metadata.version("energon_pack"),
        "counts": {
            "rows": len(columns["index"]),
            "samples": int(kept.size),
            "packs": len(groups),
            "steps": math.ceil(len(groups) / per_step),
            "last_step_packs": len(groups) % per_step or per_step,
            "tokens": int(length.sum()),
            "fill": padded / (len(groups) * spec.layout.capacity),
            "straggler": _number(steps.straggler),
            "straggler_floor": _number(steps.floor),
            "skipped": _skip_counts(columns),
        },
        "skipped": skipped,
    }
    write_record(out_dir, record)
    return Plan(out_dir, record)


def encoder_identity(encoder: SampleEncoder) -> dict[str, Any]:
    """What decides the measured lengths: the tokenizer (identity and content), the encoding,
    the encoder's settings and its media settings (:meth:`MediaConfig.settings`)."""
    tokenizer = encoder.tokenizer
    return {
        "tokenizer": tokenizer_identity(tokenizer),
        "tokenizer_content": tokenizer_content(tokenizer),
        **encoding_record(encoder),
        "settings": encoder.settings(),
        "media": json.loads(json.dumps(encoder.media.settings())),  # as plan.json holds it
    }


def _skip_counts(columns: dict[str, Any]) -> dict[str, int]:
    counted = Counter(str(kind) for kind in columns["skip"] if kind)
    return {kind: counted.get(kind, 0) for kind in SKIP_KINDS}


def _refuse_overlong(columns: dict[str, Any]) -> None:
    """A ValueError naming the first row that fits no pack (``overlong="error"``)."""
    for kind, reason in zip(columns["skip"], columns["reason"], strict=True):
        if kind in ("overlong", "over_vision_cap"):
            raise ValueError(f"{reason}; or pass overlong='skip' (--overlong skip) to list it")


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value
