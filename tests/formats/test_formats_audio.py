"""Audio in every sample format: chat rows' ``audios`` (a file's bytes, ``{"bytes"}``, a
decoded ``{"array", "sampling_rate"}``, a path read inside the media root), ShareGPT's
``<audio>`` placeholders and ``{"type": "audio"}`` parts, native WebDataset audio members and
Megatron-Bridge's single audio members; placeholders and items checked one to one; encoders
that take no audio refuse it by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from audio_files import encode_audio
from hypothesis import given, settings
from hypothesis import strategies as st

from energon_pack import ConversationEncoder
from energon_pack.formats import parse_any
from energon_pack.formats.chat_rows import ChatDataset
from energon_pack.media import MediaError
from energon_pack.media.audio_decode import Waveform

WAV = encode_audio("wav", 16000, 1, 4000)
FLAC = encode_audio("flac", 22050, 2, 3000)


def turns(placeholders: str) -> list[dict[str, str]]:
    return [
        {"from": "human", "value": f"{placeholders}What is that sound?"},
        {"from": "gpt", "value": "A tone."},
    ]


def test_chat_row_audio_items_in_every_form() -> None:
    array = np.linspace(-0.5, 0.5, 800, dtype=np.float64)
    row = {
        "conversations": turns("<audio><image><audio><audio>"),
        "audios": [WAV, {"bytes": FLAC, "path": "x.flac"}, {"array": array, "sampling_rate": 8000}],
        "images": [b"\x89PNG"],
    }
    raw = parse_any("k", row)
    assert [(member, kind) for member, kind, _ in raw.media] == [
        ("audios[0]", "audio"),
        ("images[0]", "image"),
        ("audios[1]", "audio"),
        ("audios[2]", "audio"),
    ]
    payloads = [payload for _, _, payload in raw.media]
    assert payloads[0] == WAV
    assert payloads[2] == FLAC
    waveform = payloads[3]
    assert isinstance(waveform, Waveform)
    assert waveform.sample_rate == 8000
    assert np.array_equal(waveform.array(), array.astype(np.float32))


def test_typed_audio_parts_and_a_single_audio_field() -> None:
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello."},
        ],
        "audio": WAV,
    }
    raw = parse_any("k", row)
    assert [(m, kind) for m, kind, _ in raw.media] == [("audios[0]", "audio")]
    assert raw.messages[0]["content"][0] == {"type": "audio"}


@pytest.mark.parametrize(
    ("audios", "match"),
    [
        ([], "1 audio placeholders or parts but 0 items in 'audios'"),
        ([WAV, WAV], "1 audio placeholders or parts but 2 items"),
    ],
)
def test_placeholders_and_items_are_one_to_one(audios: list[Any], match: str) -> None:
    with pytest.raises(MediaError, match=match) as error:
        parse_any("k", {"conversations": turns("<audio>"), "audios": audios})
    assert error.value.kind == "placeholder_mismatch"


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ({"array": [[0.1, 0.2], [0.3, 0.4]], "sampling_rate": 16000}, r"shape \[2, 2\]"),
        ({"array": [], "sampling_rate": 16000}, r"shape \[0\]"),
        ({"array": [0.1, float("nan")], "sampling_rate": 16000}, "NaN"),
        ({"array": [0.1], "sampling_rate": 0}, "outside 1..768000"),
        ({"array": [0.1], "sampling_rate": 16000.0}, "must be an int"),
        ({"array": [0.1]}, "must be an int, not None"),
        ({"array": ["a"], "sampling_rate": 16000}, "not numbers"),
    ],
)
def test_a_bad_decoded_array_is_named(item: dict[str, Any], match: str) -> None:
    with pytest.raises(MediaError, match=match) as error:
        parse_any("k", {"conversations": turns("<audio>"), "audios": [item]})
    assert (error.value.kind, error.value.member) == ("bad_sample", "audios[0]")


def test_audio_paths_are_read_inside_the_media_root(tmp_path: Path) -> None:
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.wav").write_bytes(WAV)
    decoded = {"array": [0.1, 0.2], "sampling_rate": 16000, "path": "/elsewhere/b.wav"}
    rows = [
        {"conversations": turns("<audio>"), "audios": ["clips/a.wav"]},
        {"conversations": turns("<audio>"), "audio": {"path": "../out.wav", "bytes": None}},
        {"conversations": turns("<audio>"), "audios": [decoded]},  # its path is never read
    ]
    dataset = ChatDataset(rows, media_root=tmp_path)
    key, row = dataset[0]
    assert row["audios"] == [WAV]
    assert parse_any(key, row).media[0][2] == WAV
    _, outside = dataset[1]
    with pytest.raises(MediaError, match=r"without '\.\.'"):
        parse_any("1", outside)
    _, kept = dataset[2]
    assert isinstance(parse_any("2", kept).media[0][2], Waveform)


def test_native_and_bridge_audio_members() -> None:
    body = {"conversations": turns("<audio><audio>")}
    native = {"json": json.dumps(body).encode(), "0.wav": WAV, "1.flac": FLAC}
    raw = parse_any("n", native)
    assert [(m, kind, p) for m, kind, p in raw.media] == [
        ("0.wav", "audio", WAV),
        ("1.flac", "audio", FLAC),
    ]
    bridge = {"json": json.dumps(turns("<image><audio>")).encode(), "jpg": b"x", "audio.wav": WAV}
    raw = parse_any("b", bridge)
    assert [(m, kind) for m, kind, _ in raw.media] == [("jpg", "image"), ("audio.wav", "audio")]
    with pytest.raises(MediaError, match=r"0 <audio> placeholders but 0 images .* 1 audios"):
        parse_any("b", {"json": json.dumps(turns("")).encode(), "audio.wav": WAV})


def test_an_encoder_without_audio_refuses_it_by_name() -> None:
    row = {"conversations": turns("<audio>"), "audios": [WAV]}
    with pytest.raises(MediaError, match="not audio") as error:
        ConversationEncoder(tokenizer=None).encode_sample("k", row)
    assert (error.value.kind, error.value.member) == ("unsupported", "audios[0]")


ARRAYS = st.one_of(
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=40),
    st.lists(st.lists(st.floats(-1, 1, width=32), min_size=0, max_size=3), max_size=4),
    st.lists(st.one_of(st.text(max_size=2), st.none(), st.booleans()), max_size=3),
    st.binary(max_size=8),
    st.none(),
)
RATES = st.one_of(st.integers(-10, 10**6), st.floats(), st.text(max_size=3), st.none())


@settings(max_examples=400, deadline=None)
@given(array=ARRAYS, rate=RATES)
def test_a_decoded_array_is_kept_exactly_or_named_as_a_bad_sample(array: Any, rate: Any) -> None:
    """Any value in an ``{"array", "sampling_rate"}`` item: a Waveform holding exactly its
    float32 samples, or a ``bad_sample`` naming the member; nothing else escapes."""
    row = {"conversations": turns("<audio>"), "audios": [{"array": array, "sampling_rate": rate}]}
    refused: MediaError | None = None
    try:
        raw = parse_any("k", row)
    except MediaError as error:
        refused = error
    if refused is not None:
        assert (refused.kind, refused.member) == ("bad_sample", "audios[0]")
        return
    waveform = raw.media[0][2]
    assert isinstance(waveform, Waveform)
    assert waveform.sample_rate == rate
    assert np.array_equal(waveform.array(), np.asarray(array, dtype=np.float32).reshape(-1))
