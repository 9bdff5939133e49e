"""Shared pieces of the per-family tests: a small local tokenizer with a family's special
tokens and chat template (no downloads), seeded test images, sounds and media rows, and the
packed-versus-alone check on a tiny transformers model.

The check runs each sample alone through the model (its processor's own inputs, unshifted
labels with ``-100`` off the assistant spans) and the packed row once (positions restarting per
segment, ``-100`` on each segment's first label), and compares the summed target loss and every
parameter gradient.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedModel, PreTrainedTokenizerFast

IGNORE = -100
ZERO_GRADIENT = 1e-9
"""A parameter whose gradient stays below this share of the largest one is compared on that
scale: its gradient is zero in exact arithmetic, rounding noise in float64."""
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CORPUS = (
    "What is shown here? Describe the image in detail.\n\n\nThe quick brown fox jumps over the "
    "lazy dog.\n A user asks, the assistant answers; the system sets the rules. 12 345 6789\n"
    "  indented text\tand tabs, émigré façade naïve. user model assistant system\n"
)


def tiny_tokenizer(
    special: Sequence[str],
    chat_template: str,
    *,
    bos: str | None = None,
    eos: str,
    pad: str,
    add_bos: bool = False,
    vocab_size: int = 600,
    extra: Mapping[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on a fixed text, with ``special`` as special tokens
    (``bos``/``eos``/``pad`` among them), ``chat_template``, and BOS added on encode when
    ``add_bos`` (as Gemma's and Llama's tokenizers do). ``extra`` sets named special-token
    attributes the processors read (e.g. ``{"image_token": "<image>"}``)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(dict.fromkeys(special)),
        show_progress=False,
    )
    backend.train_from_iterator([_CORPUS] * 4, trainer)
    if add_bos:
        assert bos is not None
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, backend.token_to_id(bos))],
        )
    named: dict[str, Any] = {"eos_token": eos, "pad_token": pad}
    if bos is not None:
        named["bos_token"] = bos
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        additional_special_tokens=[t for t in special if t not in (bos, eos, pad)],
        extra_special_tokens=dict(extra or {}),
        **named,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def test_images(seed: int, sizes: Sequence[tuple[int, int]]) -> list[np.ndarray[Any, Any]]:
    """Seeded RGB images (HWC uint8) of the given ``(height, width)`` sizes: smooth gradients
    plus noise, so resizing is exercised."""
    rng = np.random.default_rng(seed)
    out = []
    for height, width in sizes:
        y = np.linspace(0, 255, height)[:, None, None]
        x = np.linspace(0, 255, width)[None, :, None]
        base = (y * rng.uniform(0.2, 1) + x * rng.uniform(0.2, 1)) % 256
        noise = rng.integers(0, 40, (height, width, 3))
        out.append(((base + noise) % 256).astype(np.uint8))
    return out


def png_bytes(image: np.ndarray[Any, Any]) -> bytes:
    """``image`` as PNG bytes."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


SOUND_RATE = 16_000
"""The sample rate of :func:`sound`'s files."""
Media = list[tuple[str, Any]]
"""A sample's media in text order: ``(kind, spec)``, ``kind`` one of ``"image"`` (``spec`` its
``(height, width)``), ``"video"`` (``spec`` names its clip) or ``"audio"`` (``spec`` its
seconds)."""


@cache
def sound(seconds: float) -> bytes:
    """A mono WAV sweep of ``seconds`` at :data:`SOUND_RATE`."""
    from audio_files import encode_audio

    return encode_audio("wav", SOUND_RATE, 1, int(SOUND_RATE * seconds), sweep=True)


