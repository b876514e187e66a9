"""llama.cpp's published tokenizer test vectors (`models/ggml-vocab-*.gguf.{inp,out}`), read as
test-tokenizer-0 does.

test-tokenizer-0 splits the .inp file on "\\n__ggml_vocab_test__\\n" (the file ends with one, which
adds no empty string), keys the tests by string, and tokenizes with add_special=false and
parse_special=false, i.e. no BOS and control-token text left as text.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.tokenizer import Tokenizer

VECTORS = Path(__file__).parent.parent / "data" / "tokenizer-vectors"
VOCABS = ["llama-spm", "llama-bpe", "gpt-2", "qwen2"]


def read_tests(name: str) -> dict[str, list[int]]:
    raw = (VECTORS / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    separator = "\n__ggml_vocab_test__\n"
    strings = []
    pos = 0
    while pos < len(raw):
        end = raw.find(separator, pos)
        if end < 0:
            strings.append(raw[pos:])
            break
        strings.append(raw[pos:end])
        pos = end + len(separator)
    lines = (VECTORS / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(strings) == len(lines), f"{name}: .inp has {len(strings)} tests, .out {len(lines)}"
    return {text: [int(token) for token in line.split()] for text, line in zip(strings, lines)}


@pytest.fixture(params=VOCABS)
def vocab(request: pytest.FixtureRequest, vocab_tokenizer) -> tuple[str, Tokenizer]:
    return request.param, vocab_tokenizer(request.param)


def test_every_string_matches_llama_cpp(vocab: tuple[str, Tokenizer]) -> None:
    name, tokenizer = vocab
    tests = read_tests(name)
    assert len(tests) > 40
    wrong = {
        text: (expected, got)
        for text, expected in tests.items()
        if (got := tokenizer.encode(text, add_bos=False, parse_special=False)) != expected
    }
    assert not wrong, f"{name}: {len(wrong)} of {len(tests)} strings differ from llama.cpp: {wrong}"


def test_decode_round_trips(vocab: tuple[str, Tokenizer]) -> None:
    name, tokenizer = vocab
    for text in read_tests(name):
        assert tokenizer.decode(tokenizer.encode(text, add_bos=False, parse_special=False)) == text


def test_llama_spm_defaults(vocab_tokenizer) -> None:
    """SentencePiece vocabularies get BOS and the prefix space; special-token text parses only on
    request."""
    tokenizer = vocab_tokenizer("llama-spm")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 32000)
    assert tokenizer.encode("Hello world") == [1, 15043, 3186]
    assert tokenizer.encode("</s>")[-1] == 2
    assert 2 not in tokenizer.encode("</s>", parse_special=False)
    assert tokenizer.decode([1, 15043, 3186]) == "<s> Hello world"
    assert tokenizer.decode([1, 15043, 3186], skip_special_tokens=True) == "Hello world"
    assert tokenizer.id_to_piece(15043) == "▁Hello"
    assert tokenizer.stop_token_ids == frozenset({2})


def test_llama3_adds_bos_by_default(vocab_tokenizer) -> None:
    tokenizer = vocab_tokenizer("llama-bpe")
    assert tokenizer.encode("Hello world") == [128000, 9906, 1917]
    assert tokenizer.encode("<|eot_id|>", add_bos=False) == [128009]
    assert 128009 in tokenizer.stop_token_ids  # <|eot_id|> ends a turn, as llama.cpp detects it
