"""``PlannedDataset``: pack ``i`` of a plan, read by random access, is the collator's row of its
members (every tensor, images and videos decoded), in a DataLoader with any number of workers;
a plan measured with another encoder, or whose source changed, is refused by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import SMALL_MEDIA
from plan_rows import ChatRows, sharegpt_rows

from energon_pack import (
    ChatDataset,
    PlannedDataset,
    PlanSampler,
    RowLayout,
    VisionBudget,
    VLMPackingCollator,
    make_encoder,
)
from energon_pack.encoding.chatml import ByteTokenizer
from energon_pack.formats.chat_rows import read_media_paths
from energon_pack.plan import Plan, PlanSpec, plan_dataset

pytestmark = [
    pytest.mark.usefixtures("ray_cluster"),
    # the reference collator is given packs of one sample too
    pytest.mark.filterwarnings("ignore:VLMPackingCollator got a micro-batch of 1 sample"),
]

LAYOUT = RowLayout(2048, 8)
SPEC = PlanSpec(
    LAYOUT,
    VisionBudget(max_vision_tokens=1500, max_media=6, balance=True),
    data_parallel_size=4,
    global_batch_size=8,
    seed=3,
)


def encoder() -> Any:
    return make_encoder(None, media=SMALL_MEDIA)


@pytest.fixture(scope="module")
def planned(chat_rows: ChatRows, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("planned") / "plan"
    plan_dataset(chat_rows.path, out, SPEC, encoder(), media_root=chat_rows.media_root)
    return out


def assert_same_value(a: Any, b: Any, name: str) -> None:
    """``a == b`` in full: tensors exactly, dataclasses, mappings and sequences item by item."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), name
        assert torch.equal(a, b), name
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):
        for field in dataclasses.fields(a):
            assert_same_value(
                getattr(a, field.name), getattr(b, field.name), f"{name}.{field.name}"
            )
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), name
        for key in a:
            assert_same_value(a[key], b[key], f"{name}[{key!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), name
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_value(x, y, f"{name}[{k}]")
    else:
        assert a == b, name


def test_every_pack_is_the_collators_row_of_its_members(planned: Path, chat_rows: ChatRows) -> None:
    dataset = PlannedDataset(planned, encoder())
    plan = Plan.read(planned)
    assert len(dataset) == plan.packs
    assert dataset.steps_per_epoch() == plan.steps
    rows = ChatDataset(str(chat_rows.path), chat_rows.media_root)  # the collator's own reader
    collator = VLMPackingCollator(layout=LAYOUT, encoder=encoder())
    seen: list[str] = []
    media = 0
    for index in range(len(dataset)):
        keys = dataset.keys[index]
        got = dataset[index]
        want = collator([rows[int(key)] for key in keys])
        assert got.keys == (tuple(keys),)
        assert_same_value(got, want, "row")
        seen += keys
        media += 0 if got.vision.image_grid_thw is None else len(got.vision.image_grid_thw)
    planned_keys = [key for pack in plan.table().column("keys").to_pylist() for key in pack]
    assert sorted(seen) == sorted(planned_keys)  # every planned sample, once
    assert media > 0


def test_the_dataset_order_deals_consecutive_packs_over_the_plans_ranks(planned: Path) -> None:
    """Megatron's samplers give rank r the indices r, r + D, ... of each step's block."""
    dataset = PlannedDataset(planned, encoder())
    order = dataset.order
    for step in order.steps()[:-1]:
        assert len(step) == 8
        assert [int(order.rank[i]) for i in step] == [0, 1, 2, 3, 0, 1, 2, 3]
    sampler = PlanSampler(dataset, data_parallel_rank=2, data_parallel_size=4)
    batches = list(sampler)
    step = order.steps()[0]
    assert batches[:2] == [[step[2]], [step[6]]]


def test_a_dataloader_with_workers_gives_the_same_packs(planned: Path) -> None:
    dataset = PlannedDataset(planned, encoder())
    sampler = PlanSampler(dataset, data_parallel_rank=1, data_parallel_size=4)
    wanted = [dataset[batch[0]] for batch in PlanSampler(dataset, 1, 4)]
    for workers in (0, 2):
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=PlanSampler(dataset, 1, 4),
            collate_fn=PlannedDataset.collate_fn,
            num_workers=workers,
        )
        got = list(loader)
        assert len(got) == len(wanted) == len(sampler)
        for a, b in zip(got, wanted, strict=True):
            assert_same_value(a, b, "row")


