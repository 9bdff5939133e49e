""":func:`verify_packing`: a model directory's architecture, cut to CPU size, trained on a
packed row of the user's samples and on each sample alone, per attention implementation."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from energon_pack.collate import VLMPackingCollator
from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.family import model_family
from energon_pack.encoding.template import make_encoder
from energon_pack.packing.packed import EncodedSample
from energon_pack.train.hf import HFTarget
from energon_pack.tune.tokenizers import read_chat_template, refuse_template_for_processor
from energon_pack.verify.data import Samples, changed, encode_samples
from energon_pack.verify.diagnose import Findings, layer_name, reason
from energon_pack.verify.inputs import Adapt, Inputs, Packing
from energon_pack.verify.measure import gradient_error, loss_error, moved, run, segments_error
from energon_pack.verify.report import TOLERANCES, BackendResult, Tolerance, VerifyReport
from energon_pack.verify.tiny import (
    Vocabulary,
    cut_config,
    layer_types_of,
    special_ids,
    tiny_model,
)

DEFAULT_ATTN = ("eager", "sdpa")
"""Attention implementations checked on a CPU when none is named: those that run there with a
backward (``flex_attention`` runs forward only on a CPU: name it to check it)."""
_GPU_ATTN = ("flex_attention", "flash_attention_2", "flash_attention_3")
_KERNEL_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
_LINEAR_REFUSAL = (
    "models with linear-attention layers are refused by hf_model_inputs and the collator's "
    "hf output, because transformers carries those layers' state across packed segments"
)


def verify_packing(
    model_dir: str | Path,
    *,
    data: str | Path | None = None,
    attn_implementations: Sequence[str] | None = None,
    samples: int = 4,
    max_tokens: int = 4096,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    adapt: Adapt | None = None,
    chat_template: str | Path | None = None,
) -> VerifyReport:
    """Check that a packed row trains ``model_dir``'s architecture exactly as its samples one
    by one, for each attention implementation (default:
    :func:`default_attn_implementations` of ``device``).

    ``model_dir`` holds the model's ``config.json`` and its tokenizer (and processor files for
    a model that takes media); weights are never read. The model is cut to a few layers (one
    of each layer type) and small widths with random weights from ``seed``
    (:mod:`energon_pack.verify.tiny`). The first ``samples`` samples of ``data`` (a dataset
    directory or a JSON/JSONL file; default: the shipped demo dataset) are encoded by the
    model's encoder and packed in one row. Per implementation it compares the summed loss, each
    segment's logits and every gradient with the samples run alone, and changes one sample's
    tokens and images to see whether the others move. ``adapt`` edits the packed inputs as a
    trainer does before its forward; ``chat_template`` is a Jinja file that replaces the
    tokenizer's template (as ``--chat-template`` does in training). Raises ValueError for a
    directory or source it cannot use, or a model family the library refuses to pack (naming
    it)."""
    directory = Path(model_dir)
    config = _config(directory)
    family = _family(directory)
    encoder = _encoder(directory, family, chat_template)
    source = Path(data) if data is not None else _default_data()
    chosen = encode_samples(
        source, encoder, count=samples, max_tokens=max_tokens, media=family is not None
    )
    probe_index = _probe_index(chosen.encoded)
    regular = _regular_ids(chosen.encoded, config, encoder)
    swapped = list(chosen.encoded)
    swapped[probe_index] = changed(chosen.encoded[probe_index], regular, seed)
    vocabulary = _vocabulary(chosen, swapped, config, encoder)
    total = sum(sample.length for sample in chosen.encoded)
    collator = VLMPackingCollator(
        seq_length=-(-total // 8) * 8,
        encoder=encoder,
        family=family,
        position_ids="mrope" if _rotates_mrope(family) else "1d",
    )
    packing = Packing(collator, family, vocabulary)
    tolerance = TOLERANCES.get(dtype)
    if tolerance is None:
        raise ValueError(f"dtype {dtype}: expected one of {sorted(map(str, TOLERANCES))}")
    results = []
    cut = cut_config(config, vocabulary)
    model_class, layer_types = "", layer_types_of(cut)
    if attn_implementations is None:
        attn_implementations = default_attn_implementations(device)
    for attn in attn_implementations:
        started = time.perf_counter()
        try:
            model = tiny_model(cut, seed=seed, dtype=dtype, attn_implementation=attn).to(device)
        except (ImportError, ValueError, RuntimeError) as error:
            results.append(BackendResult(attn, "cannot_run", reason=_first_line(error)))
            continue
        model_class = type(model).__name__
        context = _Context(packing, model, device, adapt, tolerance, family)
        try:
            result = _check(context, chosen.encoded, swapped, probe_index, attn, layer_types)
        except (RuntimeError, NotImplementedError, ImportError, ValueError) as error:
            # ValueError: the library builds no packed inputs for this implementation
            result = BackendResult(attn, "cannot_run", reason=_first_line(error))
        results.append(_timed(result, time.perf_counter() - started))
    target = HFTarget.of(config)
    return VerifyReport(
        model_dir=str(directory),
        model_type=str(config.model_type),
        family=None if family is None else str(family.name),
        model_class=model_class,
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        samples=tuple(sample.key for sample in chosen.encoded),
        segment_tokens=tuple(sample.length for sample in chosen.encoded),
        skipped=chosen.skipped,
        layer_types=tuple(layer_types),
        results=tuple(results),
        refusal=_LINEAR_REFUSAL if target.segment_blind else None,
        tolerance=vars(tolerance),
    )


@dataclass(frozen=True)
class _Context:
    """What every pass of one attention implementation shares."""

    packing: Packing
    model: Any
    device: str
    adapt: Adapt | None
    tolerance: Tolerance
    family: Any

    def packed(self, samples: Sequence[EncodedSample]) -> tuple[Inputs, Any]:
        inputs, segments = self.packing.packed(self.model, samples)
        if self.adapt is not None:
            inputs = self.adapt(inputs)
        return _to(inputs, self.device, self.model.dtype), segments

    def alone(self, sample: EncodedSample) -> Inputs:
        return _to(self.packing.alone(self.model, sample), self.device, self.model.dtype)


def _check(
    context: _Context,
    samples: Sequence[EncodedSample],
    swapped: Sequence[EncodedSample],
    probe_index: int,
    attn: str,
    layer_types: Sequence[str],
) -> BackendResult:
    model, tolerance = context.model, context.tolerance
    inputs, segments = context.packed(samples)
    by_key = {sample.key: sample for sample in samples}
    no_backward = ""
    try:
        packed = run(model, inputs)
    except NotImplementedError as error:  # FlexAttention runs no backward on a CPU
        no_backward = _first_line(error)
        packed = run(model, inputs, backward=False)
    backward = not no_backward
    alone = [run(model, context.alone(by_key[s.key]), backward=backward) for s in segments]
    loss = loss_error(packed, alone)
    gradient, parameter = gradient_error(packed, alone) if backward else (None, None)
    versus_alone = segments_error(packed, alone, segments, tolerance.logits)
    other_inputs, _ = context.packed(swapped)
    other = run(model, other_inputs, backward=False)
    changed_segment = next(i for i, s in enumerate(segments) if s.key == samples[probe_index].key)
    leak = moved(packed, other, segments, changed_segment, tolerance.leak)
    leaked = leak.error > tolerance.leak
    exact = (
        not leaked
        and loss <= tolerance.loss
        and versus_alone.error <= tolerance.logits
        and (gradient is None or gradient <= tolerance.gradient)
    )
    found = Findings(
        attn,
        inputs,
        segments,
        layer_types,
        mrope=_rotates_mrope(context.family) or HFTarget.of(model).mrope,
        block_mask=getattr(context.family, "packing", None) == "block_mask",
        alone=versus_alone,
        leak=leak,
        leaked=leaked,
    )
    first = leak.layer if leaked else versus_alone.layer
    return BackendResult(
        attn,
        "exact" if exact else "leaks",
        loss_error=loss,
        logits_error=versus_alone.error,
        gradient_error=gradient,
        worst_parameter=parameter,
        leak=leak.error,
        layer=None if exact else layer_name(first, layer_types),
        reason=reason(found) if not exact else _forward_only(no_backward),
    )


def _forward_only(no_backward: str) -> str:
    if not no_backward:
        return ""
    return f"forward only, gradients not compared ({no_backward})"


def _timed(result: BackendResult, seconds: float) -> BackendResult:
    return replace(result, seconds=round(seconds, 2))


def _config(directory: Path) -> Any:
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise ValueError(
            f"--model {directory}: no config.json; give the model's directory (its "
            "config.json and tokenizer files; weights are not needed)"
        )
    config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    return getattr(config, "thinker_config", None) or config  # an Omni model trains its thinker


def _family(directory: Path) -> Any:
    """The model's family from its processor files, or None for a text model."""
    if any((directory / name).is_file() for name in _PROCESSOR_FILES):
        return model_family(directory)
    return None


