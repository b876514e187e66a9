"""DeepSeek-V2 (and V2-Lite) and V3: tiny random HF models and their GGUF twins, written as
llama.cpp's converter writes them, give transformers' logits through the engine's paged KV cache;
latent attention caches one latent head per token, and grouped routing computes a token alike
whatever its batch."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from tests.model.test_gguf_model import VOCAB, add_tiny_vocab, save
from tests.model.test_moe import _assert_matches_transformers, _store
from tokenmill.engine.kv_memory import blocks_for_budget
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model.attention import KVCache
from tokenmill.model.config import MoESettings
from tokenmill.model.loader import load_model
from tokenmill.model.mla import LatentAttention
from tokenmill.model.moe import route

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,  # the dense layers'
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.1,
    kv_lora_rank=32,
    qk_nope_head_dim=32,  # whole Q8_0 blocks in attn_k_b rows
    qk_rope_head_dim=16,
    v_head_dim=24,
    first_k_dense_replace=1,
    n_shared_experts=2,
    num_experts_per_tok=2,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32,
    "beta_slow": 1,
}
VARIANTS = {
    # V2: softmax scores, grouped by each group's best expert, scaled
    "v2": (
        "DeepseekV2Config",
        dict(
            q_lora_rank=24,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
        ),
    ),
    # V2-Lite: no query compression, ungrouped; a latent head tokenmill's attention kernel does not
    # take (72 is no multiple of 16, as DeepSeek's 576 is over its 512): the SDPA and matmul paths
    "v2-lite": (
        "DeepseekV2Config",
        dict(q_lora_rank=None, n_routed_experts=6, kv_lora_rank=64, qk_rope_head_dim=8),
    ),
    # V3: sigmoid scores with a choice bias, grouped by each group's best two, renormalized and
    # scaled; YaRN rope (with its softmax scale), interleaved rope pairs
    "v3": (
        "DeepseekV3Config",
        dict(
            q_lora_rank=24,
            n_routed_experts=8,
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
        ),
    ),
}


def _hf_model(variant: str) -> transformers.PreTrainedModel:
    config_class, extra = VARIANTS[variant]
    config = getattr(transformers, config_class)(**(COMMON | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms and choice biases; a wider router spreads the tokens
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_logits_match_transformers(variant: str, tmp_path: Path) -> None:
    hf = _hf_model(variant)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype="fp32", progress=False)
    cfg = loaded.config
    latent = hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    assert cfg.mla is not None and (cfg.num_kv_heads, cfg.head_dim) == (1, latent)
    assert cfg.moe.dense_layers == (0,) and cfg.moe.shared_intermediate_size == 64
    assert cfg.moe.score_bias == (variant == "v3")
    _assert_matches_transformers(loaded, hf, atol=1e-4)


# ---------------------------------------------------------------- GGUF

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def _write_gguf(path: Path, hf, split_kv_b: bool, qtype: gguf.GGMLQuantizationType) -> dict:
    """Write hf as llama.cpp's convert_hf_to_gguf.py does for DeepseekV2/V3 (arch deepseek2: one
    KV head of kv_lora_rank + rope, the per-head sizes in key_length_mla / value_length_mla;
    kv_b_proj as attn_kv_b, or split into attn_k_b (transposed per head) and attn_v_b as its newer
    versions write it; experts stacked; the choice bias in exp_probs_b); returns hf's state dict
    as the file encodes it."""
    cfg = hf.config
    v3 = cfg.model_type == "deepseek_v3"
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(cfg.kv_lora_rank)
    writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    writer.add_value_length(cfg.kv_lora_rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    if cfg.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    grouped = v3 or cfg.topk_method == "group_limited_greedy"
    if grouped:
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)
    if v3:  # from the checkpoint's scoring_func
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    rope = cfg.rope_parameters
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    add_tiny_vocab(writer)

    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    encoded = {}
    for hf_name, tensor in hf.state_dict().items():
        data = tensor.float().numpy()
        base, _, suffix = hf_name.removeprefix("model.").rpartition(".")
        if base in ("embed_tokens", "norm", "lm_head"):
            name = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[base]
            dense = name != "output"
            stored = _store(writer, f"{name}.{suffix}", data, Q.F32 if dense else qtype)
            encoded[hf_name] = torch.from_numpy(np.ascontiguousarray(stored))
            continue
        _, layer, rest = base.split(".", 2)
        blk = f"blk.{layer}"
        if rest == "mlp.gate" and suffix == "e_score_correction_bias":
            writer.add_tensor(f"{blk}.exp_probs_b.bias", data)
            encoded[hf_name] = tensor
        elif rest == "mlp.experts":  # (experts, 2 x width, hidden) and (experts, hidden, width)
            if suffix == "gate_up_proj":
                gate, up = np.split(data, 2, axis=1)
                gate = _store(writer, f"{blk}.ffn_gate_exps.weight", gate, qtype)
                up = _store(writer, f"{blk}.ffn_up_exps.weight", up, qtype)
                encoded[hf_name] = torch.from_numpy(np.concatenate([gate, up], axis=1))
            else:
                stored = _store(writer, f"{blk}.ffn_down_exps.weight", data, qtype)
                encoded[hf_name] = torch.from_numpy(np.ascontiguousarray(stored))
        elif rest == "self_attn.kv_b_proj" and split_kv_b:
            per_head = data.reshape(heads, nope + v, -1)
            k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
            k_b = _store(writer, f"{blk}.attn_k_b.weight", k_b, qtype)
            v_b = _store(writer, f"{blk}.attn_v_b.weight", per_head[:, nope:].copy(), qtype)
            stored = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(data.shape)
            encoded[hf_name] = torch.from_numpy(np.ascontiguousarray(stored))
        else:
            name = f"{blk}.{_LAYER_NAMES.get(rest, 'attn_kv_b')}.{suffix}"
            dense = "ffn_gate_inp" in name or data.ndim == 1
            stored = _store(writer, name, data, Q.F32 if dense else qtype)
            encoded[hf_name] = torch.from_numpy(np.ascontiguousarray(stored))
    save(writer)
    return encoded


Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize(
    "variant, split_kv_b, qtype",
    [("v2", False, Q.F32), ("v2-lite", True, Q.Q8_0), ("v3", True, Q.F32)],
)
def test_gguf_matches_transformers(variant: str, split_kv_b: bool, qtype: Q, tmp_path) -> None:
    hf = _hf_model(variant)
    path = tmp_path / "model.gguf"
    encoded = _write_gguf(path, hf, split_kv_b, qtype)
    hf.load_state_dict(encoded)  # hf now holds what the file holds
    loaded = load_model(path, progress=False, quantization="none")
    assert loaded.config.mla is not None
    assert loaded.config.moe.scoring == ("sigmoid" if variant == "v3" else "softmax")
    _assert_matches_transformers(loaded, hf, atol=1e-4)


# ---------------------------------------------------------------- cache and routing


@pytest.fixture(scope="module")
def v3_loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3")
    _hf_model("v3").save_pretrained(path, safe_serialization=True)
    return load_model(path, dtype="fp32", progress=False)


def test_the_cache_holds_one_latent_head_per_token_as_keys_and_values(v3_loaded) -> None:
    runner = ModelRunner(v3_loaded, num_blocks=4, block_size=4, kv_cache_dtype="float32")
    cache = runner.cache
    assert all(v is k for k, v in zip(cache.k, cache.v))
    assert cache.k[0].shape == (4 * 4 + 1, 1, 32 + 16)
    per_block = KVCache.bytes_per_block(3, 4, 1, 48, torch.float32, shared_kv=True)
    assert per_block == 3 * 4 * 48 * 4
    assert cache.nbytes == (4 * 4 + 1) * 3 * 48 * 4
    assert blocks_for_budget(10 * per_block, v3_loaded, 4, "float32") == 10


def test_batched_prompts_give_the_logits_of_each_prompt_alone(v3_loaded) -> None:
    prompts = [[5, 9, 3, 70, 1, 1, 44], [8, 2, 60, 61, 62, 63, 64, 65, 66, 67, 11], [7, 7, 30]]
    runner = ModelRunner(v3_loaded, num_blocks=16, block_size=4, kv_cache_dtype="float32")
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    layer = v3_loaded.model.layers[1]
    assert isinstance(layer.attn, LatentAttention)
    picked = []
    hook = layer.mlp.register_forward_hook(
        lambda m, inputs, _o: picked.append(route(m.router(inputs[0]), m.settings, m.score_bias)[1])
    )
    try:
        with torch.no_grad():
            batched = runner.all_logits(prompts, [len(p) for p in prompts], tables)
            alone = [runner.all_logits([p], [len(p)], [t]) for p, t in zip(prompts, tables)]
    finally:
        hook.remove()
    assert len(picked[0].unique()) >= 6  # the batch's tokens reach most of the 8 experts
    assert torch.equal(batched, torch.cat(alone))


def test_grouped_routing_picks_from_the_best_groups_only() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 2.8, -1.0, 2.0, 1.0, 1.5]])
    grouped = dict(num_experts=8, top_k=2, intermediate_size=1, num_groups=4, topk_groups=2)
    # softmax: groups ranked by their best expert, (0, 1) and (2, 3)
    weights, experts = route(logits, MoESettings(**grouped, routed_scale=2.0))
    assert experts.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, 2 * logits.softmax(-1)[:, [1, 2]])
    # sigmoid: by the sum of their best two, so (0, 1) ranks below (2, 3) whatever expert 1's
    # score, and the bias lifts (6, 7) to the top; it steers the choice, not the weights
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    sigmoid = MoESettings(**grouped, scoring="sigmoid", score_bias=True, norm_topk=True)
    weights, experts = route(logits, sigmoid, bias)
    assert experts.tolist() == [[7, 2]]
    top = logits.sigmoid()[:, [7, 2]]
    torch.testing.assert_close(weights, top / top.sum())
