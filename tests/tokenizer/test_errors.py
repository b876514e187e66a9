"""Vocabularies and calls tokenmill cannot serve fail with a message that says what is wrong."""

from __future__ import annotations

import pytest

from tokenmill.tokenizer import Tokenizer, TokenizerError

BPE = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.tokens": ["a", "b", "ab"],
    "tokenizer.ggml.merges": ["a b"],
}


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({}, "no tokenizer.ggml.tokens"),
        ({**BPE, "tokenizer.ggml.model": "rwkv"}, "unsupported GGUF tokenizer.ggml.model 'rwkv'"),
        ({**BPE, "tokenizer.ggml.model": "bert"}, "BERT vocabulary names no unknown token"),
        ({**BPE, "tokenizer.ggml.model": "t5"}, "Unigram vocabulary needs a tokenizer.ggml.scores"),
        (
            {**BPE, "tokenizer.ggml.pre": "brand-new"},
            "unsupported GGUF pre-tokenizer tokenizer.ggml.pre='brand-new'",
        ),
        ({**BPE, "tokenizer.ggml.merges": []}, "no tokenizer.ggml.merges"),
        ({**BPE, "tokenizer.ggml.tokens": ["a", "b", "a"]}, "lists the token 'a' twice"),
        ({**BPE, "tokenizer.ggml.add_bos_token": True}, "names no BOS token"),
    ],
)
def test_unusable_vocabularies(metadata: dict, message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf_metadata(metadata)


def test_bad_calls() -> None:
    tokenizer = Tokenizer.from_gguf_metadata(BPE)
    assert tokenizer.encode("abba") == [2, 1, 0]
    with pytest.raises(TokenizerError, match="token id 7 is outside the vocabulary"):
        tokenizer.decode([0, 7])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tokenizer.id_to_piece(-1)
    with pytest.raises(TokenizerError, match="cannot add a BOS token"):
        tokenizer.encode("a", add_bos=True)
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
