"""The README's transformers quick starts run as written.

The Python blocks of the section run in order in one namespace that holds only what the text
says the reader brings: a Qwen2.5-VL ``model`` and its ``processor`` (tiny, from config), plus,
for the accumulation loop, a ``collate`` with ``output="batch"``, one ``step`` of micro-batches
and a one-process ``torch.distributed`` group.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hf_qwen import qwen_processor
from test_trainers import TOKENIZER, model_for

from energon_pack import ConversationEncoder, MediaConfig, MRopeConfig, VLMPackingCollator

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "## Quick start: transformers"


def section_blocks() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.DOTALL)


def test_the_transformers_quick_starts_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = section_blocks()
    assert sum("trainer.train()" in block for block in blocks) == 3
    monkeypatch.chdir(tmp_path)
    model = model_for("qwen2_5_vl")
    processor = qwen_processor(TOKENIZER, MediaConfig())
    # The test's processor has no video processor (it needs torchvision), which saving needs.
    monkeypatch.setattr(processor, "save_pretrained", lambda *args, **kwargs: None)
    namespace: dict[str, object] = {"model": model, "processor": processor}
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        for block in blocks:
            if "all_reduce" in block:
                rows = namespace["rows"]
                batches = VLMPackingCollator(
                    8192,
                    encoder=ConversationEncoder(TOKENIZER),
                    position_ids="mrope",
                    mrope=MRopeConfig.from_tokenizer(TOKENIZER, tokens_per_second=2),
                )
                namespace.update(collate=batches, step=[[rows[0], rows[1]], [rows[2], rows[3]]])
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            exec(compile(block, str(README), "exec"), namespace)
            if "trainer.train()" in block:
                trainer = namespace["trainer"]
                assert trainer.state.global_step == 3  # type: ignore[attr-defined]
                changed = any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
                assert changed
            if "all_reduce" in block:
                assert torch.isfinite(namespace["loss"].detach())  # type: ignore[union-attr]
                assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    finally:
        dist.destroy_process_group()
