"""Architecture settings as data: one generic decoder covers every supported family.

Each family (Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, ...) differs from the others only in the
fields below, so adding a family means adding a mapping from its config, not a new model class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class RopeSettings:
    """Rotary embedding of one attention kind (Gemma 3 uses different bases per layer kind)."""

    theta: float
    scaling: dict[str, Any] | None = None  # HF-style {"rope_type": "linear"|"llama3", ...}
    freq_factors: tuple[float, ...] | None = None  # GGUF `rope_freqs`: inv_freq is divided by these

    def inv_freq(self, rotary_dim: int) -> torch.Tensor:
        """Inverse frequencies (float32), computed the way transformers does for each rope type."""
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
        inv = 1.0 / (self.theta ** (steps / rotary_dim))
        if self.freq_factors is not None:
            return inv / torch.tensor(self.freq_factors, dtype=torch.float32, device="cpu")
        rope_type = (self.scaling or {}).get("rope_type", "default")
        if rope_type == "default":
            return inv
        if rope_type == "linear":
            return inv / float(self.scaling["factor"])
        if rope_type == "llama3":
            return _llama3_inv_freq(inv, self.scaling)
        if rope_type == "longrope":
            return inv / torch.tensor(
                self.scaling["short_factor"], dtype=torch.float32, device="cpu"
            )
        if rope_type == "yarn":
            return _yarn_inv_freq(self.theta, rotary_dim, self.scaling)
        if rope_type == "proportional":
            # Gemma 4's global layers: the lowest frequencies of the whole head turn, the rest are
            # 0 (cos 1, sin 0), so a quarter of each head rotates in the rotate-half layout
            turned = int(self.scaling.get("partial_rotary_factor", 1.0) * rotary_dim // 2)
            inv[turned:] = 0.0
            return inv / float(self.scaling.get("factor", 1.0))
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} "
            "(supported: default, linear, llama3, longrope, yarn, proportional)"
        )

    def long_inv_freq(self, rotary_dim: int) -> tuple[torch.Tensor, int] | None:
        """LongRoPE (Phi-3): the inverse frequencies of positions past the original context, and
        the first position they apply to; None for other rope types. Positions before it keep
        the short factors, so a token's rotation depends on its position alone, never on its
        batch (transformers picks one set per forward from the largest position in it, which
        is the same for every token of a prompt within the original context and of each decode
        step)."""
        if (self.scaling or {}).get("rope_type") != "longrope":
            return None
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
        inv = 1.0 / (self.theta ** (steps / rotary_dim))
        long = inv / torch.tensor(self.scaling["long_factor"], dtype=torch.float32, device="cpu")
        return long, int(self.scaling["original_max_position_embeddings"])

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (LongRoPE's and YaRN's attention scaling), 1
        otherwise."""
        scaling = self.scaling or {}
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        if scaling.get("rope_type") == "yarn":
            return _yarn_attention_factor(scaling)
        return 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(theta: float, dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (transformers' `_compute_yarn_parameters`): interpolated (divided by the factor)
    frequencies for the slow dimensions, the original ones for the fast, and a linear ramp between
    the dimensions that turn beta_slow and beta_fast times over the original context; `truncate`
    (default on, off for gpt-oss) rounds the ramp's ends to whole dimensions."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dimension(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1 - ramp  # weight of the original frequencies
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    pos_freqs = theta ** (steps / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """YaRN's scaling of cos and sin where the config does not give it: 0.1 ln(factor) + 1, or
    the ratio of two such terms where `mscale` and `mscale_all_dim` are given (DeepSeek)."""
    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        mscale, mscale_all = float(scaling["mscale"]), float(scaling["mscale_all_dim"])
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times the original (1 within it)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLASettings:
    """Multi-head latent attention (DeepSeek-V2/V3, see model/mla.py and docs/design/mla.md).

    Keys and values of every head are decompressed from one latent vector per token; the cache
    holds that latent (kv_lora_rank wide, normalized) and the shared rope key (qk_rope_head_dim),
    as one head of width kv_lora_rank + qk_rope_head_dim that serves as key and as value."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # the query's own low-rank compression; 0: one q_proj (V2-Lite)
    # rope over adjacent pairs of the rope dimensions (DeepSeek's layout), not halves
    rope_interleaved: bool = True


@dataclass(frozen=True)
class MoESettings:
    """A mixture-of-experts feed-forward (see model/moe.py): a router picks `top_k` of
    `num_experts` gated MLPs for each token and sums their outputs weighted by its scores."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    # "softmax": the top-k of the softmax over all experts (Mixtral, Qwen, OLMoE);
    # "topk_softmax": the softmax over the top-k logits (gpt-oss);
    # "sigmoid": the top-k of each expert's sigmoid (DeepSeek-V3)
    scoring: str = "softmax"
    norm_topk: bool = False  # the top-k weights divided by their sum (Mixtral, Qwen3-MoE)
    shared_intermediate_size: int = 0  # an expert every token runs (Qwen2-MoE); 0: none
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(x . w) (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # layers with a plain MLP instead (Qwen's mlp_only_layers)
    router_bias: bool = False  # the router's logits have a bias (gpt-oss)
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    # gpt-oss's clamped SwiGLU: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    # g = min(gate, limit), instead of the family's activation; None: the plain gated MLP
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # grouped top-k (DeepSeek): the experts fall into num_groups equal groups, and a token picks
    # its experts from its topk_groups best groups only, ranked by their best score (softmax) or
    # the sum of their best two (sigmoid, as DeepSeek-V3's noaux_tc)
    num_groups: int = 1
    topk_groups: int = 1
    # a per-expert bias added to the scores for choosing the experts only, not to their weights
    # (DeepSeek-V3's e_score_correction_bias, GGUF's exp_probs_b)
    score_bias: bool = False
    routed_scale: float = 1.0  # the routed experts' weights are multiplied by this (DeepSeek)

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "topk_softmax", "sigmoid"):
            raise ValueError(f"unsupported expert scoring {self.scoring!r}")
        if self.num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts in {self.num_groups} groups, {self.topk_groups} of "
                "them used: the groups must split the experts evenly, and at least one be used"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"{self.top_k} experts per token is not between 1 and the {self.num_experts} "
                "experts"
            )


@dataclass(frozen=True)
class GatherWidths:
    """Under tensor parallelism, the columns each rank contributes, in rank order, to the tensors
    the ranks gather: the attention output (its query heads x head_dim), the MLP's intermediate
    activations, and the outputs of o_proj and down_proj (the hidden size)."""

    attention: tuple[int, ...]
    intermediate: tuple[int, ...]
    hidden: tuple[int, ...]


@dataclass
class ModelConfig:
    """Everything the generic decoder needs to know about one checkpoint."""

    architecture: str  # family name, e.g. "llama", "qwen3", "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeSettings = field(default_factory=lambda: RopeSettings(theta=10000.0))
    rope_local: RopeSettings | None = None  # rope of sliding-window layers, when it differs
    hidden_act: str = "silu"  # "silu" or "gelu_tanh" (gated MLP either way)
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    output_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head of q and k before rope (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # extra norms after attention and after the MLP (Gemma 2/3)
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    attn_scale: float | None = None  # softmax scale; None means head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # per layer FULL_/SLIDING_ATTENTION
    tie_word_embeddings: bool = False
    # tensor parallelism (see model/sharding.py): the head and intermediate counts above are then
    # this rank's share, and `gather` says what every rank contributes; None: one rank
    gather: GatherWidths | None = None
    moe: MoESettings | None = None  # mixture-of-experts feed-forwards; None: dense MLPs
    qk_norm_whole: bool = False  # q and k normed over all heads at once (OLMoE, OLMo 2)
    rotary_dim: int | None = None  # rope on the first rotary_dim of each head only (Phi-4-mini)
    no_rope_layers: tuple[int, ...] = ()  # layers whose attention has no rope at all (SmolLM3)
    post_norm: bool = False  # norms after attention and the MLP instead of before (OLMo 2)
    residual_scale: float = 1.0  # attention and MLP outputs scaled before the residual (Granite)
    logits_scaling: float = 1.0  # logits are divided by this (Granite)
    attention_sinks: bool = False  # a learned logit per head joins each softmax (gpt-oss)
    # multi-head latent attention (DeepSeek-V2/V3); num_kv_heads is then 1 and head_dim the
    # cached latent's width, kv_lora_rank + qk_rope_head_dim (see model/mla.py)
    mla: MLASettings | None = None
    # Layers of different shapes (Gemma 4); empty: every layer has head_dim, num_kv_heads and
    # intermediate_size
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_intermediate_sizes: tuple[int, ...] = ()
    # the last layers compute queries only: they attend over the cache of the last earlier layer
    # of their kind and write none (Gemma 4)
    kv_shared_layers: int = 0
    k_as_v_layers: tuple[int, ...] = ()  # layers whose values are their keys' projection
    value_norm: bool = False  # RMSNorm without weights on each value head (Gemma 4)
    layer_scalars: bool = False  # each layer's output (the whole stream) times a learned scalar
    # per-layer inputs (Gemma 4): a second embedding table of this width per layer, mixed with a
    # projection of the main embedding, gates a projection added to each layer's output; 0: none
    per_layer_input_size: int = 0

    def __post_init__(self) -> None:
        if not self.layer_types:
            kind = SLIDING_ATTENTION if self.sliding_window else FULL_ATTENTION
            self.layer_types = [kind] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        for name in ("layer_head_dims", "layer_kv_heads", "layer_intermediate_sizes"):
            values = getattr(self, name)
            if values and len(values) != self.num_layers:
                raise ValueError(f"{name} has {len(values)} entries for {self.num_layers} layers")
        for layer in range(self.num_layers):
            if self.num_heads % self.layer_kv_head_count(layer):
                raise ValueError(
                    f"{self.num_heads} attention heads is not a multiple of "
                    f"{self.layer_kv_head_count(layer)} KV heads (layer {layer})"
                )
            self.kv_source(layer)  # a sharing layer has a layer to share with

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def latent_kv(self) -> bool:
        """Whether the cache's values are its keys (one tensor per layer): MLA's latent."""
        return self.mla is not None

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of a layer (keys at distance >= window are masked), None for full
        attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING_ATTENTION else None

    def layer_is_moe(self, layer: int) -> bool:
        """Whether a layer's feed-forward is a mixture of experts."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def layer_rope(self, layer: int) -> RopeSettings:
        if self.layer_types[layer] == SLIDING_ATTENTION and self.rope_local is not None:
            return self.rope_local
        return self.rope

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def layer_kv_head_count(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def layer_intermediate_size(self, layer: int) -> int:
        if self.layer_intermediate_sizes:
            return self.layer_intermediate_sizes[layer]
        return self.intermediate_size

    def layer_rope_dim(self, layer: int) -> int:
        """How many leading dimensions of each head of this layer the rotary embedding turns."""
        return self.rotary_dim or self.layer_head_dim(layer)

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache this layer attends over: itself, or for one of the last
        `kv_shared_layers`, the last layer of its kind before them."""
        first_shared = self.num_layers - self.kv_shared_layers
        if layer < first_shared:
            return layer
        kind = self.layer_types[layer]
        for source in range(first_shared - 1, -1, -1):
            if self.layer_types[source] == kind:
                return source
        raise ValueError(f"layer {layer} shares the KV cache of no earlier {kind} layer")

    def cache_layers(self) -> list[int]:
        """The layers that write a KV cache of their own, in order: one cache tensor each."""
        return [i for i in range(self.num_layers) if self.kv_source(i) == i]

    def kv_cache_shapes(self) -> list[tuple[int, int]]:
        """(KV heads, head width) of each cache tensor (`cache_layers`)."""
        return [(self.layer_kv_head_count(i), self.layer_head_dim(i)) for i in self.cache_layers()]

    @property
    def layers_differ(self) -> bool:
        """Whether layers differ in shape or share caches (tensor parallelism does not split such
        models)."""
        return bool(
            self.layer_head_dims
            or self.layer_kv_heads
            or self.layer_intermediate_sizes
            or self.kv_shared_layers
        )
