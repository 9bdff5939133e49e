"""Gemma 3n (``Gemma3nProcessor``): images and audio, token-exact against transformers' own
processor (built locally: the test tokenizer with Gemma 3n's special tokens, the end-of-media and
soft tokens last as in the released vocabulary, SigLIP's PIL image processor, Gemma 3n's audio
feature extractor, the released turn format), and a packed row of a tiny
``Gemma3nForConditionalGeneration`` equal to its samples alone, through the collator.

The model's vision tower is a timm network, and timm imports torchvision, which this process
never imports: the model checks run in the torchvision child (:mod:`torchvision_child`, with
the reference timm of ``scripts/venv.sh``) and send back plain values.
"""

from __future__ import annotations

import json
import logging
import traceback
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from family_kit import IGNORE, Media, media_row, seeded, sound, tiny_tokenizer
from family_kit import test_images as make_images
from PIL import Image
from torchvision_child import available, run_in_child
from transformers import Gemma3nProcessor
from transformers.models.gemma3n.feature_extraction_gemma3n import Gemma3nAudioFeatureExtractor
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from energon_pack import VLMPackingCollator, make_encoder, model_family
from energon_pack.encoding.families.gemma3n import Gemma3nFamily
from energon_pack.encoding.families.materialise import sample_media
from energon_pack.media import MediaError
from energon_pack.media.audio_decode import audio_samples

RATE = 16_000
BOI, EOI, IMAGE = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
BOA, EOA, AUDIO = "<start_of_audio>", "<end_of_audio>", "<audio_soft_token>"
# Gemma 3n's released turn format: the assistant role is "model", every turn ends with
# <end_of_turn> and a newline, an image renders its soft token, an audio its own.
TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'audio' -%}{{ '<audio_soft_token>' }}"
    "{%- elif item['type'] == 'image' -%}{{ '<image_soft_token>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
MEDIA_TOKENS = [EOI, IMAGE, EOA, AUDIO]
"""Added after the text vocabulary, in this order (as named special tokens not yet in it): the
model embeds ids from the vision offset (the end of image and the image soft token) and from
the audio offset (end of audio, audio soft token) with its media embedders."""


@cache
def tokenizer() -> Any:
    special = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", BOI, BOA]
    named = {"boi": BOI, "eoi": EOI, "image": IMAGE, "boa": BOA, "eoa": EOA, "audio": AUDIO}
    tok = tiny_tokenizer(
        special,
        TEMPLATE,
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        add_bos=True,
        extra={f"{name}_token": token for name, token in named.items()},
    )
    assert tok.convert_tokens_to_ids(MEDIA_TOKENS) == list(range(len(tok) - 4, len(tok)))
    return tok


@cache
def processor(
    image_seq: int = 4, audio_seq: int = 16, mels: int = 16, side: int = 64
) -> Gemma3nProcessor:
    """The real processor: ``side`` px images of ``image_seq`` soft tokens, audio of ``mels``
    mel bins and ``audio_seq`` soft tokens."""
    return Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(feature_size=mels),
        image_processor=SiglipImageProcessorPil(size={"height": side, "width": side}),
        tokenizer=tokenizer(),
        chat_template=TEMPLATE,
        image_seq_length=image_seq,
        audio_seq_length=audio_seq,
    )


def family(image_seq: int = 4, audio_seq: int = 16) -> Gemma3nFamily:
    found = model_family(processor(image_seq, audio_seq))
    assert isinstance(found, Gemma3nFamily)
    return found


CASES: list[tuple[Media, str]] = [
    ([("image", (40, 90))], "The quick brown fox jumps."),
    ([("audio", 1.2)], "A sweep."),
    ([], "The system sets the rules."),
    ([("audio", 0.7), ("image", (60, 30)), ("image", (33, 33))], "A lazy dog and a fox."),
    ([("image", (17, 8)), ("audio", 2.1), ("audio", 0.4)], "Two sweeps."),
]


def no_video(_: Any) -> bytes:
    raise AssertionError("Gemma 3n samples hold no video")


def rows() -> list[dict[str, Any]]:
    return [media_row(index, media, reply, no_video) for index, (media, reply) in enumerate(CASES)]


