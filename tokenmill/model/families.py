"""Per-family settings: how each checkpoint format's config and tensor names map onto ours."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    MLASettings,
    ModelConfig,
    MoESettings,
    RopeSettings,
    yarn_mscale,
)
from tokenmill.model.encoder import ENCODER_MODEL_TYPES


@dataclass(frozen=True)
class Family:
    """What distinguishes one architecture family from the generic decoder."""

    hidden_act: str = "silu"
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norm: bool = False
    scaled_embeddings: bool = False
    norm_plus_one: bool = False  # HF checkpoints store RMSNorm weights as w - 1 (Gemma)
    gguf_permuted_qk: bool = False  # llama.cpp's converter reorders q/k rows for interleaved rope
    sliding_pattern: int | None = None  # every Nth layer is global, the others sliding (Gemma 3)
    fused_gate_up: bool = False  # gate and up in one checkpoint tensor, GGUF's `ffn_up` (Phi-3)
    post_norm: bool = False  # norms after attention and the MLP, none before (OLMo 2)
    qk_norm_whole: bool = False  # q/k norm over the whole projection, not per head (OLMoE, OLMo 2)
    no_rope_every: int | None = None  # every Nth layer has no rope (SmolLM3's GGUF default)
    # MoE: the top-k weights renormalized where a GGUF file does not say (llama.cpp's per-arch
    # choice; HF configs say it with norm_topk_prob)
    gguf_norm_topk: bool = False
    # gpt-oss: attention sinks, biased router and experts with the clamped SwiGLU, top-k logits
    # softmaxed, HF expert stacks (experts, in, out) with gate and up in alternate columns
    gpt_oss: bool = False
    # YaRN's ramp ends rounded to whole dimensions where a GGUF file does not say (GGUF has no
    # key for it); gpt-oss leaves them unrounded, as OpenAI's model and transformers do
    gguf_yarn_truncate: bool = True


FAMILIES: dict[str, Family] = {
    "llama": Family(gguf_permuted_qk=True, gguf_norm_topk=True),  # GGUF Mixtral is "llama"
    "mistral": Family(gguf_permuted_qk=True),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "gemma": Family(hidden_act="gelu_tanh", scaled_embeddings=True, norm_plus_one=True),
    "gemma2": Family(
        hidden_act="gelu_tanh", sandwich_norm=True, scaled_embeddings=True, norm_plus_one=True
    ),
    "gemma3": Family(
        hidden_act="gelu_tanh",
        qk_norm=True,
        sandwich_norm=True,
        scaled_embeddings=True,
        norm_plus_one=True,
        sliding_pattern=6,
    ),
    # mixture-of-experts families (see model/moe.py)
    "mixtral": Family(gguf_permuted_qk=True),
    "qwen2moe": Family(qkv_bias=True),
    "qwen3moe": Family(qk_norm=True, gguf_norm_topk=True),
    "olmoe": Family(qk_norm_whole=True),
    "phi3": Family(fused_gate_up=True),
    "smollm3": Family(gguf_permuted_qk=True, no_rope_every=4),
    "olmo2": Family(qk_norm=True, post_norm=True, qk_norm_whole=True),
    "granite": Family(gguf_permuted_qk=True),
    "gpt-oss": Family(gpt_oss=True, sliding_pattern=2, gguf_yarn_truncate=False),
    # DeepSeek-V2 and V3 (llama.cpp's "deepseek2"): latent attention, see model/mla.py
    "deepseek2": Family(),
    # layers of two shapes, KV shared between layers, per-layer inputs (see _hf_gemma4)
    "gemma4": Family(
        hidden_act="gelu_tanh",
        qk_norm=True,
        sandwich_norm=True,
        scaled_embeddings=True,
        sliding_pattern=6,
    ),
}

# Families tokenmill knows but does not run yet, and why (docs/design/newer-families.md)
_LINEAR_ATTENTION = (
    "its linear-attention (Gated DeltaNet) layers keep a recurrent state per request, which "
    "tokenmill's paged KV cache does not hold yet; run a model whose layers all attend instead"
)
_GEMMA4_MOE = (
    "Gemma 4's mixture-of-experts block (26B-A4B: a dense MLP beside routed experts, each with "
    "norms of its own, and a normed, scaled router) is not implemented yet; run a dense Gemma 4 "
    "(E2B, E4B, 31B) instead"
)
_SEE = " (see docs/design/newer-families.md)"
UNSUPPORTED_HF_MODEL_TYPES = {
    model_type: reason + _SEE
    for reason, model_types in (
        (
            _LINEAR_ATTENTION,
            ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        ),
    )
    for model_type in model_types
}
UNSUPPORTED_GGUF_ARCHITECTURES = {
    "qwen3next": _LINEAR_ATTENTION + _SEE,
    "qwen35": _LINEAR_ATTENTION + _SEE,
    "qwen35moe": _LINEAR_ATTENTION + _SEE,
}

# HF `model_type` -> family name
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "olmo2": "olmo2",
    "granite": "granite",
    "gpt_oss": "gpt-oss",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "gemma4_text": "gemma4",
}


def supported_list() -> str:
    return ", ".join(sorted(FAMILIES))


def _family(name: str, source: str) -> Family:
    if name in UNSUPPORTED_GGUF_ARCHITECTURES:
        reason = UNSUPPORTED_GGUF_ARCHITECTURES[name]
        raise ValueError(f"architecture {name!r} in {source} is not supported: {reason}")
    if name not in FAMILIES:
        raise ValueError(
            f"unsupported architecture {name!r} in {source} (supported: {supported_list()})"
        )
    return FAMILIES[name]


# ---------------------------------------------------------------- Hugging Face configs


def config_from_hf(hf: Any) -> ModelConfig:
    """Map a transformers `PretrainedConfig` onto `ModelConfig`."""
    model_type = getattr(hf, "model_type", None)
    if model_type in ENCODER_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is an encoder: it serves embeddings "
            "(`tokenmill serve` and /v1/embeddings), not generation"
        )
    if model_type in UNSUPPORTED_HF_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported: {UNSUPPORTED_HF_MODEL_TYPES[model_type]}"
        )
    if model_type not in HF_MODEL_TYPES:
        known = ", ".join(sorted(HF_MODEL_TYPES))
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json (supported: {known})"
        )
    name = HF_MODEL_TYPES[model_type]
    fam = FAMILIES[name]
    # Gemma 4's head width and KV heads differ by layer: its config gives them per layer only
    first = hf.per_layer_config[0] if name == "gemma4" else hf
    head_dim = getattr(first, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope, rope_local = _hf_rope(hf)
    rope = _longrope_factor(rope, hf.max_position_embeddings)
    attention_bias = bool(getattr(hf, "attention_bias", False)) or fam.qkv_bias
    sliding = getattr(hf, "sliding_window", None)
    layer_types = list(getattr(hf, "layer_types", None) or [])
    if sliding is None or (
        name in ("qwen2", "qwen3", "qwen2moe", "qwen3moe", "smollm3")
        and not getattr(hf, "use_sliding_window", False)
    ):
        sliding, layer_types = None, [FULL_ATTENTION] * hf.num_hidden_layers
    pre_attn_scalar = getattr(hf, "query_pre_attn_scalar", None)
    attn_scale = pre_attn_scalar**-0.5 if pre_attn_scalar else None
    if getattr(hf, "attention_multiplier", None):  # Granite
        attn_scale = float(hf.attention_multiplier)
    embed_scale = math.sqrt(hf.hidden_size) if fam.scaled_embeddings else 1.0
    if getattr(hf, "embedding_multiplier", None):  # Granite
        embed_scale = float(hf.embedding_multiplier)
    # SmolLM3: 1 where a layer has rope, 0 where it has none
    uses_rope = getattr(hf, "no_rope_layers", None) or [1] * hf.num_hidden_layers
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if getattr(hf, "clip_qkv", None) is not None:
        raise ValueError("clip_qkv (clamped q/k/v projections) is not supported")
    gemma4 = _hf_gemma4(hf) if name == "gemma4" else {}
    if gemma4:
        attn_scale = 1.0
    config = ModelConfig(
        architecture=name,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        # DeepSeek's latent attention caches one head (`_hf_deepseek`)
        num_kv_heads=1
        if name == "deepseek2"
        else getattr(first, "num_key_value_heads", None) or hf.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        rope=rope,
        rope_local=rope_local,
        hidden_act=_activation(act),
        attention_bias=attention_bias,
        output_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=fam.qk_norm,
        sandwich_norm=fam.sandwich_norm,
        embed_scale=embed_scale,
        attn_scale=attn_scale,
        attn_logit_softcap=getattr(hf, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(hf, "final_logit_softcapping", None),
        sliding_window=sliding,
        layer_types=layer_types,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        moe=_hf_moe(hf, fam),
        rotary_dim=_hf_rotary_dim(hf, head_dim),
        no_rope_layers=tuple(i for i, has_rope in enumerate(uses_rope) if not has_rope),
        post_norm=fam.post_norm,
        qk_norm_whole=fam.qk_norm_whole,
        residual_scale=float(getattr(hf, "residual_multiplier", None) or 1.0),
        logits_scaling=float(getattr(hf, "logits_scaling", None) or 1.0),
        attention_sinks=fam.gpt_oss,
        **gemma4,
    )
    return _hf_deepseek(hf, config) if name == "deepseek2" else config


def _hf_deepseek(hf: Any, cfg: ModelConfig) -> ModelConfig:
    """DeepSeek-V2/V3: latent attention (as one cached KV head, see model/mla.py), YaRN's
    softmax scale, and their routing: V2 softmax scores, grouped by each group's best expert
    where topk_method says so; V3 sigmoid scores with a bias for choosing, grouped by each
    group's best two."""
    if hf.attention_bias:
        raise ValueError("DeepSeek attention with biases (attention_bias) is not supported")
    rope = hf.qk_rope_head_dim
    mla = MLASettings(
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=rope,
        v_head_dim=hf.v_head_dim,
        q_lora_rank=hf.q_lora_rank or 0,
        rope_interleaved=bool(getattr(hf, "rope_interleave", True)),  # V2's is always
    )
    rope_settings, mscale = _yarn_factor(cfg.rope, hf.max_position_embeddings)
    v3 = hf.model_type == "deepseek_v3"
    grouped = v3 or hf.topk_method == "group_limited_greedy"
    moe = MoESettings(
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        scoring="sigmoid" if v3 else "softmax",
        norm_topk=bool(hf.norm_topk_prob),
        shared_intermediate_size=hf.moe_intermediate_size * (hf.n_shared_experts or 0),
        dense_layers=tuple(range(hf.first_k_dense_replace or 0)),
        num_groups=(hf.n_group or 1) if grouped else 1,
        topk_groups=(hf.topk_group or 1) if grouped else 1,
        score_bias=v3,
        routed_scale=float(hf.routed_scaling_factor),
    )
    return _with_mla(cfg, mla, rope_settings, mscale, moe)


