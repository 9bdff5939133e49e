"""The manifest of a packed directory: what it records, how a directory is checked against a
request (reuse or rebuild) and on open (sizes, shapes, CRC-32 samples).

A directory is reused only when the request matches every input that decides its packs (the
spec, the format, the input's sha256, the tokenizer's identity and content: its special tokens
and their ids, its vocabulary and rules, the chat template) and its files are still what the
build wrote (:func:`reuse_problems`: each data file's size, header and block sample, the
metadata file's size and CRC-32).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from energon_pack.offline.spec import (
    FORMATS,
    MANIFEST_FILE,
    STATS,
    PackingSpec,
    PackMetadata,
    data_files,
    is_int,
    metadata_file,
)
from energon_pack.sources.files import name_os_errors

FORMAT_VERSION = 2
"""Manifest layout written; format 1 (no ``arrays`` entry) is still read, unchecked."""
_READABLE_FORMATS = (1, FORMAT_VERSION)


_ARRAY_FACTS = ("bytes", "shape", "dtype", "crc32", "sample_crc32")
_SAMPLE_BLOCKS = 16
_SAMPLE_BLOCK_BYTES = 1 << 16
"""The block sample checked on every open: 16 blocks of 64 KiB spread over the file."""
_READ_BYTES = 1 << 20


_FILE_FACTS = ("bytes", "crc32", "sample_crc32")
_METADATA_FACTS = ("bytes", "crc32", "fields")
_TOKENIZER_FLAGS = ("add_bos_token", "add_eos_token")


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The manifest of ``out_dir`` (None: there is none), checked to hold every key read."""
    path = out_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    fix = "rebuild with --force or point to a new directory"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read {path} ({error}); {fix}") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version not in _READABLE_FORMATS:
        raise ValueError(
            f"{path} is not an energon_pack offline manifest of format "
            f"{' or '.join(map(str, _READABLE_FORMATS))} (format_version={version!r}); {fix}"
        )
    problem = _manifest_problem(manifest)
    if problem:
        raise ValueError(f"{path} is malformed: {problem}; {fix}")
    return dict(manifest)


def file_record(path: Path, *, npy: bool) -> dict[str, Any]:
    """What the manifest records of a data file (``.npy`` files: also shape and dtype)."""
    facts = array_facts(path) if npy else {"bytes": path.stat().st_size}
    return {
        **facts,
        "crc32": crc32(path, sample=False),
        "sample_crc32": crc32(path, sample=True),
    }


def _manifest_problem(manifest: Mapping[str, Any]) -> str | None:
    """What a manifest of a readable format lacks, or None."""
    keys: list[str] = ["spec", "tokenizer", "stats"]
    keys += ["arrays"] if manifest["format_version"] >= 2 else []
    missing = [key for key in keys if not isinstance(manifest.get(key), dict)]
    if missing:
        return f"it has no {', '.join(missing)} (JSON object{'s' if len(missing) > 1 else ''})"
    try:
        PackingSpec.from_json(manifest["spec"])
    except (TypeError, ValueError) as error:
        return f"its spec is not a PackingSpec ({error})"
    if not is_int(manifest["tokenizer"].get("pad_token_id")):
        return "it has no int tokenizer.pad_token_id"
    if sorted(manifest["stats"]) != sorted(STATS) or not all(
        is_int(value) for value in manifest["stats"].values()
    ):
        return f"its stats are not the int counters {', '.join(STATS)}"
    format = manifest.get("format", "energon_pack")
    if format not in FORMATS:
        return f"its format {format!r} is none of {', '.join(FORMATS)}"
    facts = _ARRAY_FACTS if format == "energon_pack" else _FILE_FACTS
    size = manifest["spec"]["packed_sequence_size"]
    for name in data_files(format, size) if "arrays" in keys else ():
        record = manifest["arrays"].get(name)
        if not isinstance(record, dict) or sorted(record) != sorted(facts):
            return f"it has no arrays.{name} record with {', '.join(facts)}"
    record = manifest.get("metadata")  # absent in manifests of earlier versions
    if record is not None and (
        not isinstance(record, dict) or sorted(record) != sorted(_METADATA_FACTS)
    ):
        return f"its metadata record is not an object of {', '.join(_METADATA_FACTS)}"
    if not isinstance(manifest.get("tokenizer_content", {}), dict):
        return "its tokenizer_content is not a JSON object"
    return None