def default_attn_implementations(device: str = "cpu") -> tuple[str, ...]:
    """What :func:`verify_packing` checks when no implementation is named: eager and sdpa on a
    CPU; on a GPU also ``flex_attention`` and each FlashAttention whose kernel is installed."""
    if torch.device(device).type == "cpu":
        return DEFAULT_ATTN
    import importlib.util

    installed = [
        attn
        for attn in _GPU_ATTN
        if attn not in _KERNEL_PACKAGES or importlib.util.find_spec(_KERNEL_PACKAGES[attn])
    ]
    return (*DEFAULT_ATTN, *installed)


def _encoder(directory: Path, family: Any, chat_template: str | Path | None) -> Any:
    if isinstance(family, ProcessorFamily):
        refuse_template_for_processor(chat_template)
        return make_encoder(family=family)
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(str(chat_template))
    return make_encoder(tokenizer, family=family)


def _rotates_mrope(family: Any) -> bool:
    return family is not None and not isinstance(family, ProcessorFamily)


def _default_data() -> Path:
    from energon_pack.tune.runs import default_dataset

    return default_dataset()


def _probe_index(samples: Sequence[EncodedSample]) -> int:
    """The sample the leakage probe changes: the first with an image, else the first."""
    for index, sample in enumerate(samples):
        if any(item.kind == "image" for item in sample.media):
            return index
    return 0


