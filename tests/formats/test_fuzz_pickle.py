"""Seeded fuzzing of the restricted unpickler (Bridge's ``jpgs`` / ``videos`` members).

Thousands of mutated pickles (bytes flipped, truncated, random bytes spliced in) go through
:func:`~energon_pack.formats.safe_pickle.load_arrays` in a child process, so a native crash
would be seen as the child's death: every outcome must be arrays or a ``MediaError``.
"""

from __future__ import annotations

import textwrap

import pytest
from fuzz_child import fuzz_report

CHILD = textwrap.dedent(
    """
    import json, pickle, random, sys
    import numpy as np
    from energon_pack.formats.safe_pickle import load_arrays
    from energon_pack.media import MediaError

    rng = random.Random(int(sys.argv[1]))
    allow_bytes = sys.argv[3] == "bytes"
    frames = [np.arange(2 * 3 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3, 3)]
    values = [[frames[0][0]], [frames], [frames[0].astype(np.float32)]]
    if allow_bytes:  # the Mantis layout: a list of encoded image files, or files and arrays
        png = b"\\x89PNG\\r\\n\\x1a\\n" + bytes(range(40))
        values += [[png], [b"\\xff\\xd8\\xff", frames[0][0]]]
    seeds = [pickle.dumps(value, protocol=p) for p in (2, 4, 5) for value in values]
    counts = {"arrays": 0, "media_error": 0, "other": 0}
    others = []
    for _ in range(int(sys.argv[2])):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            how = rng.randrange(3) if len(data) > 1 else 2
            if how == 0:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif how == 1:
                del data[rng.randrange(1, len(data)):]
            else:
                at = rng.randrange(len(data))
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        try:
            load_arrays(bytes(data), "k", "jpgs", allow_bytes=allow_bytes)
            counts["arrays"] += 1
        except MediaError:
            counts["media_error"] += 1
        except BaseException as exc:
            counts["other"] += 1
            others.append(repr(exc)[:200])
    print(json.dumps({"counts": counts, "others": others[:5]}))
    """
)


@pytest.mark.parametrize("items", ["arrays", "bytes"])
def test_mutated_pickles_give_arrays_or_media_errors_never_a_crash(items: str) -> None:
    """``items="bytes"``: the unpickler as the Mantis layout calls it (bytes items allowed)."""
    report = fuzz_report(CHILD, "20261130", "3000", items)
    counts = report["counts"]
    assert counts["other"] == 0, report["others"]
    assert sum(counts.values()) == 3000
    assert counts["media_error"] > 1000  # the mutations really break most pickles
    assert counts["arrays"] > 0  # and some survive intact (e.g. a flipped pixel byte)
