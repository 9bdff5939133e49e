from __future__ import annotations

import itertools
import logging
import pickle
import tarfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import image_bytes
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from energon_pack.collate import CollatedBatch, VLMPackingCollator
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.media import MediaConfig, MediaError, MediaItem, normalize_pixels
from energon_pack.packing.bins import aligned_length
from energon_pack.packing.mrope import MRopeConfig, mrope_position_ids
from energon_pack.packing.packed import EncodedSample
from energon_pack.packing.row import IGNORE_INDEX, PackedRow
from energon_pack.packing.row_layout import PackingWarning

VLM_DEMO = Path(__file__).resolve().parents[2] / "fixtures" / "vlm_demo"


class FixtureDataset(Dataset[dict[str, Any]]):
    """The first ``count`` raw samples of fixtures/vlm_demo (member dicts with ``__key__``)."""

    def __init__(self, count: int) -> None:
        self.samples: list[dict[str, Any]] = []
        for shard in sorted(VLM_DEMO.glob("*.tar")):
            with tarfile.open(shard) as tar:
                for member in tar.getmembers():
                    key, _, ext = member.name.partition(".")
                    file = tar.extractfile(member)
                    if file is None:
                        continue
                    if not self.samples or self.samples[-1]["__key__"] != key:
                        if len(self.samples) == count:
                            return
                        self.samples.append({"__key__": key})
                    self.samples[-1][ext] = file.read()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


@pytest.fixture(scope="module")
def demo() -> FixtureDataset:
    return FixtureDataset(12)


def text_sample(key: str, length: int, seed: int = 0) -> EncodedSample:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (length,), generator=generator)
    mask = torch.randint(0, 2, (length,), generator=generator)
    return EncodedSample(key, ids, mask)


def segments(batch: CollatedBatch) -> Iterator[tuple[str, PackedRow, int, int, int]]:
    """(key, row, start, real length, physical length) of every segment, row then segment."""
    for r, keys in enumerate(batch.keys):
        row = batch.row(r)
        cu, cu_pad = batch.cu_seqlens[r].tolist(), batch.cu_seqlens_padded[r].tolist()
        for i, key in enumerate(keys):
            yield key, row, cu_pad[i], cu[i + 1] - cu[i], cu_pad[i + 1] - cu_pad[i]


def assert_round_trip(batch: CollatedBatch, samples: Sequence[EncodedSample]) -> None:
    """Each sample's tokens, labels and loss mask come back, once; labels stay in segments."""
    by_key = {s.key: s for s in samples}
    seen = []
    for key, row, start, length, span in segments(batch):
        sample = by_key[key]
        seen.append(key)
        assert length == sample.length
        ids, mask = sample.input_ids, sample.loss_mask
        assert torch.equal(row.input_ids[start : start + length], ids)
        target = mask[1:] != 0
        expected = torch.full((span,), IGNORE_INDEX)
        expected[: length - 1] = torch.where(target, ids[1:], IGNORE_INDEX)
        assert torch.equal(row.labels[start : start + span], expected)
        assert torch.equal(row.loss_mask[start : start + span], (expected != IGNORE_INDEX).float())
        assert torch.equal(row.position_ids[start : start + length], torch.arange(length))
    assert sorted(seen) == sorted(by_key)
    assert batch.num_real_tokens == sum(s.length for s in samples)
    # The flattened boundaries are the rows' real segments with row offsets added.
    width = batch.input_ids.shape[1]
    flat_pad = [0] + [
        int(c) + r * width
        for r, (cu, keys) in enumerate(zip(batch.cu_seqlens_padded, batch.keys, strict=True))
        for c in cu[1 : len(keys) + 1]
    ]
    count = len(seen) + 1
    assert batch.cu_seqlens_padded_flat[:count].tolist() == flat_pad[:count]
    lengths = [length for _, _, _, length, _ in segments(batch)]
    assert batch.cu_seqlens_flat[:count].tolist() == list(itertools.accumulate(lengths, initial=0))


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=2, max_size=9),
    align=st.sampled_from([1, 2, 4, 8]),
    width_units=st.integers(5, 24),
    fixed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_text_round_trip_property(
    lengths: list[int], align: int, width_units: int, fixed: bool, seed: int
) -> None:
    seq_length = width_units * 8
    samples = [text_sample(f"s{i}", n, seed + i) for i, n in enumerate(lengths)]
    collate = VLMPackingCollator(
        seq_length, pad_to_multiple_of=align, pad_to_max_length=fixed, overlong="skip"
    )
    kept = [s for s in samples if aligned_length(s.length, align) <= seq_length]
    by_key = {s.key: s.length for s in samples}
    needed = sum(aligned_length(s.length, align) for s in kept)
    if not kept:
        with pytest.warns(PackingWarning, match="every sample of the micro-batch was skipped"):
            batch = collate(samples)
        assert_padding_only(batch, [s.key for s in samples])
        return
    batch = collate(samples)
    assert_round_trip(batch, kept)
    assert batch.skipped_keys == tuple(s.key for s in samples if s not in kept)
    order = {s.key: i for i, s in enumerate(samples)}
    for keys in batch.keys:  # segments keep micro-batch order, rows ordered by first sample
        assert [order[k] for k in keys] == sorted(order[k] for k in keys)
    assert [order[keys[0]] for keys in batch.keys] == sorted(order[k[0]] for k in batch.keys)
    if fixed:
        assert batch.input_ids.shape[1] == seq_length
    elif needed <= seq_length:
        assert batch.num_rows == 1
        assert batch.input_ids.shape[1] == needed
    else:  # split into rows as wide as the widest, each row's padding in its last segment
        widest = max(sum(aligned_length(by_key[k], align) for k in keys) for keys in batch.keys)
        assert batch.num_rows > 1
        assert batch.input_ids.shape[1] == widest <= seq_length
        assert all(
            int(cu[len(keys)]) == widest
            for cu, keys in zip(batch.cu_seqlens_padded, batch.keys, strict=True)
        )


