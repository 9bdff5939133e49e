"""Online packs through Megatron-Bridge 0.6.2's own code: its sample type, datamodule and VLM step.

Runs in the Bridge test environment (``bash scripts/bridge_env.sh``, then
``.bridge-venv/bin/python -m pytest tests/bridge``); elsewhere it is skipped with the reason.
This machine has no CUDA, so ``Tensor.cuda`` (the device moves of Bridge's ``get_batch``) is a
no-op here; everything else is Bridge's code unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import SMALL_MEDIA, make_encoder, native_pack, read_samples
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

from energon_pack import BufferConfig

shims = pytest.importorskip(
    "tests.bridge.shims", reason="tests/bridge/shims.py (the Bridge import shims) is missing"
)
try:
    shims.install()
    from megatron.bridge.data.energon.base_energon_datamodule import EnergonMultiModalDataModule
    from megatron.bridge.training import vlm_step
    from megatron.bridge.training.utils.packed_seq_utils import get_packed_seq_params
    from megatron.bridge.training.utils.visual_inputs import GenericVisualInputs
    from megatron.core.packed_seq_params import PackedSeqParams
except ImportError as error:
    how = "" if "bridge_env.sh" in str(error) else "; build it with bash scripts/bridge_env.sh"
    pytest.skip(f"Megatron-Bridge is not importable: {error}{how}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = ROOT / "fixtures" / "bridge_layouts"
PARAM_FIELDS = (
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
    "qkv_format",
)


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bridge's ``get_batch`` moves tensors with ``.cuda()``; here they stay on the CPU."""
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)


def bridge_step_inputs(batch: dict[str, Any]) -> tuple[Any, ...]:
    """What Bridge's ``vlm_step.get_batch`` returns for ``batch`` (one pipeline stage)."""
    cfg = SimpleNamespace(dataset=SimpleNamespace())
    return vlm_step.get_batch(iter([batch]), cfg, pg_collection=SimpleNamespace(pp=None))  # type: ignore[no-any-return]


def loader(path: Path, workers: int, **overrides: Any) -> Iterator[Any]:
    """Our encoder over ``path`` as its ``dataset.yaml`` declares it (Bridge's
    ``ChatMLWebdataset``), one epoch."""
    dataset = get_train_dataset(
        path,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
        batch_size=1,
        packing_buffer_size=4,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=make_encoder(**overrides),
        repeat=False,
    )
    return iter(get_savable_loader(dataset))


def assert_same_params(got: Any, want: Any) -> None:
    for name in PARAM_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), name
            assert a.dtype == b.dtype, name
            assert torch.equal(a, b), name
        else:
            assert a == b, name


def test_every_batch_goes_through_bridges_vlm_step_with_two_workers() -> None:
    path = LAYOUTS / "mantis"
    bounded = BufferConfig(min_rows=None)  # four samples a pack: several packs per worker
    plain = list(loader(path, 2, buffer=bounded))
    bridged = list(loader(path, 2, output="bridge", buffer=bounded))
    assert len(plain) == len(bridged) >= 3
    for ours, batch in zip(plain, bridged, strict=True):
        tokens, labels, loss_mask, attention, positions, params, visual = bridge_step_inputs(batch)
        assert torch.equal(tokens, ours.input_ids)
        assert torch.equal(labels, ours.labels)
        assert torch.equal(loss_mask, ours.loss_mask)
        assert torch.equal(positions, ours.position_ids)
        assert attention is None
        want = PackedSeqParams(**ours.row().to_packed_seq_params_kwargs())
        assert_same_params(get_packed_seq_params(params), want)
        assert isinstance(visual, GenericVisualInputs)
        kwargs = visual.normalized_for_model()
        assert set(kwargs) == {k for k, v in ours.media().items() if v is not None}
        for name, value in kwargs.items():
            assert torch.equal(value, getattr(ours, name)), name


@pytest.mark.parametrize("layout", ["mantis", "tutorial", "llava", "text"])
def test_chatml_webdataset_layouts_read_as_they_are(layout: str, vlm_demo_path: Path) -> None:
    """The fixture's ``dataset.yaml`` names Bridge's ``ChatMLWebdataset`` with its field_map."""
    path = LAYOUTS / layout
    assert "ChatMLWebdataset" in (path / ".nv-meta" / "dataset.yaml").read_text()
    native = read_samples(vlm_demo_path)
    seen: list[str] = []
    stats = None
    for batch in loader(path, 0):
        keys = list(batch.__keys__)
        seen += keys
        stats = batch.packing_stats
        expected = native_pack(native, keys, SMALL_MEDIA)
        assert torch.equal(batch.input_ids[0], expected.row.input_ids), keys
        assert torch.equal(batch.labels[0], expected.row.labels), keys
        if expected.vision.pixel_values is not None:
            assert torch.equal(batch.pixel_values, expected.vision.pixel_values), keys
    assert sorted(seen) == sorted(read_samples(path))
    assert len(seen) == len(set(seen))
    assert stats is not None
    assert dict(stats.skipped) == {}


