"""Voxtral (``VoxtralProcessor``): ids from mistral-common's own request encoding, token-exact
against transformers' processor (its chat-template call on the same conversation with the
audio files), the reply spans where mistral-common puts the replies, and a packed row of a tiny
``VoxtralForConditionalGeneration`` equal to its samples alone.

mistral-common is a test reference installed outside this process's path (``scripts/venv.sh``:
``.venv/mistral``), so every check runs in the mistral child of :mod:`torchvision_child` and
sends back plain values; the asserting stays here.
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from torchvision_child import MISTRAL_DIR, available, reported, run_in_child

CASES: list[tuple[list[float], str]] = [
    ([1.3], "The quick brown fox."),
    ([0.7, 2.1], "Two sweeps, the second longer."),
    ([], "The system sets the rules."),
    ([31.0], "A long one: two chunks."),
    ([0.4], "A short one."),
]
"""Each sample's audio lengths in seconds and the assistant's reply."""


def rows() -> list[dict[str, Any]]:
    """The samples as native rows: a user turn of the audio and a question, the reply, and a
    second exchange after it (the audio is in the first user turn)."""
    from family_kit import sound

    out = []
    for index, (seconds, reply) in enumerate(CASES):
        parts = [{"type": "audio"} for _ in seconds]
        messages = [
            {"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": f"Then {index}."},
        ]
        row: dict[str, Any] = {"id": f"s{index}", "messages": messages}
        if seconds:
            row["audios"] = [sound(s) for s in seconds]
        out.append(row)
    return out


def _with_paths(row: dict[str, Any], folder: Path) -> list[dict[str, Any]]:
    """The row's conversation as the processor takes it: each audio part the path of its
    file."""
    files = iter(row.get("audios", []))
    messages = []
    for number, message in enumerate(row["messages"]):
        content = message["content"]
        if isinstance(content, list):
            parts = []
            for index, part in enumerate(content):
                if part["type"] == "audio":
                    path = folder / f"{row['id']}-{number}-{index}.wav"
                    path.write_bytes(next(files))
                    part = {"type": "audio", "path": str(path)}
                parts.append(part)
            content = parts
        messages.append({**message, "content": content})
    return messages


def _reference(row: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The processor's outputs for the row (a finetuning-mode tokenizer takes a conversation
    ending with the reply) and the reply mask from mistral-common alone: the tokens each
    conversation through a reply adds to the one through the user turn before it."""
    import voxtral_kit

    messages = _with_paths(row, folder)
    proc = voxtral_kit.processor("finetuning")
    out = proc.apply_chat_template(messages, tokenize=True, return_dict=True)
    ids = out["input_ids"][0].tolist()
    mask = [False] * len(ids)
    for end, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = voxtral_kit.processor("test").apply_chat_template(
            messages[:end], tokenize=True, return_dict=True
        )["input_ids"][0]
        through = proc.apply_chat_template(messages[: end + 1], tokenize=True, return_dict=True)
        through_ids = through["input_ids"][0].tolist()
        assert through_ids[: len(before)] == before.tolist()
        for at in range(len(before), len(through_ids)):
            mask[at] = True
    return {"inputs": out, "mask": mask}


@reported
def token_checks(_: object) -> dict[str, Any]:
    import torch
    import voxtral_kit

    from energon_pack import make_encoder
    from energon_pack.encoding.families.materialise import sample_media

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for mode in ("test", "finetuning"):
            encoder = make_encoder(family=voxtral_kit.processor(mode))
            for row in rows():
                encoded = encoder.encode_sample(row["id"], row)
                want = _reference(row, Path(scratch))
                got = sample_media(encoder.family, encoded, encoder.media)
                inputs = want["inputs"]
                ids = inputs["input_ids"][0].tolist()
                features = inputs.get("input_features")
                results.append(
                    {
                        "mode": mode,
                        "ids": encoded.input_ids.tolist() == ids,
                        "mask": encoded.loss_mask.bool().tolist() == want["mask"],
                        "targets": sum(want["mask"]),
                        "tokens": [m.tokens for m in encoded.media],
                        "audio_ids": ids.count(24),
                        "keys": sorted(got),
                        "features": features is None
                        or (
                            got["input_features"].dtype == features.dtype
                            and torch.equal(got["input_features"], features)
                        ),
                        "chunks": 0 if features is None else int(features.shape[0]),
                    }
                )
    return {"results": results}


@reported
def boundary_counts(_: object) -> dict[str, Any]:
    """``[AUDIO]`` tokens the encoder counts from each audio's header against those the
    processor writes once it has decoded the audio, around the 30 s chunk edge at 16 kHz and
    through resampling from 22.05 and 44.1 kHz."""
    import voxtral_kit
    from audio_files import encode_audio

    from energon_pack import make_encoder

    encoder = make_encoder(family=voxtral_kit.processor())
    out = []
    with tempfile.TemporaryDirectory() as scratch:
        for rate, frames in [
            (16000, 480000 - 1),
            (16000, 480000),
            (16000, 480001),
            (22050, 661500),
            (22050, 661501),
            (44100, 1323000),
            (44100, 1323001),
            (44100, 100),
        ]:
            data = encode_audio("wav", rate, 1, frames, sweep=True)
            row = {
                "id": f"{rate}-{frames}",
                "messages": [
                    {"role": "user", "content": [{"type": "audio"}]},
                    {"role": "assistant", "content": "ok"},
                ],
                "audios": [data],
            }
            ours = encoder.encode_sample(row["id"], row).media[0].tokens
            want = _reference(row, Path(scratch))["inputs"]["input_ids"][0].tolist().count(24)
            out.append((rate, frames, ours, want))
    return {"counts": out}