def min_rows_brute_force(units: list[int], capacity: int, max_items: int | None) -> int:
    def partitions(items: list[int]) -> Iterator[list[list[int]]]:
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            yield [[first], *part]
            for i in range(len(part)):
                yield [*part[:i], [first, *part[i]], *part[i + 1 :]]

    best = len(units)
    for part in partitions(list(range(len(units)))):
        if all(
            sum(units[i] for i in block) <= capacity
            and (max_items is None or len(block) <= max_items)
            for block in part
        ):
            best = min(best, len(part))
    return best


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=7),
    align=st.sampled_from([1, 4]),
    max_segments=st.none() | st.integers(1, 4),
)
def test_split_rows_are_fewest_and_lose_nothing(
    lengths: list[int], align: int, max_segments: int | None
) -> None:
    seq_length = 64
    samples = [text_sample(f"s{i}", n, i) for i, n in enumerate(lengths)]
    collate = VLMPackingCollator(
        seq_length,
        pad_to_multiple_of=align,
        pad_to_max_length=True,
        pad_cu_seqlens=max_segments is not None,
        max_segments=max_segments,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PackingWarning)
        batch = collate(samples)
    assert_round_trip(batch, samples)
    units = [aligned_length(n, align) for n in lengths]
    assert batch.num_rows == min_rows_brute_force(units, seq_length, max_segments)
    assert batch.input_ids.shape == (batch.num_rows, seq_length)
    for r in range(batch.num_rows):
        assert int(batch.cu_seqlens_padded[r][-1]) == seq_length
    if max_segments is not None:
        assert all(len(keys) <= max_segments for keys in batch.keys)
        assert all(cu.numel() == max_segments + 1 for cu in batch.cu_seqlens)
        assert batch.cu_seqlens_flat.numel() == batch.num_rows * max_segments + 1
        assert batch.max_seqlen == seq_length


def test_split_beats_best_fit_decreasing() -> None:
    # BFD needs 3 rows for 4,4,3,3,3,3 in rows of 10; two rows (4+3+3 twice) suffice.
    samples = [text_sample(f"s{i}", n) for i, n in enumerate([4, 4, 3, 3, 3, 3])]
    batch = VLMPackingCollator(10, pad_to_max_length=True)(samples)
    assert batch.num_rows == 2
    assert_round_trip(batch, samples)


