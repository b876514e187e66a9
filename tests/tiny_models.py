"""Tiny random-weight models with a real (small, trained) byte-level BPE tokenizer, for engine
tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Paris is the capital of France; Berlin is the capital of Germany. ",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small engine that served many users at once. ",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Café, naïve, 東京, 🙂. ",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tokenizer(vocab_size: int, added: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens(added)
    return tok


def build_tiny_model(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 320,
    layers: int = 2,
    added_tokens: list[str] | None = None,
    chat_template: str = CHATML,
    tie_word_embeddings: bool = False,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden_size: int = 64,
    bias: bool = False,
    head_dim: int = 16,
) -> Path:
    """Save a tiny model of the given family plus tokenizer files into `path` (an HF directory).
    added_tokens (such as "<think>") are whole tokens of their own after the trained ones;
    tie_word_embeddings: llama's output head is the embedding table (gemma3's always is);
    num_heads, num_kv_heads, hidden_size: the attention's shape (gemma3's heads are 16 wide);
    bias: llama's projections have biases (attention_bias, mlp_bias); head_dim: gemma3's."""
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(vocab_size, added_tokens or [])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": chat_template,
            }
        )
    )
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        initializer_range=0.3,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        bos_token_id=None,
    )
    configs = {
        "llama": lambda: transformers.LlamaConfig(
            **common, tie_word_embeddings=tie_word_embeddings, attention_bias=bias, mlp_bias=bias
        ),
        "gemma3": lambda: transformers.Gemma3TextConfig(
            **common,
            head_dim=head_dim,
            sliding_window=8,
            query_pre_attn_scalar=head_dim,
            layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"],
        ),
    }
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs[arch](), dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


BERT_WORDS = (
    "the a of and to in is was it for on with as at by an be this that from or are not but "
    "one two three quick brown fox jumps over lazy dog paris capital france engine small time "
    "embedding vector text model many users served once upon there"
).split()


def _bert_tokenizer() -> Tokenizer:
    """A WordPiece tokenizer framed as BERT's: [CLS] text [SEP], lowercased."""
    from tokenizers import normalizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    letters = "abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'"
    pieces = specials + BERT_WORDS + list(letters) + [f"##{c}" for c in letters]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    tok.decoder = decoders.WordPiece()
    return tok


def build_tiny_bert(path: Path, pooling: str = "mean", normalize: bool = False) -> Path:
    """A random 2-layer BertModel saved by transformers (safetensors), with a WordPiece
    tokenizer and a sentence-transformers modules.json / pooling config."""
    path.mkdir(parents=True, exist_ok=True)
    tok = _bert_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    model = transformers.BertModel(config).eval()
    with torch.no_grad():  # LayerNorms away from their 1/0 init, so a mix-up shows
        for name, param in model.named_parameters():
            if "LayerNorm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path, safe_serialization=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {
        "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean",
        "pooling_mode_lasttoken": pooling == "lasttoken",
    }
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, **modes})
    )
    return path