@reported
def refusals(_: object) -> dict[str, Any]:
    """What the encoder says of a conversation mistral-common refuses (a system prompt next to
    audio), of an image, and of a saved processor directory."""
    import voxtral_kit
    from family_kit import png_bytes, test_images

    from energon_pack import make_encoder, model_family
    from energon_pack.media import MediaError

    encoder = make_encoder(family=voxtral_kit.processor())

    def refused(key: str, row: dict[str, Any]) -> tuple[str, str] | None:
        """The kind and message of the MediaError encoding ``row`` raises, or None."""
        try:
            encoder.encode_sample(key, row)
        except MediaError as error:
            return error.kind, str(error)
        return None

    out: dict[str, Any] = {
        "system": refused("sys", {**rows()[0], "system": "Be brief."}),
        "unanswered": refused("open", {**rows()[0], "messages": rows()[0]["messages"][:1]}),
    }
    image = {
        "id": "img",
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "A fox."},
        ],
        "images": [png_bytes(test_images(0, [(30, 40)])[0])],
    }
    out["image"] = refused("img", image)
    with tempfile.TemporaryDirectory() as scratch:
        voxtral_kit.processor().save_pretrained(scratch)
        voxtral_kit.tiny_model().config.save_pretrained(scratch)
        loaded = model_family(scratch)
        out["saved_family"] = type(loaded).__name__
        out["saved_settings_equal"] = loaded.settings() == encoder.family.settings()
        again = make_encoder(family=loaded).encode_sample("s1", rows()[1]).input_ids
        ours = encoder.encode_sample("s1", rows()[1]).input_ids
        out["saved_ids_equal"] = again.tolist() == ours.tolist()
    prompted = make_encoder(family=voxtral_kit.processor(), system_prompt="Be brief.")
    out["text_only_with_system"] = prompted.encode_sample("t", rows()[2]).input_ids.tolist()
    out["settings"] = encoder.settings()
    everything = make_encoder(family=voxtral_kit.processor(), loss_on="all")
    out["all_off_audio"] = []
    for row in rows():
        encoded = everything.encode_sample(row["id"], row)
        pairs = zip(encoded.input_ids.tolist(), encoded.loss_mask.tolist(), strict=True)
        off = [token for token, on in pairs if not on]
        out["all_off_audio"].append(off == [24] * sum(m.tokens for m in encoded.media))
    return out


@reported
def model_checks(_: object) -> dict[str, Any]:
    import torch
    import voxtral_kit
    from family_kit import IGNORE, packed_matches_alone, running_positions_differ

    from energon_pack import VLMPackingCollator

    torch.set_num_threads(1)
    model = voxtral_kit.tiny_model()
    proc = voxtral_kit.processor()
    collator = VLMPackingCollator(seq_length=4096, family=proc, output="hf", hf_model=model)
    chosen = [rows()[i] for i in (0, 1, 2, 4)]
    packed = collator(chosen)
    packed.pop("use_cache", None)
    alone = []
    with tempfile.TemporaryDirectory() as scratch:
        for row in chosen:
            want = _reference(row, Path(scratch))
            inputs = dict(want["inputs"])
            inputs.pop("attention_mask")
            ids = inputs["input_ids"][0]
            labels = torch.where(torch.tensor(want["mask"]), ids, IGNORE)
            labels[0] = IGNORE
            inputs["labels"] = labels[None]
            if "input_features" in inputs:
                inputs["input_features"] = inputs["input_features"].double()
            alone.append(inputs)
    packed["input_features"] = packed["input_features"].double()
    loss_error, worst = packed_matches_alone(model, alone, packed)
    return {
        "loss_error": loss_error,
        "worst": worst,
        "keys": sorted(packed),
        "chunks": int(packed["input_features"].shape[0]),
        "running_differs": running_positions_differ(model, alone, packed),
    }


@reported
def verify_outcome(_: object) -> dict[str, Any]:
    """``verify_packing``'s verdicts on a Voxtral checkpoint directory (the tiny processor and
    model config) over four rows of audio, with eager and sdpa."""
    import json

    import voxtral_kit
    from audio_files import encode_audio

    from energon_pack import verify_packing

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        voxtral_kit.processor().save_pretrained(folder)
        voxtral_kit.tiny_model().config.save_pretrained(folder)
        lines = []
        for index, seconds in enumerate([1.0, 2.0, 0.5, 1.5]):
            clip = encode_audio("wav", 16000, 1, int(16000 * seconds), sweep=True)
            (folder / f"{index}.wav").write_bytes(clip)
            user = [{"type": "audio"}, {"type": "text", "text": "What is it?"}]
            messages = [
                {"role": "user", "content": user},
                {"role": "assistant", "content": f"A fox {index}."},
            ]
            lines.append(json.dumps({"messages": messages, "audios": [f"{index}.wav"]}))
        (folder / "rows.jsonl").write_text("\n".join(lines))
        report = verify_packing(
            str(folder), data=str(folder / "rows.jsonl"), attn_implementations=["eager", "sdpa"]
        )
    return {
        "samples": len(report.samples),
        "verdicts": {r.attn_implementation: (r.verdict, r.reason) for r in report.results},
    }