def test_fixture_media_round_trip(demo: FixtureDataset) -> None:
    items = [demo[i] for i in range(8)]
    encoder = ConversationEncoder()
    samples = [encoder.encode_sample(item["__key__"], item).materialize() for item in items]
    assert {m.kind for s in samples for m in s.media} == {"image", "video"}
    collate = VLMPackingCollator(4096, pad_to_multiple_of=8, pad_to_max_length=True)
    batch = collate(items)  # raw samples: the collator encodes and decodes them
    assert batch.num_rows == 2
    assert_round_trip(batch, samples)
    by_key = {s.key: s for s in samples}
    offsets = {"pixel_values": 0, "image_grid_thw": 0, "pixel_values_videos": 0}
    offsets |= {"video_grid_thw": 0, "second_per_grid_ts": 0}
    got = batch.vision.tensors()
    for key in itertools.chain.from_iterable(batch.keys):
        vision = by_key[key].vision
        for name, tensor in (vision.tensors() if vision is not None else {}).items():
            start = offsets[name]
            assert torch.equal(got[name][start : start + tensor.shape[0]], tensor), (key, name)
            offsets[name] += tensor.shape[0]
    assert offsets == {name: tensor.shape[0] for name, tensor in got.items()}
    # Pre-encoded samples give the same batch as raw ones.
    again = collate(samples)
    assert torch.equal(again.input_ids, batch.input_ids)
    assert torch.equal(again.vision.tensors()["pixel_values"], got["pixel_values"])


def test_uint8_pixels_normalise_to_the_float_batch(demo: FixtureDataset) -> None:
    items = [demo[i] for i in range(8)]
    raw_media = MediaConfig(pixel_dtype="uint8")
    settings: dict[str, Any] = {"pad_to_multiple_of": 8, "pad_to_max_length": True}
    floats = VLMPackingCollator(4096, **settings)(items).vision
    raw_encoder = ConversationEncoder(media=raw_media)
    raws = VLMPackingCollator(4096, encoder=raw_encoder, **settings)(items).vision
    assert raws.pixel_values is not None
    assert raws.pixel_values_videos is not None
    for name in ("pixel_values", "pixel_values_videos"):
        raw, expected = getattr(raws, name), getattr(floats, name)
        assert raw.dtype == torch.uint8
        assert torch.equal(normalize_pixels(raw, raw_media), expected), name
    # Samples materialised before collation are copied in as uint8 too.
    ready = [
        raw_encoder.encode_sample(item["__key__"], item).materialize(raw_media) for item in items
    ]
    again = VLMPackingCollator(4096, encoder=raw_encoder, **settings)(ready).vision
    assert again.pixel_values is not None
    assert torch.equal(again.pixel_values, raws.pixel_values)
    # ... but not float32 ones: a mixed batch is refused by name.
    first = items[0]
    float_ready = raw_encoder.encode_sample(first["__key__"], first).materialize(MediaConfig())
    with pytest.raises(ValueError, match=rf"{first['__key__']}.*torch.float32 pixels.*'uint8'"):
        VLMPackingCollator(4096, encoder=raw_encoder, **settings)([float_ready, *ready[1:]])


def test_default_mode_is_one_row_with_adapters(demo: FixtureDataset) -> None:
    items = [demo[i] for i in range(4)]
    batch = VLMPackingCollator(8192, pad_to_multiple_of=4)(items)
    assert batch.num_rows == 1
    assert batch.keys == (tuple(item["__key__"] for item in items),)
    assert torch.equal(batch.cu_seqlens_flat, batch.cu_seqlens[0])
    assert torch.equal(batch.cu_seqlens_padded_flat, batch.cu_seqlens_padded[0])
    assert batch.row_offsets.tolist() == [0, 4]
    mcore = batch.to_packed_seq_params_kwargs()
    assert mcore["qkv_format"] == "thd"
    assert mcore["cu_seqlens_q_padded"] is batch.cu_seqlens_padded_flat
    assert (
        mcore["max_seqlen_q"]
        == batch.max_seqlen
        == max(
            aligned_length(n, 4)
            for n in (batch.cu_seqlens[0][1:] - batch.cu_seqlens[0][:-1]).tolist()
        )
    )
    hf = batch.to_hf_varlen_kwargs()
    assert hf["position_ids"].shape == (1, batch.input_ids.shape[1])
    assert hf["cu_seq_lens_k"] is batch.cu_seqlens_padded_flat
    flat = batch.to_dict()
    assert {"input_ids", "cu_seqlens_flat", "pixel_values", "image_grid_thw", "keys"} <= set(flat)
    assert "vision" not in flat


def test_flat_boundaries_of_split_batch() -> None:
    samples = [text_sample(f"s{i}", n) for i, n in enumerate([5, 9, 7])]
    batch = VLMPackingCollator(16, pad_to_multiple_of=4, pad_to_max_length=True)(samples)
    assert batch.keys == (("s0", "s2"), ("s1",))
    assert batch.cu_seqlens_padded_flat.tolist() == [0, 8, 16, 32]
    assert batch.cu_seqlens_flat.tolist() == [0, 5, 12, 21]
    assert batch.row_offsets.tolist() == [0, 2, 3]
    assert batch.to_hf_varlen_kwargs()["position_ids"].shape == (1, 32)


