"""The GGUF vocabularies of encoder models, tokenized as llama.cpp's `llama-vocab.cpp` does:
WordPiece (`bert`, llama.cpp's WPM) and Unigram (`t5`, llama.cpp's UGM).

- WPM: llama.cpp splits text as BERT's normalizer and pre-tokenizer do (whitespace, punctuation and
  CJK characters; lowercase and accents stripped unless the file says otherwise), then takes the
  longest vocabulary token from the left of each word, the whole word becoming the unknown token
  where that fails: a WordPiece model. GGUF spells word-initial pieces `▁piece` and continuations
  bare; the model gets BERT's own spelling back (`piece`, `##piece`).
- UGM: llama.cpp rewrites the text with the SentencePiece precompiled character map, marks spaces
  `▁`, then picks the segmentation with the best total score (Viterbi) over the whole text, an
  unknown character costing ten less than the worst token: a Unigram model.

Both frame a text for the encoder (`encode_framed`) as llama.cpp's `add_special` does: [CLS] ...
[SEP] for WPM; BOS and EOS as the file's flags say for UGM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from tokenmill.tokenizer.errors import TokenizerError

# tokenizer.ggml.token_type values (as in gguf_vocab)
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

_ANY_WORD_LENGTH = 1 << 30  # llama.cpp splits a word however long it is


def wordpiece(
    metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int], ids: Mapping[str, int]
) -> Backend:
    """A BERT vocabulary (`tokenizer.ggml.model` "bert")."""
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        name = _bert_spelling(token, kind)
        if name in vocab:
            raise TokenizerError(
                f"GGUF BERT vocabulary has two tokens that are both {name!r} in BERT's spelling"
            )
        vocab[name] = i
    if "unk_token" not in ids:
        raise TokenizerError("GGUF BERT vocabulary names no unknown token")
    names = list(vocab)
    model = models.WordPiece(
        vocab,
        unk_token=names[ids["unk_token"]],
        max_input_chars_per_word=_ANY_WORD_LENGTH,
    )
    backend = Backend(model)
    lowercase = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=True,
        strip_accents=bool(metadata.get("tokenizer.ggml.normalizer.strip_accents", lowercase)),
        lowercase=lowercase,
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    if "bos_token" in ids and "sep_token" in ids:
        cls, sep = names[ids["bos_token"]], names[ids["sep_token"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}",
            pair=f"{cls} $A {sep} $B:1 {sep}:1",
            special_tokens=[(cls, ids["bos_token"]), (sep, ids["sep_token"])],
        )
    return backend


def _bert_spelling(token: str, kind: int) -> str:
    """Undo the conversion to GGUF (llama.cpp's `conversion/bert.py`): `▁piece` was `piece`, a
    bare `piece` was `##piece`; control tokens, and `[...]` ones from older conversions, are
    unchanged."""
    if kind == TOKEN_CONTROL or (token.startswith("[") and token.endswith("]")):
        return token
    if token.startswith("▁"):
        return token[1:]
    return "##" + token


def unigram(
    metadata: Mapping[str, Any],
    tokens: Sequence[str],
    types: Sequence[int],
    ids: Mapping[str, int],
    add_bos: bool,
    add_eos: bool,
) -> Backend:
    """A SentencePiece Unigram vocabulary (`tokenizer.ggml.model` "t5")."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) < len(tokens):
        raise TokenizerError("GGUF Unigram vocabulary needs a tokenizer.ggml.scores per token")
    if "unk_token" not in ids:
        raise TokenizerError("GGUF Unigram vocabulary names no unknown token")
    # llama.cpp's segmentation uses normal, user-defined and unused tokens only, and prices an
    # unknown character from the worst normal one; the model prices it from the worst of all, so
    # the others get that worst normal score.
    segmenting = (TOKEN_NORMAL, TOKEN_USER_DEFINED, TOKEN_UNUSED)
    worst = min((score for score, kind in zip(scores, types) if kind == TOKEN_NORMAL), default=0.0)
    pieces = [
        (token, float(score) if kind in segmenting else worst)
        for token, score, kind in zip(tokens, scores, types)
    ]
    backend = Backend(models.Unigram(pieces, ids["unk_token"], byte_fallback=False))
    backend.normalizer = normalizers.Sequence(_unigram_normalizers(metadata))
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])
    )
    bos = [ids["bos_token"]] if add_bos and "bos_token" in ids else []
    eos = [ids["eos_token"]] if add_eos and "eos_token" in ids else []
    if bos or eos:
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join([tokens[i] for i in bos] + ["$A"] + [tokens[i] for i in eos]),
            special_tokens=[(tokens[i], i) for i in sorted(set(bos + eos))],
        )
    return backend


def _unigram_normalizers(metadata: Mapping[str, Any]) -> list[normalizers.Normalizer]:
    """The precompiled character map, then llama.cpp's handling of spaces: with
    remove_extra_whitespaces, every run of words gets one `▁` before each word; otherwise each space
    becomes `▁`, with one more in front where add_space_prefix says."""
    steps: list[normalizers.Normalizer] = []
    charsmap = metadata.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None and len(charsmap) > 0:
        steps.append(normalizers.Precompiled(bytes(value & 0xFF for value in charsmap)))
    if metadata.get("tokenizer.ggml.remove_extra_whitespaces", False):
        steps += [normalizers.Replace(Regex(" +"), " "), normalizers.Replace(Regex("^ | $"), "")]
        steps.append(normalizers.Prepend("▁"))
    elif metadata.get("tokenizer.ggml.add_space_prefix", False):
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    return steps
