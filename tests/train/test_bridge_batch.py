"""The batch dict of Megatron-Bridge's VLM step (``output="bridge"``, ``to_bridge_batch``).

Bridge's ``vlm_step.get_batch`` moves ``input_ids``, ``labels``, ``loss_mask``,
``position_ids``, the ``cu_seqlens*`` tensors and the ``visual_inputs`` fields to the device,
reads ``max_seqlen_q/kv`` on the host (``.cpu()``, so they must be tensors) and builds
``PackedSeqParams`` from the ``cu_seqlens*`` / ``max_seqlen*`` keys. These tests hold the dict to
that contract without Bridge; ``tests/bridge`` runs Bridge's own code on it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SMALL_MEDIA, assert_resume_equivalent, make_encoder, savable_loader
from hypothesis import given, settings
from hypothesis import strategies as st
from megatron.energon import WorkerConfig, get_train_dataset

from energon_pack import BufferConfig, PackedBatch, PackingTaskEncoder, RowLayout, build_packed_row
from energon_pack.train.bridge import BRIDGE_BATCH_KEYS, BridgeVisualInputs, bridge_batch

MANTIS = Path(__file__).resolve().parents[2] / "fixtures" / "bridge_layouts" / "mantis"
PACKED_SEQ_KEYS = (
    "cu_seqlens_q",
    "cu_seqlens_kv",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
)


def loader(encoder: PackingTaskEncoder, workers: int = 0, *, repeat: bool = False) -> Any:
    dataset = get_train_dataset(
        MANTIS,
        dataset_config="crude.yaml",
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
        batch_size=1,
        packing_buffer_size=4,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        task_encoder=encoder,
        repeat=repeat,
    )
    return savable_loader(dataset, checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)


def packed_seq_params_fields(batch: dict[str, Any]) -> dict[str, Any]:
    """What Bridge's ``get_packed_seq_params`` makes of the batch, field by field: tensors
    squeezed, ``max_seqlen*`` as Python ints."""
    out: dict[str, Any] = {}
    for key in PACKED_SEQ_KEYS:
        value = batch[key].cpu() if key.startswith("max") else batch[key]
        out[key] = int(value.item()) if key.startswith("max") else value.squeeze()
    return out


@pytest.fixture(scope="module")
def pairs() -> list[tuple[PackedBatch, dict[str, Any]]]:
    """Each pack of the Mantis fixture as a PackedBatch and as Bridge's dict."""
    bounded = BufferConfig(min_rows=None)  # four samples a pack: several packs
    plain = list(loader(make_encoder(buffer=bounded)))
    bridged = list(loader(make_encoder(output="bridge", buffer=bounded)))
    assert len(plain) == len(bridged) >= 3
    return list(zip(plain, bridged, strict=True))


def test_bridge_dict_holds_every_key_bridge_reads(
    pairs: list[tuple[PackedBatch, dict[str, Any]]],
) -> None:
    for plain, batch in pairs:
        assert isinstance(batch, dict)
        assert set(BRIDGE_BATCH_KEYS) <= set(batch)
        for name in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert torch.equal(batch[name], getattr(plain, name)), name
            assert batch[name].shape == (1, plain.input_ids.shape[1])
        assert batch["attention_mask"] is None
        assert batch["__keys__"] == plain.__keys__
        assert batch["__key__"] == plain.__key__
        assert batch["packing_stats"] == plain.packing_stats


def test_max_seqlen_are_0d_int32_tensors(pairs: list[tuple[PackedBatch, dict[str, Any]]]) -> None:
    for plain, batch in pairs:
        for key in ("max_seqlen_q", "max_seqlen_kv"):
            value = batch[key]
            assert isinstance(value, torch.Tensor), key
            assert value.dim() == 0, key
            assert value.dtype == torch.int32
            assert int(value) == plain.max_seqlen


def test_packed_seq_params_equal_the_rows_on_every_field(
    pairs: list[tuple[PackedBatch, dict[str, Any]]],
) -> None:
    for plain, batch in pairs:
        ours = plain.row().to_packed_seq_params_kwargs()
        fields = packed_seq_params_fields(batch)
        for key, value in fields.items():
            want = ours[key]
            if isinstance(want, torch.Tensor):
                assert value.dtype == torch.int32, key
                assert torch.equal(value, want), key
            else:
                assert value == want, key
    # pad_to_multiple_of=8: the real and physical boundaries differ, so a swap would show
    assert any(not torch.equal(p.cu_seqlens, p.cu_seqlens_padded) for p, _ in pairs)


def test_visual_inputs_carry_the_media_in_segment_order(
    pairs: list[tuple[PackedBatch, dict[str, Any]]],
) -> None:
    for plain, batch in pairs:
        visual = batch["visual_inputs"]
        assert isinstance(visual, BridgeVisualInputs)  # Bridge is not importable here
        kwargs = visual.normalized_for_model()
        assert set(kwargs) == {k for k, v in plain.media().items() if v is not None}
        for name, value in kwargs.items():
            assert torch.equal(value, getattr(plain, name)), name
        assert kwargs["pixel_values"].dtype == torch.float32


def test_normalized_for_model_flattens_batched_media() -> None:
    pixels = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4, 1, 1)
    grids = torch.ones(2, 3, 3, dtype=torch.long)
    kwargs = BridgeVisualInputs(pixel_values=pixels, image_grid_thw=grids).normalized_for_model()
    assert kwargs["pixel_values"].shape == (6, 4, 1, 1)
    assert kwargs["image_grid_thw"].shape == (6, 3)
    assert set(kwargs) == {"pixel_values", "image_grid_thw"}


