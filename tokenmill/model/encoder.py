"""BERT-family encoders for embeddings: the architecture as data, the few layers it needs, and
sentence-transformers' pooling.

An encoder differs from the generic decoder (`transformer.py`) in every layer: attention is
bidirectional (no causal mask, no KV cache), positions are learned absolute embeddings plus
token type embeddings, LayerNorm comes after each residual sum (post-norm) and the MLP is a
plain GELU (erf) one. The forward pass runs on packed sequences: the linear layers and norms
take all tokens of all sequences as rows, attention runs on each sequence alone, so a text's
embedding does not depend on the batch it came in (no padding, no cross-sequence mask), and the
dense fp32 layers multiply through `invariant_linear` for the same reason.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelFileError
from tokenmill.model.dense_linear import invariant_linear

ENCODER_MODEL_TYPES = ("bert",)  # HF `model_type`s this module loads
POOLING_MODES = ("mean", "cls", "lasttoken")


@dataclass(frozen=True)
class EncoderConfig:
    """Everything the encoder and its pooling need to know about one checkpoint."""

    architecture: str  # HF model_type, e.g. "bert"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    max_seq_len: int  # longest input served: sentence-transformers' max_seq_length, else positions
    pooling: str = "mean"  # one of POOLING_MODES
    normalize: bool = False  # L2-normalize the pooled vector (sentence-transformers' Normalize)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def is_encoder_dir(path: str | Path) -> bool:
    """Whether `path` is a model folder whose config.json names an encoder this module loads."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text()).get("model_type") in ENCODER_MODEL_TYPES
    except (OSError, ValueError):
        return False


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFileError(path, f"unreadable JSON ({exc})") from exc


def _pooling(folder: Path) -> tuple[str, bool]:
    """(pooling mode, normalize) as sentence-transformers' modules.json configures them; a folder
    without modules.json is mean-pooled and not normalized."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return "mean", False
    modules = _read_json(modules_file)
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
    normalize = "Normalize" in kinds
    if "Pooling" not in kinds:
        return "mean", normalize
    pooling_file = folder / kinds["Pooling"].get("path", "") / "config.json"
    settings = _read_json(pooling_file) if pooling_file.is_file() else {}
    if "pooling_mode" in settings:  # newer sentence-transformers write the mode by name
        chosen = [settings["pooling_mode"]]
    else:
        chosen = [
            key.removeprefix("pooling_mode_").removesuffix("_token").removesuffix("_tokens")
            for key, on in settings.items()
            if key.startswith("pooling_mode_") and on
        ]
    chosen = chosen or ["mean"]
    if len(chosen) != 1 or chosen[0] not in POOLING_MODES:
        raise ModelFileError(
            pooling_file,
            f"unsupported pooling {'+'.join(chosen)} (supported: {', '.join(POOLING_MODES)})",
        )
    return chosen[0], normalize


def load_encoder_config(folder: str | Path) -> EncoderConfig:
    """The encoder config of an HF (or sentence-transformers) folder with a BERT config.json."""
    folder = Path(folder)
    hf = _read_json(folder / "config.json")
    model_type = hf.get("model_type")
    if model_type not in ENCODER_MODEL_TYPES:
        raise ModelFileError(
            folder / "config.json",
            f"model_type {model_type!r} is not an encoder "
            f"(supported: {', '.join(ENCODER_MODEL_TYPES)})",
        )
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise ModelFileError(folder / "config.json", f"unsupported hidden_act {act!r} (gelu)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ModelFileError(
            folder / "config.json", "only absolute position embeddings are supported"
        )
    positions = int(hf["max_position_embeddings"])
    st_config = folder / "sentence_bert_config.json"
    max_seq = _read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    pooling, normalize = _pooling(folder)
    return EncoderConfig(
        architecture=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=int(hf["num_attention_heads"]),
        max_position_embeddings=positions,
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        max_seq_len=min(int(max_seq), positions) if max_seq else positions,
        pooling=pooling,
        normalize=normalize,
    )


class _Linear(nn.Module):
    """A dense fp32 linear layer whose rows do not depend on their batch (`invariant_linear`)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


