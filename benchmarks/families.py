"""Processor families: what serving a sample through energon_pack costs against the family's
own processor call, and what the header probe costs against a decode.

For each family, a processor with its released checkpoints' image settings (built locally by
the test suite's builders: a small tokenizer, the real transformers classes) and JPEG images of
three sizes. Per image, interleaved in each round:

* processor: the chat template rendered, the image decoded (Pillow, EXIF-transposed, RGB),
  ``processor(text=[rendered], images=[[image]])``: what a user's pipeline runs per sample;
* energon_pack: the family's encoder on the native sample (header probe, template, tokens) +
  the pack's materialisation (decode in the guarded helper process + the processor's media
  outputs), and the same with ``decode_isolation="off"`` (decoded in this process);
* probe: the header size read alone, against the guarded decode alone.

Then, per family, the collator's packed ``output="hf"`` row of four samples (1, 2, 0 and 1
images) on the family's tiny float64 model against the samples alone through the processor's
own outputs (``tests/encoding/test_processor_families.py``): the relative error of the summed
loss and the worst relative gradient error over all parameters. Gemma 3n's tiny model needs
timm (and so torchvision): its packed figures come from ``tests/encoding/test_family_gemma3n.py``
in the torchvision child, "(child)" here.

Reports the median of the per-round ratios. Torch runs on one thread.

Usage: python benchmarks/families.py [--rounds 7] [--out results/families.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

ROOT = Path(__file__).resolve().parent.parent
# The family tests' builders (tests/encoding) and the shared test helpers (tests/support).
sys.path[:0] = [str(ROOT / "tests" / "encoding"), str(ROOT / "tests" / "support")]

import test_family_gemma3 as gemma3  # noqa: E402
import test_family_gemma3n as gemma3n  # noqa: E402
import test_family_gemma4 as gemma4  # noqa: E402
import test_family_glm4v as glm4v  # noqa: E402
import test_family_idefics3 as idefics3  # noqa: E402
import test_family_internvl as internvl  # noqa: E402
import test_family_llava_onevision as llava_onevision  # noqa: E402
import test_family_pixtral as pixtral  # noqa: E402
import test_processor_families as parity  # noqa: E402
from family_kit import packed_matches_alone  # noqa: E402

from energon_pack import MediaConfig, VLMPackingCollator, make_encoder, model_family  # noqa: E402
from energon_pack.cli.tables import format_table  # noqa: E402
from energon_pack.encoding.families import ProcessorFamily  # noqa: E402
from energon_pack.encoding.families.materialise import sample_media  # noqa: E402
from energon_pack.media.displayed import displayed_image_size, displayed_images  # noqa: E402

PROCESSORS: dict[str, Callable[[], Any]] = {
    "gemma3": lambda: gemma3.make_processor(size=896, seq=256),
    "gemma3n": lambda: gemma3n.processor(256, 188, 128, 768),
    "gemma4": gemma4.build,
    "glm4v": glm4v.make_processor,
    "idefics3": lambda: idefics3.processor("idefics3", 169),
    "internvl": lambda: internvl.make_processor(
        256, size={"height": 448, "width": 448}, max_patches=12
    ),
    "llava_onevision": llava_onevision.released,
    "pixtral": lambda: pixtral.processor(14, 2, 1540),
}
"""Each family's processor with the released checkpoints' image settings."""
PACKED_IN_CHILD = ("gemma3n",)
"""Families whose tiny model needs torchvision (timm), which this process never imports: their
packed figures are those of their family test, run in the torchvision child."""
SIZES = [(480, 640), (720, 1280), (1024, 512)]
MEDIA = MediaConfig()
IN_PROCESS = MediaConfig(decode_isolation="off")


def jpeg(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y = np.linspace(0, 255, height)[:, None, None]
    x = np.linspace(0, 255, width)[None, :, None]
    pixels = ((y * 0.7 + x * 0.4 + rng.integers(0, 40, (height, width, 3))) % 256).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def native(data: bytes) -> dict[str, Any]:
    turns = [
        {"from": "human", "value": "<image>Describe the image in detail."},
        {"from": "gpt", "value": "The quick brown fox jumps over the lazy dog."},
    ]
    return {
        "json": json.dumps({"conversations": turns, "media": ["0.jpg"]}).encode(),
        "0.jpg": data,
    }


def messages() -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "Describe the image in detail."},
            ],
        },
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "The quick brown fox jumps over the lazy dog."}],
        },
    ]


def decoded_alone(data: bytes) -> None:
    height, width = displayed_image_size(data, MEDIA)
    displayed_images([("s", "0.jpg", data, (height, width), 0)], MEDIA)


def timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def ratio(ours: Callable[[], Any], theirs: Callable[[], Any], index: int) -> float:
    """``time(ours) / time(theirs)``, run in the order that alternates with ``index``."""
    if index % 2:
        reference = timed(theirs)
        return timed(ours) / reference
    own = timed(ours)
    return own / timed(theirs)


def measure(name: str, rounds: int) -> dict[str, Any]:
    processor = PROCESSORS[name]()
    family = model_family(processor)
    assert isinstance(family, ProcessorFamily)
    encoder = make_encoder(processor.tokenizer, family=family)
    images = [jpeg(h, w, seed) for seed, (h, w) in enumerate(SIZES)]

    def reference(data: bytes) -> None:
        rendered = processor.apply_chat_template(messages(), tokenize=False)
        image = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        processor(text=[rendered], images=[[image]], return_tensors="pt")

    def ours(data: bytes, media: MediaConfig = MEDIA) -> None:
        encoded = encoder.encode_sample("s", native(data))
        sample_media(family, encoded, media, 0)

    for data in images:  # warm-up: the helper process, caches
        reference(data)
        ours(data)
    serve, unguarded, probe = [], [], []
    for index in range(rounds):
        for data in images:
            serve.append(ratio(partial(ours, data), partial(reference, data), index))
            in_process = partial(ours, data, IN_PROCESS)
            unguarded.append(ratio(in_process, partial(reference, data), index))
            head = partial(displayed_image_size, data, MEDIA)
            probe.append(ratio(head, partial(decoded_alone, data), index))
    tokens = [family.image_tokens([size])[0] for size in SIZES]
    return {
        "family": name,
        "processor": type(processor).__name__,
        "image_tokens": tokens,
        "serve_ratio": statistics.median(serve),
        "unguarded_ratio": statistics.median(unguarded),
        "probe_ratio": statistics.median(probe),
    }


def packed_errors(name: str) -> tuple[float, float]:
    """(loss, worst gradient) relative errors of the collated row against its samples alone."""
    case = parity.CASES[name]
    processor = case.processor()
    family = model_family(processor)
    assert isinstance(family, ProcessorFamily)
    torch.manual_seed(0)
    model = case.model(processor).double().train()
    batch = parity.samples()
    collate = VLMPackingCollator(seq_length=4096, family=family, output="hf", hf_model=model)
    packed = collate(batch)
    assert isinstance(packed, dict)  # output="hf"
    packed.pop("use_cache")
    alone = parity.alone(processor, family, batch)
    return packed_matches_alone(model, alone, packed, rtol=1.0, tensor_rtol=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--families", default=",".join(PROCESSORS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "families.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = [measure(name, args.rounds) for name in args.families.split(",")]
    for result in results:
        if result["family"] in PACKED_IN_CHILD:
            result["packed_loss_error"] = result["packed_gradient_error"] = None
            continue
        result["packed_loss_error"], result["packed_gradient_error"] = packed_errors(
            result["family"]
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"rounds": args.rounds, "sizes": SIZES, "results": results}, indent=2) + "\n"
    )
    sizes = ", ".join(f"{h}x{w}" for h, w in SIZES)
    print(
        format_table(
            [
                "family",
                "processor",
                f"tokens ({sizes})",
                "energon_pack / processor",
                "same, decode_isolation='off'",
                "probe / decode",
                "packed loss error",
                "worst gradient error",
            ],
            [
                [
                    r["family"],
                    r["processor"],
                    " / ".join(map(str, r["image_tokens"])),
                    f"{r['serve_ratio']:.3f}",
                    f"{r['unguarded_ratio']:.3f}",
                    f"{r['probe_ratio']:.4f}",
                    _error(r["packed_loss_error"]),
                    _error(r["packed_gradient_error"]),
                ]
                for r in results
            ],
        )
    )


def _error(value: float | None) -> str:
    return "(child)" if value is None else f"{value:.1e}"


if __name__ == "__main__":
    main()