def test_another_encoder_or_a_changed_source_is_refused(
    planned: Path, chat_rows: ChatRows, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"measured with another encoder: .*media"):
        PlannedDataset(planned, make_encoder(None))  # the default media settings
    copy = tmp_path / "rows.jsonl"
    shutil.copy(chat_rows.path, copy)
    moved = tmp_path / "plan"
    shutil.copytree(planned, moved)
    record = json.loads((moved / "plan.json").read_text())
    record["source"]["path"] = str(copy)
    (moved / "plan.json").write_text(json.dumps(record))
    assert len(PlannedDataset(moved, encoder())) > 0  # the same rows elsewhere
    copy.write_text(copy.read_text().replace("a", "b", 1))
    with pytest.raises(ValueError, match=r"its source changed since it was planned .*sha256"):
        PlannedDataset(moved, encoder())


def test_parquet_and_pretokenised_members_are_read_by_row(
    tmp_path: Path, chat_rows: ChatRows
) -> None:
    _, rows = sharegpt_rows(chat_rows)
    pq.write_table(pa.Table.from_pylist(rows[:60]), tmp_path / "rows.parquet", row_group_size=16)
    spec = PlanSpec(LAYOUT, data_parallel_size=2)
    plan_dataset(
        tmp_path / "rows.parquet",
        tmp_path / "plan",
        spec,
        encoder(),
        media_root=chat_rows.media_root,
    )
    dataset = PlannedDataset(tmp_path / "plan", encoder())
    collator = VLMPackingCollator(layout=LAYOUT, encoder=encoder())
    for index in range(len(dataset)):
        keys = dataset.keys[index]
        items = [(k, read_media_paths(rows[int(k)], k, chat_rows.media_root)) for k in keys]
        assert_same_value(dataset[index], collator(items), "row")
    tokens = [
        {"input_ids": [65 + i % 20] * (30 + i), "loss_mask": [0] * 10 + [1] * (20 + i)}
        for i in range(40)
    ]
    (tmp_path / "ids.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tokens))
    plan_dataset(
        tmp_path / "ids.jsonl",
        tmp_path / "ids-plan",
        PlanSpec(RowLayout(256)),
        make_encoder(ByteTokenizer()),
    )
    ids = PlannedDataset(tmp_path / "ids-plan", make_encoder(ByteTokenizer()))
    total = 0
    for index in range(len(ids)):
        row = ids[index]
        for segment, key in enumerate(ids.keys[index]):
            start, stop = row.cu_seqlens[0][segment : segment + 2].tolist()
            assert row.input_ids[0, start:stop].tolist() == tokens[int(key)]["input_ids"]
            total += 1
    assert total == 40


def _family_rows(root: Path) -> Path:
    """Ten chat rows, two in three with a PNG under ``root``, as ``root/rows.jsonl``."""
    from family_kit import png_bytes
    from family_kit import test_images as make_images

    rows = []
    for i, image in enumerate(make_images(0, [(40 + 8 * i, 60) for i in range(10)])):
        turns = [
            {"role": "user", "content": ("<image>\n" if i % 3 else "") + "What is shown here?"},
            {"role": "assistant", "content": f"The quick brown fox {i}."},
        ]
        row: dict[str, Any] = {"messages": turns}
        if i % 3:
            (root / f"{i}.png").write_bytes(png_bytes(image))
            row["images"] = [f"{i}.png"]
        rows.append(row)
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root / "rows.jsonl"


@pytest.mark.parametrize("name", ["gemma3", "idefics3"])
def test_a_processor_familys_packs_are_the_collators_rows(name: str, tmp_path: Path) -> None:
    import test_family_gemma3 as gemma3
    import test_family_idefics3 as idefics3

    from energon_pack import model_family

    make = {"gemma3": gemma3.make_processor, "idefics3": lambda: idefics3.small("idefics3")}
    family = model_family(make[name]())
    source = _family_rows(tmp_path)
    spec = PlanSpec(RowLayout(512), data_parallel_size=2)
    plan_dataset(source, tmp_path / "plan", spec, make_encoder(family=family), media_root=tmp_path)
    dataset = PlannedDataset(tmp_path / "plan", make_encoder(family=family), family=family)
    rows = ChatDataset(str(source), tmp_path)
    collator = VLMPackingCollator(layout=RowLayout(512), family=family)
    seen = []
    for index in range(len(dataset)):
        keys = dataset.keys[index]
        got = dataset[index]
        want = collator([rows[int(key)] for key in keys])
        assert got.family_inputs is not None
        assert_same_value(got, want, "row")
        seen += keys
    assert sorted(seen, key=int) == [str(i) for i in range(10)]


def test_an_energon_plans_packs_are_the_collators_rows_of_its_samples(tmp_path: Path) -> None:
    """Members are read through Energon's index and prepared as the online loaders prepare
    them; the reference is the collator given the raw WebDataset samples."""
    from helpers import read_samples
    from plan_rows import FIXTURES

    demo = FIXTURES / "vlm_demo"
    spec = PlanSpec(RowLayout(8192, 8), data_parallel_size=2)
    plan_dataset(demo, tmp_path / "plan", spec, encoder())
    dataset = PlannedDataset(tmp_path / "plan", encoder())
    samples = read_samples(demo)
    collator = VLMPackingCollator(layout=RowLayout(8192, 8), encoder=encoder())
    seen: list[str] = []
    videos = 0
    for index in range(len(dataset)):
        keys = dataset.keys[index]
        got = dataset[index]
        assert_same_value(got, collator([{"__key__": k, **samples[k]} for k in keys]), "row")
        seen += keys
        videos += 0 if got.vision.video_grid_thw is None else len(got.vision.video_grid_thw)
    assert sorted(seen) == sorted(samples)  # every sample of the demo, once
    assert videos > 0


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_resumed_on_other_ranks_and_workers_every_sample_trains_once(planned: Path) -> None:
    """4 ranks with 2 workers for a step, 2 ranks in the main process for two steps, 1 rank
    with 3 workers for a step, then 8 ranks with 2 workers to the end (3 cuts): every sample of
    the plan once, and after each cut the packs of a run that had the new size from the
    start."""
    dataset = PlannedDataset(planned, encoder())
    assert len(dataset) > 5 * 8
    # ranks, workers, consumed, steps
    phases = [(4, 2, 0, 1), (2, 0, 8, 2), (1, 3, 24, 1), (8, 2, 32, None)]
    trained: list[str] = []
    for ranks, workers, consumed, steps in phases:
        for rank in range(ranks):
            sampler = PlanSampler(dataset, rank, ranks, consumed_samples=consumed)
            uninterrupted = list(PlanSampler(dataset, rank, ranks))
            loader = torch.utils.data.DataLoader(
                dataset,
                batch_sampler=sampler,
                collate_fn=PlannedDataset.collate_fn,
                num_workers=workers,
            )
            per_rank = 8 // ranks
            batches = list(loader)[: None if steps is None else steps * per_rank]
            done = consumed // ranks  # micro-batches this rank's size had before the cut
            for k, batch in enumerate(batches):
                assert batch.keys == (tuple(dataset.keys[uninterrupted[done + k][0]]),)
                trained += batch.keys[0]
    planned_keys = [key for keys in dataset.keys for key in keys]
    assert sorted(trained) == sorted(planned_keys)


def test_hf_output_is_the_collators_model_inputs(planned: Path, chat_rows: ChatRows) -> None:
    dataset = PlannedDataset(planned, encoder(), output="hf")
    rows = ChatDataset(str(chat_rows.path), chat_rows.media_root)
    collator = VLMPackingCollator(layout=LAYOUT, encoder=encoder(), output="hf")
    for index in (0, len(dataset) // 2, len(dataset) - 1):
        got = dataset[index]
        assert isinstance(got, dict)
        assert {"input_ids", "labels", "position_ids"} <= set(got)
        assert_same_value(got, collator([rows[int(k)] for k in dataset.keys[index]]), "inputs")


def test_bridge_output_is_bridges_batch_of_the_row(planned: Path) -> None:
    rows = PlannedDataset(planned, encoder())
    bridged = PlannedDataset(planned, encoder(), output="bridge")
    for index in (0, len(rows) - 1):
        row, batch = rows[index], bridged[index]
        assert batch["__keys__"] == row.keys[0]
        for name in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert torch.equal(batch[name], getattr(row, name)), name
        assert torch.equal(batch["cu_seqlens_q"], row.cu_seqlens[0])
        assert torch.equal(batch["cu_seqlens_q_padded"], row.cu_seqlens_padded[0])
        visual = batch["visual_inputs"]
        for name, tensor in row.vision.tensors().items():
            assert torch.equal(getattr(visual, name), tensor), name
    with pytest.raises(ValueError, match=r"output must be .batch., .hf. or .bridge., got"):
        PlannedDataset(planned, encoder(), output="megatron")  # type: ignore[arg-type]


def test_bridge_batches_are_one_row() -> None:
    collator = VLMPackingCollator(layout=RowLayout(64), encoder=make_encoder(ByteTokenizer()))
    turns = [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello you"}]
    two_rows = collator([("a", {"conversations": turns}), ("b", {"conversations": turns})])
    assert two_rows.num_rows == 2
    with pytest.raises(ValueError, match=r"takes a batch of one row .* got 2 row"):
        two_rows.to_bridge_batch()


def test_mrope_positions_are_the_collators(planned: Path, chat_rows: ChatRows) -> None:
    dataset = PlannedDataset(planned, encoder(), position_ids="mrope")
    rows = ChatDataset(str(chat_rows.path), chat_rows.media_root)
    collator = VLMPackingCollator(layout=LAYOUT, encoder=encoder(), position_ids="mrope")
    for index in range(0, len(dataset), max(1, len(dataset) // 4)):
        got = dataset[index]
        assert got.mrope_position_ids is not None
        assert_same_value(got, collator([rows[int(k)] for k in dataset.keys[index]]), "row")


def test_the_pack_index_holds_the_parquets_packs(planned: Path, tmp_path: Path) -> None:
    """The dataset reads ``index/`` (mapped, no pyarrow); it says what ``plan.parquet`` says."""
    from energon_pack.plan.store import PackIndex

    table = Plan.read(planned).table().to_pylist()
    index = PackIndex.read(planned)
    assert index.packs.shape == (5, len(table))
    for row, pack in enumerate(table):
        assert index.members(row) == pack["keys"]
        numbers = [pack["pack"], pack["step"], pack["rank"], pack["micro"]]
        assert index.packs[:4, row].tolist() == numbers
        assert int(index.packs[4, row]) == sum(pack["vision_tokens"])
    old = tmp_path / "old"
    shutil.copytree(planned, old)
    shutil.rmtree(old / "index")
    with pytest.raises(ValueError, match=r"has no index/ .*plan it again"):
        PlannedDataset(old, encoder())