class EncoderLayer(nn.Module):
    """Post-norm block: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.query, self.key, self.value = _Linear(h, h), _Linear(h, h), _Linear(h, h)
        self.attn_out, self.attn_norm = _Linear(h, h), nn.LayerNorm(h, eps=eps)
        self.mlp_in = _Linear(h, cfg.intermediate_size)
        self.mlp_out = _Linear(cfg.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=eps)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        x = self.attn_norm(x + self.attn_out(self._attention(x, seq_lens)))
        return self.mlp_norm(x + self.mlp_out(F.gelu(self.mlp_in(x))))

    def _attention(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Bidirectional attention within each sequence of the packed rows of x."""
        q, k, v = (
            proj(x).view(-1, self.num_heads, self.head_dim)
            for proj in (self.query, self.key, self.value)
        )
        outs = []
        for qs, ks, vs in zip(q.split(seq_lens), k.split(seq_lens), v.split(seq_lens)):
            # (heads, len, head_dim) for one sequence alone: no mask, no padding
            o = F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)
            )
            outs.append(o.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim))
        return torch.cat(outs)


class Encoder(nn.Module):
    """Token + position + token type embeddings, LayerNorm, then the post-norm layers."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.requires_grad_(False)

    @torch.inference_mode()
    def forward(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Final hidden states of every token of every sequence, packed: (total tokens, hidden).
        Every sequence has token type 0 (one segment, as sentence-transformers encodes a text)."""
        seq_lens = [len(t) for t in token_ids]
        ids = torch.tensor([i for t in token_ids for i in t], dtype=torch.long)
        positions = torch.cat([torch.arange(n) for n in seq_lens])
        x = (
            self.word_embeddings(ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(torch.zeros_like(ids))
        )
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, seq_lens)
        return x

    @torch.inference_mode()
    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One pooled (and, if configured, normalized) float32 vector per sequence."""
        hidden = self.forward(token_ids)
        return pool(hidden, [len(t) for t in token_ids], self.config.pooling, self.config.normalize)


def pool(hidden: torch.Tensor, seq_lens: list[int], mode: str, normalize: bool) -> torch.Tensor:
    """Pool packed hidden states (total tokens, hidden) into one vector per sequence: the mean of
    its tokens, its first token (CLS) or its last token; then L2-normalize if asked."""
    rows = []
    for seq in hidden.float().split(seq_lens):
        if mode == "mean":
            rows.append(seq.mean(dim=0))
        elif mode == "cls":
            rows.append(seq[0])
        elif mode == "lasttoken":
            rows.append(seq[-1])
        else:
            raise ValueError(f"unknown pooling {mode!r} (choose from {', '.join(POOLING_MODES)})")
    pooled = torch.stack(rows)
    return F.normalize(pooled, p=2.0, dim=-1) if normalize else pooled


# HF BertModel tensor names (without the `bert.` prefix) -> ours
_HF_NAMES = [
    (r"embeddings\.LayerNorm\.", "embed_norm."),
    (r"embeddings\.", ""),
    (r"encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.", r"layers.\1.\2."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn_out."),
    (r"encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
    (r"encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.mlp_in."),
    (r"encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.mlp_out."),
    (r"encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.mlp_norm."),
]
_IGNORED = re.compile(r"^(pooler\.|cls\.|embeddings\.position_ids$)")


def encoder_tensor_name(hf_name: str) -> str | None:
    """Our name for an HF BertModel tensor (with or without `bert.`), None for tensors the
    encoder does not use (the pooler, masked-LM heads, position id buffers)."""
    name = hf_name.removeprefix("bert.")
    if _IGNORED.match(name):
        return None
    # old checkpoints name LayerNorm parameters gamma/beta
    name = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))
    for pattern, replacement in _HF_NAMES:
        if re.match(pattern, name):
            return re.sub(pattern, replacement, name, count=1)
    return name  # an unknown tensor: reported by `load_encoder` as unexpected


def _safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelFileError(folder, "no *.safetensors files found")
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for hf_name in f.keys():
                    yield hf_name, f.get_tensor(hf_name)
        except SafetensorError as exc:
            raise ModelFileError(shard, f"malformed safetensors file ({exc})") from exc


def load_encoder(folder: str | Path) -> Encoder:
    """An fp32 encoder with the weights of an HF BertModel folder (safetensors)."""
    folder = Path(folder)
    model = Encoder(load_encoder_config(folder))
    state = {}
    for hf_name, tensor in _safetensors(folder):
        if (name := encoder_tensor_name(hf_name)) is not None:
            state[name] = tensor.float()
    expected = model.state_dict()
    if unexpected := sorted(set(state) - set(expected)):
        raise ModelFileError(folder, f"unexpected tensors for a BERT encoder: {unexpected[:3]}")
    if missing := sorted(set(expected) - set(state)):
        raise ModelFileError(folder, f"missing tensors: {missing[:3]}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ModelFileError(
                folder,
                f"shape {tuple(tensor.shape)} does not match the config's "
                f"{tuple(expected[name].shape)}",
                tensor=name,
            )
    model.load_state_dict(state)
    return model.eval()
