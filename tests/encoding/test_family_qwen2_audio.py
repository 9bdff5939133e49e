"""Qwen2-Audio family: token-exact against transformers' own ``Qwen2AudioProcessor`` (built
locally: the test tokenizer with the family's special tokens, Whisper's feature extractor, the
processor's released chat template), audio tokens from the header equal to the processor's
count, model inputs equal to the processor's on the decoded waveform, and a packed row of a tiny
``Qwen2AudioForConditionalGeneration`` equal to its samples alone, through the collator."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from audio_files import encode_audio
from family_kit import IGNORE, chatml_reply_mask, packed_matches_alone, seeded, tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2AudioProcessor,
    WhisperFeatureExtractor,
)

from energon_pack import PlanSpec, RowLayout, VLMPackingCollator, make_encoder, model_family
from energon_pack.encoding.families.materialise import sample_media
from energon_pack.encoding.families.qwen2_audio import Qwen2AudioFamily
from energon_pack.formats.chat_rows import ChatDataset
from energon_pack.media import MediaError
from energon_pack.media.audio_decode import Waveform, audio_probe, audio_samples
from energon_pack.plan import PlannedDataset, plan_dataset

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>"]
SPECIAL += ["<|audio_eos|>"]
NAMED = {
    "audio_token": "<|AUDIO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
RATE = 16_000


@cache
def processor(chunk_seconds: int = 30, mels: int = 16) -> Qwen2AudioProcessor:
    """The processor with its released template (the one it falls back to) and a Whisper
    feature extractor of ``mels`` mel bins and ``chunk_seconds`` windows."""
    template = Qwen2AudioProcessor.default_chat_template.fget(None)  # type: ignore[attr-defined]
    tok = tiny_tokenizer(SPECIAL, template, eos="<|im_end|>", pad="<|endoftext|>", extra=NAMED)
    extractor = WhisperFeatureExtractor(feature_size=mels, chunk_length=chunk_seconds)
    return Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tok)  # type: ignore[no-untyped-call]


def family(chunk_seconds: int = 30) -> Qwen2AudioFamily:
    found = model_family(processor(chunk_seconds))
    assert isinstance(found, Qwen2AudioFamily)
    return found


def tone(frames: int, rate: int = RATE, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    t = np.arange(frames) / rate
    return (0.3 * np.sin(2 * np.pi * rng.uniform(200, 900) * t)).astype(np.float32)


def reference(proc: Qwen2AudioProcessor, messages: list[dict[str, Any]], audios: list[Any]) -> Any:
    """The processor's own outputs for the conversation and its waveforms at 16 kHz."""
    text = proc.apply_chat_template(messages, tokenize=False)
    return proc(
        text=[text], audio=audios or None, sampling_rate=RATE, return_tensors="pt", padding=True
    )


