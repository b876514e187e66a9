"""Build a fast `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata, tokenizing as
llama.cpp's `llama-vocab.cpp` does.

The vocabulary kinds (`tokenizer.ggml.model`), by llama.cpp's names for them:

- SPM, `llama` (SentencePiece BPE with scores, byte fallback, `▁` for spaces). llama.cpp merges the
  adjacent pair whose joined text is the best-scoring vocabulary token, leftmost first on a tie,
  over the whole text between special tokens (no word splitting). A BPE model whose merge list holds
  every (left, right) split of every token, ranked by that token's score, makes the same choices
  (see `_ranked_splits` for ties).
- BPE, `gpt2` (ranked merges), split first by the pre type's regexes (`pretokenize`): byte-level as
  GPT-2, or, for SentencePiece-style pre types, over the raw text with `▁` for spaces and `<0xXX>`
  byte tokens. `gemma4` is the latter with the `gemma4` pre type.
- WPM, `bert`, and UGM, `t5`: see `gguf_encoders`.

llama.cpp's other kinds (`rwkv`, `plamo2`, `hybriddna`, `whitespace`) are refused with an error.

In all, llama.cpp cuts control, unknown and user-defined tokens out of the raw text before anything
else; added tokens that are not normalized do the same here. Control and unknown ones are marked
special, so they are only matched when special tokens are parsed, and skipped when decoding with
`skip_special_tokens`; user-defined ones are always matched, as in llama.cpp.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from tokenmill.catalog import cache_root, mark_used, prune_cache, write_atomic
from tokenmill.tokenizer.errors import TokenizerError
from tokenmill.tokenizer.gguf_encoders import unigram, wordpiece
from tokenmill.tokenizer.pretokenize import PRE_TOKENIZERS, PreTokenizer

# tokenizer.ggml.token_type values used here (5 is unused, 6 a byte token like <0x0A>)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

KEEP_SPLITS = 8  # vocabularies whose cached merge splits (~4 MB each) outlive a new one's

# llama.cpp treats a control token with one of these texts as end-of-generation, whatever the file's
# ids say.
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
    }
)


def gguf_tokens(metadata: Mapping[str, Any]) -> list[str]:
    """The vocabulary; llama.cpp renames an empty token so every text stays unique."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens) == 0:
        raise TokenizerError(
            "GGUF metadata has no tokenizer.ggml.tokens: the file carries no vocabulary"
        )
    tokens = [token or f"[EMPTY_{i}]" for i, token in enumerate(tokens)]
    if len(set(tokens)) != len(tokens):
        duplicate = next(token for token, count in Counter(tokens).items() if count > 1)
        raise TokenizerError(f"GGUF vocabulary lists the token {duplicate!r} twice")
    return tokens


def gguf_token_types(metadata: Mapping[str, Any], tokens: Sequence[str]) -> list[int]:
    """Token types, with normal tokens whose text ends a turn made control, as llama.cpp does.

    User-defined ones are left alone: Gemma 3 has an HTML tag "</s>" that must not stop generation.
    """
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        types = [TOKEN_NORMAL] * len(tokens)
    if len(types) < len(tokens):
        raise TokenizerError(
            f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    return [
        TOKEN_CONTROL if kind == TOKEN_NORMAL and token in EOG_TEXTS else kind
        for token, kind in zip(tokens, types)
    ]


def build_backend(metadata: Mapping[str, Any], tokens: list[str], types: Sequence[int]) -> Backend:
    """The tokenizer for this GGUF vocabulary, with special tokens added; it adds no BOS/EOS
    itself."""
    kind = metadata.get("tokenizer.ggml.model")
    ids = special_token_ids(metadata, len(tokens))
    if kind == "llama":
        backend = _sentencepiece_bpe(metadata, tokens)
    elif kind in ("gpt2", "gemma4"):
        backend = _bpe(metadata, tokens)
    elif kind == "bert":
        backend = wordpiece(metadata, tokens, types, ids)
    elif kind == "t5":
        backend = unigram(
            metadata, tokens, types, ids, default_add_bos(metadata), default_add_eos(metadata)
        )
    else:
        raise TokenizerError(
            f"unsupported GGUF tokenizer.ggml.model {kind!r}: tokenmill reads 'llama' "
            "(SentencePiece), 'gpt2' and 'gemma4' (BPE), 'bert' (WordPiece) and 't5' (Unigram) "
            "vocabularies"
        )
    special = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, types)
        if kind in (TOKEN_CONTROL, TOKEN_UNKNOWN)
    ]
    user_defined = [
        AddedToken(token, special=False, normalized=False)
        for token, kind in zip(tokens, types)
        if kind == TOKEN_USER_DEFINED
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)
    return backend


