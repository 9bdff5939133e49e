"""Pickle bombs in Megatron-Bridge's ``jpgs`` / ``videos`` members (issue 35, item 3).

A few bytes of pickle can claim gigabytes: an array shape, a memo index, a length field, a list
that names one frame 100,000 times, millions of one-byte empty lists. Each attack runs in one
child process (where it could allocate, or crash numpy) through the Bridge layout's parser; the
child reports, per attack, the error and how much its peak RSS grew. Each must be a named
``MediaError`` before the memory is allocated. Sizes are drawn from a seeded generator.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest

from energon_pack.formats.safe_pickle import (
    OPCODE_BYTES,
    PICKLE_SLACK_BYTES,
    load_arrays,
    pickle_bound,
)
from energon_pack.media import MediaError

SEED = 20261201
GROWTH_LIMIT_MB = 100
"""Most a refused attack may grow the child's peak RSS (each claims 250 MB to 4.9 GB)."""

CHILD = textwrap.dedent(
    """
    import json, pickle, random, resource, struct, sys
    import numpy as np
    from energon_pack.formats.bridge import parse_bridge_sample
    from energon_pack.media import MediaError

    rng = random.Random(int(sys.argv[1]))
    P2, P4 = b"\\x80\\x02", b"\\x80\\x04"
    RECONSTRUCT = b"cnumpy._core.multiarray\\n_reconstruct\\n"
    NDARRAY, DTYPE = b"cnumpy\\nndarray\\n", b"cnumpy\\ndtype\\n"

    def text(s):
        return b"X" + struct.pack("<I", len(s)) + s.encode()

    def int4(n):
        return b"J" + struct.pack("<i", n)

    n = rng.randrange(200_000_000, 250_000_000)  # elements: 1.6 to 2 GB as pointers
    side = rng.randrange(80, 100)  # a frame of side x side x 3 bytes, 19-30 KB
    frame = np.full((side, side, 3), rng.randrange(256), np.uint8)
    attacks = {
        # _reconstruct(ndarray, (n,), "O"): numpy fills n object pointers (71 bytes)
        "reconstruct_object": P2 + b"]" + RECONSTRUCT + NDARRAY + int4(n) + b"\\x85"
        + text("O") + b"\\x87Ra.",
        # the same shape of uint8: n bytes, allocated before any check of the result
        "reconstruct_uint8": P2 + b"]" + RECONSTRUCT + NDARRAY + int4(8 * n) + b"\\x85"
        + text("u1") + b"\\x87Ra.",
        # numpy.ndarray((n,), "O") called directly
        "ndarray_called": P2 + b"]" + NDARRAY + int4(n) + b"\\x85" + text("O") + b"\\x86Ra.",
        # an object array's state with too short a list: numpy 2.4 crashes on it
        "object_state": P2 + b"]" + RECONSTRUCT + NDARRAY + b"K\\x00\\x85" + text("b")
        + b"\\x87R(K\\x01" + int4(rng.randrange(10, 1000)) + b"\\x85" + DTYPE + text("O8")
        + b"\\x89\\x88\\x87R\\x89]tba.",
        # a void dtype of 1.6-2 GB per element, one element
        "void_dtype": P2 + b"]" + RECONSTRUCT + NDARRAY + b"K\\x01\\x85" + text(f"V{8 * n}")
        + b"\\x87Ra.",
        # LONG_BINPUT at index 2**27: the unpickler grows its memo table to 2 GB
        "memo_index": P2 + b"]r" + struct.pack("<I", 1 << 27) + b".",
        # BINBYTES8 claiming 2**40 bytes in a 20-byte pickle
        "length_claim": P4 + b"]\\x8e" + struct.pack("<Q", 1 << 40) + b"xxxx" + b"a.",
        # one frame named 100,000 times: 225 KB of pickle, stacked into 2-3 GB
        "frame_references": pickle.dumps([[frame] * 100_000], protocol=4),
        # 3 MB of one-byte empty lists: 3 million list objects
        "empty_lists": P4 + b"](" + b"]" * 3_000_000 + b"e.",
        # 3,000 references to one list of 3,000 empty frames: 9 million entries to walk
        "list_entries": pickle.dumps([[np.zeros((0, 2, 2, 3), np.uint8)] * 3000] * 3000),
    }
    turns = [{"from": "human", "value": "<video>Hi"}, {"from": "gpt", "value": "Yo"}]
    out = {}
    for name, data in attacks.items():
        member = "videos" if name in ("frame_references", "list_entries") else "jpgs"
        turns[0]["value"] = "<video>Hi" if member == "videos" else "<image>Hi"
        sample = {"json": json.dumps(turns).encode(), member: data}
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            parse_bridge_sample("evil", sample)
            result = {"outcome": "parsed"}
        except MediaError as error:
            result = {"outcome": "media_error", "kind": error.kind, "message": str(error)}
        except BaseException as error:
            result = {"outcome": "other", "message": repr(error)[:300]}
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        out[name] = {**result, "bytes": len(data), "grown_mb": grown / 1024}
        print(json.dumps({name: out[name]}), flush=True)
    """
)

