"""A plan's measure step counts each row as the loaders do: the planned length of every row
equals the length of the row the collator builds for it alone, and its vision tokens equal
what the collator's decode gives (shipped fixtures; byte and real Qwen tokenizers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from chat_templates import QWEN2_VL
from helpers import SMALL_MEDIA
from plan_rows import ChatRows, sharegpt_rows
from real_qwen import real_qwen_tokenizer

from energon_pack import RowLayout, VisionBudget, VLMPackingCollator, make_encoder
from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.formats.chat_rows import ChatDataset
from energon_pack.plan.measure import measure_partition
from energon_pack.plan.spec import PlanSpec
from energon_pack.sources.rows import JsonSource, open_source

SPEC = PlanSpec(RowLayout(32768))


def _measured(path: Path, media_root: Path | None, encoder: SampleEncoder) -> dict:
    source = open_source(path, media_root)
    parts = [measure_partition(p, encoder, SPEC, media_root) for p in source.partitions(rows=64)]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


@pytest.mark.filterwarnings("ignore:VLMPackingCollator got a micro-batch of 1 sample")
@pytest.mark.parametrize("tokenizer", ["byte", "qwen"])
def test_planned_counts_equal_the_collators_row_for_each_sample(
    chat_rows: ChatRows, tokenizer: str
) -> None:
    hf = None if tokenizer == "byte" else real_qwen_tokenizer(chat_template=QWEN2_VL)
    encoder = make_encoder(hf, media=SMALL_MEDIA)
    measured = _measured(chat_rows.path, chat_rows.media_root, encoder)
    rows = ChatDataset(chat_rows.path, media_root=chat_rows.media_root)
    collator = VLMPackingCollator(layout=RowLayout(32768), encoder=encoder)
    assert measured["index"].tolist() == list(range(len(rows))) == list(range(300))
    assert set(measured["skip"].tolist()) == {""}
    merge = SMALL_MEDIA.merge_size**2
    for index in range(len(rows)):
        batch = collator([rows[index]])
        assert batch.skipped_keys == ()
        assert int(batch.cu_seqlens[0][-1]) == measured["length"][index]
        decoded = sum(
            int(grid.prod(dim=-1).sum()) // merge
            for grid in (batch.vision.image_grid_thw, batch.vision.video_grid_thw)
            if grid is not None
        )
        assert decoded == measured["vision_tokens"][index]
        media = len(rows[index][1].get("images", [])) + len(rows[index][1].get("videos", []))
        assert measured["media"][index] == media
    assert measured["vision_tokens"].sum() > 0
    assert (measured["media"] > 1).any()


def test_rows_that_cannot_be_packed_are_counted_by_kind_with_their_reason(
    chat_rows: ChatRows, tmp_path: Path
) -> None:
    good = chat_rows.path.read_text().splitlines()
    two_images = next(row for row in good if len(json.loads(row).get("images", [])) == 2)
    rows = [
        good[0],
        "{not json",
        json.dumps(
            {"conversations": [{"from": "human", "value": "<image>\nhi"}], "images": ["gone.jpg"]}
        ),
        json.dumps({"input": "q " * 3000, "output": "a"}),
        json.dumps(["a list"]),
        "",
        json.dumps({"input": "q", "output": "a"}),
        two_images,
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows) + "\n")
    spec = PlanSpec(RowLayout(4096), VisionBudget(max_media=1))
    source = JsonSource.open(path, chat_rows.media_root)
    assert len(source) == 7  # the blank line is no row
    (part,) = source.partitions()
    encoder = make_encoder(None, media=SMALL_MEDIA)
    measured = measure_partition(part, encoder, spec, chat_rows.media_root)
    kinds = ["", "bad_row", "media_error", "overlong", "bad_row", "", "over_vision_cap"]
    assert measured["skip"].tolist() == kinds
    reasons = measured["reason"].tolist()
    assert "row 1: invalid JSON" in reasons[1]
    assert "sample '2', member 'images[0]'" in reasons[2]
    assert "gone.jpg" in reasons[2]
    assert "above seq_length=4096" in reasons[3]
    assert "expected a JSON object" in reasons[4]
    assert "above max_media=1" in reasons[6]
    assert measured["length"][[1, 2, 4]].tolist() == [0, 0, 0]  # not measured
    assert measured["length"][3] > 4096  # measured, then refused
    assert measured["media"][6] == 2


def test_a_json_array_is_read_as_rows_of_one_partition_each(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"input": f"q{i}", "output": "a" * i} for i in range(5)]))
    source = JsonSource.open(path)
    measured = _measured(path, None, make_encoder(None))
    assert len(source) == 5
    assert measured["index"].tolist() == [0, 1, 2, 3, 4]
    assert np.diff(measured["length"]).tolist() == [1, 1, 1, 1]  # one byte token per "a"


def test_a_parquet_source_measures_as_its_jsonl_rows(chat_rows: ChatRows, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    kept, rows = sharegpt_rows(chat_rows)
    lines = chat_rows.path.read_text().splitlines()
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(lines[i] + "\n" for i in kept))
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("conversations", pa.list_(turn)),
            ("system", pa.string()),
            ("images", pa.list_(image)),
            ("videos", pa.list_(pa.string())),
        ]
    )
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema), parquet, row_group_size=128)
    encoder = make_encoder(None, media=SMALL_MEDIA)
    source = open_source(parquet, chat_rows.media_root)
    assert len(source) == len(kept) > 128
    assert len(source.partitions()) == -(-len(kept) // 128)  # one per row group
    from_parquet = _measured(parquet, chat_rows.media_root, encoder)
    from_jsonl = _measured(jsonl, chat_rows.media_root, encoder)
    assert set(from_jsonl["skip"].tolist()) == {""}
    for name in ("index", "length", "vision_tokens", "media", "skip"):
        assert from_parquet[name].tolist() == from_jsonl[name].tolist(), name
    not_parquet = tmp_path / "bad.parquet"
    not_parquet.write_bytes(b"PAR1 but no footer")
    with pytest.raises(ValueError, match=r"bad\.parquet is not a readable Parquet file"):
        open_source(not_parquet)
