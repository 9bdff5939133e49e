"""Seeded fuzzing of what a loader reads from a plan's directory: ``plan.json``, the pack index
(``index/*.npy``) and the JSONL line index (``rows.npy``).

Thousands of mutated copies of one plan (bytes flipped in the arrays' data and headers, files
cut short, JSON values overwritten) are opened with :class:`~energon_pack.PlannedDataset` and
every pack is read, in a child process so that a crash or a hang would be seen as the child's
death. Every outcome must be a pack, a ``ValueError`` naming the plan directory at open (or the
pack at read), or members skipped by name; never another error.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
from fuzz_child import fuzz_report
from PIL import Image

from energon_pack import PlannedDataset, PlanSpec, RowLayout, make_encoder, plan_dataset

MUTATIONS = 3000

CHILD = textwrap.dedent(
    """
    import json, logging, random, shutil, sys, tempfile
    from pathlib import Path
    from energon_pack import PlannedDataset, make_encoder

    logging.disable(logging.CRITICAL)
    plan, count, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    FILES = ["plan.json", "rows.npy", "index/packs.npy", "index/member_starts.npy",
             "index/keys.npy", "index/key_starts.npy"]
    encoder = make_encoder(None)

    def mutate(path):
        data = bytearray(path.read_bytes())
        how = rng.randrange(4)
        if how == 0:  # bytes flipped anywhere (the .npy header included)
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == 1:  # cut short
            del data[rng.randrange(len(data)):]
        elif how == 2 and path.suffix == ".npy":  # a value of the array's data overwritten
            header = data.index(b"\\n") + 1
            if len(data) > header + 8:
                at = rng.randrange(header, len(data) - 7)
                value = rng.choice([-1, 0, 1, 2**31, 2**62, rng.randrange(-50, 5000)])
                data[at:at + 8] = value.to_bytes(8, "little", signed=True)
        else:  # a JSON value replaced
            if path.suffix == ".json":
                record = json.loads(data)
                section = rng.choice(["counts", "spec", "source", "encoder"])
                if isinstance(record.get(section), dict) and record[section]:
                    name = rng.choice(sorted(record[section]))
                    record[section][name] = rng.choice([None, -1, "x", [], {}, 10**12])
                data = bytearray(json.dumps(record).encode())
            else:
                data[rng.randrange(len(data))] ^= 0xFF
        path.write_bytes(bytes(data))

    counts = {"packs": 0, "refused": 0, "pack_refused": 0, "members_skipped": 0, "other": 0}
    others = []
    with tempfile.TemporaryDirectory() as scratch:
        for number in range(count):
            copy = Path(scratch) / f"plan{number % 3}"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(plan, copy)
            mutate(copy / rng.choice(FILES))
            try:
                dataset = PlannedDataset(copy, encoder)
            except ValueError as error:
                if str(copy) in str(error):
                    counts["refused"] += 1
                else:
                    counts["other"] += 1
                    others.append(f"open, unnamed: {error}"[:300])
                continue
            except Exception as error:
                counts["other"] += 1
                others.append(f"open: {type(error).__name__}: {error}"[:300])
                continue
            for index in range(len(dataset)):
                try:
                    row = dataset[index]
                except ValueError as error:
                    if f"pack {index}" in str(error):
                        counts["pack_refused"] += 1
                    else:
                        counts["other"] += 1
                        others.append(f"pack {index}, unnamed: {error}"[:300])
                    continue
                except Exception as error:
                    counts["other"] += 1
                    others.append(f"pack {index}: {type(error).__name__}: {error}"[:300])
                    break
                counts["packs"] += 1
                counts["members_skipped"] += len(row.skipped_keys)
    print(json.dumps({"counts": counts, "others": others[:40]}))
    """
)


def write_plan(root: Path) -> Path:
    """A small plan of JSONL chat rows, some with an image next to the file."""
    lines = []
    for index in range(24):
        row: dict[str, object] = {"input": "question " * (1 + index % 7), "output": f"a{index}"}
        if index % 4 == 0:
            Image.new("RGB", (32, 32), (index, 9, 9)).save(root / f"{index}.png")
            turns = [{"from": "human", "value": "<image>\nwhat?"}, {"from": "gpt", "value": "a"}]
            row = {"conversations": turns, "images": [f"{index}.png"]}
        lines.append(json.dumps(row))
    (root / "rows.jsonl").write_text("\n".join(lines) + "\n")
    spec = PlanSpec(RowLayout(512), data_parallel_size=2, global_batch_size=2)
    plan_dataset(root / "rows.jsonl", root / "plan", spec, make_encoder(None), engine="local")
    return root / "plan"


def test_mutated_plans_give_packs_or_errors_naming_them(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    report = fuzz_report(CHILD, str(plan), str(MUTATIONS), "0", timeout=1200)
    counts = report["counts"]
    assert counts["other"] == 0, report["others"]
    assert counts["refused"] > MUTATIONS / 2, counts  # most are caught at open, by name
    assert counts["packs"] > MUTATIONS / 10, counts  # the rest leave packs readable
    assert counts["members_skipped"] > 0, counts  # a key no row has: its member skipped
    assert counts["pack_refused"] > 0, counts  # no member readable: the pack named


def test_a_damaged_index_or_line_index_is_refused_naming_the_file(tmp_path: Path) -> None:
    plan = write_plan(tmp_path)
    starts = plan / "index" / "member_starts.npy"
    np.save(starts, np.load(starts)[::-1].copy())  # offsets that run backwards
    with pytest.raises(ValueError, match=r"index/member_starts\.npy is not offsets running"):
        PlannedDataset(plan, make_encoder(None))
    shutil.rmtree(plan)
    plan = write_plan(tmp_path)
    (plan / "rows.npy").write_bytes((plan / "rows.npy").read_bytes()[:100])  # cut short
    with pytest.raises(ValueError, match=r"rows\.npy is not an array numpy reads"):
        PlannedDataset(plan, make_encoder(None))