def _with_mla(
    cfg: ModelConfig, mla: MLASettings, rope: RopeSettings, mscale: float, moe: MoESettings | None
) -> ModelConfig:
    """cfg with latent attention: one cached KV head as wide as the latent and the rope key."""
    return dataclasses.replace(
        cfg,
        num_kv_heads=1,
        head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
        rotary_dim=mla.qk_rope_head_dim,
        rope=rope,
        attn_scale=(mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5 * mscale**2,
        moe=moe,
        mla=mla,
    )


def _hf_gemma4(hf: Any) -> dict[str, Any]:
    """Gemma 4's layer options (`ModelConfig`) from its text config; refuses what is not
    implemented."""
    if getattr(hf, "enable_moe_block", False):
        raise ValueError(f"model_type {hf.model_type!r} is not supported: {_GEMMA4_MOE}{_SEE}")
    if getattr(hf, "use_bidirectional_attention", None) == "all":
        raise ValueError(
            "bidirectional attention (use_bidirectional_attention='all') is not "
            "supported: tokenmill's decoder attends causally"
        )
    layers = range(hf.num_hidden_layers)
    per_layer = [hf.per_layer_config[i] for i in layers]
    width = hf.hidden_size_per_layer_input or 0
    if width and hf.vocab_size_per_layer_input != hf.vocab_size:
        raise ValueError(
            f"a per-layer input vocabulary of {hf.vocab_size_per_layer_input} tokens for "
            f"{hf.vocab_size} tokens is not supported"
        )
    shared = hf.num_kv_shared_layers
    wide = hf.use_double_wide_mlp
    return dict(
        layer_head_dims=tuple(c.head_dim for c in per_layer),
        layer_kv_heads=tuple(c.num_key_value_heads for c in per_layer),
        layer_intermediate_sizes=tuple(
            hf.intermediate_size * (2 if wide and i >= len(layers) - shared else 1) for i in layers
        ),
        kv_shared_layers=shared,
        k_as_v_layers=tuple(
            i
            for i in layers[: len(layers) - shared]  # layers with keys of their own
            if hf.attention_k_eq_v and hf.layer_types[i] == FULL_ATTENTION
        ),
        value_norm=True,
        layer_scalars=True,
        per_layer_input_size=width,
    )


def _yarn_factor(rope: RopeSettings, max_positions: int) -> tuple[RopeSettings, float]:
    """YaRN with its factor filled in where the config leaves it to the context length, and the
    factor whose square scales DeepSeek's softmax (1 without YaRN), from mscale_all_dim as
    transformers computes it (`RopeSettings.attention_factor` scales cos and sin)."""
    scaling = rope.scaling or {}
    if scaling.get("rope_type") != "yarn":
        return rope, 1.0
    factor = float(
        scaling.get("factor") or max_positions / scaling["original_max_position_embeddings"]
    )
    mscale_all = scaling.get("mscale_all_dim")
    softmax_mscale = yarn_mscale(factor, mscale_all) if mscale_all else 1.0
    return RopeSettings(theta=rope.theta, scaling=scaling | {"factor": factor}), softmax_mscale


def _hf_moe(hf: Any, fam: Family) -> MoESettings | None:
    """The mixture-of-experts settings of an HF config, None for a dense model."""
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    if not experts:
        return None
    layers = hf.num_hidden_layers
    step = getattr(hf, "decoder_sparse_step", None) or 1
    dense_only = set(getattr(hf, "mlp_only_layers", None) or [])
    norm = getattr(hf, "norm_topk_prob", None)
    shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
    settings = dict(
        norm_topk=True if norm is None else bool(norm),  # Mixtral's config has no switch: on
        shared_intermediate_size=shared,
        shared_gate=shared > 0,  # Qwen2-MoE always gates its shared expert
        dense_layers=tuple(i for i in range(layers) if i in dense_only or (i + 1) % step),
    )
    if fam.gpt_oss:
        settings |= _gpt_oss_moe(hf.swiglu_limit, hf.swiglu_alpha)
    return MoESettings(
        num_experts=experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=getattr(hf, "moe_intermediate_size", None) or hf.intermediate_size,
        **settings,
    )


def _gpt_oss_moe(limit: float, alpha: float) -> dict[str, Any]:
    """gpt-oss's MoESettings beyond the counts: the softmax of the top-k biased router logits,
    experts with biases and the clamped SwiGLU."""
    return dict(
        scoring="topk_softmax",
        norm_topk=False,
        router_bias=True,
        expert_bias=True,
        swiglu_limit=float(limit),
        swiglu_alpha=float(alpha),
    )


def hf_interleaved_experts(cfg: ModelConfig) -> bool:
    """Whether an HF checkpoint stacks the experts as gpt-oss does
    (`moe.deinterleave_hf_experts`)."""
    return FAMILIES[cfg.architecture].gpt_oss


def _hf_rotary_dim(hf: Any, head_dim: int) -> int | None:
    """The leading dimensions of each head that rope turns, None for all of them."""
    params = getattr(hf, "rope_parameters", None)
    params = params if isinstance(params, dict) else {}
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    return None if factor == 1.0 else int(head_dim * factor)


def _longrope_factor(rope: RopeSettings, max_positions: int) -> RopeSettings:
    """LongRoPE's scaling of cos and sin, computed as transformers and llama.cpp's converter do
    when the config does not give it: from the ratio of the context to the original one."""
    scaling = rope.scaling or {}
    if scaling.get("rope_type") != "longrope" or scaling.get("attention_factor") is not None:
        return rope
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or max_positions / original)
    attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return RopeSettings(theta=rope.theta, scaling=scaling | {"attention_factor": attention_factor})


