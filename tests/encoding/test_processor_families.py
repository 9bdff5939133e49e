"""Processor families end to end, through the library's own paths: ``model_family`` of a
processor instance and of its saved directory, the family's encoder on native samples with real
PNG/JPEG bytes (ids equal the processor's on the same conversation, images EXIF-transposed as
``datasets`` does), and the collator's packed ``output="hf"`` dict on a tiny model of the family
(loss and every gradient equal to the samples run alone through the processor's outputs).

Each family's processor and tiny model come from its own test module (``test_family_*``).
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_family_gemma3 as gemma3
import test_family_gemma4 as gemma4
import test_family_glm4v as glm4v
import test_family_idefics3 as idefics3
import test_family_internvl as internvl
import test_family_llava_onevision as llava_onevision
import test_family_pixtral as pixtral
import torch
from family_kit import IGNORE, packed_matches_alone, png_bytes
from family_kit import test_images as make_images
from PIL import Image, ImageOps
from torchvision_child import available, run_in_child
from transformers import PreTrainedModel

from energon_pack import PackingTaskEncoder, VLMPackingCollator, make_encoder, model_family
from energon_pack.encoding.families import ProcessorFamily
from energon_pack.encoding.processor_encoder import ProcessorEncoder
from energon_pack.media import MediaError


@dataclass(frozen=True)
class Case:
    """A family's processor, its tiny model (built under a fixed seed) and the worst relative
    gradient error allowed (float64 models; some run a layer in float32)."""

    processor: Callable[[], Any]
    model: Callable[[Any], PreTrainedModel]
    gradient_rtol: float = 1e-10


CASES = {
    "gemma3": Case(gemma3.make_processor, lambda _: gemma3.tiny_model(), 1e-5),
    "gemma4": Case(gemma4.build, lambda p: gemma4.tiny_model(p, "vision"), 1e-5),
    "glm4v": Case(glm4v.make_processor, lambda _: glm4v.tiny_model(), 1e-5),
    "idefics3": Case(
        lambda: idefics3.small("idefics3"), lambda p: idefics3.tiny_model("idefics3", p)
    ),
    "internvl": Case(lambda: internvl.default()[0], lambda _: internvl.tiny_model()),
    "llava_onevision": Case(llava_onevision.small, lambda _: llava_onevision.tiny_model()),
    "pixtral": Case(lambda: pixtral.processor(4, 2, 32), lambda _: pixtral.tiny_model("mistral3")),
    "smolvlm": Case(lambda: idefics3.small("smolvlm"), lambda p: idefics3.tiny_model("smolvlm", p)),
}
SAVABLE = {"idefics3", "gemma3"}
"""Families whose processor has no video processor, so it saves and loads here."""
SAMPLES = [  # (image sizes (height, width), turns)
    ([(50, 120)], 1),
    ([(20, 20), (40, 90)], 2),
    ([], 1),
    ([(64, 48)], 2),
]


def jpeg_rotated(image: np.ndarray[Any, Any]) -> bytes:
    """``image`` stored turned on its side with EXIF orientation 6 (displayed: ``image``)."""
    stored = Image.fromarray(image).transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", quality=95, exif=exif)
    return buffer.getvalue()


def native(key: str, sizes: list[tuple[int, int]], turns: int, seed: int) -> dict[str, Any]:
    """A native sample: the images in the first user turn, one PNG, the others EXIF JPEGs."""
    members, names = {}, []
    for index, image in enumerate(make_images(seed, sizes)):
        name = f"{index}.png" if index == 0 else f"{index}.jpg"
        members[name] = png_bytes(image) if index == 0 else jpeg_rotated(image)
        names.append(name)
    turns_out = []
    for turn in range(turns):
        question = "<image>" * (len(sizes) if turn == 0 else 0) + f"What is shown here? {turn}"
        turns_out.append({"from": "human", "value": question})
        turns_out.append({"from": "gpt", "value": f"The quick brown fox {turn}."})
    body = {"conversations": turns_out, "media": names}
    return {"__key__": key, "json": json.dumps(body).encode(), **members}


def reference(processor: Any, sample: dict[str, Any]) -> dict[str, Any]:
    """The processor's own outputs for ``sample``: its chat template on the same messages,
    the images decoded and EXIF-transposed as ``datasets`` does."""
    body = json.loads(sample["json"])
    messages = []
    for turn in body["conversations"]:
        text = turn["value"]
        role = "user" if turn["from"] == "human" else "assistant"
        if "<image>" in text:
            parts: Any = [{"type": "image"}] * text.count("<image>")
            parts.append({"type": "text", "text": text.replace("<image>", "")})
            messages.append({"role": role, "content": parts})
        else:
            messages.append({"role": role, "content": [{"type": "text", "text": text}]})
    images = [
        ImageOps.exif_transpose(Image.open(io.BytesIO(sample[name]))).convert("RGB")
        for name in body["media"]
    ]
    text = processor.apply_chat_template(messages, tokenize=False)
    out: dict[str, Any] = processor(
        text=[text], images=[images] if images else None, return_tensors="pt"
    )
    return out


def alone(processor: Any, family: ProcessorFamily, batch: list[dict[str, Any]]) -> list[Any]:
    """Each sample's model inputs by itself: the processor's own outputs, with the encoder's
    assistant mask as unshifted labels (the first one -100)."""
    encoder = ProcessorEncoder(family)
    out = []
    for sample in batch:
        encoded = encoder.encode_sample(sample["__key__"], sample)
        labels = torch.where(encoded.loss_mask.bool(), encoded.input_ids, IGNORE)
        labels[0] = IGNORE
        out.append({**reference(processor, sample), "labels": labels[None]})
    return out


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, Any, ProcessorFamily]:
    processor = CASES[request.param].processor()
    family = model_family(processor)
    assert isinstance(family, ProcessorFamily)
    return request.param, processor, family


def samples() -> list[dict[str, Any]]:
    return [native(f"s{i}", sizes, turns, i) for i, (sizes, turns) in enumerate(SAMPLES)]


def test_encoder_equals_the_processor(case: tuple[str, Any, ProcessorFamily]) -> None:
    name, processor, family = case
    encoder = ProcessorEncoder(family)
    for sample in samples():
        encoded = encoder.encode_sample(sample["__key__"], sample)
        want = reference(processor, sample)
        assert encoded.input_ids.tolist() == want["input_ids"][0].tolist(), (
            name,
            sample["__key__"],
        )
        replies = processor.tokenizer.decode(encoded.input_ids[encoded.loss_mask.bool()])
        assert "The quick brown fox 0." in replies
        assert "What is shown" not in replies
        vision = torch.isin(encoded.input_ids, torch.tensor(sorted(family.vision_token_ids)))
        assert sum(m.tokens for m in encoded.media) == int(vision.sum())
        assert [m.size for m in encoded.media] == list(SAMPLES[int(sample["__key__"][1:])][0])


def test_saved_directory_gives_the_same_family(
    case: tuple[str, Any, ProcessorFamily], tmp_path: Path
) -> None:
    name, processor, family = case
    if name not in SAVABLE:
        pytest.skip(f"{name}'s processor saves or loads only with torchvision")
    processor.save_pretrained(tmp_path)
    loaded = model_family(tmp_path)
    assert isinstance(loaded, type(family))
    assert loaded.settings() == family.settings()
    sizes = [(50, 120), (7, 300)]
    assert loaded.expansions(sizes) == family.expansions(sizes)


@pytest.mark.parametrize("name", sorted(SAVABLE))
def test_the_tokenizer_saved_with_the_processor_is_the_processors(
    name: str, tmp_path: Path
) -> None:
    """``make_encoder(tokenizer, family=DIR)``, the call a user writes first, with the tokenizer
    loaded from the same directory: it encodes as ``make_encoder(family=DIR)``. A tokenizer
    that differs (another vocabulary, another chat template) is refused, naming the fix."""
    from transformers import AutoTokenizer

    CASES[name].processor().save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    family = model_family(tmp_path)
    assert tokenizer is not family.tokenizer
    theirs, ours = make_encoder(family=tmp_path), make_encoder(tokenizer, family=tmp_path)
    for sample in samples():
        key = sample["__key__"]
        want, got = theirs.encode_sample(key, sample), ours.encode_sample(key, sample)
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.loss_mask, want.loss_mask)
    other = CASES["gemma3" if name != "gemma3" else "idefics3"].processor().tokenizer
    with pytest.raises(ValueError, match="differs from it"):
        make_encoder(other, family=tmp_path)
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="chat template"):
        make_encoder(tokenizer, family=tmp_path)


RELOAD_SIZES = [(50, 120), (64, 48), (300, 20)]
"""Image sizes (height, width) the saved and the reloaded processor's families process."""
RELOAD_TOLERANCE = {"gemma3": 4 / 255 + 1e-6, "idefics3": 22 / 255 + 1e-6}
"""Largest |difference| between the pixels (normalised to [-1, 1]) of the PIL and the torchvision
image processor on :data:`RELOAD_SIZES`: measured one 8-bit level (Gemma 3) and ten (Idefics3,
whose resizes differ more); one level more is allowed (a level is 2/255 here)."""