@cache
def child(name: str, timeout: float = 400) -> dict[str, Any]:
    if not available() or not MISTRAL_DIR.is_dir():
        pytest.skip("the reference mistral-common is not installed (scripts/venv.sh)")
    result = run_in_child(f"test_family_voxtral:{name}", None, timeout=timeout, mistral=True)
    assert "error" not in result, result.get("error")
    return dict(result)


def test_ids_replies_and_features_are_the_processors() -> None:
    """ids and ``input_features`` equal the processor's chat-template call on the same
    conversation and audio files, the loss mask is every reply with its ``</s>`` (as
    mistral-common encodes the replies), whether the processor's tokenizer validates as for
    serving (``from_pretrained``'s default) or for finetuning."""
    results = child("token_checks")["results"]
    assert len(results) == 2 * len(CASES)
    for got, (seconds, _) in zip(results, CASES * 2, strict=True):
        assert got["ids"], got
        assert got["mask"], got
        assert got["features"], got
        assert got["targets"] > 4, got
        assert got["tokens"] == [375 * (1 + int(s // 30)) for s in seconds], got
        assert sum(got["tokens"]) == got["audio_ids"], got
        assert got["chunks"] == sum(1 + int(s // 30) for s in seconds), got
        assert got["keys"] == (["input_features"] if seconds else []), got


def test_audio_counts_from_the_header_equal_the_processors_after_decoding() -> None:
    """375 ``[AUDIO]`` per started 30 s chunk, counted from the header alone, equal to what the
    processor writes once mistral-common has decoded (and resampled) the audio, either side of
    the chunk edge."""
    counts = child("boundary_counts")["counts"]
    for rate, frames, ours, want in counts:
        assert ours == want, (rate, frames, ours, want)
    by_frames = {(rate, frames): ours for rate, frames, ours, _ in counts}
    assert by_frames[(16000, 480000)] == 375
    assert by_frames[(16000, 480001)] == 750
    assert by_frames[(44100, 100)] == 375


def test_refusals_name_the_sample_and_the_fix() -> None:
    """A system prompt next to audio (mistral-common's v7 rule) is a ``bad_sample`` naming the
    rule; an image is ``unsupported``; a saved processor directory is the same family."""
    got = child("refusals")
    reason, message = got["system"]
    assert reason == "bad_sample"
    assert "Found system messages at indexes [0] and audio chunks" in message
    assert "sys" in message
    # a conversation without a reply, which mistral-common refuses as training data
    reason, message = got["unanswered"]
    assert reason == "bad_sample"
    assert "'open'" in message
    reason, message = got["image"]
    assert reason == "unsupported"
    assert "'voxtral' takes audio only" in message
    assert got["saved_family"] == "VoxtralFamily"
    assert got["saved_settings_equal"]
    assert got["saved_ids_equal"]
    # a text-only sample takes the default system prompt: <s>[SYSTEM_PROMPT]...[/SYSTEM_PROMPT]
    prompted = got["text_only_with_system"]
    assert prompted[:2] == [1, 17], prompted
    assert 18 in prompted, prompted
    # loss_on="all": every token but the audio's features is a target
    assert got["all_off_audio"] == [True] * len(CASES)
    settings = got["settings"]
    assert settings["encoding"] == "request"
    assert settings["tokenizer"]["version"] == "v7"
    assert settings["tokenizer"]["audio"]["chunk_length_s"] == 30.0


def test_a_packed_row_trains_like_its_samples_alone() -> None:
    """The collator's ``output="hf"`` row of four samples (one and two audios, text only, a
    short audio) gives the loss and every gradient of the samples run alone through the
    processor's outputs (float64), and positions running on across samples do not."""
    got = child("model_checks", timeout=500)
    assert got["chunks"] == 4
    assert {"input_features", "position_ids", "labels"} <= set(got["keys"])
    assert got["loss_error"] < 1e-6, got
    assert got["worst"] < 1e-6, got
    assert got["running_differs"], "positions running on should break the equality"


def test_verify_checks_a_voxtral_checkpoint_exactly() -> None:
    """``energon-pack verify`` cuts Voxtral's audio encoder keeping its feed-forward multiple
    (the projector regroups the encoder's outputs by it) and finds packing exact on audio rows
    with eager and sdpa."""
    got = child("verify_outcome")
    assert got["samples"] == 4
    assert got["verdicts"] == {"eager": ("exact", ""), "sdpa": ("exact", "")}, got