def _activation(name: str) -> str:
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh", "gelu"):  # Gemma's "gelu" means the tanh form
        return "gelu_tanh"
    raise ValueError(f"unsupported activation {name!r}")


def _hf_rope(hf: Any) -> tuple[RopeSettings, RopeSettings | None]:
    """Rope of full-attention layers and, when different, of sliding layers
    (transformers 4 and 5)."""
    params = getattr(hf, "rope_parameters", None)
    if isinstance(params, dict) and FULL_ATTENTION in params:
        full, local = params[FULL_ATTENTION], params.get(SLIDING_ATTENTION)
        return _rope_from_params(full), _rope_from_params(local) if local else None
    if isinstance(params, dict) and "rope_theta" in params:
        return _rope_from_params(params), None
    theta = getattr(hf, "rope_theta", 10000.0)
    scaling = getattr(hf, "rope_scaling", None)
    local_theta = getattr(hf, "rope_local_base_freq", None)
    local = RopeSettings(theta=local_theta) if local_theta else None
    return RopeSettings(theta=theta, scaling=_scaling(scaling)), local


def _rope_from_params(params: dict[str, Any]) -> RopeSettings:
    return RopeSettings(theta=float(params["rope_theta"]), scaling=_scaling(params))


def _scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    if not params:
        return None
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    return {k: v for k, v in params.items() if k != "rope_theta"} | {"rope_type": rope_type}