def reply_mask(ids: list[int]) -> list[bool]:
    """True from after each ``<start_of_turn>model\\n`` through its ``<end_of_turn>`` and the
    newline after it (the Gemma training templates' generation blocks)."""
    tok = tokenizer()
    header = tok.encode("<start_of_turn>model\n", add_special_tokens=False)
    end, newline = tok.convert_tokens_to_ids("<end_of_turn>"), tok.encode("\n")[-1]
    mask, at = [False] * len(ids), 0
    while at < len(ids):
        if ids[at : at + len(header)] != header:
            at += 1
            continue
        at += len(header)
        while at < len(ids) and ids[at] != end:
            mask[at], at = True, at + 1
        mask[at] = True
        if at + 1 < len(ids) and ids[at + 1] == newline:
            mask[at + 1] = True
        at += 1
    return mask


def reference(index: int, proc: Gemma3nProcessor | None = None) -> dict[str, torch.Tensor]:
    """The processor's own outputs for sample ``index``: its conversation, the images decoded
    and its audio decoded at 16 kHz, with ``labels`` from :func:`reply_mask`."""
    proc = proc or processor()
    media, _ = CASES[index]
    row = rows()[index]
    sizes = [spec for kind, spec in media if kind == "image"]
    images = [Image.fromarray(a) for a in make_images(index, sizes)]
    audios = [audio_samples(data, RATE) for data in row.get("audios", [])]
    text = proc.apply_chat_template(row["messages"], tokenize=False)
    out = dict(
        proc(
            text=[text],
            images=[images] if images else None,
            audio=audios or None,
            return_tensors="pt",
        )
    )
    ids = out["input_ids"][0]
    labels = torch.where(torch.tensor(reply_mask(ids.tolist())), ids, IGNORE)
    labels[0] = IGNORE
    out["labels"] = labels[None]
    return out


def test_ids_labels_and_inputs_are_the_processors() -> None:
    """ids, the reply mask, ``token_type_ids`` and every media input equal the processor's on
    the same conversation and decoded media, for images and audio in any order and number."""
    encoder = make_encoder(family=processor())
    for index, row in enumerate(rows()):
        encoded = encoder.encode_sample(row["id"], row)
        want = reference(index)
        ids = want["input_ids"][0]
        assert encoded.input_ids.tolist() == ids.tolist()
        assert encoded.loss_mask.bool().tolist() == reply_mask(ids.tolist())
        kinds = [kind for kind, _ in CASES[index][0]]
        assert sorted(m.kind for m in encoded.media) == sorted(kinds)
        assert sum(m.tokens for m in encoded.media) == int((want["token_type_ids"] > 0).sum())
        tokens = family().token_inputs(ids)
        assert torch.equal(tokens["token_type_ids"], want["token_type_ids"][0])
        got = sample_media(family(), encoded, encoder.media)
        media_keys = {"pixel_values", "input_features", "input_features_mask"}
        assert set(got) == media_keys & set(want)
        for key in got:
            assert got[key].dtype == want[key].dtype, key
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_soft_token_counts_come_from_the_processor_not_the_media(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every image and every audio is the processor's fixed run, whatever its size or length
    (audio past the extractor's 30 s is cut by the processor, its count unchanged, and a
    warning names it)."""
    fam = family(image_seq=9, audio_seq=5)
    assert fam.image_tokens([(1, 1), (900, 30)]) == [9, 9]
    encoder = make_encoder(family=processor(9, 5))
    row = {**rows()[3], "id": "x"}
    encoded = encoder.encode_sample("x", row)
    assert [m.tokens for m in encoded.media] == [5, 9, 9]
    assert not caplog.records
    long = {**rows()[1], "audios": [sound(31.0)]}
    with caplog.at_level(logging.WARNING, logger="energon_pack.encoding"):
        assert [m.tokens for m in encoder.encode_sample("long", long).media] == [5]
    assert "31.0 s is past the feature extractor's window of 30.0 s" in caplog.text
    want = reference(1, processor(9, 5))
    assert int((want["token_type_ids"] == 3).sum()) == 5


def test_a_saved_processor_directory_is_the_same_family(tmp_path: Path) -> None:
    processor().save_pretrained(tmp_path)
    loaded = model_family(tmp_path)
    assert isinstance(loaded, Gemma3nFamily)
    assert loaded.settings() == family().settings()
    row = rows()[3]
    ours = make_encoder(family=processor()).encode_sample("x", row)
    theirs = make_encoder(family=loaded).encode_sample("x", row)
    assert theirs.input_ids.tolist() == ours.input_ids.tolist()
    assert theirs.loss_mask.tolist() == ours.loss_mask.tolist()


def test_audio_settings_set_on_the_processor_apply() -> None:
    """A window of 1 s set in the processor's audio kwargs cuts the features (and is the
    window the family warns about), as the processor's own call cuts them."""
    proc = Gemma3nProcessor(
        feature_extractor=Gemma3nAudioFeatureExtractor(feature_size=16),
        image_processor=SiglipImageProcessorPil(size={"height": 64, "width": 64}),
        tokenizer=tokenizer(),
        chat_template=TEMPLATE,
        image_seq_length=4,
        audio_seq_length=16,
    )
    proc.audio_kwargs = {"max_length": RATE}
    fam = Gemma3nFamily(proc)
    assert fam.audio_window == RATE
    assert fam.settings() != family().settings()
    encoder = make_encoder(family=proc)
    row = rows()[1]  # one audio of 1.2 s
    got = sample_media(fam, encoder.encode_sample(row["id"], row), encoder.media)
    want = reference(1, proc)
    assert got["input_features"].shape == want["input_features"].shape
    assert got["input_features"].shape[1] < reference(1)["input_features"].shape[1]
    torch.testing.assert_close(got["input_features"], want["input_features"], rtol=0, atol=0)
    assert torch.equal(got["input_features_mask"], want["input_features_mask"])


