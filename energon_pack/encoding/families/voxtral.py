"""Voxtral (``VoxtralProcessor``: Whisper's feature extractor, a Mistral text model, and the
``MistralCommonBackend`` tokenizer of mistral-common).

The tokenizer has no chat template: mistral-common encodes a chat request to ids itself
(``<s>[INST]...[/INST]reply</s>...``), each audio as ``[BEGIN_AUDIO]`` + ``[AUDIO]`` x n with n
from the audio's length padded to whole chunks of ``chunk_length_s`` (375 tokens per 30 s for
the released checkpoints). The family encodes the request with mistral-common itself, each
audio standing in as a short silent clip, and then sets each audio's run to the count its
header gives (:meth:`VoxtralFamily.audio_tokens`), so no audio is decoded to count tokens.

Model inputs: ``input_features [chunks, mels, frames]``, each audio padded to whole chunks and
cut into them, the chunks of a packed row joined in order. The text model attends causally
only, so a packed row trains exactly through position ids restarting per segment.
"""

from __future__ import annotations

import base64
import io
import math
import wave
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch

from energon_pack.encoding.families.base import AudioFamily, PackingRule, Tokenizes, jsonable
from energon_pack.media.audio import AudioProbe
from energon_pack.media.audio_decode import played_frames

__all__ = ["VoxtralFamily"]


