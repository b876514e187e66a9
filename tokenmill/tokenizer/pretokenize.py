"""Pre-tokenizer regexes per GGUF `tokenizer.ggml.pre` name, as llama.cpp's `src/llama-vocab.cpp`
has them.

llama.cpp applies a pre type's regexes one after another: each one splits every piece left by the
previous one into its matches and the text between them. A sequence of `Split(..., "isolated")`
pre-tokenizers does the same. Where llama.cpp rewrote a regex for its own engine, the original from
the model's `tokenizer.json` is used (Oniguruma understands it), which is what llama.cpp's rewrite
reproduces. Where llama.cpp replaced a regex by code of its own (Kimi-K2, AFMoE's digit groups), the
regex here is the one that code implements, or the model's original where llama.cpp cites it.

Most pre types have no vocabulary among llama.cpp's test files; tests/tokenizer checks each regex
compiles, and the vocabularies with test vectors tokenize exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = _CONTRACTIONS + (
    r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{c}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{c}"
)
_GPT4O = (
    _CASED_WORDS.replace("{c}", _CONTRACTIONS + "?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    _CASED_WORDS.replace("{c}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BAILINGMOE = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-"
    "ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ"
    "\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-"
    "𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_DEEPSEEK3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LLAMA3_CONTRACTIONS = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
)
_JAIS2 = (
    _LLAMA3_CONTRACTIONS
    + "".join(rf"|\s{{{n}}}(?!\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4, "1,2"))
    + r"|\s{1}"
)
_YOUTU = (
    _CASED_WORDS.replace("{c}", _CONTRACTIONS + "?")
    + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_EXAONE_MOE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"
)
# llama.cpp's rewrite of GPT-4o's regex with \p{M} joined to the letters; no original is cited
_GRANITE_MULTI = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:"
    + _CONTRACTIONS
    + r")?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:"
    + _CONTRACTIONS
    + r")?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_HAN_FREE = r"&&[^\p{Han}]"
_KIMI_K2 = (
    r"\p{Han}+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}" + _HAN_FREE + r"]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}" + _HAN_FREE + "]+" + f"(?:{_CONTRACTIONS})?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}" + _HAN_FREE + r"]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}" + _HAN_FREE + "]*" + f"(?:{_CONTRACTIONS})?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK_WORDS = r"[一-龥぀-ゟ゠-ヿ]+"
# SentencePiece-style BPE (Gemma 4): the text between newlines goes to BPE whole
_LINES = r"[^\n]+|[\n]+"


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one `tokenizer.ggml.pre` family."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole vocabulary token is taken as is
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token flag
    force_bos: bool = False  # BOS even where the file's add_bos_token flag says no (Gemma 4)
    # False: BPE over the raw UTF-8 text with <0xXX> byte tokens, not GPT-2's byte-to-char map
    byte_level: bool = True
    escape_spaces: bool = False  # spaces become "▁" before splitting (SentencePiece style)


_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_FAMILIES: list[tuple[tuple[str, ...], PreTokenizer]] = [
    (("default",), _DEFAULT),
    (
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    (("dbrx", "smaug-bpe", "chatglm-bpe"), PreTokenizer((_LLAMA3,))),
    (("glm4", "glm5"), PreTokenizer((_LLAMA3,), ignore_merges=True)),
    (("jais-2",), PreTokenizer((_JAIS2,))),
    (
        ("minicpm5",),
        PreTokenizer(
            (r"\p{N}{1,3}", _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}+")), ignore_merges=True
        ),
    ),
    (
        ("deepseek-llm",),
        PreTokenizer(
            (
                r"[\r\n]",
                rf"\s?[{_DEEPSEEK_LLM_LETTERS}]+",
                "\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
                r"\s+$",
                r"[一-龥ࠀ-一가-퟿]+",
                r"\p{N}+",
            )
        ),
    ),
    (
        ("deepseek-coder",),
        PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")),
    ),
    (
        ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
        PreTokenizer((r"\p{N}{1,3}", _CJK_WORDS, _DEEPSEEK3)),
    ),
    (
        ("spark2_5",),
        PreTokenizer(
            (
                r"\p{N}{1,3}",
                _CJK_WORDS,
                _DEEPSEEK3.replace(r"[\r\n]*|\s*[\r\n]+", r"|[\r\n]"),
                r"\p{N}",
            )
        ),
    ),
    (
        ("afmoe",),
        PreTokenizer(
            (
                # llama.cpp's code: a run of digits splits into groups of three from the right
                r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
                r"[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
                _DEEPSEEK3,
            )
        ),
    ),
    (
        ("youtu",),
        PreTokenizer(
            (r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|" + _CJK_WORDS, _YOUTU),
            ignore_merges=True,
        ),
    ),
    (
        ("falcon",),
        PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    ),
    (
        (
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        PreTokenizer((r"\p{N}", _GPT2)),
    ),
    (
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ),
        PreTokenizer((_GPT2,)),
    ),
    (
        (
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ),
        PreTokenizer((_QWEN2,)),
    ),
    (("qwen35",), PreTokenizer((_QWEN35,))),
    (("ufakzeka",), PreTokenizer((_QWEN2.removeprefix(_CONTRACTIONS + "|"),))),
    (("laguna",), PreTokenizer((_LINES, _QWEN2))),
    (("exaone-moe",), PreTokenizer((_EXAONE_MOE,))),
    (
        ("chameleon",),
        PreTokenizer(
            (
                r"<sentinel:[0-9]+>",
                r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                r"([\t\n]|    |  )",
                r"\p{N}",
                r"[\p{P}!-/:-@\[-`{-~]",
                _GPT2,
            ),
            add_bos=True,
        ),
    ),
    (("granite-embed-multi-97m",), PreTokenizer((_GRANITE_MULTI,), ignore_merges=True)),
    (
        ("tiny_aya", "cohere2moe"),
        PreTokenizer(
            (
                r"\d{1,3}(?=(?:\d{3})*\b)",
                _CASED_WORDS.replace("{c}", _CONTRACTIONS + "?")
                + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
            )
        ),
    ),
    (("superbpe",), PreTokenizer((r"\p{N}+", r"(?=(\d{3})+(?!\d))"))),
    (("kimi-k2",), PreTokenizer((_KIMI_K2,))),
    (
        ("gemma4", "granite-embed-multi-311m"),
        PreTokenizer((_LINES,), force_bos=True, byte_level=False, escape_spaces=True),
    ),
    (("sarvam-moe",), PreTokenizer((_LINES,), byte_level=False, escape_spaces=True)),
    (("whitespace",), PreTokenizer((r"\S+",), byte_level=False)),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+",))),
    (("viking",), PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"))),
    (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer((_GPT4O,))),
    (("seed-coder",), PreTokenizer((_SEED_CODER,))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((_BAILINGMOE,))),
]
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _FAMILIES for name in names}
