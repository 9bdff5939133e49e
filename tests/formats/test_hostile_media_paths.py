"""Hostile media paths in chat rows (issue 35, item 3): a NUL byte, a 5,000-character name, a
symlink loop are each a ``MediaError`` naming the row, skipped and listed like any bad medium,
never a raw ``ValueError`` / ``OSError`` / ``RuntimeError`` out of ``ChatDataset``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from helpers import image_bytes

from energon_pack import VLMPackingCollator
from energon_pack.encoding.chatml import ConversationEncoder
from energon_pack.formats import ChatDataset
from energon_pack.formats.chat_rows import resolve_inside
from energon_pack.media import MediaError

SEED = 20261201


def _row(key: str, path: str) -> dict[str, object]:
    return {
        "id": key,
        "conversations": [{"from": "human", "value": "<image>Hi"}, {"from": "gpt", "value": "Yo"}],
        "image": path,
    }


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(image_bytes(32, 32))
    (root / "loop_a").symlink_to("loop_b")
    (root / "loop_b").symlink_to("loop_a")
    (root / "folder").mkdir()
    return root


def _paths() -> dict[str, tuple[str, str]]:
    rng = random.Random(SEED)
    name = "".join(rng.choices("abcdefghij", k=5000)) + ".png"
    nested = "/".join("".join(rng.choices("xyz", k=200)) for _ in range(30)) + ".png"
    return {
        "nul": (f"img{rng.randrange(100)}\x00.png", "embedded null byte"),
        "long_name": (name, "(ENAMETOOLONG)"),
        "long_path": (nested, "(ENAMETOOLONG)"),
        "loop": ("loop_a", "a symlink loop"),
        "loop_inside": ("loop_a/x.png", "a symlink loop"),
        "folder": ("folder", "not found under"),
    }


@pytest.mark.parametrize("case", sorted(_paths()))
def test_a_hostile_path_is_a_media_error_naming_the_row(root: Path, case: str) -> None:
    path, reason = _paths()[case]
    key, row = ChatDataset([_row(case, path)], media_root=root)[0]  # never raises
    with pytest.raises(MediaError) as error:
        ConversationEncoder().encode_sample(key, row)
    assert (error.value.key, error.value.member, error.value.kind) == (case, "image", "bad_sample")
    assert reason in error.value.cause
    assert len(str(error.value)) < 600  # a 5,000-character name is cut in the message
    with pytest.raises(MediaError, match=r"media (path|file) ") as direct:
        resolve_inside(root, path, case, "image")
    assert direct.value.key == case


def test_hostile_paths_are_skipped_and_listed_by_the_collator(root: Path) -> None:
    rows = [_row(case, path) for case, (path, _) in sorted(_paths().items())]
    dataset = ChatDataset([*rows, _row("good", "ok.png")], media_root=root)
    batch = VLMPackingCollator(1024, on_media_error="skip")(
        [dataset[i] for i in range(len(rows) + 1)]
    )
    assert sorted(batch.skipped_keys) == sorted(_paths())
    assert batch.keys == (("good",),)