def test_bridges_datamodule_takes_the_encoder() -> None:
    encoder = make_encoder(output="bridge")
    datamodule = EnergonMultiModalDataModule(
        path=str(LAYOUTS / "llava"),
        tokenizer=None,
        seq_length=8192,
        micro_batch_size=1,
        num_workers=2,
        task_encoder=encoder,
        packing_buffer_size=4,
        shuffle_buffer_size=1,
    )
    batches = datamodule.train_dataloader()
    for _ in range(6):
        batch = next(batches)
        tokens, *_, params, visual = bridge_step_inputs(batch)
        assert tokens.shape[0] == 1
        packed = get_packed_seq_params(params)
        assert int(packed.cu_seqlens_q_padded[-1]) == tokens.shape[1]
        assert packed.max_seqlen_q == int(batch["max_seqlen_q"])
        assert isinstance(visual, GenericVisualInputs)


def test_the_docs_bridge_quick_start_runs_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block of docs/quickstart/bridge.md that the main suite skips ("needs Megatron-Bridge")
    runs here, as written."""
    page = ROOT / "docs" / "quickstart" / "bridge.md"
    section = page.read_text().split("## Train with Bridge", 1)[1]
    code = re.search(r"<!-- skip: next [^>]*-->\n```python\n(.*?)```", section, re.S)
    assert code is not None
    monkeypatch.chdir(ROOT)
    scope: dict[str, Any] = {}
    exec(compile(code.group(1), str(page), "exec"), scope)
    batch = scope["batch"]
    assert isinstance(batch["visual_inputs"], GenericVisualInputs)
    tokens, *_ = bridge_step_inputs(batch)
    assert torch.equal(tokens, batch["input_ids"])
    assert (scope["valid"], scope["test"]) == (None, None)
    assert next(scope["train"])["max_seqlen_q"].dtype == torch.int32


def test_the_fallback_visual_inputs_have_bridges_fields() -> None:
    from dataclasses import fields

    from energon_pack.train.bridge import BridgeVisualInputs

    ours_fields = [f.name for f in fields(BridgeVisualInputs)]
    assert ours_fields == [f.name for f in fields(GenericVisualInputs)]
    pixels = torch.ones(2, 3, 4, 1, 1)
    ours = BridgeVisualInputs(pixel_values=pixels).normalized_for_model()
    theirs = GenericVisualInputs(pixel_values=pixels).normalized_for_model()
    assert ours.keys() == theirs.keys()
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])


def test_declarative_energon_config_refuses_our_encoder() -> None:
    """Why the quick start goes through the datamodule (as docs/quickstart/bridge.md says)."""
    from megatron.bridge.data.builders.energon import EnergonDatasetConfig

    config = EnergonDatasetConfig(
        path=str(LAYOUTS / "mantis"),
        seq_length=8192,
        micro_batch_size=1,
        task_encoder=make_encoder(output="bridge"),  # type: ignore[arg-type]
    )
    with pytest.raises(TypeError, match="declarative Energon task-encoder config"):
        config.validate()


def test_a_decoded_chatml_sample_is_refused_by_name() -> None:
    """A ``ChatMLSample`` whose dataset kept Bridge's own decoder (images as tensors)."""
    from megatron.bridge.data.energon.task_encoder_utils import ChatMLSample

    from energon_pack.formats.energon_types import typed_sample_row
    from energon_pack.media import MediaError

    turns = '[{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "red"}]'
    decoded = ChatMLSample(
        __key__="k", __restore_key__=(), conversation=turns, imgs=[torch.zeros(3, 8, 8)]
    )
    with pytest.raises(MediaError, match=r"ChatMLSample.imgs arrived decoded \(list\)") as error:
        typed_sample_row(decoded)
    assert error.value.kind == "unsupported"
    voice = ChatMLSample(__key__="k", __restore_key__=(), conversation=turns, audio=torch.zeros(4))
    with pytest.raises(MediaError, match=r"ChatMLSample.audio is not read"):
        typed_sample_row(voice)
