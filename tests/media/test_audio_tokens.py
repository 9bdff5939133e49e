"""Audio tokens from the header: Qwen2-Audio's processor (Whisper's feature extractor and its
token rule) gives as many ``<|AUDIO|>`` tokens for the waveform ``decode_audio`` yields as
``qwen2_audio_tokens`` counts from the probe, for every format, at lengths around the mel
hop and past the 30-second window."""

from __future__ import annotations

import numpy as np
import pytest
from audio_files import encode_audio
from hf_qwen import qwen_tokenizer
from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

from energon_pack.media.audio import AudioProbe
from energon_pack.media.audio_decode import decode_audio
from energon_pack.media.audio_tokens import qwen2_audio_tokens, whisper_frames

AUDIO_TOKENS = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]


@pytest.fixture(scope="module")
def processor() -> Qwen2AudioProcessor:
    tokenizer = qwen_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": AUDIO_TOKENS})
    extractor = WhisperFeatureExtractor(feature_size=128)  # Qwen2-Audio's mel bins
    return Qwen2AudioProcessor(feature_extractor=extractor, tokenizer=tokenizer)


def processor_tokens(processor: Qwen2AudioProcessor, waveform: np.ndarray) -> int:
    text = "<|audio_bos|><|AUDIO|><|audio_eos|>What is said?"
    out = processor(text=[text], audio=[waveform], sampling_rate=16000)
    audio_id = processor.tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    return list(out["input_ids"][0]).count(audio_id)


@pytest.mark.parametrize("kind", ["wav", "flac", "mp3", "opus", "m4a"])
@pytest.mark.parametrize("frames", [1601, 16000 * 3 + 7, 24000 * 2])
def test_the_probe_counts_the_processors_tokens(
    processor: Qwen2AudioProcessor, kind: str, frames: int
) -> None:
    rate = 24000 if kind == "opus" else 22050 if kind in ("wav", "mp3") else 16000
    waveform, probe = decode_audio(encode_audio(kind, rate, 1, frames))
    assert qwen2_audio_tokens(probe) == processor_tokens(processor, waveform)


@pytest.mark.parametrize("samples", [1, 159, 160, 161, 320, 479_999, 480_000, 480_001, 600_000])
def test_lengths_around_the_hop_and_the_window(
    processor: Qwen2AudioProcessor, samples: int
) -> None:
    probe = AudioProbe("wav", 16000, 1, samples)
    assert qwen2_audio_tokens(probe) == processor_tokens(processor, np.zeros(samples, np.float32))
    assert whisper_frames(probe) == min(-(-samples // 160), 3000)