def hf_tensor_name(name: str, cfg: ModelConfig) -> str | None:
    """Our parameter name for an HF tensor name, None for tensors we do not use."""
    name = name.removeprefix("model.").removeprefix("language_model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name in ("norm.weight", "lm_head.weight"):
        return name
    if name in _HF_PER_LAYER_NAMES:
        return _HF_PER_LAYER_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if not m:
        return None
    layer, rest = m.groups()
    rest = rest.replace("self_attn.", "attn.")
    for theirs, ours in _HF_LAYER_INPUT_NAMES.items():
        rest = rest.replace(theirs, ours)
    norms = {"input_layernorm": "attn_norm"}
    if cfg.sandwich_norm or cfg.post_norm:
        norms |= {
            "post_attention_layernorm": "attn_post_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "ffn_post_norm",
        }
    else:
        norms["post_attention_layernorm"] = "ffn_norm"
    head, _, tail = rest.partition(".")
    rest = f"{norms[head]}.{tail}" if head in norms else rest
    for pattern, replacement in _HF_MOE_NAMES:
        rest = re.sub(pattern, replacement, rest)
    return f"layers.{layer}.{rest}"


# Gemma 4's per-layer inputs: HF names -> ours
_HF_PER_LAYER_NAMES = {
    "embed_tokens_per_layer.weight": "per_layer_embed.weight",
    "per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
}
_HF_LAYER_INPUT_NAMES = {
    "per_layer_input_gate.": "per_layer_gate.",
    "per_layer_projection.": "per_layer_proj.",
    "post_per_layer_input_norm.": "per_layer_norm.",
}

# HF mixture-of-experts names -> ours (see model/moe.py), applied in order
_HF_MOE_NAMES = [
    (r"^block_sparse_moe\.", "mlp."),  # Mixtral
    (r"^mlp\.gate\.", "mlp.router."),
    (r"^mlp\.shared_expert_gate\.", "mlp.shared_gate."),
    (r"^mlp\.shared_experts\.", "mlp.shared_expert."),  # DeepSeek
    (r"^mlp\.router\.e_score_correction_bias$", "mlp.score_bias"),  # DeepSeek-V3
    (r"^(mlp\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
    (r"^(mlp\.experts\.\d+)\.w3\.", r"\1.up_proj."),
    (r"^(mlp\.experts\.\d+)\.w2\.", r"\1.down_proj."),
    # stacks (transformers 5 "fused" experts): (experts, rows, cols) tensors without a suffix
    (r"^mlp\.experts\.(gate_up_proj|down_proj)$", r"mlp.experts.\1.weight"),
    (r"^mlp\.experts\.(gate_up_proj|down_proj)_bias$", r"mlp.experts.\1.bias"),
]


def hf_norm_offset(cfg: ModelConfig) -> float:
    """What to add to every RMSNorm weight of an HF checkpoint of this family."""
    return 1.0 if FAMILIES[cfg.architecture].norm_plus_one else 0.0


# ---------------------------------------------------------------- GGUF metadata


def config_from_gguf(md: dict[str, Any], tensor_names: set[str], source: str) -> ModelConfig:
    """Map GGUF metadata (llama.cpp's keys) onto `ModelConfig`."""
    arch = md.get("general.architecture")
    fam = _family(str(arch), source)
    if arch == "gemma4" and md.get("gemma4.expert_count"):
        raise ValueError(f"architecture 'gemma4' in {source} is not supported: {_GEMMA4_MOE}{_SEE}")

    def key(suffix: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"{source}: missing metadata key {arch}.{suffix}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list) and arch != "gemma4":  # Gemma 4's: see _gguf_gemma4
        # per-layer lists are allowed by the format; we need them uniform
        if len(set(kv_heads)) != 1:
            raise ValueError(f"{source}: per-layer KV head counts are not supported")
        kv_heads = kv_heads[0]
    num_layers = int(key("block_count"))
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // heads))
    ffn = key("feed_forward_length")
    ffn = ffn[0] if isinstance(ffn, list) else ffn
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = None
    if md.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(md[f"{arch}.rope.scaling.factor"])}
    elif md.get(f"{arch}.rope.scaling.type") == "yarn":
        scaling = _gguf_yarn(md, str(arch), fam)
    sliding = md.get(f"{arch}.attention.sliding_window")
    layer_types: list[str] = []
    rope_local = None
    if fam.sliding_pattern and sliding:
        # llama.cpp: either a per-layer list of booleans or "every Nth layer is global"
        pattern = md.get(f"{arch}.attention.sliding_window_pattern", fam.sliding_pattern)
        if isinstance(pattern, list):
            layer_types = [
                SLIDING_ATTENTION if is_swa else FULL_ATTENTION for is_swa in pattern[:num_layers]
            ]
        else:
            layer_types = [
                SLIDING_ATTENTION if (i + 1) % int(pattern) else FULL_ATTENTION
                for i in range(num_layers)
            ]
        if not fam.gpt_oss:  # Gemma 3's sliding layers turn at their own base
            rope_local = RopeSettings(theta=float(md.get(f"{arch}.rope.freq_base_swa", 10000.0)))
    elif arch == "gemma2" and sliding:
        layer_types = [
            SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers)
        ]
    moe = _gguf_moe(md, str(arch), fam, int(ffn), tensor_names, source)
    attn_scale = md.get(f"{arch}.attention.scale")  # Granite
    if arch in ("gemma2", "gemma3"):
        attn_scale = head_dim**-0.5  # query_pre_attn_scalar equals head_dim for released sizes
    gemma4 = (
        _gguf_gemma4(md, num_layers, layer_types, tensor_names, source) if arch == "gemma4" else {}
    )
    if gemma4:
        attn_scale = 1.0
        head_dim, kv_heads = gemma4["layer_head_dims"][0], gemma4["layer_kv_heads"][0]
    embed_scale = float(md.get(f"{arch}.embedding_scale", 1.0))  # Granite
    if fam.scaled_embeddings:
        embed_scale = math.sqrt(hidden)
    rotary_dim = None if gemma4 else md.get(f"{arch}.rope.dimension_count")
    # llama.cpp's fixed NoPE step (SmolLM3): no GGUF key gives it
    every = fam.no_rope_every
    no_rope = tuple(i for i in range(num_layers) if every and (i + 1) % every == 0)
    config = ModelConfig(
        architecture=str(arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(key("context_length", 4096)),
        rope=RopeSettings(theta=theta, scaling=scaling),
        rope_local=rope_local,
        hidden_act=fam.hidden_act,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        output_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        qk_norm=fam.qk_norm,
        sandwich_norm=fam.sandwich_norm,
        embed_scale=embed_scale,
        attn_scale=attn_scale,
        attn_logit_softcap=md.get(f"{arch}.attn_logit_softcapping"),
        final_logit_softcap=md.get(f"{arch}.final_logit_softcapping"),
        # Mistral and Phi-3 window every layer (transformers does for Phi-3-mini's 2047; llama.cpp
        # leaves Phi-3's window out, so its logits differ from transformers' past the window)
        sliding_window=(
            int(sliding) if sliding and (layer_types or arch in ("mistral", "phi3")) else None
        ),
        layer_types=layer_types,
        tie_word_embeddings="output.weight" not in tensor_names,
        moe=moe,
        rotary_dim=int(rotary_dim) if rotary_dim and int(rotary_dim) != head_dim else None,
        no_rope_layers=no_rope,
        post_norm=fam.post_norm,
        qk_norm_whole=fam.qk_norm_whole,
        residual_scale=float(md.get(f"{arch}.residual_scale", 1.0)),
        logits_scaling=float(md.get(f"{arch}.logit_scale", 1.0)),
        attention_sinks=fam.gpt_oss,
        **gemma4,
    )
    return _gguf_deepseek(md, config, tensor_names, source) if arch == "deepseek2" else config


# llama.cpp's expert_gating_func values
_GGUF_GATING = {1: "softmax", 2: "sigmoid"}


def _gguf_deepseek(
    md: dict[str, Any], cfg: ModelConfig, tensor_names: set[str], source: str
) -> ModelConfig:
    """DeepSeek-V2/V3 as llama.cpp's converter writes them: the attention's sizes in
    attention.kv_lora_rank, q_lora_rank, key_length_mla and value_length_mla (older files: the
    per-head key_length and value_length), YaRN in rope.scaling.*, whose yarn_log_multiplier is
    0.1 x mscale_all_dim, and the routing in expert_gating_func (softmax where absent, as
    llama.cpp reads it), expert_group_count, expert_group_used_count, expert_weights_scale and the
    exp_probs_b biases."""
    arch = "deepseek2"

    def key(suffix: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{suffix}", default)
        if value is None:
            raise ValueError(f"{source}: missing metadata key {arch}.{suffix}")
        return value

    rope = int(key("rope.dimension_count"))
    suffix = "_mla" if f"{arch}.attention.key_length_mla" in md else ""
    key_length = key(f"attention.key_length{suffix}")
    value_length = key(f"attention.value_length{suffix}")
    mla = MLASettings(
        kv_lora_rank=int(key("attention.kv_lora_rank")),
        qk_nope_head_dim=int(key_length) - rope,
        qk_rope_head_dim=rope,
        v_head_dim=int(value_length),
        q_lora_rank=int(md.get(f"{arch}.attention.q_lora_rank", 0)),
    )
    rope_settings, mscale = cfg.rope, 1.0
    if md.get(f"{arch}.rope.scaling.type") == "yarn":
        factor = float(key("rope.scaling.factor"))
        scaling = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
            "beta_fast": float(md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            "attention_factor": 1.0,  # mscale equals mscale_all_dim, as llama.cpp takes it
        }
        rope_settings = RopeSettings(theta=cfg.rope.theta, scaling=scaling)
        log_mul = float(md.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0))
        mscale = 1.0 + log_mul * math.log(factor) if factor > 1 else 1.0
    gating = int(md.get(f"{arch}.expert_gating_func", 1))
    if gating not in _GGUF_GATING:
        raise ValueError(f"{source}: unsupported {arch}.expert_gating_func {gating}")
    moe = cfg.moe and dataclasses.replace(
        cfg.moe,
        scoring=_GGUF_GATING[gating],
        norm_topk=bool(md.get(f"{arch}.expert_weights_norm", False)),
        dense_layers=tuple(range(int(md.get(f"{arch}.leading_dense_block_count", 0)))),
        num_groups=int(md.get(f"{arch}.expert_group_count", 1)),
        topk_groups=int(md.get(f"{arch}.expert_group_used_count", 1)),
        score_bias=any(name.endswith(".exp_probs_b.bias") for name in tensor_names),
        routed_scale=float(md.get(f"{arch}.expert_weights_scale", 1.0)),
    )
    return _with_mla(cfg, mla, rope_settings, mscale, moe)


def _gguf_gemma4(
    md: dict[str, Any], num_layers: int, layer_types: list[str], names: set[str], source: str
) -> dict[str, Any]:
    """Gemma 4's layer options (`ModelConfig`) as llama.cpp's converter writes them: head widths
    of global and sliding layers (`key_length`, `key_length_swa`), per-layer KV head counts and
    MLP widths, values from the keys' projection where a layer has no `attn_v`."""
    if not layer_types:
        raise ValueError(f"{source}: missing metadata key gemma4.attention.sliding_window")

    def per_layer(value: Any) -> tuple[int, ...]:
        return (
            tuple(int(v) for v in value) if isinstance(value, list) else (int(value),) * num_layers
        )

    needed = [f"gemma4.attention.{k}" for k in ("key_length", "key_length_swa", "head_count_kv")]
    missing = [k for k in needed + ["gemma4.feed_forward_length"] if k not in md]
    if missing:
        raise ValueError(f"{source}: missing metadata key {missing[0]}")
    full, swa = md["gemma4.attention.key_length"], md["gemma4.attention.key_length_swa"]
    head_dims = tuple(int(full if t == FULL_ATTENTION else swa) for t in layer_types)
    shared = int(md.get("gemma4.attention.shared_kv_layers", 0))
    writes = range(num_layers - shared)
    return dict(
        layer_head_dims=head_dims,
        layer_kv_heads=per_layer(md["gemma4.attention.head_count_kv"]),
        layer_intermediate_sizes=per_layer(md["gemma4.feed_forward_length"]),
        kv_shared_layers=shared,
        k_as_v_layers=tuple(i for i in writes if f"blk.{i}.attn_v.weight" not in names),
        value_norm=True,
        layer_scalars="blk.0.layer_output_scale.weight" in names,
        per_layer_input_size=int(md.get("gemma4.embedding_length_per_layer_input", 0)),
    )


def _gguf_yarn(md: dict[str, Any], arch: str, fam: Family) -> dict[str, Any]:
    """YaRN from the keys llama.cpp's converter writes, in transformers' terms."""
    scaling = {
        "rope_type": "yarn",
        "factor": float(md[f"{arch}.rope.scaling.factor"]),
        "original_max_position_embeddings": int(md[f"{arch}.rope.scaling.original_context_length"]),
        "beta_fast": float(md.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(md.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": fam.gguf_yarn_truncate,
    }
    if f"{arch}.rope.scaling.yarn_attn_factor" in md:
        scaling["attention_factor"] = float(md[f"{arch}.rope.scaling.yarn_attn_factor"])
    return scaling


def _gguf_moe(
    md: dict[str, Any], arch: str, fam: Family, ffn: int, tensor_names: set[str], source: str
) -> MoESettings | None:
    """The mixture-of-experts settings llama.cpp reads for this arch, None for a dense model."""
    experts = md.get(f"{arch}.expert_count")
    if not experts:
        return None
    used = md.get(f"{arch}.expert_used_count")
    if not used:
        raise ValueError(f"{source}: missing metadata key {arch}.expert_used_count")
    shared = int(md.get(f"{arch}.expert_shared_feed_forward_length", 0))
    if not shared:  # DeepSeek's files give the count of shared experts as wide as the routed
        width = int(md.get(f"{arch}.expert_feed_forward_length", ffn))
        shared = int(md.get(f"{arch}.expert_shared_count", 0)) * width
    if "blk.0.ffn_up_shexp.weight" in tensor_names and not shared:
        raise ValueError(
            f"{source}: a shared expert without {arch}.expert_shared_feed_forward_length"
        )
    settings = dict(
        norm_topk=bool(md.get(f"{arch}.expert_weights_norm", fam.gguf_norm_topk)),
        shared_intermediate_size=shared,
        shared_gate="blk.0.ffn_gate_inp_shexp.weight" in tensor_names,
    )
    if fam.gpt_oss:  # llama.cpp's fixed limit and alpha (OpenAI's, no GGUF key gives them)
        settings |= _gpt_oss_moe(limit=7.0, alpha=1.702)
    return MoESettings(
        num_experts=int(experts),
        top_k=int(used),
        intermediate_size=int(md.get(f"{arch}.expert_feed_forward_length", ffn)),
        **settings,
    )


def gguf_longrope(
    md: dict[str, Any], cfg: ModelConfig, short: list[float], long: list[float]
) -> RopeSettings:
    """Phi-3's LongRoPE from a GGUF file: its `rope_factors_short` / `rope_factors_long` tensors
    and the converter's attention factor and original context length."""
    arch = md.get("general.architecture")
    original = md.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(
            f"rope_factors_long without {arch}.rope.scaling.original_context_length: the file "
            "does not say where the long factors start; convert the model again"
        )
    scaling = {
        "rope_type": "longrope",
        "short_factor": short,
        "long_factor": long,
        "original_max_position_embeddings": int(original),
        "attention_factor": float(md.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
    }
    return RopeSettings(theta=cfg.rope.theta, scaling=scaling)


_GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "attn.q_proj",
    "attn_k": "attn.k_proj",
    "attn_v": "attn.v_proj",
    "attn_output": "attn.o_proj",
    "attn_q_norm": "attn.q_norm",
    "attn_k_norm": "attn.k_norm",
    "post_attention_norm": "attn_post_norm",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "ffn_post_norm",
    # mixture of experts: stacks of every expert's projection (split by moe.expert_tensors)
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_gate",
    # DeepSeek's latent attention (see model/mla.py)
    "attn_q_a": "attn.q_a_proj",
    "attn_q_a_norm": "attn.q_a_layernorm",
    "attn_q_b": "attn.q_b_proj",
    "attn_kv_a_mqa": "attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "attn.kv_a_layernorm",
    "attn_kv_b": "attn.kv_b_proj",
    "attn_k_b": "attn.k_b_proj",
    "attn_v_b": "attn.v_b_proj",
    # Gemma 4's per-layer inputs
    "inp_gate": "per_layer_gate",
    "proj": "per_layer_proj",
    "post_norm": "per_layer_norm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "embed",
    "output_norm": "norm",
    "output": "lm_head",
    "per_layer_token_embd": "per_layer_embed",
    "per_layer_model_proj": "per_layer_model_proj",
    "per_layer_proj_norm": "per_layer_proj_norm",
}


def gguf_tensor_name(name: str, cfg: ModelConfig) -> str | None:
    """Our parameter name for a GGUF tensor name, None for tensors we do not use
    (e.g. rope_freqs). Fused tensors get the name of our fused projection, which
    `fused_parts` splits."""
    base, _, suffix = name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if not m:
        return None
    kind = m.group(2)
    if kind == "layer_output_scale":  # Gemma 4's scalar: a parameter of the layer itself
        return f"layers.{m.group(1)}.layer_scalar"
    ours = _GGUF_LAYER_NAMES.get(kind)
    if kind == "attn_sinks":
        return f"layers.{m.group(1)}.attn.sinks"  # a vector without a suffix, as in HF's
    if kind == "post_attention_norm" and not (cfg.sandwich_norm or cfg.post_norm):
        ours = "ffn_norm"  # gpt-oss's name for the norm before the feed-forward
    if kind == "attn_qkv":
        ours = "attn.qkv_proj"
    elif kind == "exp_probs_b":  # DeepSeek-V3's expert choice bias, a vector of its own
        return f"layers.{m.group(1)}.mlp.score_bias"
    elif kind == "ffn_up" and FAMILIES[cfg.architecture].fused_gate_up:
        ours = "mlp.gate_up_proj"  # llama.cpp's Phi-3 keeps gate and up in one tensor
    return None if ours is None else f"layers.{m.group(1)}.{ours}.{suffix}"


def fused_parts(name: str, cfg: ModelConfig) -> list[tuple[str, int]] | None:
    """The projections a fused checkpoint tensor (Phi-3's qkv_proj and gate_up_proj) stacks, by
    our name with their row counts, in order; None for a tensor that is not fused."""
    m = re.fullmatch(r"(layers\.\d+)\.(attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)", name)
    if not m:
        return None
    layer, fused, suffix = m.groups()
    if fused == "attn.qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        parts = [("attn.q_proj", q), ("attn.k_proj", kv), ("attn.v_proj", kv)]
    else:
        parts = [("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)]
    return [(f"{layer}.{part}.{suffix}", rows) for part, rows in parts]


def gguf_qk_permuted(cfg: ModelConfig) -> bool:
    return FAMILIES[cfg.architecture].gguf_permuted_qk