def test_uint8_pixels_never_reach_bridge_unnormalised(
    pairs: list[tuple[PackedBatch, dict[str, Any]]],
) -> None:
    with pytest.raises(ValueError, match=r"output='bridge'.*pixel_dtype='uint8'.*float32"):
        make_encoder(output="bridge", media=replace(SMALL_MEDIA, pixel_dtype="uint8"))
    raw_media = replace(SMALL_MEDIA, pixel_dtype="uint8")
    raw = next(iter(loader(make_encoder(media=raw_media, buffer=BufferConfig(min_rows=None)))))
    assert raw.pixel_values.dtype == torch.uint8
    with pytest.raises(ValueError, match=r"pixel_values are uint8.*to_bridge_batch\(media="):
        raw.to_bridge_batch()
    normalised = raw.to_bridge_batch(raw_media)["visual_inputs"].pixel_values
    assert torch.equal(normalised, pairs[0][0].pixel_values)


def test_output_is_checked_by_name() -> None:
    with pytest.raises(ValueError, match="output"):
        make_encoder(output="dict")


class TaggingEncoder(PackingTaskEncoder):
    """A subclass whose ``encode_batch`` adds a field: Energon's hook, as users write it."""

    def encode_batch(self, batch: PackedBatch) -> Any:
        out = super().encode_batch(batch)
        if isinstance(out, dict):
            return {**out, "tag": len(out["__keys__"])}
        return {"tag": len(out.__keys__), "batch": out}


@pytest.mark.parametrize("output", ["batch", "bridge"])
def test_encode_batch_overrides_are_honoured(output: str) -> None:
    encoder = TaggingEncoder(
        seq_length=8192, pad_to_multiple_of=8, media=SMALL_MEDIA, output=output
    )
    seen = []
    for out in loader(encoder):
        assert isinstance(out, dict)
        assert out["tag"] >= 1
        keys = out["__keys__"] if output == "bridge" else out["batch"].__keys__
        assert out["tag"] == len(keys)
        seen += keys
    assert len(seen) == len(set(seen)) == 12


def test_bridge_batches_through_two_workers() -> None:
    seen = []
    for batch in loader(make_encoder(output="bridge"), workers=2):
        assert isinstance(batch["visual_inputs"], BridgeVisualInputs)
        assert batch["max_seqlen_q"].dtype == torch.int32
        seen += batch["__keys__"]
    assert len(seen) == len(set(seen)) == 12


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    multiple=st.sampled_from([1, 2, 4, 8]),
    fixed=st.booleans(),
)
def test_bridge_metadata_matches_the_row_for_any_layout(
    lengths: list[int], multiple: int, fixed: bool
) -> None:
    layout = RowLayout(512, multiple, fixed)
    sequences = [
        {"input_ids": torch.arange(n) + 5, "loss_mask": torch.ones(n, dtype=torch.long)}
        for n in lengths
    ]
    row = build_packed_row(sequences, layout)
    batch = bridge_batch(row, {})
    ours = row.to_packed_seq_params_kwargs()
    for key, value in packed_seq_params_fields(batch).items():
        want = ours[key]
        assert torch.equal(value, want) if isinstance(want, torch.Tensor) else value == want, key
    assert int(batch["cu_seqlens_q_padded"][-1]) == batch["input_ids"].shape[1]
    assert batch["visual_inputs"].normalized_for_model() == {}


class BridgeRun:
    """A repeating ``output="bridge"`` loader for the resume helper."""

    def __init__(self) -> None:
        self.loader = loader(make_encoder(output="bridge"), repeat=True)
        self.batches: Any = None

    def step(self) -> tuple[Any, ...]:
        if self.batches is None:
            self.batches = iter(self.loader)
        batch = next(self.batches)
        pixels = float(batch["visual_inputs"].pixel_values.sum())
        return tuple(batch["__keys__"]), batch["input_ids"].tolist(), pixels


@pytest.mark.parametrize("at", [1, 4])
def test_bridge_output_resumes_exactly(at: int) -> None:
    assert_resume_equivalent(
        BridgeRun,
        [BridgeRun.step] * 6,
        at,
        save=lambda run: run.loader.save_state_rank(),
        load=lambda run, state: run.loader.restore_state_rank(state),
        roundtrip=lambda state: state,
    )


def test_restore_sample_rebuilds_a_bridge_batch() -> None:
    bridge_loader = loader(make_encoder(output="bridge"))
    batches = list(bridge_loader)
    for batch in (batches[0], batches[-1]):
        again = bridge_loader.restore_sample(batch["__restore_key__"])
        assert again["__keys__"] == batch["__keys__"]
        assert torch.equal(again["input_ids"], batch["input_ids"])
        assert torch.equal(again["cu_seqlens_q_padded"], batch["cu_seqlens_q_padded"])
        pixels = again["visual_inputs"].pixel_values
        assert torch.equal(pixels, batch["visual_inputs"].pixel_values)


def test_a_failing_conversion_stops_the_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure in the encoder's own ``encode_batch`` is a bug, not bad data: the loader stops
    at once instead of dropping packs (Energon's default tolerates 100 failures)."""

    def broken(self: PackedBatch, media: Any = None) -> dict[str, Any]:
        raise RuntimeError("conversion broke")

    monkeypatch.setattr(PackedBatch, "to_bridge_batch", broken)
    with pytest.raises(Exception, match=r"conversion broke|encode_batch") as error:
        next(iter(loader(make_encoder(output="bridge"))))
    assert not isinstance(error.value, StopIteration)
