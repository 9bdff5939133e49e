"""Token parity sweep: the template encoder vs transformers on many conversations, per template.

For each released Qwen template (``tests/support/chat_templates.py``: Qwen2-VL,
Qwen2.5-Instruct, Qwen3, Qwen3-VL) and Qwen's real tokenizer (``tests/support/real_qwen.py``),
every conversation is encoded by :class:`~energon_pack.TemplateEncoder` from one of the
project's input forms (chat row, ShareGPT row, native ``json`` member, in turn) and compared
with the reference of ``tests/support/template_reference.py``: ``apply_chat_template`` with the
template's generation-marked variant (same text; checked here for every conversation) plus
Qwen2-VL's processor expansion of image blocks.

Conversations: ``--generated N`` seeded ones from ``tests/support/chat_corpus.py`` (real text
from the Python documentation; system prompts, multi-turn, think blocks, tool use; with the VL
templates about a third carry an image), plus every conversation of the ``--data`` files: JSON
lists of ``{"instruction", "input", "response"}`` records (GPTeacher's layout) or of
``{"conversations": [{"from", "value"}, ...]}`` (ShareGPT / FastChat); with the VL templates
every tenth of them gets an image before its first question.

Prints a table (equal ids, equal masks per template) and writes
benchmarks/results/template_parity.json; exits 1 on any difference.
Run: .venv/bin/python benchmarks/template_parity.py [--generated 10000] [--data FILE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the shared test helpers

from chat_corpus import Case, cases  # noqa: E402
from chat_templates import MARKED, RELEASED  # noqa: E402
from helpers import SMALL_MEDIA, image_bytes  # noqa: E402
from real_qwen import real_qwen_tokenizer  # noqa: E402
from template_reference import processor_for, reference  # noqa: E402

from energon_pack.cli.tables import format_table  # noqa: E402
from energon_pack.encoding.template import TemplateEncoder  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "template_parity.json"
VL = ("QWEN2_VL", "QWEN3_VL")
IMAGE = image_bytes(90, 64)
FORMS = ("messages", "conversations", "json")


def load_data(path: Path) -> list[list[dict[str, Any]]]:
    """The conversations of one ``--data`` file as role/content messages."""
    records = json.loads(path.read_text(encoding="utf-8"))
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    out = []
    for record in records:
        if "conversations" in record:
            turns = [
                {"role": roles.get(t["from"], t["from"]), "content": t["value"]}
                for t in record["conversations"]
            ]
            if turns and all(t["role"] in ("user", "assistant", "system") for t in turns):
                out.append(turns)
        else:
            question = record["instruction"]
            if record.get("input"):
                question += "\n\n" + record["input"]
            out.append(
                [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": record["response"]},
                ]
            )
    return out


def data_case(index: int, messages: list[dict[str, Any]], image: bool) -> Case:
    """A data conversation in the input form of its index; with ``image``, an image part."""
    images = []
    if image:
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        parts = [{"type": "image"}, {"type": "text", "text": messages[first]["content"]}]
        messages = [*messages[:first], {"role": "user", "content": parts}, *messages[first + 1 :]]
        images = [IMAGE]

    def sharegpt(message: dict[str, Any]) -> dict[str, Any]:
        content = message["content"]
        if isinstance(content, list):
            content = "<image>" + content[1]["text"]
        return {
            "from": {"user": "human", "assistant": "gpt"}.get(message["role"], "system"),
            "value": content,
        }

    form = FORMS[index % len(FORMS)]
    if form == "json":
        names = [f"{i}.png" for i in range(len(images))]
        sample: dict[str, Any] = {
            "json": {"conversations": [sharegpt(m) for m in messages], "media": names},
            **dict(zip(names, images, strict=True)),
        }
    else:
        turns = messages if form == "messages" else [sharegpt(m) for m in messages]
        sample = {form: turns, **({"images": images} if images else {})}
    return Case(f"data-{index}", messages, None, sample, images)


def sweep(name: str, conversations: list[Case]) -> dict[str, Any]:
    tokenizer = real_qwen_tokenizer(RELEASED[name])
    processor = processor_for(tokenizer, SMALL_MEDIA)
    encoder = TemplateEncoder(tokenizer, media=SMALL_MEDIA)
    ids_equal = mask_equal = 0
    differing: list[str] = []
    start = time.perf_counter()
    for case in conversations:
        tools: list[dict[Any, Any] | Callable[..., Any]] | None = (
            None if case.tools is None else list(case.tools)
        )
        released = tokenizer.apply_chat_template(
            case.messages, tools=tools, chat_template=RELEASED[name], tokenize=False
        )
        marked = tokenizer.apply_chat_template(
            case.messages, tools=tools, chat_template=MARKED[name], tokenize=False
        )
        if released != marked:
            raise AssertionError(f"{name}: the marked template renders {case.key} differently")
        encoded = encoder.encode_sample(case.key, case.sample)
        ids, mask = reference(processor, name, case.messages, case.tools, case.images)
        same_ids = encoded.input_ids.tolist() == ids
        same_mask = same_ids and encoded.loss_mask.tolist() == mask
        ids_equal += same_ids
        mask_equal += same_mask
        if not same_mask and len(differing) < 10:
            differing.append(case.key)
    return {
        "conversations": len(conversations),
        "ids_equal": ids_equal,
        "mask_equal": mask_equal,
        "with_tools": sum(case.tools is not None for case in conversations),
        "with_images": sum(bool(case.images) for case in conversations),
        "seconds": time.perf_counter() - start,
        "differing": differing,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generated", type=int, default=10_000)
    parser.add_argument("--data", type=Path, nargs="*", default=[])
    parser.add_argument("--templates", nargs="*", default=sorted(RELEASED))
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = [m for path in args.data for m in load_data(path)]
    results = {}
    for name in args.templates:
        vl = name in VL
        conversations = cases(args.generated, seed=2026, media=vl, image=IMAGE)
        conversations += [data_case(i, m, vl and i % 10 == 0) for i, m in enumerate(data)]
        results[name] = sweep(name, conversations)
        r = results[name]
        print(f"{name}: {r['mask_equal']}/{r['conversations']} equal ({r['seconds']:.0f} s)")
    rows = [
        [
            name,
            r["conversations"],
            r["with_tools"],
            r["with_images"],
            f"{r['ids_equal']} / {r['conversations']}",
            f"{r['mask_equal']} / {r['conversations']}",
            f"{r['seconds']:.0f}",
        ]
        for name, r in results.items()
    ]
    headers = ["template", "conversations", "tools", "images", "ids equal", "ids+mask equal", "s"]
    print(format_table(headers, rows))
    print(f"generated: {args.generated} per template; data files: {[str(p) for p in args.data]}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    record = {"generated": args.generated, "data": [str(p) for p in args.data], **results}
    RESULTS.write_text(json.dumps(record, indent=1))
    if any(r["mask_equal"] != r["conversations"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
