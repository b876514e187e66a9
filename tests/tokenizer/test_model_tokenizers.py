"""SmolLM2 (byte-level BPE, pre type "smollm") and Gemma 3 (SentencePiece) GGUFs against
transformers and llama.cpp.

transformers' GGUF conversion is the reference for ordinary text. Where it disagrees with llama.cpp,
we follow llama.cpp (the GGUF format's own implementation); the ids for those cases below come from
llama.cpp's `llama-tokenize` (llama-cpp-python 0.3.36) on these same files:

- SmolLM2: llama.cpp's "smollm" pre type splits every digit off first, as SmolLM2's own
  tokenizer.json does; transformers' conversion has no split for "smollm" and keeps whitespace
  before a digit apart ("  5" becomes "Ġ","Ġ","5" instead of "ĠĠ","5").
- Gemma 3: the file stores its whitespace tokens as real spaces ("  "). transformers respells them
  "▁▁" so a literal U+2581 next to a space can merge into them; llama.cpp cannot ("x ▁y").
"""

from __future__ import annotations

import random
import re

import pytest

from tokenmill.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve Ångström façade Müller",
    "日本語のテキストと中文混合 한국어",
    "emoji 🦙🚀 family 👨‍👩‍👧 flag 😶‍🌫️ ✅",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f(3))",
    '{"key": [1, 2.5, -3e10], "ok": true}',
    " leading space",
    "trailing space ",
    "   three leading, two trailing  ",
    "multiple   spaces    between",
    "\n\nnewlines\nand\r\nwindows\n",
    "I'm sure they'll say we've done it, isn't it?",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <s>x</s> <table><tr><td>1</td></tr></table>",
    "",
]


def assert_matches_transformers(ours: Tokenizer, hf) -> None:
    for text in TEXTS:
        for parse_special in (True, False):
            ids = ours.encode(text, add_bos=False, parse_special=parse_special)
            assert ids == hf.encode(
                text, add_special_tokens=False, split_special_tokens=not parse_special
            ), (
                text,
                parse_special,
            )
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), text


def test_smollm2_matches_transformers(smollm2_tokenizer: Tokenizer, smollm2_hf) -> None:
    assert_matches_transformers(smollm2_tokenizer, smollm2_hf)


def test_gemma3_matches_transformers(gemma3_tokenizer: Tokenizer, gemma3_hf) -> None:
    assert_matches_transformers(gemma3_tokenizer, gemma3_hf)


PIECES = (
    list("abcXYZ019 \n\t.,;!?'\"()<>{}|_-=/#@")
    + list("éàüßñÅ日本語中文한국어при😀🦙🚀‍️✅ △▁")
    + [
        "  ", "\n\n", "'s", "'ll", "<|im_start|>", "<|im_end|>", "<start_of_turn>",
        "<end_of_turn>", "<bos>", "<eos>", "<s>", "</s>", "<table>", "<unused3>", "[multimodal]",
        "<0x41>",
    ]
)  # fmt: skip


def random_texts(seed: int, exclude: str) -> list[str]:
    """Random texts, leaving out the pattern where transformers is known to differ from
    llama.cpp."""
    rng = random.Random(seed)
    texts = ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    return [text for text in texts if not re.search(exclude, text)]


def test_smollm2_random_text_matches_transformers(smollm2_tokenizer: Tokenizer, smollm2_hf) -> None:
    for text in random_texts(1, exclude=r"\s\d"):
        for parse_special in (True, False):
            ids = smollm2_tokenizer.encode(text, parse_special=parse_special)
            assert ids == smollm2_hf.encode(text, split_special_tokens=not parse_special), text
        assert smollm2_tokenizer.decode(ids) == smollm2_hf.decode(ids)


def test_gemma3_random_text_matches_transformers(gemma3_tokenizer: Tokenizer, gemma3_hf) -> None:
    for text in random_texts(2, exclude="▁"):
        for parse_special in (True, False):
            ids = gemma3_tokenizer.encode(text, parse_special=parse_special)
            assert ids == gemma3_hf.encode(text, split_special_tokens=not parse_special), text
        assert gemma3_tokenizer.decode(ids) == gemma3_hf.decode(ids)


@pytest.mark.parametrize(
    ("text", "llama_cpp_ids"),
    [("  5", [256, 37]), ("\n\n1", [1116, 33]), ("a  5 and\n1", [81, 256, 37, 284, 198, 33])],
)
def test_smollm2_digits_split_like_llama_cpp(
    smollm2_tokenizer: Tokenizer, text: str, llama_cpp_ids: list[int]
) -> None:
    assert smollm2_tokenizer.encode(text) == llama_cpp_ids


@pytest.mark.parametrize(
    ("text", "llama_cpp_ids"), [("x ▁y", [236781, 236743, 570]), ("  5", [138, 236810])]
)
def test_gemma3_whitespace_tokens_like_llama_cpp(
    gemma3_tokenizer: Tokenizer, text: str, llama_cpp_ids: list[int]
) -> None:
    assert gemma3_tokenizer.encode(text, add_bos=False) == llama_cpp_ids


def test_smollm2_special_tokens(smollm2_tokenizer: Tokenizer) -> None:
    tok = smollm2_tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (49152, 1, 2)
    assert tok.encode("Hello") == [19556]  # the file says add_bos_token = false
    assert tok.stop_token_ids == {0, 2}  # <|im_end|> (EOS) and <|endoftext|>
    assert tok.encode("<|im_start|>") == [1]
    assert tok.id_to_piece(tok.encode(" world")[0]) == "Ġworld"


def test_gemma3_special_tokens(gemma3_tokenizer: Tokenizer) -> None:
    tok = gemma3_tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (262144, 2, 1)
    assert tok.encode("Hello")[0] == 2  # BOS by default
    assert tok.stop_token_ids == {1, 106}  # <eos> and <end_of_turn>
    assert tok.encode("<start_of_turn>", add_bos=False) == [105]
    assert tok.encode("</s>", add_bos=False) == [212]  # an HTML tag here, not an end of generation
    assert 212 not in tok.stop_token_ids
    assert tok.chat_template is None  # this file carries no template