def conversation(audios: int, turns: int, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages for the processor (audio parts first in the first user turn) and the same
    conversation as a chat row's ``messages``."""
    messages = []
    for turn in range(turns):
        parts: list[dict[str, Any]] = [{"type": "audio"}] * (audios if turn == 0 else 0)
        parts = [*parts, {"type": "text", "text": f"What is that sound? {seed} {turn}"}]
        messages.append({"role": "user", "content": parts})
        messages.append({"role": "assistant", "content": f"The quick brown fox {turn}."})
    return messages, {"messages": messages}


@pytest.mark.parametrize("kind", ["wav", "flac", "mp3", "opus", "m4a"])
@pytest.mark.parametrize(("rate", "channels", "seconds"), [(16000, 1, 0.7), (44100, 2, 3.3)])
def test_audio_tokens_from_the_header_are_the_processors(
    kind: str, rate: int, channels: int, seconds: float
) -> None:
    rate = 48000 if kind == "opus" else rate  # Opus encodes at 48 kHz
    data = encode_audio(kind, rate, channels, int(rate * seconds))
    fam = family()
    probe = audio_probe(data)
    waveform = audio_samples(data, RATE)
    out = reference(processor(), [{"role": "user", "content": [{"type": "audio"}]}], [waveform])
    counted = int((out["input_ids"] == processor().audio_token_id).sum())
    assert fam.audio_tokens(probe) == counted
    assert len(waveform) == round(probe.frames * RATE / probe.sample_rate)


@settings(max_examples=40, deadline=None)
@given(frames=st.integers(961, 700_000), rate=st.sampled_from([8000, 16000, 22050, 48000]))
def test_audio_tokens_of_a_waveform_are_the_processors(frames: int, rate: int) -> None:
    """Any length (cut to the window past 30 s), any rate the row states."""
    wave = Waveform.from_array(tone(frames, rate), rate)
    samples = audio_samples(wave, RATE)
    out = reference(processor(), [{"role": "user", "content": [{"type": "audio"}]}], [samples])
    counted = int((out["input_ids"] == processor().audio_token_id).sum())
    assert family().audio_tokens(audio_probe(wave)) == counted


def test_audio_tokens_follow_the_extractors_window() -> None:
    """A 2-second window cuts a 3-second audio where a 30-second one does not."""
    wave = Waveform.from_array(tone(3 * RATE), RATE)
    short, long = (
        family(2).audio_tokens(audio_probe(wave)),
        family().audio_tokens(audio_probe(wave)),
    )
    assert short < long
    out = reference(
        processor(2), [{"role": "user", "content": [{"type": "audio"}]}], [wave.array()]
    )
    assert short == int((out["input_ids"] == processor(2).audio_token_id).sum())


CASES = [  # (audios as (format, rate, channels, seconds), turns)
    ([("wav", 16000, 1, 1.2)], 1),
    ([("mp3", 44100, 2, 2.5), ("array", 22050, 1, 0.9)], 2),
    ([], 1),
    ([("flac", 48000, 1, 0.4), ("wav", 8000, 2, 1.7), ("opus", 48000, 1, 1.1)], 1),
]


def audio_items(specs: list[tuple[str, int, int, float]], seed: int) -> list[Any]:
    """Each audio as a chat row holds it: a file's bytes, or a decoded ``{"array",
    "sampling_rate"}`` (with the path a ``datasets`` Audio column names, never read)."""
    items: list[Any] = []
    for index, (kind, rate, channels, seconds) in enumerate(specs):
        frames = int(rate * seconds)
        if kind == "array":
            array = tone(frames, rate, seed + index)
            items.append({"array": array, "sampling_rate": rate, "path": "not/here.wav"})
        else:
            items.append(encode_audio(kind, rate, channels, frames, sweep=True))
    return items


def waveform_of(item: Any) -> np.ndarray[Any, Any]:
    if isinstance(item, dict):
        return audio_samples(Waveform.from_array(item["array"], item["sampling_rate"]), RATE)
    return audio_samples(item, RATE)


def rows() -> list[tuple[list[dict[str, Any]], dict[str, Any], list[Any]]]:
    out = []
    for seed, (specs, turns) in enumerate(CASES):
        messages, row = conversation(len(specs), turns, seed)
        items = audio_items(specs, 10 * seed)
        out.append((messages, {**row, "audios": items, "id": f"s{seed}"}, items))
    return out


def test_encoder_equals_the_processor() -> None:
    """ids, the reply mask and every model input equal the processor's on the same
    conversation and the decoded waveforms, for files of five formats and decoded arrays."""
    fam = family()
    encoder = make_encoder(family=processor())
    for messages, row, items in rows():
        encoded = encoder.encode_sample(row["id"], row)
        want = reference(processor(), messages, [waveform_of(item) for item in items])
        assert encoded.input_ids.tolist() == want["input_ids"][0].tolist()
        assert encoded.loss_mask.bool().tolist() == chatml_reply_mask(
            processor(), want["input_ids"][0].tolist()
        )
        assert [m.kind for m in encoded.media] == ["audio"] * len(items)
        assert sum(m.tokens for m in encoded.media) == int(
            (want["input_ids"] == processor().audio_token_id).sum()
        )
        if items:
            got = sample_media(fam, encoded, encoder.media)
            assert set(got) == {"input_features", "feature_attention_mask"}
            torch.testing.assert_close(
                got["input_features"], want["input_features"], rtol=0, atol=0
            )
            assert torch.equal(got["feature_attention_mask"], want["feature_attention_mask"])


def tiny_model(proc: Qwen2AudioProcessor) -> Qwen2AudioForConditionalGeneration:
    extractor = proc.feature_extractor
    audio = {
        "num_mel_bins": extractor.feature_size,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 32,
        "d_model": 16,
        "max_source_positions": extractor.nb_max_frames // 2,
    }
    text = {
        "model_type": "qwen2",
        "vocab_size": len(proc.tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    }
    config = Qwen2AudioConfig(
        audio_config=audio, text_config=text, audio_token_index=proc.audio_token_id
    )
    config._attn_implementation = "sdpa"
    return seeded(lambda: Qwen2AudioForConditionalGeneration(config))


def test_collated_row_trains_like_its_samples() -> None:
    """The collator's packed ``output="hf"`` row (positions restarting per sample) gives the
    loss and every gradient of its samples run alone through the processor's outputs."""
    torch.set_num_threads(1)
    proc = processor(2)
    model = tiny_model(proc)
    collator = VLMPackingCollator(seq_length=4096, family=family(2), output="hf", hf_model=model)
    batch = rows()
    packed = collator([row for _, row, _ in batch])
    packed.pop("use_cache")
    assert packed["input_features"].shape[0] == sum(len(items) for _, _, items in batch)
    alone = []
    for messages, _, items in batch:
        want = dict(reference(proc, messages, [waveform_of(item) for item in items]))
        mask = chatml_reply_mask(proc, want["input_ids"][0].tolist())
        labels = torch.where(torch.tensor(mask), want["input_ids"][0], IGNORE)
        labels[0] = IGNORE
        want.pop("attention_mask")
        alone.append({**want, "labels": labels[None]})
    loss_error, worst = packed_matches_alone(model, alone, packed)
    assert loss_error < 1e-6, loss_error
    assert worst < 1e-10, worst


def test_an_audio_too_short_for_the_encoder_is_a_counted_skip() -> None:
    encoder = make_encoder(family=processor())
    _, row = conversation(1, 1, 0)
    row["audios"] = [{"array": tone(960), "sampling_rate": RATE}]  # 6 mel frames: 1 token
    with pytest.raises(MediaError, match="fewer than 2 audio tokens") as error:
        encoder.encode_sample("short", row)
    assert error.value.kind == "unsupported"
    row["audios"] = [{"array": tone(961), "sampling_rate": RATE}]  # 7 frames: 2 tokens
    assert sum(m.tokens for m in encoder.encode_sample("long", row).media) == 2


def test_an_audio_that_no_longer_decodes_is_skipped_by_name() -> None:
    _, good, _ = rows()[0]
    _, broken = conversation(1, 1, 5)
    data = encode_audio("wav", RATE, 1, RATE)
    broken = {**broken, "id": "cut", "audios": [data[: len(data) // 2]]}  # header says more
    collator = VLMPackingCollator(seq_length=4096, family=family(), on_media_error="skip")
    batch = collator([good, broken])
    assert batch.skipped_keys == ("cut",)
    assert batch.keys == (("s0",),)
    strict = VLMPackingCollator(seq_length=4096, family=family())
    with pytest.raises(MediaError, match="cut"):
        strict([good, broken])


def test_images_are_refused_by_name() -> None:
    encoder = make_encoder(family=processor())
    row = {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello."},
        ],
        "images": [encode_audio("wav", RATE, 1, 100)],
    }
    with pytest.raises(MediaError, match="takes audio only") as error:
        encoder.encode_sample("pic", row)
    assert (error.value.kind, error.value.member) == ("unsupported", "images[0]")


def test_settings_name_the_feature_extractor() -> None:
    ours, other = family().settings(), family(2).settings()
    assert ours["family"] == "qwen2_audio"
    assert ours["feature_extractor"]["n_samples"] == 480_000
    assert ours != other
    assert json.dumps(ours)


def test_an_image_family_refuses_audio_by_name() -> None:
    import test_family_pixtral as pixtral

    encoder = make_encoder(family=pixtral.processor(4, 2, 32))
    _, row = conversation(1, 1, 0)
    row["audios"] = [encode_audio("wav", RATE, 1, RATE)]
    with pytest.raises(MediaError, match="takes encoded images only") as error:
        encoder.encode_sample("heard", row)
    assert (error.value.kind, error.value.member) == ("unsupported", "audios[0]")


@pytest.mark.filterwarnings("ignore:VLMPackingCollator got a micro-batch of 1")
def test_a_plan_of_audio_rows_reads_as_the_collator_packs(tmp_path: Path) -> None:
    """A whole-dataset plan measures audio rows (files read next to the source, decoded
    arrays) with the family's encoder: each planned length is the collator's, and each planned
    pack is the collator's row of its members (the family comes with its encoder)."""
    source_rows = []
    for index, (_, row, items) in enumerate(rows()):
        audios: list[Any] = []
        for position, item in enumerate(items):
            if isinstance(item, bytes):
                audios.append(f"a{index}_{position}.audio")
                (tmp_path / audios[-1]).write_bytes(item)
            else:
                audios.append({"array": item["array"].tolist(), "sampling_rate": 22050})
        source_rows.append({**row, "audios": audios})
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join(json.dumps(row) for row in source_rows))
    encoder = make_encoder(family=processor(2))
    spec = PlanSpec(RowLayout(256, pad_to_multiple_of=8))
    plan = plan_dataset(source, tmp_path / "plan", spec, encoder, engine="local")
    assert plan.counts["samples"] == len(source_rows)
    planned = PlannedDataset(tmp_path / "plan", encoder)
    collator = VLMPackingCollator(layout=spec.layout, encoder=encoder)
    by_key = dict(ChatDataset(source_rows, media_root=tmp_path))
    assert len(planned) >= 2
    for index in range(len(planned)):
        got = planned[index]
        keys = planned.keys[index]
        want = collator([(key, by_key[source_rows[int(key)]["id"]]) for key in keys])
        assert got.input_ids.tolist() == want.input_ids.tolist()
        assert got.family_inputs is not None
        assert want.family_inputs is not None
        for name, tensor in want.family_inputs.tensors().items():
            assert torch.equal(got.family_inputs.tensors()[name], tensor), name