def saved_and_reloaded(names: list[str]) -> dict[str, dict[str, Any]]:
    """Run where torchvision imports (:func:`torchvision_child.run_in_child`): each family of
    ``names`` built from its processor and from that processor's saved directory, with the
    image processor class of each, whether their settings and expansions agree, and the largest
    pixel difference between them on :data:`RELOAD_SIZES`."""
    out: dict[str, dict[str, Any]] = {}
    images = make_images(7, RELOAD_SIZES)
    for name in names:
        processor = CASES[name].processor()
        family = model_family(processor)
        with tempfile.TemporaryDirectory() as saved:
            processor.save_pretrained(saved)
            loaded = model_family(Path(saved))
        assert isinstance(loaded, ProcessorFamily)
        ours, theirs = family.media_inputs(images), loaded.media_inputs(images)
        out[name] = {
            "saved": type(processor.image_processor).__name__,
            "reloaded": type(loaded.processor.image_processor).__name__,
            "settings": loaded.settings() == family.settings(),
            "expansions": loaded.expansions(RELOAD_SIZES) == family.expansions(RELOAD_SIZES),
            "shapes": {k: (tuple(v.shape), tuple(theirs[k].shape)) for k, v in ours.items()},
            "worst": max(
                float((v.double() - theirs[k].double()).abs().max()) for k, v in ours.items()
            ),
        }
    return out