def loader_batches(dataset: FixtureDataset, workers: int, context: str | None) -> list[Any]:
    collate = VLMPackingCollator(4096, pad_to_multiple_of=8, pad_to_max_length=True)
    loader = DataLoader(
        dataset,
        batch_size=4,
        num_workers=workers,
        collate_fn=collate,
        multiprocessing_context=context if workers else None,
    )
    out = []
    for batch in loader:
        out.append(
            (batch.keys, batch.input_ids, batch.labels, batch.cu_seqlens_padded_flat, batch.vision)
        )
    return out


def test_collator_pickles() -> None:
    collate = VLMPackingCollator(64, pad_to_max_length=True, overlong="truncate")
    samples = [text_sample("a", 70), text_sample("b", 30)]
    clone = pickle.loads(pickle.dumps(collate))
    assert torch.equal(clone(samples).input_ids, collate(samples).input_ids)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_match_single_process(context: str) -> None:
    dataset = FixtureDataset(8)
    reference = loader_batches(dataset, 0, None)
    got = loader_batches(dataset, 2, context)
    assert len(got) == len(reference) == 2
    for (keys, *tensors, vision), (keys_ref, *tensors_ref, vision_ref) in zip(
        got, reference, strict=True
    ):
        assert keys == keys_ref
        for a, b in zip(tensors, tensors_ref, strict=True):
            assert torch.equal(a, b)
        ours, theirs = vision.tensors(), vision_ref.tensors()
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)


# --- policies and errors -----------------------------------------------------------------------


def test_overlong_error_skip_and_truncate(caplog: pytest.LogCaptureFixture) -> None:
    samples = [text_sample("short", 10), text_sample("long", 50)]
    with pytest.raises(ValueError, match=r"sample 'long' has 50 tokens .* seq_length=32; raise"):
        VLMPackingCollator(32, overlong="error")(samples)
    with caplog.at_level(logging.WARNING, logger="energon_pack.collate"):
        batch = VLMPackingCollator(32)(samples)  # skip is the default: counted and logged
    assert batch.skipped_keys == ("long",)
    assert batch.keys == (("short",),)
    assert [r.getMessage().count("'long'") for r in caplog.records] == [1]
    collate = VLMPackingCollator(
        32, pad_to_multiple_of=8, pad_to_max_length=True, overlong="truncate"
    )
    batch = collate(samples)
    assert batch.truncated_keys == ("long",)
    assert batch.skipped_keys == ()
    cut = EncodedSample("long", samples[1].input_ids[:32], samples[1].loss_mask[:32])
    assert_round_trip(batch, [samples[0], cut])


def test_truncate_keeps_media_or_skips_when_cut_enters_vision() -> None:
    encoder = ConversationEncoder()
    raw = {
        "json": {
            "conversations": [
                {"from": "human", "value": "<image>describe"},
                {"from": "gpt", "value": "a long answer " * 20},
            ]
        },
        "0.png": image_bytes(64, 64),
    }
    sample = encoder.encode_sample("img", raw)
    other = text_sample("txt", 20)
    collate = VLMPackingCollator(128, overlong="truncate", pad_to_max_length=True)
    batch = collate([sample, other])
    assert batch.truncated_keys == ("img",)
    decoded = sample.materialize()
    assert decoded.vision is not None
    for name, tensor in decoded.vision.tensors().items():  # media and grids kept whole
        assert torch.equal(batch.vision.tensors()[name], tensor)
    cut = EncodedSample("img", sample.input_ids[:128], sample.loss_mask[:128])
    assert_round_trip(batch, [cut, other])
    # A cut inside the vision block (it ends at token 12) skips the sample.
    short = text_sample("short", 8)
    batch = VLMPackingCollator(10, overlong="truncate")([sample, short])
    assert batch.skipped_keys == ("img",)
    assert batch.keys == (("short",),)
    # Without the tokenizer's <|vision_end|> the vision block cannot be located.
    foreign = EncodedSample(
        "foreign", torch.zeros(200, dtype=torch.long), torch.zeros(200, dtype=torch.long),
        media=(MediaItem("0.png", "image", b"", (1, 4, 4), 4),),
    )  # fmt: skip
    with pytest.raises(ValueError, match="'foreign' has media but no <\\|vision_end\\|>"):
        collate([foreign, other])


