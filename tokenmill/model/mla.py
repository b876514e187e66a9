"""Multi-head latent attention (DeepSeek-V2/V3) as multi-query attention over the cached latent.

Each token's keys and values come from one compressed vector: c = norm(W_DKV x) (kv_lora_rank
wide) and a rope key k_pe shared by every head. Head h's key is [W_UK[h] c, k_pe] and its value
W_UV[h] c. The up-projections are absorbed into the query and the output (see
docs/design/mla.md): q[h] . k[h] = (W_UK[h]^T q_nope[h]) . c + q_pe[h] . k_pe, and
sum_j p_j W_UV[h] c_j = W_UV[h] sum_j p_j c_j. So every head attends, with a query of width
kv_lora_rank + rope, over one cached "KV head" [c, k_pe] that serves as key and as value: the
paged KV cache holds that one head per token and layer (values share the keys' tensor), and the
attention is the decoder's own paged attention. The value rows' last rope columns weigh the rope
keys into the output too; those columns are dropped before W_UV.

Checkpoints hold the up-projections as HF's kv_b_proj (heads x (nope + v) rows of the latent) or,
from llama.cpp's newer converter, as attn_k_b (W_UK transposed per head) and attn_v_b (W_UV);
`up_projections` turns either into our per-head stacks k_absorb (W_UK^T) and v_up (W_UV).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from tokenmill.model.attention import AttentionBatch, paged_attention
from tokenmill.model.config import ModelConfig
from tokenmill.model.dense_linear import invariant_linear
from tokenmill.model.quant import GGMLWeight
from tokenmill.model.transformer import RMSNorm, apply_rotary

Weight = torch.Tensor | GGMLWeight


class LatentAttention(nn.Module):
    """One layer's MLA; its K and V caches are one (slots, 1, kv_lora_rank + rope) tensor."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        mla = cfg.mla
        self.settings = mla
        self.num_heads = cfg.num_heads
        self.scale = cfg.softmax_scale
        self.window = None  # full attention in every layer
        qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        h, heads = cfg.hidden_size, cfg.num_heads
        if mla.q_lora_rank:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk_head, bias=False)
        else:
            self.q_proj = nn.Linear(h, heads * qk_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.rms_norm_eps)
        # per head, as (out, in) weights: W_UK^T turns q_nope into a query of the latent, and
        # W_UV the attended latent into the head's value
        self.k_absorb = nn.Parameter(torch.empty(heads, mla.kv_lora_rank, mla.qk_nope_head_dim))
        self.v_up = nn.Parameter(torch.empty(heads, mla.v_head_dim, mla.kv_lora_rank))
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: AttentionBatch,
        mask: torch.Tensor | tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        mla, tokens = self.settings, x.shape[0]
        if mla.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(tokens, self.num_heads, -1)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = q_pe.contiguous(), k_pe[:, None].contiguous()
        if mla.rope_interleaved:
            q_pe, k_pe = _pairs_to_halves(q_pe), _pairs_to_halves(k_pe)
        q_pe, k_pe = apply_rotary(q_pe, *rope), apply_rotary(k_pe, *rope)
        # q_nope[h] . (W_UK[h] c) = (W_UK[h]^T q_nope[h]) . c
        query = torch.cat((_per_head(q_nope, self.k_absorb), q_pe), dim=-1)
        key = torch.cat((latent[:, None], k_pe), dim=-1)
        out = paged_attention(query, key, key, k_cache, v_cache, batch, mask, self.scale)
        values = _per_head(out[..., : mla.kv_lora_rank], self.v_up)
        return self.o_proj(values.reshape(tokens, -1))


def _pairs_to_halves(x: torch.Tensor) -> torch.Tensor:
    """The rope dimensions reordered from adjacent pairs (x0, x1), (x2, x3), ... to the halves
    (x0, x2, ...), (x1, x3, ...) that `apply_rotary` turns: the same rotation of each pair, in
    another order, taken alike by queries and keys, so their products are unchanged."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _per_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (tokens, heads, a) through each head's (out, in) weight w[h] (w: (heads, b, a)): (tokens,
    heads, b). In float32 on CPU head by head through tokenmill's dense kernel, so a token's result
    does not depend on its batch; else one batched matmul."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return torch.stack([invariant_linear(x[:, h], w[h]) for h in range(x.shape[1])], dim=1)
    return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors of one MLA layer, by our name under `attn.`, with shapes."""
    mla, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, h),
        "kv_a_layernorm.weight": (mla.kv_lora_rank,),
        "k_absorb": (heads, mla.kv_lora_rank, mla.qk_nope_head_dim),
        "v_up": (heads, mla.v_head_dim, mla.kv_lora_rank),
        "o_proj.weight": (h, heads * mla.v_head_dim),
    }
    if mla.q_lora_rank:
        shapes |= {
            "q_a_proj.weight": (mla.q_lora_rank, h),
            "q_a_layernorm.weight": (mla.q_lora_rank,),
            "q_b_proj.weight": (heads * qk_head, mla.q_lora_rank),
        }
    else:
        shapes["q_proj.weight"] = (heads * qk_head, h)
    return shapes


# the up-projections as checkpoints hold them (see `up_projections`)
_UP = re.compile(r"(layers\.\d+\.attn)\.(kv_b_proj|k_b_proj|v_b_proj)\.weight")


def up_projections(
    weights: Iterator[tuple[str, Weight]], cfg: ModelConfig
) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors with MLA's up-projections as our per-head stacks, dense float32:
    k_absorb (heads, kv_lora_rank, qk_nope) and v_up (heads, v_head_dim, kv_lora_rank), from HF's
    kv_b_proj or from GGUF's attn_k_b (k_absorb's layout) and attn_v_b (v_up's)."""
    for name, tensor in weights:
        m = _UP.fullmatch(name)
        if m is None or cfg.mla is None:
            yield name, tensor
            continue
        prefix, kind = m.groups()
        dense = tensor.dequantize() if isinstance(tensor, GGMLWeight) else tensor.float()
        if isinstance(tensor, GGMLWeight) and tensor.release is not None:
            tensor.release()
        mla = cfg.mla
        if kind == "kv_b_proj":
            per_head = dense.reshape(cfg.num_heads, -1, mla.kv_lora_rank)
            k_up, v_up = per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
            yield f"{prefix}.k_absorb", k_up.transpose(1, 2).contiguous()
            yield f"{prefix}.v_up", v_up.contiguous()
        else:
            yield f"{prefix}.{'k_absorb' if kind == 'k_b_proj' else 'v_up'}", dense