def test_settings_name_both_soft_token_counts_and_the_extractor() -> None:
    ours, fewer = family().settings(), family(audio_seq=8).settings()
    assert ours["family"] == "gemma3n"
    assert (ours["image_seq_length"], ours["audio_seq_length"]) == (4, 16)
    assert ours["feature_extractor"]["feature_size"] == 16
    assert ours != fewer
    assert json.dumps(ours)


def test_a_row_joins_audio_zero_padded_and_masked_to_its_most_frames() -> None:
    fam = family()
    encoder = make_encoder(family=processor())
    inputs = []
    for row in rows():
        encoded = encoder.encode_sample(row["id"], row)
        inputs.append(sample_media(fam, encoded, encoder.media))
    joined = fam.row_inputs(inputs)
    frames = [s["input_features"].shape[1] for s in inputs if "input_features" in s]
    assert joined["input_features"].shape[:2] == (4, max(frames))
    assert joined["input_features_mask"].dtype == torch.bool
    at = 0
    for sample in inputs:
        if "input_features" not in sample:
            continue
        count, own = sample["input_features"].shape[:2]
        part = slice(at, at + count)
        assert torch.equal(joined["input_features"][part, :own], sample["input_features"])
        assert torch.equal(joined["input_features_mask"][part, :own], sample["input_features_mask"])
        assert not joined["input_features_mask"][part, own:].any()
        assert not joined["input_features"][part, own:].any()
        at += count
    assert joined["pixel_values"].shape[0] == 4