def array_facts(path: Path) -> dict[str, Any]:
    """Size, shape and dtype of the ``.npy`` file ``path``; ValueError naming it when its size
    is not what its header describes (truncated) or it is no ``.npy`` array."""
    with path.open("rb") as data:
        try:
            version = np.lib.format.read_magic(data)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(data)
        except ValueError as error:
            raise ValueError(
                f"{path} is not a .npy array file ({error}); rebuild the pack with "
                "energon-pack offline --force"
            ) from None
        expected = data.tell() + math.prod(shape) * dtype.itemsize
        size = os.fstat(data.fileno()).st_size
    if size != expected:
        raise ValueError(
            f"{path} has {size} bytes but its header describes {expected} ({dtype} {shape}): the "
            "file is truncated or damaged; rebuild the pack with energon-pack offline --force"
        )
    return {"bytes": size, "shape": list(shape), "dtype": dtype.str}


def crc32(path: Path, *, sample: bool) -> int:
    """CRC-32 of the file, or of :data:`_SAMPLE_BLOCKS` blocks spread over it (first and last
    included; the whole file when it is smaller than the sample)."""
    value = 0
    with path.open("rb") as data:
        size = os.fstat(data.fileno()).st_size
        spans = [(0, size)]
        if sample and size > _SAMPLE_BLOCKS * _SAMPLE_BLOCK_BYTES:
            step = (size - _SAMPLE_BLOCK_BYTES) // (_SAMPLE_BLOCKS - 1)
            spans = [(i * step, _SAMPLE_BLOCK_BYTES) for i in range(_SAMPLE_BLOCKS - 1)]
            spans.append((size - _SAMPLE_BLOCK_BYTES, _SAMPLE_BLOCK_BYTES))
        for offset, length in spans:
            data.seek(offset)
            while length > 0 and (block := data.read(min(length, _READ_BYTES))):
                value = zlib.crc32(block, value)
                length -= len(block)
    return value


def read_metadata(out_dir: Path, manifest: Mapping[str, Any]) -> PackMetadata:
    """The packing metadata of the pack ``manifest`` describes (``{}``: an energon_pack one)."""
    format = manifest.get("format", "energon_pack")
    size = manifest["spec"]["packed_sequence_size"] if manifest else 0
    path = out_dir / metadata_file(format, size)
    try:
        data = json.loads(path.read_text())
        entry = data[0] if isinstance(data, list) else data
        return PackMetadata(**{f.name: entry[f.name] for f in dataclasses.fields(PackMetadata)})
    except (OSError, json.JSONDecodeError, LookupError, TypeError) as error:
        raise ValueError(
            f"cannot read the packing metadata {path} ({error!r}); re-run energon-pack offline "
            "--force to rewrite it"
        ) from None


def manifest_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    out = spec_differences(PackingSpec.from_json(old["spec"]), PackingSpec.from_json(new["spec"]))
    if old.get("format", "energon_pack") != new["format"]:
        out.append(
            f"format={old.get('format', 'energon_pack')!r} but the request has {new['format']!r}"
        )
    for name in ("format_version", "input_sha256", "tokenizer", "energon_pack_version"):
        if old.get(name) != new[name]:
            out.append(f"{name}={old.get(name)!r} but the request has {new[name]!r}")
    built = old.get("tokenizer_content")
    if built is None:
        out.append(
            "no record of the tokenizer's special tokens and vocabulary (tokenizer_content; a "
            "manifest of an earlier energon_pack), so the tokenizer cannot be checked"
        )
    else:
        asked = new["tokenizer_content"]
        out += [
            f"tokenizer_content.{key}={built.get(key)!r} but the request has {asked.get(key)!r}"
            for key in sorted(set(built) | set(asked))
            if built.get(key) != asked.get(key)
        ]
    return out


def tokenizer_content(tokenizer: Any) -> dict[str, Any]:
    """What decides a tokenizer's ids beyond its identity (class, name, vocabulary size, pad
    id): its length, its bos/eos/pad/unk tokens and ids, every added token, the
    ``add_bos_token`` / ``add_eos_token`` flags, and the SHA-256 of its rules (a fast
    tokenizer's ``backend_tokenizer.to_str()``, else its vocabulary); None where it has none."""
    facts: dict[str, Any] = {}
    try:
        facts["length"] = len(tokenizer)
    except TypeError:
        facts["length"] = None
    for name in ("bos", "eos", "pad", "unk"):
        token = getattr(tokenizer, f"{name}_token", None)
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        facts[f"{name}_token"] = token if isinstance(token, str) else None
        facts[f"{name}_token_id"] = token_id if is_int(token_id) else None
    for flag in _TOKENIZER_FLAGS:
        value = getattr(tokenizer, flag, None)
        facts[flag] = value if isinstance(value, bool) else None
    added = getattr(tokenizer, "added_tokens_decoder", None)
    facts["added_tokens_sha256"] = (
        _digest(
            [
                [index, str(token), bool(getattr(token, "special", False))]
                for index, token in sorted(added.items())
            ]
        )
        if isinstance(added, Mapping)
        else None
    )
    facts["rules_sha256"] = _rules_digest(tokenizer)
    return facts


