"""The offline-built Qwen tokenizer is Qwen's real one: golden ids and the added-token ids."""

from __future__ import annotations

from real_qwen import ADDED_TOKENS, FIRST_ADDED_ID, real_qwen_tokenizer

# Reference ids recorded by transformers' Qwen2 tokenizer integration test (Qwen/Qwen-tokenizer).
GOLDEN = {
    "Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides ": [
        8963, 388, 320, 69514, 3881, 438, 4510, 27414, 32852, 388, 323, 4510, 27414, 21334,
        35722, 1455, 529, 8, 5707, 220,
    ],
    "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow.": [
        6507, 304, 220, 16, 15, 15, 10, 15459, 323, 5538, 94130, 2897, 1948, 619, 706, 11,
        5355, 51, 21584, 323, 94986, 13,
    ],
    "🤗 Transformers 提供了可以轻松地下载并且训练先进的预训练模型的 API 和工具。": [
        144834, 80532, 93685, 83744, 34187, 73670, 104261, 29490, 62189, 103937, 104034,
        102830, 98841, 104034, 104949, 9370, 5333, 58143, 102011, 1773,
    ],
    '```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\n'
    'tokenizer("世界\uff0c你好\uff01")```': [
        73594, 12669, 198, 85593, 284, 8979, 37434, 6387, 10442, 35722, 445, 48, 16948, 45274,
        16948, 34841, 3135, 1138, 85593, 445, 99489, 3837, 108386, 6313, 899, 73594,
    ],
}  # fmt: skip


def test_golden_ids() -> None:
    tokenizer = real_qwen_tokenizer()
    for text, ids in GOLDEN.items():
        assert tokenizer(text)["input_ids"] == ids, text


def test_added_tokens_and_size() -> None:
    tokenizer = real_qwen_tokenizer()
    assert len(tokenizer) == FIRST_ADDED_ID + len(ADDED_TOKENS) == 151669
    for offset, (text, _) in enumerate(ADDED_TOKENS):
        assert tokenizer.convert_tokens_to_ids(text) == FIRST_ADDED_ID + offset
        assert tokenizer(text)["input_ids"] == [FIRST_ADDED_ID + offset]
    assert tokenizer.pad_token_id == 151643
    assert tokenizer.eos_token_id == 151645
    # NFC normalisation: the decomposed form encodes as the composed one.
    assert tokenizer("\u03d2\u0301")["input_ids"] == tokenizer("\u03d3")["input_ids"]
