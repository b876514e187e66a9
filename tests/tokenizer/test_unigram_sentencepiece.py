"""Unigram (`t5`) GGUF vocabularies tokenize as SentencePiece does, which llama.cpp's UGM tokenizer
reproduces: llama.cpp ships no test vectors for one, so SentencePiece itself, given the GGUF's
pieces, scores, types and character map, is the reference.
"""

from __future__ import annotations

import sentencepiece
from sentencepiece import sentencepiece_model_pb2 as model_pb2

from tests.llama_cpp_files import vocab_file
from tokenmill.model.gguf_file import read_gguf_metadata
from tokenmill.tokenizer import Tokenizer

# characters the character map rewrites (ligatures, full-width, circled digits, combining accents,
# no-break and zero-width spaces), runs of spaces, tabs and newlines, and a word past any piece
EDGES = [
    "  leading", "trailing  ", "ﬁve ①②", "Ａｂｃ\u3000ｄ", "e\u0301 é", "a\tb\nc", "\u00a0nbsp",
    "x" * 300, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\u200bzero", "",
]  # fmt: skip


def sentencepiece_model(metadata: dict) -> sentencepiece.SentencePieceProcessor:
    proto = model_pb2.ModelProto()
    proto.trainer_spec.model_type = model_pb2.TrainerSpec.UNIGRAM
    proto.trainer_spec.unk_id = metadata["tokenizer.ggml.unknown_token_id"]
    for token, score, kind in zip(
        metadata["tokenizer.ggml.tokens"],
        metadata["tokenizer.ggml.scores"],
        metadata["tokenizer.ggml.token_type"],
    ):
        proto.pieces.add(piece=token, score=score, type=kind)  # GGUF's types are SentencePiece's
    proto.normalizer_spec.precompiled_charsmap = bytes(
        value & 0xFF for value in metadata["tokenizer.ggml.precompiled_charsmap"]
    )
    proto.normalizer_spec.add_dummy_prefix = metadata["tokenizer.ggml.add_space_prefix"]
    proto.normalizer_spec.remove_extra_whitespaces = metadata[
        "tokenizer.ggml.remove_extra_whitespaces"
    ]
    return sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())


def test_xlm_roberta_vocabulary_tokenizes_as_sentencepiece() -> None:
    metadata = read_gguf_metadata(vocab_file("nomic-bert-moe", ".gguf"))
    reference = sentencepiece_model(metadata)
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    texts = EDGES + [
        text
        for name in ("llama-bpe", "qwen35", "bert-bge")
        for text in vocab_file(name, ".gguf.inp")
        .read_text(encoding="utf-8")
        .split("\n__ggml_vocab_test__\n")
    ]
    wrong = {
        text: (expected, got)
        for text in texts
        if (got := tokenizer.encode(text, add_bos=False, parse_special=False))
        != (expected := reference.encode(text))
    }
    assert not wrong, f"{len(wrong)} of {len(texts)} texts differ from SentencePiece: {wrong}"
