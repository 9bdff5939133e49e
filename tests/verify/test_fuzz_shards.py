"""Seeded fuzzing of the shard reader of ``energon-pack verify --data DIR``.

Thousands of mutated WebDataset shards (bytes flipped, truncated, header fields overwritten
with their checksum recomputed so that the damage reaches the parser behind the checksum) go
through :func:`~energon_pack.verify.data.raw_samples` in a child process, so that a crash or a
hang would be seen as the child's death: every outcome must be samples or a ``ValueError``
naming the shard.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from fuzz_child import fuzz_report

SUPPORT = Path(__file__).resolve().parents[1] / "support"

CHILD = textwrap.dedent(
    """
    import io, json, random, sys, tarfile, tempfile
    from pathlib import Path
    from energon_pack.verify.data import raw_samples
    sys.path[:0] = sys.argv[3:]
    from fuzz_child import mutated

    rng = random.Random(int(sys.argv[1]))
    count = int(sys.argv[2])

    def shard():
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for index in range(3):
                for ext, data in (("json", b'{"messages": []}'), ("png", bytes(range(200)))):
                    info = tarfile.TarInfo(f"part/s{index}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        data = buffer.getvalue()
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            headers = [member.offset for member in tar.getmembers()]
        return data, headers

    SEED, HEADERS = shard()
    FIELDS = [(0, 100), (100, 8), (124, 12), (136, 12), (156, 1), (157, 100), (257, 8),
              (345, 155)]  # name, mode, size, mtime, type, link, magic+version, prefix

    def with_checksum(data, header):
        block = data[header:header + 512]
        block[148:156] = b" " * 8
        data[header + 148:header + 156] = b"%06o\\0 " % sum(block)

    def field(rng, data, how):  # a tar header field; for how 3 with its checksum recomputed
        header = rng.choice([h for h in HEADERS if h + 512 <= len(data)] or [0])
        if header + 512 > len(data):
            return
        start, width = rng.choice(FIELDS)
        if rng.random() < 0.5:
            value = bytes(rng.randrange(256) for _ in range(width))
        else:  # plausible octal digits, often far too large
            value = (b"%o" % rng.randrange(8 ** (width - 1))).rjust(width - 1, b"0")
            value += b"\\0"
        data[header + start:header + start + width] = value[:width]
        if how == 3:
            with_checksum(data, header)

    counts = {"samples": 0, "value_error": 0, "other": 0}
    others, named = [], 0
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "shard-000000.tar"
        for _ in range(count):
            path.write_bytes(mutated(rng, SEED, field))
            try:
                list(raw_samples(Path(scratch)))
                counts["samples"] += 1
            except ValueError as error:
                counts["value_error"] += 1
                named += "shard-000000.tar" in str(error)
            except BaseException as error:
                counts["other"] += 1
                others.append(repr(error)[:200])
    print(json.dumps({"counts": counts, "named": named, "others": others[:5]}))
    """
)


def test_mutated_shards_give_samples_or_value_errors_never_a_crash() -> None:
    report = fuzz_report(CHILD, "20261204", "3000", str(SUPPORT))
    counts = report["counts"]
    assert counts["other"] == 0, report["others"]
    assert sum(counts.values()) == 3000
    assert counts["value_error"] > 300  # the mutations really break shards
    assert counts["samples"] > 300  # and many survive (a flipped payload byte)
    assert report["named"] == counts["value_error"]  # every error names the shard