def test_media_errors_raise_or_skip(caplog: pytest.LogCaptureFixture) -> None:
    jpeg = image_bytes(320, 240, "JPEG")
    broken = {
        "__key__": "broken",
        "json": {"conversations": [{"from": "human", "value": "<image>hi"}]},
        "0.jpg": jpeg[: len(jpeg) // 2],  # header intact: probes fine, fails to decode
    }
    no_media = {"conversations": [{"from": "human", "value": "<image>"}]}
    mismatch = {"__key__": "mismatch", "json": no_media}
    good = ("good", {"json": {"conversations": [{"from": "gpt", "value": "ok"}]}})
    with pytest.raises(MediaError, match=r"'broken'.*corrupt"):
        VLMPackingCollator(1024)([broken, good])
    with pytest.raises(MediaError, match=r"'mismatch'.*placeholder"):
        VLMPackingCollator(1024)([mismatch, good])
    with caplog.at_level(logging.WARNING, logger="energon_pack.collate"):
        batch = VLMPackingCollator(1024, on_media_error="skip")([broken, mismatch, good])
    assert batch.skipped_keys == ("mismatch", "broken")  # encode-time first, then decode-time
    assert batch.keys == (("good",),)
    assert batch.vision.tensors() == {}
    assert sum("'broken'" in r.getMessage() for r in caplog.records) == 1
    with pytest.warns(PackingWarning, match=r"every sample .* skipped \(\['mismatch', 'broken'\]"):
        batch = VLMPackingCollator(1024, on_media_error="skip")([broken, mismatch])
    assert_padding_only(batch, ["mismatch", "broken"])


def assert_padding_only(batch: CollatedBatch, skipped: Sequence[str]) -> None:
    """A well-formed batch of one padding row that contributes nothing to the loss."""
    assert batch.skipped_keys == tuple(skipped)
    assert batch.keys == ((),)
    assert batch.num_rows == 1
    assert not batch.loss_mask.any()
    assert (batch.labels == IGNORE_INDEX).all()
    width = batch.input_ids.shape[1]
    assert width > 0
    assert batch.cu_seqlens_padded_flat[-1] == width
    assert batch.cu_seqlens_flat.tolist()[:2] == [0, width]
    assert batch.vision.tensors() == {}


def test_samples_are_told_apart_by_position_not_key() -> None:
    jpeg = image_bytes(320, 240, "JPEG")
    turn = {"conversations": [{"from": "human", "value": "<image>hi"}]}
    bad = ("same", {"json": turn, "0.jpg": jpeg[: len(jpeg) // 2]})
    good = ("same", {"json": turn, "0.jpg": jpeg})
    other = ("other", {"json": {"conversations": [{"from": "gpt", "value": "ok"}]}})
    for batch_items in ([bad, good, other], [good, bad, other]):
        batch = VLMPackingCollator(4096, on_media_error="skip")(batch_items)
        assert batch.keys == (("same", "other"),)
        assert batch.skipped_keys == ("same",)
        assert batch.vision.pixel_values is not None  # the good image was kept


def test_input_errors() -> None:
    collate = VLMPackingCollator(32)
    with pytest.raises(ValueError, match="micro-batch is empty"):
        collate([])
    empty = EncodedSample("e", torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="sample 'e' is empty"):
        collate([empty, text_sample("a", 3)])
    with pytest.raises(ValueError, match="item #1 is a str"):
        collate([text_sample("a", 3), "oops"])  # type: ignore[list-item]
    split = collate([text_sample("a", 20), text_sample("b", 20)])  # over one row: two rows
    assert split.keys == (("a",), ("b",))
    assert split.input_ids.shape == (2, 20)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_length": 0}, "seq_length must be a positive int"),
        ({"seq_length": 8, "pad_to_multiple_of": 16}, "pad_to_multiple_of=16 is larger"),
        ({"seq_length": 10, "pad_to_multiple_of": 4, "pad_to_max_length": True}, "multiple of"),
        ({"seq_length": 8, "pad_cu_seqlens": True}, "requires fixed-width rows; set pad_to_max"),
        (
            {"seq_length": 8, "pad_cu_seqlens": True, "pad_to_max_length": True},
            "requires max_segments",
        ),
        ({"seq_length": 8, "overlong": "drop"}, "overlong must be"),
        ({"seq_length": 8, "on_media_error": "ignore"}, "on_media_error must be"),
    ],
)
def test_bad_options(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VLMPackingCollator(**kwargs)


def test_micro_batch_of_one_warns_once() -> None:
    collate = VLMPackingCollator(32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collate([text_sample("a", 5)])
        collate([text_sample("b", 5)])
        collate([text_sample("c", 5), text_sample("d", 5)])
    assert [type(w.message) for w in caught] == [PackingWarning]
    assert "nothing is packed" in str(caught[0].message)


# --- padded HF batches ---------------------------------------------------------------------------


def test_padded_hf_batch_is_repacked() -> None:
    samples = [text_sample(f"padded[{i}]", n, i) for i, n in enumerate([7, 3, 5])]
    ids = torch.zeros(3, 7, dtype=torch.long)
    attention = torch.zeros(3, 7, dtype=torch.long)
    labels = torch.full((3, 7), IGNORE_INDEX)
    for i, s in enumerate(samples):
        ids[i, : s.length] = s.input_ids
        attention[i, : s.length] = 1
        labels[i, : s.length] = torch.where(s.loss_mask != 0, s.input_ids, IGNORE_INDEX)
    collate = VLMPackingCollator(16, pad_to_multiple_of=2, pad_to_max_length=True)
    batch = collate({"input_ids": ids, "attention_mask": attention, "labels": labels})
    assert_round_trip(batch, samples)
    direct = collate(samples)
    assert torch.equal(batch.input_ids, direct.input_ids)
    assert torch.equal(batch.labels, direct.labels)
    # Without labels every real token is a target; without attention_mask every token is real.
    whole = collate.collate_padded({"input_ids": ids[:, :3]})
    assert whole.num_real_tokens == 9
    assert int(whole.loss_mask.sum()) == 3 * 2


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"input_ids": torch.ones(2, 3), "pixel_values": 1}, r"fields \['pixel_values'\]"),
        ({"attention_mask": torch.ones(2, 3)}, "has no input_ids"),
        ({"input_ids": torch.ones(3)}, r"must be \[B, L\]"),
        (
            {"input_ids": torch.ones(2, 3), "labels": torch.ones(2, 4)},
            r"labels has shape \(2, 4\)",
        ),
        (
            {"input_ids": torch.ones(1, 3), "attention_mask": torch.tensor([[0, 1, 1]])},
            "'padded\\[0\\]': attention_mask is not right-padded",
        ),
        (
            {"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[6, 7, -100]])},
            "labels\\[0\\]=6 differs from input_ids\\[0\\]=5",
        ),
    ],
)
def test_padded_batch_errors(batch: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        VLMPackingCollator(16)(batch)


@pytest.mark.parametrize("static", [False, True])
def test_mrope_ids_per_segment_in_split_rows(demo: FixtureDataset, static: bool) -> None:
    items = [demo[i] for i in range(8)]
    slots = {"pad_cu_seqlens": True, "max_segments": 5} if static else {}
    collate = VLMPackingCollator(
        4096, pad_to_multiple_of=8, pad_to_max_length=True, position_ids="mrope", **slots
    )
    batch = collate(items)
    assert batch.num_rows == 2
    assert batch.mrope_position_ids is not None
    assert batch.rope_deltas is not None
    assert batch.mrope_position_ids.shape == (3, *batch.input_ids.shape)
    config = MRopeConfig.from_tokenizer(collate.encoder.tokenizer)
    by_key = {item["__key__"]: item for item in items}
    flat = 0
    for row, keys in enumerate(batch.keys):
        starts = batch.cu_seqlens_padded[row].tolist()
        for index, key in enumerate(keys):
            single = collate.encoder.encode_sample(key, by_key[key]).materialize()
            vision = single.vision
            expected, delta = mrope_position_ids(
                single.input_ids,
                None if vision is None else vision.image_grid_thw,
                None if vision is None else vision.video_grid_thw,
                None if vision is None else vision.second_per_grid_ts,
                config,
            )
            got = batch.mrope_position_ids[:, row, starts[index] : starts[index] + single.length]
            assert torch.equal(got, expected), key
            assert int(batch.rope_deltas[flat]) == delta
            # Delta i belongs to the flat segment that cu_seqlens_flat[i:i+2] bounds.
            real = batch.cu_seqlens_flat[flat : flat + 2].tolist()
            assert real[1] - real[0] == single.length
            flat += 1
    assert flat == batch.rope_deltas.numel()
