"""Streaming detokenization: the pieces add up to the full decode, never split a character, keep
leading spaces."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Café naïve — Ångström façade. Ünïcödé ẞ",
    "日本語のテキスト、中文混合。한국어 텍스트",
    "Emoji: 🦙🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 mist 😶‍🌫️ ✅ 🤖",
    "  leading and   multiple   spaces  \n\n  indented\tline\n",
    "def f(x):\n    return {'a': [1, 2, 3]}  # ok\n",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝛼𝛽𝛾 and rare CJK 𠜎𠜱𠝹",
]
# characters for random texts: many need several UTF-8 bytes, some are byte-fallback tokens in Gemma
CHARS = list("abc XYZ  \n\t.,!?'") + list("éàüñßø日本語中文한국어кириллица🦙🚀😀👍🏽🇯🇵‍️✅𠜎𝛼")

TOKENIZERS = ["llama-spm", "gpt-2", "smollm2", "gemma3"]


@pytest.fixture(params=TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest, vocab_tokenizer) -> Tokenizer:
    if request.param in ("smollm2", "gemma3"):
        return request.getfixturevalue(f"{request.param}_tokenizer")
    return vocab_tokenizer(request.param)


def stream(
    tokenizer: Tokenizer, ids: Sequence[int], prompt_ids: Sequence[int] = (), skip: bool = True
) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids, skip_special_tokens=skip)
    return [detokenizer.push(token) for token in ids] + [detokenizer.flush()]


def random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(CHARS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_stream_equals_decode(tokenizer: Tokenizer) -> None:
    for text in TEXTS + random_texts(150, seed=1):
        ids = tokenizer.encode(text, add_bos=False)
        pieces = stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), text
        assert not any("\ufffd" in piece for piece in pieces), (text, pieces)


def test_first_generated_token_keeps_its_space(tokenizer: Tokenizer) -> None:
    """After a prompt, the continuation's leading space is text too (SentencePiece decode alone
    drops it)."""
    for prompt, continuation in [
        ("The answer is", " 42, surely 🦙"),
        ("Translate:", " café 日本"),
        ("x", "  two"),
    ]:
        prompt_ids = tokenizer.encode(prompt)
        ids = tokenizer.encode(prompt + continuation)
        assert ids[: len(prompt_ids)] == prompt_ids
        assert "".join(stream(tokenizer, ids[len(prompt_ids) :], prompt_ids)) == continuation


def test_special_tokens_are_shown_or_skipped(smollm2_tokenizer: Tokenizer) -> None:
    ids = smollm2_tokenizer.encode("Hi<|im_end|>\n<|im_start|>user")
    assert "".join(stream(smollm2_tokenizer, ids, skip=False)) == "Hi<|im_end|>\n<|im_start|>user"
    assert "".join(stream(smollm2_tokenizer, ids)) == "Hi\nuser"


def test_byte_fallback_character_is_emitted_whole(gemma3_tokenizer: Tokenizer) -> None:
    ids = gemma3_tokenizer.encode("ok 🦙", add_bos=False)
    assert [gemma3_tokenizer.id_to_piece(i) for i in ids[-4:]] == [
        "<0xF0>",
        "<0x9F>",
        "<0xA6>",
        "<0x99>",
    ]
    assert stream(gemma3_tokenizer, ids)[-5:] == ["", "", "", "🦙", ""]


def test_decodes_only_a_short_tail(vocab_tokenizer) -> None:
    """Each push decodes a few recent tokens, not the whole generation."""
    tokenizer = vocab_tokenizer("gpt-2")
    lengths: list[int] = []

    class Recording:
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
            lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    prompt_ids, ids = tokenizer.encode("Some prompt."), tokenizer.encode(" ".join(TEXTS) * 20)
    detokenizer = IncrementalDetokenizer(Recording(), prompt_ids=prompt_ids)  # type: ignore[arg-type]
    assert "".join(
        detokenizer.push(token) for token in ids
    ) + detokenizer.flush() == tokenizer.decode(ids)
    assert len(ids) > 2000 and max(lengths) <= 12