def test_a_broken_audio_is_a_named_skip() -> None:
    good = rows()[1]
    data = sound(1.0)
    broken = {**rows()[1], "id": "cut", "audios": [data[: len(data) // 2]]}  # header says more
    collator = VLMPackingCollator(seq_length=4096, family=family(), on_media_error="skip")
    batch = collator([good, broken])
    assert batch.skipped_keys == ("cut",)
    strict = VLMPackingCollator(seq_length=4096, family=family())
    with pytest.raises(MediaError, match="cut"):
        strict([good, broken])


# --- the tiny model, in the torchvision child (timm) ------------------------------------------


def tiny_model(proc: Gemma3nProcessor) -> Any:
    """A 2-layer Gemma 3n (a sliding layer of window 8, then a full one, the second sharing
    the first's key-value cache as the released models share theirs), timm's ``test_convnext``
    as the vision tower (64 px to a 2x2 map: the processor's 4 soft tokens) and a 1-block
    conformer on 16 mel bins."""
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    tok = proc.tokenizer
    text_vocab = tok.convert_tokens_to_ids(EOI)
    config = Gemma3nConfig(
        text_config={
            "vocab_size": len(tok),
            "vocab_size_per_layer_input": text_vocab,
            "hidden_size": 32,
            "hidden_size_per_layer_input": 8,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_kv_shared_layers": 0,
            "activation_sparsity_pattern": [0.0, 0.0],
            "altup_num_inputs": 2,
            "laurel_rank": 4,
            "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
        },
        vision_config={
            "architecture": "test_convnext",
            "hidden_size": 32,
            "vocab_size": 2,
            "vocab_offset": text_vocab,
            "model_args": {"dims": (8, 16, 24, 32), "depths": (1, 1, 1, 1)},
        },
        audio_config={
            "input_feat_size": 16,
            "hidden_size": 16,
            "conf_num_attention_heads": 2,
            "conf_num_hidden_layers": 1,
            "sscp_conv_channel_size": (8, 4),
            "vocab_size": 2,
            "vocab_offset": text_vocab + 2,
        },
        audio_soft_tokens_per_image=proc.audio_seq_length,
        vision_soft_tokens_per_image=proc.image_seq_length,
        boi_token_id=tok.convert_tokens_to_ids(BOI),
        eoi_token_id=text_vocab,
        image_token_id=tok.image_token_id,
        boa_token_id=tok.convert_tokens_to_ids(BOA),
        eoa_token_id=text_vocab + 2,
        audio_token_id=tok.audio_token_id,
        attn_implementation="sdpa",
    )
    return seeded(lambda: Gemma3nForConditionalGeneration(config))


def model_checks(_: object) -> dict[str, Any]:
    try:
        return _model_checks()
    except Exception:  # sent back whole: the test process asserts on it
        return {"error": traceback.format_exc()}


def _model_checks() -> dict[str, Any]:
    from family_kit import packed_matches_alone, running_positions_differ

    torch.set_num_threads(1)
    proc = processor()
    model = tiny_model(proc)
    collator = VLMPackingCollator(seq_length=4096, family=family(), output="hf", hf_model=model)
    packed = collator(rows())
    packed.pop("use_cache", None)
    alone = []
    for index in range(len(CASES)):
        want = reference(index)
        want.pop("attention_mask")
        alone.append(want)
    loss_error, worst = packed_matches_alone(model, alone, packed)
    packed_keys = sorted(packed)
    return {
        "loss_error": loss_error,
        "worst": worst,
        "keys": packed_keys,
        "audios": int(packed["input_features"].shape[0]),
        "images": int(packed["pixel_values"].shape[0]),
        "running_differs": running_positions_differ(model, alone, packed),
    }


def verify_outcome(_: object) -> dict[str, str]:
    """What ``verify_packing`` says of a Gemma 3n checkpoint directory (this processor and
    the tiny model's config)."""
    import tempfile

    from energon_pack import verify_packing

    with tempfile.TemporaryDirectory() as scratch:
        proc = processor()
        proc.save_pretrained(scratch)
        tiny_model(proc).config.save_pretrained(scratch)
        try:
            verify_packing(scratch, attn_implementations=["sdpa"])
        except ValueError as error:
            return {"refused": str(error)}
    return {"refused": ""}


@cache
def model_results() -> dict[str, Any]:
    if not available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    result = run_in_child("test_family_gemma3n:model_checks", None, timeout=500)
    assert "error" not in result, result.get("error")
    return dict(result)


def test_a_packed_row_trains_like_its_samples_alone() -> None:
    """The collator's ``output="hf"`` row of five samples (images and audio in any order, a
    text-only one) gives the loss and every gradient of the samples run alone through the
    processor's outputs: positions restarting per sample are all the model needs."""
    got = model_results()
    assert (got["images"], got["audios"]) == (4, 4)
    assert {"pixel_values", "input_features", "input_features_mask", "position_ids"} <= set(
        got["keys"]
    )
    assert got["loss_error"] < 1e-6, got
    assert got["worst"] < 1e-6, got
    assert got["running_differs"], "positions running on should break the equality"


def test_verify_refuses_a_gemma3n_checkpoint_by_name() -> None:
    """``energon-pack verify`` cannot cut Gemma 3n's config yet: a ValueError naming the model
    type and why, never a traceback from inside transformers."""
    if not available():
        pytest.skip("the reference torchvision is not installed (scripts/venv.sh: .venv/reference)")
    result = run_in_child("test_family_gemma3n:verify_outcome", None, timeout=300)
    assert "verify cannot cut a gemma3n model to CPU size yet" in result["refused"], result
    assert "timm vision tower" in result["refused"]