def _sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str]) -> Backend:
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * len(tokens)
    if len(scores) < len(tokens):
        raise TokenizerError(
            f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    vocab = {token: i for i, token in enumerate(tokens)}
    unk_id = special_token_ids(metadata, len(tokens)).get("unk_token")
    model = models.BPE(
        vocab=vocab,
        merges=_merges_by_score(tokens, scores, vocab),
        # a character that is no token becomes <0xXX> tokens; <unk> only if those lack
        byte_fallback=True,
        unk_token=tokens[unk_id] if unk_id is not None else None,
    )
    backend = Backend(model)
    add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    # llama.cpp puts the prefix space before every piece of text between special tokens.
    backend.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("▁")] if add_space_prefix else []) + [normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    return backend


def _merges_by_score(
    tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, best-scoring result first (see `_ranked_splits`).

    Finding them takes seconds for a large vocabulary (millions of dictionary lookups for Gemma's
    262k tokens), a large part of the server's start, so the splits are cached on disk, keyed by the
    vocabulary, the scores and this file's source: every GGUF file with the same vocabulary shares
    one entry.
    """
    key = hashlib.sha256(Path(__file__).read_bytes())
    key.update(array("q", map(len, tokens)).tobytes())
    key.update("".join(tokens).encode("utf-8", "surrogatepass"))
    key.update(array("d", scores[: len(tokens)]).tobytes())
    path = cache_root() / "tokenizers" / f"{key.hexdigest()[:32]}.splits"
    splits = _read_splits(path, len(tokens))
    if splits is None:
        splits = _ranked_splits(tokens, scores, vocab)
        _write_splits(path, splits)
        prune_cache(path.parent, "*.splits", KEEP_SPLITS)
    else:
        mark_used(path)
    return [
        (tokens[index][:cut], tokens[index][cut:]) for index, cut in zip(splits[::2], splits[1::2])
    ]


def _ranked_splits(
    tokens: Sequence[str], scores: Sequence[float], vocab: Mapping[str, int]
) -> array:
    """(token index, cut) pairs, flat, for every split of a token into two tokens, best-scoring
    token first.

    A rank cannot say "leftmost first" for tokens of equal score. Putting the longer token first
    does it for runs of one character, the ties real vocabularies have (Llama 2 gives all its `▁`
    runs one score): the leftmost run then grows one symbol at a time, as in llama.cpp.
    """
    ranked = []
    for index, token in enumerate(tokens):
        for cut in range(1, len(token)):
            if token[:cut] in vocab and token[cut:] in vocab:
                ranked.append((-scores[index], -len(token), index, cut))
    ranked.sort()
    return array("i", (n for _, _, index, cut in ranked for n in (index, cut)))


def _read_splits(path: Path, num_tokens: int) -> array | None:
    """The cached splits, or None when absent or unreadable."""
    try:
        splits = array("i", path.read_bytes())
    except (OSError, ValueError):
        return None
    if len(splits) % 2 or (splits and (min(splits) < 0 or max(splits[::2]) >= num_tokens)):
        return None
    return splits


def _write_splits(path: Path, splits: array) -> None:
    """Cache the splits; a cache that cannot be written only costs the next start the time again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, splits.tobytes())
    except OSError:
        pass


def pre_tokenizer_of(metadata: Mapping[str, Any]) -> PreTokenizer | None:
    """The BPE pre type of the file; llama.cpp gives `gemma4` vocabularies the `gemma4` one."""
    if metadata.get("tokenizer.ggml.model") == "gemma4":
        return PRE_TOKENIZERS["gemma4"]
    if metadata.get("tokenizer.ggml.model") != "gpt2":
        return None
    return PRE_TOKENIZERS.get(metadata.get("tokenizer.ggml.pre") or "default")


def _bpe(metadata: Mapping[str, Any], tokens: list[str]) -> Backend:
    pre = pre_tokenizer_of(metadata)
    if pre is None:
        name = metadata.get("tokenizer.ggml.pre")
        raise TokenizerError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={name!r}; "
            f"known: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    merges_text = metadata.get("tokenizer.ggml.merges")
    if merges_text is None or len(merges_text) == 0:
        raise TokenizerError("GGUF BPE vocabulary has no tokenizer.ggml.merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for merge in merges_text:
        cut = merge.find(" ", 1)  # as llama.cpp splits it
        left, right = merge[:cut], merge[cut + 1 :]
        # a merge whose parts or result are not tokens can never produce a token; the model rejects
        # it
        if cut > 0 and left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
    # Without GGUF's byte-to-char map, a character that is no token becomes <0xXX> tokens. For
    # Gemma 4, llama.cpp takes a run of newlines that is a token whole; its merges build every such
    # token, so the ranked merges give the same.
    backend = Backend(
        models.BPE(
            vocab=vocab,
            merges=merges,
            ignore_merges=pre.ignore_merges,
            byte_fallback=not pre.byte_level,
        )
    )
    if pre.escape_spaces:
        backend.normalizer = normalizers.Replace(" ", "▁")
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre.regexes]
    if pre.byte_level:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
        backend.decoder = decoders.Sequence(
            ([decoders.Replace("▁", " ")] if pre.escape_spaces else [])
            + [decoders.ByteFallback(), decoders.Fuse()]
        )
    return backend


_SPECIAL_KEYS = {
    "bos_token": "bos_token_id", "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id", "pad_token": "padding_token_id",
    "sep_token": "seperator_token_id", "mask_token": "mask_token_id",
}  # fmt: skip
# llama.cpp's, per tokenizer.ggml.model, for files that name none
_DEFAULT_IDS = {
    "llama": {"bos_token": 1, "eos_token": 2, "unk_token": 0},
    "bert": {
        "bos_token": 101,
        "unk_token": 100,
        "sep_token": 102,
        "pad_token": 0,
        "mask_token": 103,
    },
    "t5": {"eos_token": 1, "unk_token": 2, "pad_token": 0},
}


def special_token_ids(metadata: Mapping[str, Any], n_tokens: int) -> dict[str, int]:
    """The named special tokens ("bos_token", ...) the file gives; ids outside the vocabulary are
    dropped."""
    defaults = _DEFAULT_IDS.get(metadata.get("tokenizer.ggml.model"), {})
    ids = {}
    for name, key in _SPECIAL_KEYS.items():
        value = metadata.get(f"tokenizer.ggml.{key}", defaults.get(name))
        if isinstance(value, int) and 0 <= value < n_tokens:
            ids[name] = value
    return ids


def default_add_bos(metadata: Mapping[str, Any]) -> bool:
    """Whether llama.cpp puts BOS before a prompt: the file's add_bos_token flag, else on for SPM,
    WPM (BERT's [CLS]) and a few BPE pre types; Gemma 4 always."""
    pre = pre_tokenizer_of(metadata)
    if pre is not None and pre.force_bos:
        return True
    if "tokenizer.ggml.add_bos_token" in metadata:
        return bool(metadata["tokenizer.ggml.add_bos_token"])
    if metadata.get("tokenizer.ggml.model") in ("llama", "bert"):
        return True
    return bool(pre and pre.add_bos)


def default_add_eos(metadata: Mapping[str, Any]) -> bool:
    """Whether llama.cpp puts EOS after a prompt: the file's add_eos_token flag, else on for UGM."""
    if "tokenizer.ggml.add_eos_token" in metadata:
        return bool(metadata["tokenizer.ggml.add_eos_token"])
    return metadata.get("tokenizer.ggml.model") == "t5"


def stop_token_ids(
    metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], eos_id: int | None
) -> frozenset[int]:
    """EOS, EOT and EOM, and the control tokens llama.cpp recognizes as ending a turn."""
    ids = {eos_id} if eos_id is not None else set()
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if isinstance(metadata.get(key), int) and 0 <= metadata[key] < len(tokens):
            ids.add(metadata[key])
    ids.update(
        i
        for i, (token, kind) in enumerate(zip(tokens, types))
        if kind == TOKEN_CONTROL and token in EOG_TEXTS
    )
    return frozenset(ids)