@pytest.mark.skipif(not available(), reason="the reference torchvision is not installed")
def test_a_saved_directory_reloads_with_torchvision_where_it_imports() -> None:
    """Where torchvision imports, transformers (5.24 and 5.25 alike) reloads a saved PIL image
    processor with its torchvision backend; the directory's family is that processor's: the
    saved one's settings and token expansions, the same pixel shapes, pixels that differ only
    by the two backends' resizing (:data:`RELOAD_TOLERANCE`)."""
    results = run_in_child("test_processor_families:saved_and_reloaded", sorted(SAVABLE))
    results.pop("child_seconds")
    assert sorted(results) == sorted(SAVABLE)
    for name, found in results.items():
        assert found["saved"].endswith("Pil"), (name, found)
        assert found["reloaded"] == found["saved"].removesuffix("Pil"), (name, found)
        assert found["settings"], name
        assert found["expansions"], name
        assert all(ours == theirs for ours, theirs in found["shapes"].values()), (name, found)
        assert found["worst"] <= RELOAD_TOLERANCE[name], (name, found["worst"])


def test_collated_row_trains_like_its_samples(case: tuple[str, Any, ProcessorFamily]) -> None:
    name, processor, family = case
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CASES[name].model(processor).double().train()
    collator = VLMPackingCollator(seq_length=4096, family=family, output="hf", hf_model=model)
    batch = samples()
    packed = collator(batch)
    packed.pop("use_cache")
    loss_error, worst = packed_matches_alone(model, alone(processor, family, batch), packed)
    assert loss_error < 1e-6, loss_error
    assert worst < CASES[name].gradient_rtol, worst


def test_an_image_that_no_longer_decodes_is_skipped_by_name(
    case: tuple[str, Any, ProcessorFamily],
) -> None:
    _, _, family = case
    good, broken = samples()[0], samples()[3]
    broken["0.png"] = broken["0.png"][:200]  # the header survives, the pixels do not
    collator = VLMPackingCollator(seq_length=4096, family=family, on_media_error="skip")
    batch = collator([good, broken])
    assert batch.skipped_keys == ("s3",)
    assert batch.keys == (("s0",),)
    strict = VLMPackingCollator(seq_length=4096, family=family)
    with pytest.raises(MediaError, match="s3"):
        strict([good, broken])


def test_inputs_built_by_the_model_are_never_left_out() -> None:
    """A family whose rows need the model's masks or positions: the batch form refuses to give
    model inputs without the model and the family, and the ``hf`` form needs the model; the
    Energon path takes the family (its batches build them in the training step:
    ``tests/energon/test_energon_model_built.py``)."""
    processor = CASES["gemma3"].processor()
    family = model_family(processor)
    batch = VLMPackingCollator(seq_length=4096, family=family)(samples()[:2])
    with pytest.raises(ValueError, match="block_mask"):
        batch.hf_model_inputs()
    with pytest.raises(ValueError, match="hf_model"):
        VLMPackingCollator(seq_length=4096, family=family, output="hf")
    encoder = PackingTaskEncoder(seq_length=4096, family=processor)
    assert isinstance(encoder.family, ProcessorFamily)
    assert encoder.family.packing == "block_mask"