def _rules_digest(tokenizer: Any) -> str | None:
    to_str = getattr(getattr(tokenizer, "backend_tokenizer", None), "to_str", None)
    if callable(to_str):
        return hashlib.sha256(to_str().encode("utf-8")).hexdigest()
    vocab = getattr(tokenizer, "get_vocab", None)
    if callable(vocab):
        return _digest(sorted(vocab().items()))
    return None


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False).encode("utf-8")).hexdigest()


def metadata_record(path: Path, metadata: PackMetadata) -> dict[str, Any]:
    """What the manifest records of the metadata file ``path`` written for ``metadata``."""
    return {
        "bytes": path.stat().st_size,
        "crc32": crc32(path, sample=False),
        "fields": dataclasses.asdict(metadata),
    }


def metadata_problem(path: Path, record: Mapping[str, Any]) -> str | None:
    """How the metadata file ``path`` differs from the manifest's ``record`` of it, or None."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size == record["bytes"] and crc32(path, sample=False) == record["crc32"]:
        return None
    try:
        text = json.loads(path.read_text())
        entry = text[0] if isinstance(text, list) else text
        changed = [
            f"{key}={entry.get(key)!r} where the build wrote {value!r}"
            for key, value in record["fields"].items()
            if entry.get(key) != value
        ]
    except (OSError, ValueError, LookupError, AttributeError, TypeError):
        changed = []
    what = "; ".join(changed) if changed else f"{size} bytes, CRC-32 {crc32(path, sample=False)}"
    return (
        f"{path.name} was edited after the build ({what}; the manifest records "
        f"{record['bytes']} bytes, CRC-32 {record['crc32']})"
    )


def reuse_problems(out_dir: Path, manifest: Mapping[str, Any]) -> list[str]:
    """How the files of ``out_dir`` differ from what ``manifest`` records (empty: intact).

    Each data file's size and block sample (and a ``.npy`` file's header: shape, dtype) and the
    metadata file's size and CRC-32 are checked; a manifest without a metadata record (of an
    earlier version) is a problem too, since that file cannot be checked."""
    format = manifest.get("format", "energon_pack")
    size = manifest["spec"]["packed_sequence_size"]
    problems = []
    records = manifest.get("arrays", {})
    for name in data_files(format, size):
        path, record = out_dir / name, records.get(name)
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        if record is None:
            continue
        try:
            npy = format == "energon_pack"
            facts = array_facts(path) if npy else {"bytes": path.stat().st_size}
        except ValueError as error:
            problems.append(str(error).split(";")[0])
            continue
        facts["sample_crc32"] = crc32(path, sample=True)
        problems += [
            f"{name} has {value} bytes, the manifest records {record[key]}"
            if key == "bytes"
            else f"{name} has {key} {value!r}, the manifest records {record[key]!r}"
            for key, value in facts.items()
            if value != record[key]
        ][:1]
    name = metadata_file(format, size)
    record = manifest.get("metadata")
    if record is None:
        problems.append(
            f"the manifest records no size or CRC-32 of {name} (written by an earlier "
            "energon_pack), so the packing metadata cannot be checked"
        )
    else:
        problem = metadata_problem(out_dir / name, record)
        if problem is not None:
            problems.append(problem)
    return problems


def damaged_message(out_dir: Path, problems: list[str]) -> str:
    return (
        f"pack dir {out_dir} does not hold what its {MANIFEST_FILE} records: "
        f"{'; '.join(problems)}; the files were changed, cut or replaced after the build, so "
        "the pack is not reused: rebuild with --force (force=True) or point to a new directory"
    )


def spec_differences(built: PackingSpec, asked: PackingSpec) -> list[str]:
    return [
        f"{f.name}={getattr(built, f.name)!r} but the spec asks {getattr(asked, f.name)!r}"
        for f in dataclasses.fields(PackingSpec)
        if getattr(built, f.name) != getattr(asked, f.name)
    ]


def stale_message(out_dir: Path, differences: list[str], *, reader: bool = False) -> str:
    fix = (
        "rebuild it with energon-pack offline --force, or read it without a spec"
        if reader
        else "rebuild with --force (force=True) or point to a new directory"
    )
    return f"pack dir {out_dir} was built with {'; '.join(differences)}; {fix}"


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with name_os_errors(tmp):
        tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
