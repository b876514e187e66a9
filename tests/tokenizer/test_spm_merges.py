"""SentencePiece vocabularies merge as llama.cpp's SPM tokenizer does, checked against a port of its
algorithm.

The case that needs care is a tie: llama.cpp merges the best-scoring adjacent pair, leftmost first
among equal scores, and Llama 2 gives all its `▁` runs one score. The vocabulary below numbers the
runs so that taking them in id order would go wrong ("▁▁▁" before "▁▁▁▁").
"""

from __future__ import annotations

import heapq
import random

import pytest

from tokenmill.tokenizer import Tokenizer, gguf_vocab

SPECIAL = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
NORMAL = {
    "▁": -1.0,
    "a": -2.0,
    "b": -3.0,
    "▁▁": -5.0,
    "▁▁▁": -5.0,
    "▁▁▁▁": -5.0,
    "▁a": -4.0,
    "ab": -6.0,
    "▁ab": -7.0,
}
TOKENS = SPECIAL + BYTES + list(NORMAL)
SCORES = [0.0] * (len(SPECIAL) + len(BYTES)) + list(NORMAL.values())


def llama_cpp_spm(text: str) -> list[int]:
    """llama.cpp's `llm_tokenizer_spm_session::tokenize` on escaped text (`▁` for spaces)."""
    ids = {token: i for i, token in enumerate(TOKENS)}
    pieces = list(text)  # symbol texts; merged-away symbols become ""
    nxt = list(range(1, len(pieces))) + [-1]
    prv = list(range(-1, len(pieces) - 1))
    queue: list[tuple[float, int, int, str]] = []

    def add_bigram(left: int, right: int) -> None:
        joined = pieces[left] + pieces[right] if left >= 0 and right >= 0 else ""
        if joined in ids:
            heapq.heappush(queue, (-SCORES[ids[joined]], left, right, joined))

    for i in range(1, len(pieces)):
        add_bigram(i - 1, i)
    while queue:
        _, left, right, joined = heapq.heappop(queue)
        if pieces[left] + pieces[right] != joined or not pieces[left] or not pieces[right]:
            continue  # outdated: one side was merged since
        pieces[left], pieces[right] = joined, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        add_bigram(prv[left], left)
        add_bigram(left, nxt[left])
    out: list[int] = []
    for piece in pieces:
        if piece:
            out += [ids[piece]] if piece in ids else [ids[f"<0x{b:02X}>"] for b in piece.encode()]
    return out


METADATA = {
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": TOKENS,
    "tokenizer.ggml.scores": SCORES,
    "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(NORMAL),
    "tokenizer.ggml.add_space_prefix": False,
}


def test_merges_match_llama_cpp_including_ties() -> None:
    tokenizer = Tokenizer.from_gguf_metadata(METADATA)
    rng = random.Random(0)
    random_texts = [
        "".join(rng.choice(" ab c") for _ in range(rng.randint(1, 30))) for _ in range(300)
    ]
    texts = ["     ", "a     b", "ab  ab"] + random_texts
    for text in texts:
        assert tokenizer.encode(text, add_bos=False) == llama_cpp_spm(text.replace(" ", "▁")), text


def test_splits_are_cached_per_vocabulary_and_a_damaged_entry_is_rebuilt(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    text = "ab  ab ▁a b"
    expected = llama_cpp_spm(text.replace(" ", "▁"))
    assert Tokenizer.from_gguf_metadata(METADATA).encode(text, add_bos=False) == expected
    [entry] = (tmp_path / "tokenmill" / "tokenizers").glob("*.splits")
    computed = entry.read_bytes()

    def not_again(*args):
        raise AssertionError("the splits were computed again instead of read from the cache")

    with monkeypatch.context() as patch:
        patch.setattr(gguf_vocab, "_ranked_splits", not_again)
        assert Tokenizer.from_gguf_metadata(METADATA).encode(text, add_bos=False) == expected
        with pytest.raises(AssertionError, match="computed again"):  # other scores: another entry
            Tokenizer.from_gguf_metadata(METADATA | {"tokenizer.ggml.scores": SCORES[:-1] + [-8.0]})

    entry.write_bytes(computed[:-3])  # truncated
    assert Tokenizer.from_gguf_metadata(METADATA).encode(text, add_bos=False) == expected
    assert entry.read_bytes() == computed


def test_an_unwritable_cache_only_costs_time(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    text = "ab  ab ▁a b"
    assert Tokenizer.from_gguf_metadata(METADATA).encode(text, add_bos=False) == llama_cpp_spm(
        text.replace(" ", "▁")
    )
