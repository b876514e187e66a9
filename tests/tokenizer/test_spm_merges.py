"""SentencePiece vocabularies merge as llama.cpp's SPM tokenizer does, checked against a port of its algorithm.

The case that needs care is a tie: llama.cpp merges the best-scoring adjacent pair, leftmost first
among equal scores, and Llama 2 gives all its `▁` runs one score. The vocabulary below numbers the
runs so that taking them in id order would go wrong ("▁▁▁" before "▁▁▁▁").
"""

from __future__ import annotations

import heapq
import random

from tokenmill.tokenizer import Tokenizer

SPECIAL = ["<unk>", "<s>", "</s>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
NORMAL = {"▁": -1.0, "a": -2.0, "b": -3.0, "▁▁": -5.0, "▁▁▁": -5.0, "▁▁▁▁": -5.0, "▁a": -4.0, "ab": -6.0, "▁ab": -7.0}
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


def test_merges_match_llama_cpp_including_ties() -> None:
    tokenizer = Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": TOKENS,
            "tokenizer.ggml.scores": SCORES,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(NORMAL),
            "tokenizer.ggml.add_space_prefix": False,
        }
    )
    rng = random.Random(0)
    random_texts = ["".join(rng.choice(" ab c") for _ in range(rng.randint(1, 30))) for _ in range(300)]
    texts = ["     ", "a     b", "ab  ab"] + random_texts
    for text in texts:
        assert tokenizer.encode(text, add_bos=False) == llama_cpp_spm(text.replace(" ", "▁")), text
