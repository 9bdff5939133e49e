"""The samples a verification packs: the first few of the user's source, encoded by the
family's encoder, and the variant of one sample that the leakage probe swaps in.

A source is a WebDataset / Megatron-Energon directory (its ``.tar`` shards in name order, each
sample the members that share a key, as Energon's crude samples hold them) or a JSON / JSONL
file of rows in any layout the collator reads. A sample the encoder refuses (a medium the family
does not take, an unreadable file) is counted by reason and skipped; the next one is taken.
"""

from __future__ import annotations

import io
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from energon_pack.encoding.chatml import SampleEncoder
from energon_pack.formats.chat_rows import read_media_paths
from energon_pack.media import MediaError
from energon_pack.packing.packed import EncodedSample
from energon_pack.sources.files import read_records


@dataclass(frozen=True)
class Samples:
    """The encoded samples of a verification and the ones skipped on the way."""

    encoded: tuple[EncodedSample, ...]
    skipped: dict[str, int]
    """Reason (a ``MediaError`` kind, or ``overlong``) -> samples skipped for it."""


def raw_samples(source: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(key, sample)`` of each sample of ``source`` in stream order (see the module
    docstring). Raises ValueError for a source that is neither form."""
    if source.is_dir():
        shards = sorted(source.glob("*.tar"))
        if not shards:
            raise ValueError(
                f"--data {source}: a directory must hold WebDataset .tar shards (an Energon "
                "dataset); give a JSON/JSONL file of rows otherwise"
            )
        for shard in shards:
            yield from _shard_samples(shard)
        return
    if source.suffix not in (".json", ".jsonl"):
        raise ValueError(
            f"--data {source}: expected a dataset directory of .tar shards or a .json/.jsonl file"
        )
    yield from _rows(source)


def encode_samples(
    source: Path, encoder: SampleEncoder, *, count: int, max_tokens: int, media: bool
) -> Samples:
    """The first ``count`` samples of ``source`` the encoder takes, each at most
    ``max_tokens`` long (and without images or videos unless ``media``: a text model takes
    none); raises ValueError when fewer than two are left."""
    encoded: list[EncodedSample] = []
    skipped: Counter[str] = Counter()
    for key, raw in raw_samples(source):
        try:
            sample = encoder.encode_sample(key, raw)
        except MediaError as error:
            skipped[error.kind] += 1
            continue
        if sample.media and not media:
            skipped["media_for_text_model"] += 1
            continue
        if sample.length > max_tokens:
            skipped["overlong"] += 1
            continue
        encoded.append(sample)
        if len(encoded) == count:
            break
    if len(encoded) < 2:
        raise ValueError(
            f"--data {source}: {len(encoded)} sample(s) encoded, at least 2 are needed to "
            f"pack (skipped: {dict(skipped) or 'none'}); give a source with more samples or "
            "raise --max-tokens"
        )
    return Samples(tuple(encoded), dict(skipped))


def changed(sample: EncodedSample, regular_ids: torch.Tensor, seed: int) -> EncodedSample:
    """``sample`` with other text and other pictures of the same size: every token in
    ``regular_ids`` swapped for another of them, every image replaced by seeded noise of its
    displayed size (so its vision tokens stay as they were). Videos are kept."""
    ids = sample.input_ids.clone()
    swappable = torch.isin(ids, regular_ids)
    position = torch.searchsorted(regular_ids, ids[swappable])
    ids[swappable] = regular_ids[(position + 1) % len(regular_ids)]
    rng = np.random.default_rng(seed)
    media = tuple(
        replace(item, data=_noise_png(item.data, rng))
        if item.kind == "image" and isinstance(item.data, bytes)
        else item
        for item in sample.media
    )
    return replace(sample, input_ids=ids, media=media, vision=None)


def _noise_png(data: bytes, rng: np.random.Generator) -> bytes:
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as image:
        width, height = ImageOps.exif_transpose(image).size
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _shard_samples(shard: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The samples of one WebDataset shard (an uncompressed tar, as Energon reads them):
    consecutive members sharing a key. Raises ValueError naming the shard where it stops
    being a readable tar."""
    taken = 0
    try:
        with tarfile.open(shard, mode="r:") as tar:
            for sample in _grouped(tar):
                taken += 1
                yield sample
    except (tarfile.TarError, EOFError, OSError) as error:
        raise ValueError(
            f"--data: shard {shard} is not a readable tar after {taken} sample(s) ({error}); "
            "repair or leave out that shard, or give fewer --samples"
        ) from error


def _grouped(tar: tarfile.TarFile) -> Iterator[tuple[str, dict[str, Any]]]:
    current: dict[str, Any] = {}
    for member in tar:
        handle = tar.extractfile(member) if member.isfile() else None
        if handle is None:
            continue
        name = member.name.rsplit("/", 1)[-1]
        key, _, extension = name.partition(".")
        prefix = member.name[: len(member.name) - len(name)] + key
        if current and current["__key__"] != prefix:
            yield current["__key__"], current
            current = {}
        current["__key__"] = prefix
        current[extension] = handle.read()
    if current:
        yield current["__key__"], current


def _rows(source: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rows of a JSON/JSONL file, their media paths read from inside its folder."""
    for number, key, row in read_records(source):
        if not isinstance(row, dict):
            raise ValueError(f"--data {source} row {number}: expected a JSON object")
        yield key, read_media_paths(row, key, source.parent)
