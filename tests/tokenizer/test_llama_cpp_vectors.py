"""llama.cpp's published tokenizer test vectors (`models/ggml-vocab-*.gguf.{inp,out}`), read as
test-tokenizer-0 does, for every vocabulary in llama.cpp's `models/` folder.

test-tokenizer-0 splits the .inp file on "\\n__ggml_vocab_test__\\n" (the file ends with one, which
adds no empty string), keys the tests by string, and tokenizes with add_special=false and
parse_special=false, i.e. no BOS and control-token text left as text.
"""

from __future__ import annotations

import re

import pytest
from tokenizers import Regex, pre_tokenizers

from tests.llama_cpp_files import llama_cpp_files, vocab_file
from tokenmill.tokenizer import Tokenizer, TokenizerError
from tokenmill.tokenizer.pretokenize import PRE_TOKENIZERS

# (vocabulary, tokenizer.ggml.model, tokenizer.ggml.pre)
VOCABS = [
    "bert-bge",  # bert (WPM)
    "command-r",
    "deepseek-coder",
    "deepseek-llm",
    "falcon",
    "gemma-4",  # gemma4 (SentencePiece-style BPE)
    "gpt-2",
    "llama-bpe",
    "llama-spm",  # llama (SPM)
    "mpt",
    "phi-3",  # llama (SPM)
    "qwen2",
    "qwen35",
    "refact",
    "starcoder",
]
# Vocabularies the folder holds without vectors; the strings of llama-bpe's tests are used on them.
UNTESTED_VOCABS = ["aquila", "baichuan", "gpt-neox", "nomic-bert-moe"]
# The vocabularies whose text normalization (lowercase, accents, spaces) a decode cannot undo
NORMALIZING = {"bert-bge", "nomic-bert-moe"}


def read_tests(name: str) -> dict[str, list[int]]:
    raw = vocab_file(name, ".gguf.inp").read_text(encoding="utf-8")
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
    lines = vocab_file(name, ".gguf.out").read_text(encoding="utf-8").splitlines()
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
        assert_round_trips(name, tokenizer, text)


def assert_round_trips(name: str, tokenizer: Tokenizer, text: str) -> None:
    """decode gives the text back; where the vocabulary normalizes text, it gives text that
    tokenizes the same (unless that meant the unknown token, whose text is not the original's)."""
    ids = tokenizer.encode(text, add_bos=False, parse_special=False)
    decoded = tokenizer.decode(ids)
    if name not in NORMALIZING:
        assert decoded == text
    elif tokenizer.special_tokens["unk_token"] not in decoded:
        assert tokenizer.encode(decoded, add_bos=False, parse_special=False) == ids, decoded


@pytest.mark.parametrize("name", UNTESTED_VOCABS)
def test_vocabularies_without_vectors_round_trip(name: str, vocab_tokenizer) -> None:
    """They load, and llama-bpe's test strings (English, code, CJK, emoji, runs of spaces and
    newlines) round-trip; a wrong merge table or normalizer would break one."""
    tokenizer = vocab_tokenizer(name)
    for text in read_tests("llama-bpe"):
        assert_round_trips(name, tokenizer, text)
    words = tokenizer.encode("Hello world, this is a test.", add_bos=False)
    assert 3 <= len(words) <= 10, words


def test_every_llama_cpp_vocabulary_is_covered() -> None:
    names = {
        path.name[len("ggml-vocab-") : -len(".gguf")] for path in llama_cpp_files().glob("*.gguf")
    }
    assert names == set(VOCABS + UNTESTED_VOCABS)


def llama_vocab_cpp() -> str:
    return (llama_cpp_files() / "llama-vocab.cpp").read_text(encoding="utf-8")


def test_every_llama_cpp_pre_type_is_known() -> None:
    """llama.cpp's pre type names (those a gpt2 vocabulary may give), each with regexes Oniguruma
    compiles; most have no vocabulary to test them on."""
    source = llama_vocab_cpp()
    names = set(re.findall(r'tokenizer_pre == "([^"]+)"', source))
    assert len(names) > 80
    assert names <= set(PRE_TOKENIZERS), sorted(names - set(PRE_TOKENIZERS))
    for name, pre in PRE_TOKENIZERS.items():
        for regex in pre.regexes:
            split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
            assert split.pre_tokenize_str("Hello World's 1234567 中文 \n\n  x!"), (name, regex)


REFUSED_MODELS = {"no_vocab", "none", "test", "rwkv", "plamo2", "hybriddna", "whitespace"}


def test_every_llama_cpp_vocabulary_kind_is_read_or_refused() -> None:
    """The tokenizer.ggml.model names llama.cpp knows: five are read; the others (RWKV, PLaMo-2, the
    DNA hybrid, whitespace-split and test vocabularies, and none) are refused with an error."""
    names = set(re.findall(r'tokenizer_model == "([^"]+)"', llama_vocab_cpp()))
    assert names == REFUSED_MODELS | {"llama", "gpt2", "gemma4", "bert", "t5"}
    for name in REFUSED_MODELS:
        with pytest.raises(TokenizerError, match="unsupported GGUF tokenizer.ggml.model"):
            Tokenizer.from_gguf_metadata(
                {"tokenizer.ggml.model": name, "tokenizer.ggml.tokens": ["a", "b"]}
            )


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


def test_encoder_vocabularies_frame_as_llama_cpp(vocab_tokenizer) -> None:
    """llama.cpp's add_special: [CLS] ... [SEP] for BERT, BOS and EOS for XLM-R (the file's
    flags)."""
    bert = vocab_tokenizer("bert-bge")
    ids = bert.encode("Hello  World!", add_bos=False)
    assert [bert.id_to_piece(i) for i in ids] == ["hello", "world", "!"]
    assert bert.encode_framed("Hello  World!") == [101, *ids, 102]
    assert bert.decode(ids) == "hello world!"
    xlmr = vocab_tokenizer("nomic-bert-moe")
    ids = xlmr.encode("Hello  World!", add_bos=False)
    assert [xlmr.id_to_piece(i) for i in ids] == ["▁Hello", "▁World", "!"]
    assert xlmr.encode("Hello  World!") == xlmr.encode_framed("Hello  World!") == [0, *ids, 2]
    assert xlmr.decode(ids) == "Hello World!"


def test_gemma4_adds_bos_and_marks_spaces(vocab_tokenizer) -> None:
    tokenizer = vocab_tokenizer("gemma-4")
    ids = tokenizer.encode("Hello world\n\n")
    assert ids[0] == tokenizer.bos_token_id == 2
    assert [tokenizer.id_to_piece(i) for i in ids[1:]] == ["Hello", "▁world", "\n\n"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world\n\n"
    # llama.cpp takes a run of newlines that is a token whole; the merges build each such token
    for n in range(1, 32):
        assert [tokenizer.id_to_piece(i) for i in tokenizer.encode("\n" * n, add_bos=False)] == [
            "\n" * n
        ]