def conversation(media: Media, reply: str) -> list[dict[str, Any]]:
    """A user turn of ``media``'s placeholders and a question, then the assistant's ``reply``."""
    parts = [{"type": kind} for kind, _ in media]
    return [
        {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
    ]


def media_row(
    index: int, media: Media, reply: str, video: Callable[[Any], bytes]
) -> dict[str, Any]:
    """Sample ``index`` as a row: its :func:`conversation`, PNG images seeded by ``index``, the
    bytes ``video(spec)`` gives for each video and the :func:`sound` of each audio."""
    sizes = [spec for kind, spec in media if kind == "image"]
    out: dict[str, Any] = {"id": f"s{index}", "messages": conversation(media, reply)}
    if sizes:
        out["images"] = [png_bytes(a) for a in test_images(index, sizes)]
    if videos := [video(spec) for kind, spec in media if kind == "video"]:
        out["videos"] = videos
    if audios := [sound(spec) for kind, spec in media if kind == "audio"]:
        out["audios"] = audios
    return out


Inputs = dict[str, Any]


def expanded_text(family: Any, text: str, sizes: Sequence[tuple[int, int]]) -> str:
    """``text`` with each of the family's image placeholders replaced by its expansion for the
    images of ``sizes``, in order (what the processor writes before it tokenises)."""
    pieces = text.split(family.image_placeholder)
    assert len(pieces) == len(sizes) + 1
    out = pieces[0]
    for expansion, piece in zip(family.expansions(sizes), pieces[1:], strict=True):
        out += expansion + piece
    return out


def packed_matches_alone(
    model: PreTrainedModel,
    alone: Sequence[Inputs],
    packed: Inputs,
    *,
    rtol: float = 1e-6,
    tensor_rtol: float = 1e-5,
) -> tuple[float, float]:
    """Summed target loss and every gradient of ``packed`` (one row) against the samples of
    ``alone`` run one by one; returns (relative loss error, worst relative gradient error) and
    asserts they are within ``rtol`` / ``tensor_rtol``. Each inputs dict carries ``labels``
    (unshifted, ``-100`` off targets); the loss is ``mean x targets``."""

    def run(inputs: Inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = model(**inputs, use_cache=False)
        targets = int((inputs["labels"][..., 1:] != IGNORE).sum())
        (out.loss * targets).backward()
        grads = {
            n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
        }
        return (out.loss * targets).detach(), grads

    want_loss = torch.zeros((), dtype=torch.float64)
    want: dict[str, torch.Tensor] = {}
    for inputs in alone:
        loss, grads = run(inputs)
        want_loss = want_loss + loss.double()
        for name, grad in grads.items():
            want[name] = want[name] + grad if name in want else grad
    got_loss, got = run(packed)
    loss_error = float(abs(got_loss.double() - want_loss) / abs(want_loss))
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst = 0.0
    # a gradient that is zero in exact arithmetic (a key projection's bias: softmax ignores it)
    # holds rounding noise only; it is measured against the largest gradient's rounding
    floor = ZERO_GRADIENT * max(float(grad.abs().max()) for grad in want.values())
    for name, grad in want.items():
        scale = max(float(grad.abs().max()), floor)
        error = float((got[name] - grad).abs().max()) / scale if scale > 0 else 0.0
        assert error <= tensor_rtol, (name, error)
        worst = max(worst, error)
    assert loss_error <= rtol, loss_error
    return loss_error, worst


def running_positions_differ(
    model: PreTrainedModel, alone: Sequence[Inputs], packed: Inputs
) -> bool:
    """Whether ``packed`` with positions running on across its samples (0, 1, ... over the
    whole row) fails :func:`packed_matches_alone`: restarting positions are what make it
    exact."""
    running = {**packed, "position_ids": torch.arange(packed["input_ids"].shape[1])[None]}
    try:
        packed_matches_alone(model, alone, running)
    except AssertionError:
        return True
    return False


def seeded(build: Callable[[], PreTrainedModel], seed: int = 0) -> PreTrainedModel:
    """``build()`` under a fixed torch seed, in float64 and training mode."""
    torch.manual_seed(seed)
    return build().double().train()


def chatml_reply_mask(processor: Any, ids: list[int]) -> list[bool]:
    """True on each reply token of ChatML ids: after ``<|im_start|>assistant\n`` through its
    ``<|im_end|>`` (the processor's tokenizer gives both)."""
    header = processor.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    mask, inside, at = [False] * len(ids), False, 0
    while at < len(ids):
        if not inside and ids[at : at + len(header)] == header:
            inside, at = True, at + len(header)
            continue
        if inside:
            mask[at] = True
            inside = ids[at] != end
        at += 1
    return mask