class VoxtralFamily(AudioFamily):
    """Voxtral: audio only, ids from mistral-common's own request encoding (see the module
    docstring). Raises ValueError for a tokenizer whose audio is not cut into fixed chunks (a
    streaming transcription tokenizer) or whose chunks differ from the feature extractor's."""

    name: ClassVar[str] = "voxtral"
    processor_classes: ClassVar[tuple[str, ...]] = ("VoxtralProcessor",)
    packing: ClassVar[PackingRule] = "position_ids"
    takes_images: ClassVar[bool] = False
    tokenizes: ClassVar[Tokenizes] = "request"

    def __init__(self, processor: Any) -> None:
        super().__init__(processor)
        if type(self.tokenizer).__name__ != "MistralCommonBackend":
            raise ValueError(
                f"Voxtral's processor carries a {type(self.tokenizer).__name__}, not "
                "mistral-common's tokenizer (MistralCommonBackend), so its audio tokens cannot "
                "be counted; install mistral-common[audio] and load the checkpoint's directory "
                "(with its config.json, which names the model type)"
            )
        config = self._audio_config
        chunk = config.chunk_length_s
        positions = int(self._audio_kwargs.get("max_source_positions", 0))
        hop = int(config.encoding_config.hop_length)
        extractor_rate = int(self.processor.feature_extractor.sampling_rate)
        if extractor_rate != int(config.sampling_rate):
            raise ValueError(
                f"the tokenizer's audio rate {config.sampling_rate} Hz is not the feature "
                f"extractor's {extractor_rate} Hz; load the processor and tokenizer from the "
                "same checkpoint"
            )
        if not chunk or config.is_streaming:
            raise ValueError(
                "the voxtral family serves tokenizers that pad audio to whole chunks "
                f"(audio.chunk_length_s), not {config.transcription_format} transcription "
                f"with chunk_length_s={chunk}"
            )
        if positions * hop != config.chunk_frames:
            raise ValueError(
                f"the tokenizer's audio chunks of {config.chunk_frames} samples are not the "
                f"feature extractor's max_source_positions={positions} frames of hop {hop}; "
                "load the processor and tokenizer from the same checkpoint"
            )

    @property
    def vision_token_ids(self) -> frozenset[int]:
        return frozenset()

    def expansions(self, sizes: Sequence[tuple[int, int]]) -> list[str]:
        raise ValueError("Voxtral takes no images")

    @cached_property
    def _audio_config(self) -> Any:
        """The tokenizer's audio settings (mistral-common's ``AudioConfig``)."""
        return self.tokenizer.tokenizer.instruct_tokenizer.audio_encoder.audio_config

    @cached_property
    def _requests(self) -> Any:
        """mistral-common's tokenizer for the processor's tokenizer file, validating requests
        as training data (a conversation may end with the assistant's reply)."""
        from mistral_common.protocol.instruct.validator import ValidationMode
        from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

        path = self.tokenizer.tokenizer.instruct_tokenizer.tokenizer.file_path
        return MistralTokenizer.from_file(str(path), mode=ValidationMode.finetuning)

    @cached_property
    def _stand_in(self) -> dict[str, Any]:
        """The content part each audio is encoded as: a silent WAV of one analysis window."""
        config = self._audio_config
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(int(config.sampling_rate))
            out.writeframes(bytes(2 * int(config.encoding_config.window_size)))
        data = base64.b64encode(buffer.getvalue()).decode()
        return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}

    @property
    def audio_rate(self) -> int:
        """The tokenizer's audio rate (the feature extractor's too)."""
        return int(self._audio_config.sampling_rate)

    def audio_tokens(self, probe: AudioProbe) -> int:
        """``[AUDIO]`` tokens of one audio: its length at :attr:`audio_rate` padded to whole
        chunks, as mistral-common counts them."""
        config = self._audio_config
        chunks = math.ceil(played_frames(probe, self.audio_rate) / config.chunk_frames)
        return int(config.num_audio_tokens(chunks * config.chunk_frames))

    def audio_counts(self, probes: Sequence[AudioProbe]) -> list[int]:
        """:meth:`audio_tokens` of each audio; an empty audio is a ValueError."""
        counts = [self.audio_tokens(probe) for probe in probes]
        if 0 in counts:
            raise ValueError("an audio without samples gives no audio tokens")
        return counts

    def request_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        audio_counts: Sequence[int],
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids mistral-common gives the conversation (OpenAI-style messages whose audio
        parts are ``{"type": "audio"}``), each audio's ``[AUDIO]`` run ``audio_counts`` long,
        and the token spans of the assistant replies (each through its ``</s>``). A
        ValueError where mistral-common refuses the conversation or the replies cannot be
        placed."""
        from mistral_common.exceptions import MistralCommonException
        from mistral_common.protocol.instruct.messages import AssistantMessage
        from mistral_common.protocol.instruct.request import ChatCompletionRequest

        requests = self._requests
        try:
            request = ChatCompletionRequest.from_openai(
                messages=[self._request_message(m) for m in messages],
                tools=list(tools) if tools else None,
            )
            # encode_chat_completion's own steps, for the normalised request's replies (which
            # mistral-common keeps on these private attributes only)
            validated = requests._chat_completion_request_validator.validate_request(request)
            instruct = requests._instruct_request_normalizer.from_chat_completion_request(validated)
            encoded = requests.instruct_tokenizer.encode_instruct(instruct)
        except (ValueError, AssertionError, MistralCommonException) as error:
            raise ValueError(f"mistral-common refuses the conversation: {error}") from None
        ids = self._audio_runs(list(encoded.tokens), audio_counts)
        replies = [
            requests.instruct_tokenizer.encode_assistant_message(message, False)
            for message in instruct.messages
            if isinstance(message, AssistantMessage)
        ]
        return ids, self._reply_spans(ids, replies)

    def _request_message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """``message`` with each audio part the stand-in clip."""
        content = message.get("content")
        if not isinstance(content, list):
            return dict(message)
        parts = [self._stand_in if part.get("type") == "audio" else part for part in content]
        return {**message, "content": parts}

    def _audio_runs(self, ids: list[int], counts: Sequence[int]) -> list[int]:
        """``ids`` with the ``[AUDIO]`` run after each ``[BEGIN_AUDIO]`` set to its count."""
        begin = int(self.tokenizer.tokenizer.instruct_tokenizer.audio_encoder.begin_audio_token)
        audio = int(self.processor.audio_token_id)
        starts = [i for i, token in enumerate(ids) if token == begin]
        if len(starts) != len(counts):
            raise ValueError(f"{len(starts)} audio runs for {len(counts)} audios")
        out: list[int] = []
        last = 0
        for start, count in zip(starts, counts, strict=True):
            end = start + 1
            while end < len(ids) and ids[end] == audio:
                end += 1
            out += ids[last : start + 1] + [audio] * count
            last = end
        return out + ids[last:]

    def _reply_spans(
        self, ids: Sequence[int], replies: Sequence[Sequence[int]]
    ) -> list[tuple[int, int]]:
        """The span of each reply: the tokens mistral-common encodes it as, ending at its
        ``</s>`` (only replies end with one: the k-th reply at the k-th)."""
        eos = int(self._requests.instruct_tokenizer.tokenizer.eos_id)
        ends = [index + 1 for index, token in enumerate(ids) if token == eos]
        if len(ends) != len(replies):
            raise ValueError(
                f"{len(ends)} replies end with </s> for {len(replies)} assistant turns"
            )
        spans = [(end - len(reply), end) for end, reply in zip(ends, replies, strict=True)]
        for number, ((begin, end), reply) in enumerate(zip(spans, replies, strict=True), 1):
            if begin < 0 or list(ids[begin:end]) != list(reply):
                raise ValueError(f"assistant reply {number} is not where mistral-common puts it")
        return spans

    def audio_inputs(self, waveforms: Sequence[np.ndarray[Any, Any]]) -> dict[str, torch.Tensor]:
        """``input_features [chunks, mels, frames]``: the feature extractor on each audio with
        the processor's audio settings (padded to whole chunks), cut into chunks of
        ``max_source_positions`` frames, as the processor's chat-template call gives them."""
        if not waveforms:
            return {}
        settings = {**self._audio_kwargs, "return_tensors": "pt"}
        positions = int(settings.pop("max_source_positions"))
        extractor = self.processor.feature_extractor
        chunks = []
        for waveform in waveforms:
            features = extractor(np.asarray(waveform, dtype=np.float32), **settings)
            values = features["input_features"].reshape(extractor.feature_size, -1, positions)
            chunks.append(values.transpose(0, 1))
        return {"input_features": torch.cat(chunks)}

    def settings(self) -> dict[str, Any]:
        """The family's name, the feature extractor's settings (with the processor's audio
        kwargs) and the tokenizer's version and audio settings."""
        extractor = self.processor.feature_extractor.to_dict()
        config = self._audio_config
        return {
            "family": self.name,
            "feature_extractor": jsonable({**extractor, "call": self._audio_kwargs}),
            "tokenizer": {
                "version": str(self._requests.instruct_tokenizer.tokenizer.version.value),
                "vocab_size": int(self._requests.instruct_tokenizer.tokenizer.n_words),
                "audio": jsonable(
                    {
                        "sampling_rate": config.sampling_rate,
                        "frame_rate": config.frame_rate,
                        "chunk_length_s": config.chunk_length_s,
                        "hop_length": config.encoding_config.hop_length,
                    }
                ),
            },
        }