def _specials(config: Any, encoder: Any) -> set[int]:
    tokenizer = getattr(encoder, "tokenizer", None)
    named = getattr(tokenizer, "all_special_ids", None) or []
    return special_ids(config) | {int(i) for i in named}


def _regular_ids(samples: Sequence[EncodedSample], config: Any, encoder: Any) -> torch.Tensor:
    """The text ids of the samples that are no special token (sorted)."""
    seen = torch.unique(torch.cat([sample.input_ids for sample in samples]))
    special = torch.tensor(sorted(_specials(config, encoder)), dtype=seen.dtype)
    regular: torch.Tensor = seen[~torch.isin(seen, special)]
    return regular


def _vocabulary(
    chosen: Samples, swapped: Sequence[EncodedSample], config: Any, encoder: Any
) -> Vocabulary:
    ids = set(_specials(config, encoder))
    for sample in (*chosen.encoded, *swapped):
        ids.update(int(i) for i in torch.unique(sample.input_ids))
    return Vocabulary(tuple(sorted(ids)))


def _to(inputs: Inputs, device: str, dtype: torch.dtype) -> Inputs:
    """``inputs`` on ``device``, floating tensors (pixels, float masks) in the model's
    ``dtype``, as a trainer hands them over."""

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device, dtype if value.is_floating_point() else value.dtype)
        if isinstance(value, dict):
            return {k: move(v) for k, v in value.items()}
        return value

    return {name: move(value) for name, value in inputs.items()}


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