EXPECTED = {
    "reconstruct_object": ("bad_sample", "pickle holds object"),
    "reconstruct_uint8": ("too_large", "an array of shape"),
    "ndarray_called": ("unreadable", "numpy.ndarray is only passed to _reconstruct"),
    "object_state": ("bad_sample", "pickle holds object"),
    "void_dtype": ("too_large", "an array of shape (1,) and dtype |V"),
    "memo_index": ("unreadable", "pickle stores memo entry 134217728"),
    "length_claim": ("unreadable", f"pickle claims {1 << 40} bytes"),
    "frame_references": ("too_large", "each array counted at each place in the list"),
    "empty_lists": ("too_large", f"opcodes at {OPCODE_BYTES} bytes each"),
    "list_entries": ("too_large", f"{OPCODE_BYTES} bytes per list entry"),
}


@pytest.fixture(scope="module")
def attacks() -> dict[str, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(SEED)], capture_output=True, text=True, timeout=600
    )
    reports: dict[str, dict[str, Any]] = {}
    for line in done.stdout.splitlines():
        reports.update(json.loads(line))
    assert done.returncode == 0, (
        f"child died ({done.returncode}) after {list(reports)}: " + (done.stderr[-2000:])
    )
    return reports


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_pickle_bomb_is_refused_before_it_allocates(
    attacks: dict[str, dict[str, Any]], name: str
) -> None:
    report = attacks[name]
    kind, message = EXPECTED[name]
    assert report["outcome"] == "media_error", report
    assert report["kind"] == kind, report
    assert message in report["message"], report
    assert report["message"].startswith("sample 'evil', member '"), report
    assert report["grown_mb"] < GROWTH_LIMIT_MB, report


def test_the_bound_follows_the_pickles_size() -> None:
    """Arrays larger than the slack load: their data is in the pickle. A list that repeats one
    array is charged at each place, up to the pickle's size plus the slack."""
    big = np.zeros((PICKLE_SLACK_BYTES // 3 + 2**20, 3), np.uint8)  # 67 MB, over the slack
    for protocol in (2, 4, 5):
        (loaded,) = load_arrays(pickle.dumps([big], protocol=protocol), "k", "jpgs")
        assert loaded.shape == big.shape
    frame = np.ones((1024, 1024, 3), np.uint8)  # 3 MiB
    twice = pickle.dumps([[frame] * 2])
    assert len(load_arrays(twice, "k", "videos")[0]) == 2
    fits = (PICKLE_SLACK_BYTES + len(twice)) // frame.nbytes - 1
    assert len(load_arrays(pickle.dumps([[frame] * fits]), "k", "videos")[0]) == fits
    with pytest.raises(MediaError, match="each array counted at each place") as error:
        load_arrays(pickle.dumps([[frame] * (fits + 2)]), "k", "videos")
    assert error.value.kind == "too_large"
    assert f"bound of {pickle_bound(len(pickle.dumps([[frame] * (fits + 2)])))}" in str(error.value)


def test_max_bytes_sets_the_bound() -> None:
    data = pickle.dumps([np.zeros((64, 64, 3), np.uint8)])
    assert len(load_arrays(data, max_bytes=20_000)) == 1
    with pytest.raises(MediaError, match=r"bound of 10000 bytes \(max_bytes\)"):
        load_arrays(data, max_bytes=10_000)


@pytest.mark.parametrize(
    ("data", "kind", "message"),
    [
        (b"\x80\x04\x8f.", "unsupported", "opcode EMPTY_SET at byte 2"),
        (b"\x80\x04]\x82\x01a.", "unsupported", "opcode EXT1"),
        (b"\x80\x04]Q.", "unsupported", "opcode BINPERSID"),
        (b"\x80\x04]\x00.", "unreadable", "byte 3 (b'\\x00') is no pickle opcode"),
        (b"\x80\x04\x95" + (1 << 40).to_bytes(8, "little") + b"].", "unreadable", "claims"),
        (b"(lp5\n.", "unreadable", "memo entry 5"),
    ],
)
def test_opcodes_outside_arrays_and_forged_fields_are_refused(
    data: bytes, kind: str, message: str
) -> None:
    with pytest.raises(MediaError) as error:
        load_arrays(data, "k", "jpgs")
    assert error.value.kind == kind
    assert message in str(error.value)


def test_every_protocol_still_reads_arrays_and_files() -> None:
    frames = np.arange(2 * 4 * 5 * 3, dtype=np.uint8).reshape(2, 4, 5, 3)
    value = [frames[0], b"\x89PNG", [frames[1].astype(np.float32), frames[0].T.copy("F")]]
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        data = pickle.dumps(value, protocol=protocol)
        first, png, (second, third) = load_arrays(data, allow_bytes=True)
        plain = pickle.loads(data)
        assert png == b"\x89PNG"
        for got, want in ((first, plain[0]), (second, plain[2][0]), (third, plain[2][1])):
            assert got.dtype == want.dtype
            assert got.flags.f_contiguous == want.flags.f_contiguous
            np.testing.assert_array_equal(got, want)
