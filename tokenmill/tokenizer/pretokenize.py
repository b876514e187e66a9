"""Pre-tokenizer regexes per GGUF `tokenizer.ggml.pre` name, as llama.cpp's `src/llama-vocab.cpp`
has them.

llama.cpp applies a pre type's regexes one after another: each one splits every piece left by the
previous one into its matches and the text between them. A sequence of `Split(..., "isolated")`
pre-tokenizers does the same. Where llama.cpp rewrote a regex for its own engine, the original from
the model's `tokenizer.json` is used (Oniguruma understands it), which is what llama.cpp's rewrite
reproduces.
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
_DEEPSEEK3 = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE for one `tokenizer.ggml.pre` family."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole vocabulary token is taken as is
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token flag


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
    (("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), PreTokenizer((_LLAMA3,))),
    (
        ("minicpm5",),
        PreTokenizer(
            (r"\p{N}{1,3}", _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}+")), ignore_merges=True
        ),
    ),
    (
        ("deepseek-coder",),
        PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")),
    ),
    (
        ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
        PreTokenizer((r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DEEPSEEK3)),
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
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+",))),
    (("viking",), PreTokenizer((r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"))),
    (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizer((_GPT4O,))),
    (("seed-coder",), PreTokenizer((_SEED_CODER,))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreTokenizer((_BAILINGMOE,))),
]
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _FAMILIES for name in names}
