"""Checks of a processor family on the Energon path: each pack against what the collator makes
of the same native samples, the model inputs a pack builds against the collator's ``output="hf"``
dict, and a whole run (every pack, the skips, exact resume at :data:`~helpers.CUT_POINTS`) as
plain values for a test in the torchvision child."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from helpers import CUT_POINTS, FamilyLoaderRun, assert_loader_resumes, batches, train_dataset

from energon_pack import VLMPackingCollator, model_family
from energon_pack.energon.task_encoder import PackedBatch

Samples = Mapping[str, Mapping[str, bytes]]


def assert_pack_is_the_collators(batch: PackedBatch, collator: Any, samples: Samples) -> Any:
    """The Energon ``batch`` equals what ``collator`` makes of the same native samples (found
    by key in ``samples``): ids, labels and every family input; returns the collator's batch."""
    keys = list(batch.__keys__)
    want = collator([{"__key__": key, **samples[key]} for key in keys])
    assert batch.input_ids.tolist() == want.input_ids.tolist(), keys
    assert batch.labels.tolist() == want.labels.tolist(), keys
    assert batch.family_inputs is not None
    assert want.family_inputs is not None
    got, expected = batch.family_inputs.tensors(), want.family_inputs.tensors()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), (keys, name, _difference(got[name], tensor))
    return want


def _difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """How ``got`` differs from ``want``: shapes and dtypes, and where they agree, the largest
    difference, how many elements differ and the first rows that hold one."""
    head = f"{tuple(got.shape)} {got.dtype} against {tuple(want.shape)} {want.dtype}"
    if got.shape != want.shape or got.ndim == 0:
        return head
    apart = (got.double() - want.double()).abs()
    rows = (apart.flatten(1) > 0).any(1).nonzero().flatten().tolist() if got.ndim > 1 else []
    return (
        f"{head}: largest difference {float(apart.max())}, {int((apart > 0).sum())} of "
        f"{apart.numel()} elements differ (rows {rows[:5]} of {len(rows)})"
    )


def assert_model_inputs_are_the_collators(
    batch: PackedBatch, collated: Any, hf: Any, model: Any, samples: Samples
) -> None:
    """``batch.hf_model_inputs(model, family=...)``, and the same of the collator's batch form
    ``collated``, hold the ``output="hf"`` dict the collator ``hf`` makes of the same samples
    (tensors, or dicts of them: a family's 4-D masks per layer type)."""
    keys = list(batch.__keys__)
    wanted = hf([{"__key__": key, **samples[key]} for key in keys])
    wanted.pop("use_cache", None)
    family = hf.family
    for inputs in (
        batch.hf_model_inputs(model, family=family),
        collated.hf_model_inputs(model, family=family),
    ):
        assert set(inputs) >= set(wanted), sorted(set(wanted) - set(inputs))
        for key, value in wanted.items():
            assert _equal(inputs[key], value), (keys, key)


def _equal(got: Any, want: Any) -> bool:
    if isinstance(want, dict):
        return set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    return bool(torch.equal(got, want))


def family_run_report(
    path: Path,
    processor: Any,
    samples: Samples,
    settings: Mapping[str, Any],
    *,
    model: Callable[[], Any] | None = None,
    check: Callable[[PackedBatch], None] | None = None,
) -> dict[str, Any]:
    """The Energon path of ``processor``'s family over the dataset at ``path`` (2 workers, a
    buffer of 6), as plain values: the keys seen, the packs unequal to the collator's (and,
    with ``model``, whose model inputs are unequal; with ``check``, the packs it fails), each
    worker's skip counts, and the resume at each cut point (``"exact"`` or why not); an
    exception's traceback under ``"error"``."""
    try:
        return _report(path, processor, samples, settings, model, check)
    except Exception:
        return {"error": traceback.format_exc()}


def _report(
    path: Path,
    processor: Any,
    samples: Samples,
    settings: Mapping[str, Any],
    model: Callable[[], Any] | None,
    check: Callable[[PackedBatch], None] | None,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    layout = {"seq_length": settings["seq_length"], "family": model_family(processor)}
    layout["pad_to_multiple_of"] = settings["pad_to_multiple_of"]
    collator = VLMPackingCollator(**layout)
    tiny = model() if model is not None else None
    hf = VLMPackingCollator(**layout, output="hf", hf_model=tiny) if tiny is not None else None

    def dataset(repeat: bool = False) -> Any:
        return train_dataset(path, 6, workers=2, repeat=repeat, family=processor, **settings)

    out: dict[str, Any] = {"seen": [], "unequal": [], "skipped": {}, "resumed": {}}
    for batch in batches(dataset()):
        out["seen"] += list(batch.__keys__)
        out["skipped"][batch.packing_stats.worker] = dict(batch.packing_stats.skipped)
        try:
            collated = assert_pack_is_the_collators(batch, collator, samples)
            if hf is not None:
                assert_model_inputs_are_the_collators(batch, collated, hf, tiny, samples)
            if check is not None:
                check(batch)
        except AssertionError as error:
            out["unequal"].append(f"{list(batch.__keys__)}: {error}")
    for at in CUT_POINTS:
        try:
            assert_loader_resumes(lambda: FamilyLoaderRun(dataset(repeat=True)), at)
            out["resumed"][at] = "exact"
        except AssertionError as error:
            out["resumed"][at] = str(error)
    return out