def test_a_processor_of_no_family_is_refused_by_name() -> None:
    from transformers import ChameleonProcessor

    with pytest.raises(ValueError, match=r"ChameleonProcessor.*Gemma3Processor"):
        model_family(ChameleonProcessor.__new__(ChameleonProcessor))


def test_the_cli_takes_a_saved_processor_directory(
    vlm_demo_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``check-config`` shows the family of a saved processor; ``tune`` packs the demo dataset
    with it (the processor's tokenizer, its videos counted as unsupported skips)."""
    from energon_pack.cli import main

    saved = tmp_path / "smolvlm-like"
    CASES["idefics3"].processor().save_pretrained(saved)
    assert main(["check-config", "--seq-length", "4096", "--family", str(saved)]) == 0
    assert "idefics3 (through Idefics3Processor)" in capsys.readouterr().out
    out = tmp_path / "tune"
    command = ["tune", str(vlm_demo_path), "--family", str(saved), "--buffer-sizes", "8"]
    command += ["--seq-length", "8192", "--num-workers", "1", "--max-samples", "40"]
    assert main([*command, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "tokenizer the idefics3 processor's (" in printed
    assert "model family: idefics3" in printed
    report = json.loads((out / "tune.json").read_text())
    assert report["tokenizer"]["encoding"] == "processor"
    (run,) = report["results"]
    assert run["samples"] >= 40
    assert set(run["skipped"]) == {"unsupported"}  # the demo's videos, counted
    assert main([*command, "--pixel-dtype", "uint8", "--out", str(out)]) == 2
    assert "--pixel-dtype uint8 with the 'idefics3' family" in capsys.readouterr().err


def test_an_image_its_processor_refuses_is_a_counted_skip() -> None:
    """GLM-4V's processor refuses an aspect ratio over 200: the sample is skipped by name
    (or raised with on_media_error="error"), the others packed."""
    family = model_family(CASES["glm4v"].processor())
    narrow = native("narrow", [(2, 600)], 1, 0)
    collator = VLMPackingCollator(seq_length=4096, family=family, on_media_error="skip")
    batch = collator([samples()[0], narrow])
    assert batch.skipped_keys == ("narrow",)
    with pytest.raises(MediaError, match=r"narrow.*aspect ratio"):
        VLMPackingCollator(seq_length=4096, family=family)([narrow])


def test_a_family_that_refuses_packing_gets_one_sample_per_row() -> None:
    """A family whose packed rows would not train exactly (``packing = "refused"``) is refused
    by name unless each row holds one sample."""
    from energon_pack.encoding.families.internvl import InternVLFamily

    class Unpackable(InternVLFamily):
        packing = "refused"
        refusal = "its vision tower attends across images"

    family = Unpackable(CASES["internvl"].processor())
    with pytest.raises(ValueError, match="attends across images"):
        VLMPackingCollator(seq_length=4096, family=family)
    with pytest.raises(ValueError, match="attends across images"):
        PackingTaskEncoder(seq_length=4096, family=family)
    one = VLMPackingCollator(
        seq_length=4096, family=family, max_segments=1, pad_cu_seqlens=True, pad_to_max_length=True
    )
    batch = one(samples()[:2])
    assert batch.keys == (("s0",), ("s1",))


def test_several_rows_train_like_their_samples(case: tuple[str, Any, ProcessorFamily]) -> None:
    """With fixed-width rows a micro-batch that does not fit one row is split; the rows'
    joined media and ``[R, T]`` inputs still train exactly like the samples alone."""
    name, processor, family = case
    torch.manual_seed(0)
    model = CASES[name].model(processor).double().train()
    batch = samples()
    encoder = make_encoder(family=family)
    encoded = [encoder.encode_sample(s["__key__"], s) for s in batch]
    width = max(e.length for e in encoded) + 8
    collator = VLMPackingCollator(
        seq_length=width, pad_to_max_length=True, family=family, output="hf", hf_model=model
    )
    packed = collator(batch)
    assert packed["input_ids"].shape[0] > 1, "the micro-batch must need several rows"
    packed.pop("use_cache")
    loss_error, worst = packed_matches_alone(model, alone(processor, family, batch), packed)
    assert loss_error < 1e-6, loss_error
    assert worst < CASES[name].gradient_rtol, worst
