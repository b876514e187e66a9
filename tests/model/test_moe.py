"""Mixture-of-experts families: tiny random HF models (per-expert and stacked safetensors) and their
GGUF twins, written as llama.cpp's converter writes them, give transformers' logits; the expert
dispatch computes each token alike whatever its batch and runs only the experts tokens picked.
gpt-oss (attention sinks, YaRN, biased experts with the clamped SwiGLU, MXFP4 experts in GGUF) has
its own section."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from tests.model.test_gguf_model import VOCAB, add_tiny_vocab, permute_qk, save
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model import kernels
from tokenmill.model.config import SLIDING_ATTENTION
from tokenmill.model.loader import load_model
from tokenmill.model.moe import MoE
from tokenmill.model.quant_linear import QuantLinear
from tokenmill.model.sharding import Shard

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
    num_experts_per_tok=2,
)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=64, num_local_experts=6)),
    "qwen2moe": (
        "Qwen2MoeConfig",
        dict(
            intermediate_size=96,  # the dense layer's
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=8,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=32,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=True,
        ),
    ),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=32, num_experts=8)),
}
# llama.cpp's arch for each (Mixtral converts as "llama")
GGUF_ARCH = {"mixtral": "llama", "qwen2moe": "qwen2moe", "qwen3moe": "qwen3moe", "olmoe": "olmoe"}
PROMPT_LENS = [3, 11, 20]
DECODE_STEPS = 8
BLOCK = 4


def _hf_model(family: str, **overrides) -> transformers.PreTrainedModel:
    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**COMMON, **(extra | overrides))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms; a wider router spreads the tokens over the experts
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0.0, 0.5)
    return model.eval()


def _steps(loaded, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """Prefill all prompts in one batch, then the continuations one token per step, batched."""
    per_seq = -(-(max(map(len, prompts)) + DECODE_STEPS) // BLOCK)
    runner = ModelRunner(
        loaded, num_blocks=per_seq * len(prompts) + 1, block_size=BLOCK, kv_cache_dtype="float32"
    )
    tables = [[1 + s + len(prompts) * b for b in range(per_seq)] for s in range(len(prompts))]
    lens = [len(p) for p in prompts]
    outputs = [runner.all_logits(prompts, lens, tables)]
    for step in range(DECODE_STEPS):
        lens = [n + 1 for n in lens]
        outputs.append(runner.all_logits([[c[step]] for c in continuations], lens, tables))
    return outputs


def _assert_matches_transformers(loaded, hf, atol: float, mean_atol: float | None = None) -> None:
    """Prefill and decode logits within atol of transformers' (and on average within mean_atol)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    continuations = [
        torch.randint(0, VOCAB, (DECODE_STEPS,), generator=gen).tolist() for _ in prompts
    ]
    with torch.no_grad():
        ours = _steps(loaded, prompts, continuations)
        starts = [0, *torch.tensor(PROMPT_LENS).cumsum(0).tolist()]
        for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
            ref = hf(torch.tensor([prompt + cont])).logits[0].float()
            prefill = ours[0][starts[i] : starts[i + 1]]
            torch.testing.assert_close(prefill, ref[: len(prompt)], atol=atol, rtol=0)
            decode = torch.stack([ours[1 + s][i] for s in range(DECODE_STEPS)])
            torch.testing.assert_close(decode, ref[len(prompt) :], atol=atol, rtol=0)
            if mean_atol is not None:
                mean = (torch.cat([prefill, decode]) - ref).abs().mean().item()
                assert mean < mean_atol, f"mean difference {mean:.3f} from transformers' logits"
    assert ref.abs().max() > 0.05, "logits too small for the comparison to mean anything"


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_logits_match_transformers(family: str, stacked: bool, tmp_path: Path) -> None:
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path, safe_serialization=True)  # one tensor per expert
    if stacked:  # transformers' in-memory layout: one (experts, rows, cols) tensor per projection
        (tmp_path / "model.safetensors").unlink()
        save_file(
            {k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "m.safetensors"
        )
        assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    loaded = load_model(tmp_path, dtype="fp32", progress=False)
    moe = loaded.config.moe
    assert moe.num_experts == FAMILIES[family][1].get("num_experts", 6)
    if family == "qwen2moe":
        assert moe.dense_layers == (1,) and moe.shared_gate
    _assert_matches_transformers(loaded, hf, atol=1e-4)


# ---------------------------------------------------------------- GGUF


def _gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    globals_ = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}
    base, _, suffix = name.rpartition(".")
    if base in globals_:
        return f"{globals_[base]}.{suffix}"
    _, layer, rest = base.split(".", 2)
    layer_names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "mlp.gate": "ffn_gate_inp",
        "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj": "ffn_up_shexp",
        "mlp.shared_expert.down_proj": "ffn_down_shexp",
        "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    }
    return f"blk.{layer}.{layer_names[rest]}.{suffix}"


def _store(writer, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Add a tensor, quantized where it is a matrix (or a stack of them); returns what the file
    holds, dequantized."""
    if data.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32:
        raw = quantize(data, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)
        return dequantize(raw, qtype).reshape(data.shape)
    writer.add_tensor(name, data)
    return data


def _write_gguf(path: Path, hf, family: str, qtype: gguf.GGMLQuantizationType) -> dict:
    """Write hf as llama.cpp's convert_hf_to_gguf.py does (experts stacked per projection in
    ffn_{gate,up,down}_exps, the router in ffn_gate_inp kept in float32, the shared expert in
    *_shexp); returns hf's state dict as the file encodes it."""
    cfg, arch = hf.config, GGUF_ARCH[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if getattr(cfg, "head_dim", None):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    add_tiny_vocab(writer)

    encoded = {}
    for hf_name, tensor in hf.state_dict().items():
        data = tensor.float().numpy()
        if hf_name.endswith("experts.gate_up_proj"):  # (experts, 2 x width, hidden)
            layer = hf_name.split(".")[2]
            gate, up = np.split(data, 2, axis=1)
            gate = _store(writer, f"blk.{layer}.ffn_gate_exps.weight", gate, qtype)
            up = _store(writer, f"blk.{layer}.ffn_up_exps.weight", up, qtype)
            encoded[hf_name] = torch.from_numpy(np.concatenate([gate, up], axis=1))
            continue
        if hf_name.endswith("experts.down_proj"):
            layer = hf_name.split(".")[2]
            stored = _store(writer, f"blk.{layer}.ffn_down_exps.weight", data, qtype)
            encoded[hf_name] = torch.from_numpy(np.ascontiguousarray(stored))
            continue
        name = _gguf_name(hf_name)
        if name.endswith("ffn_gate_inp_shexp.weight"):  # a vector in llama.cpp's files
            writer.add_tensor(name, data.reshape(-1))
            encoded[hf_name] = tensor
            continue
        permuted = arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight"))
        heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
        if permuted:
            data = permute_qk(data, heads)
        dense = "ffn_gate_inp" in name or "token_embd" in name or data.ndim == 1
        stored = _store(writer, name, data, gguf.GGMLQuantizationType.F32 if dense else qtype)
        if permuted:  # back to HF's order
            stored = (
                stored.reshape(heads, stored.shape[0] // heads // 2, 2, -1)
                .swapaxes(1, 2)
                .reshape(stored.shape)
            )
        encoded[hf_name] = torch.from_numpy(np.ascontiguousarray(stored))
    save(writer)
    return encoded


Q = gguf.GGMLQuantizationType
# Packed in memory, the GEMVs round activations to int8 and Q8_0 is re-quantized to int8 per row
# (see test_gguf_model.py's KEPT_ATOL): ~0.1 on these tiny models' logits, but a token whose two
# best experts score nearly alike may then pick the other one, which moves its logits further
# (up to ~0.4 seen); the mean difference stays at a few hundredths (0.15 with two experts swapped).
PACKED_ATOL, PACKED_MEAN_ATOL = 0.6, 0.06


@pytest.mark.parametrize(
    "qtype, quantization", [(Q.F32, "none"), (Q.Q8_0, "none"), (Q.Q4_0, "gguf"), (Q.Q8_0, "gguf")]
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_matches_transformers(family: str, qtype: Q, quantization: str, tmp_path) -> None:
    hf = _hf_model(family, mlp_only_layers=[])  # llama.cpp's MoE archs have no dense layers
    path = tmp_path / "model.gguf"
    hf.load_state_dict(_write_gguf(path, hf, family, qtype))  # hf now holds what the file holds
    loaded = load_model(path, progress=False, quantization=quantization)
    assert loaded.config.moe is not None
    assert loaded.config.moe.norm_topk == bool(getattr(hf.config, "norm_topk_prob", True))
    packed = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    if quantization == "gguf":  # each expert's slice of the stacks stays packed
        experts = loaded.model.layers[0].mlp.experts
        assert all(isinstance(e.gate_up_proj, QuantLinear) for e in experts)
        assert not isinstance(loaded.model.layers[0].mlp.router, QuantLinear)
    else:
        assert not packed
    if quantization == "none":  # dequantized exactly as ggml does
        _assert_matches_transformers(loaded, hf, atol=1e-4)
    else:
        _assert_matches_transformers(loaded, hf, atol=PACKED_ATOL, mean_atol=PACKED_MEAN_ATOL)


# ---------------------------------------------------------------- gpt-oss

GPT_OSS = dict(
    COMMON,
    head_dim=16,
    intermediate_size=64,  # 2 x 64 columns of gate/up against 64 rows of hidden: no square stacks
    num_local_experts=6,
    sliding_window=6,  # the prompts pass it: the sliding layers mask what the full ones see
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
)


def _gpt_oss_model() -> transformers.PreTrainedModel:
    """A tiny random gpt-oss; large enough biases, sinks and expert weights that the sinks, the
    router's bias and the SwiGLU's clamps all move the logits."""
    config = transformers.GptOssConfig(**GPT_OSS)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith(("router.weight", "_bias", "router.bias", "sinks")):
                p.normal_(0.0, 1.0)
            elif name.endswith("gate_up_proj"):
                p.normal_(0.0, 0.6)  # |gate| and |up| pass the limit of 7 for some tokens
    return model.eval()


@pytest.mark.parametrize("attention", ["kernel", "pytorch"])
def test_gpt_oss_hf_logits_match_transformers(attention: str, tmp_path, monkeypatch) -> None:
    """Every attention path takes the sinks: tokenmill's kernel (prompts and decodes) and, without
    it, PyTorch's (explicit softmax for prompts, matmuls for decodes)."""
    if attention == "pytorch":
        monkeypatch.setattr(kernels, "loaded", lambda: False)
    hf = _gpt_oss_model()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype="fp32", progress=False)
    cfg = loaded.config
    assert cfg.attention_sinks and cfg.attention_bias and cfg.output_bias
    assert cfg.layer_types[:2] == [SLIDING_ATTENTION, "full_attention"]
    assert cfg.rope.scaling["rope_type"] == "yarn" and cfg.rope.attention_factor > 1.3
    assert cfg.moe.scoring == "topk_softmax" and cfg.moe.swiglu_limit == 7.0
    _assert_matches_transformers(loaded, hf, atol=1e-4)


def _write_gpt_oss_gguf(path: Path, hf, qtype: Q, fused: bool) -> dict:
    """Write hf as llama.cpp's converter (GptOssModel) does: gate and up out of their alternate
    columns into ffn_gate_exps and ffn_up_exps (or, fused, gate rows then up rows in
    ffn_gate_up_exps), the stacks transposed to (experts, out, in) and quantized to qtype, their
    biases beside them, the pre-feed-forward norm as post_attention_norm, the sinks as attn_sinks;
    returns hf's state dict as the file encodes it."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.intermediate_size)
    add_tiny_vocab(writer, end="<|return|>")
    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.router": "ffn_gate_inp",
    }
    encoded = {}
    for hf_name, tensor in hf.state_dict().items():
        data = tensor.float().numpy()
        parts = hf_name.removeprefix("model.").split(".")
        if parts[0] != "layers":
            base, suffix = ".".join(parts[:-1]), parts[-1]
            base = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[base]
            writer.add_tensor(f"{base}.{suffix}", data)
            encoded[hf_name] = tensor
            continue
        blk, rest = f"blk.{parts[1]}", ".".join(parts[2:])
        if rest == "self_attn.sinks":
            writer.add_tensor(f"{blk}.attn_sinks.weight", data)
        elif rest in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
            weight = rest.endswith("proj")
            if weight:  # (experts, hidden, 2 x width) -> (experts, 2 x width, hidden)
                data = np.ascontiguousarray(data.transpose(0, 2, 1))
            gate, up = data[:, 0::2], data[:, 1::2]
            kind, store = ("weight", qtype) if weight else ("bias", Q.F32)
            if fused:
                both = _store(
                    writer, f"{blk}.ffn_gate_up_exps.{kind}", np.concatenate([gate, up], 1), store
                )
                gate, up = np.split(both, 2, axis=1)
            else:
                gate = _store(writer, f"{blk}.ffn_gate_exps.{kind}", gate, store)
                up = _store(writer, f"{blk}.ffn_up_exps.{kind}", up, store)
            both = np.stack([gate, up], axis=2).reshape(data.shape)  # alternate again
            encoded[hf_name] = torch.from_numpy(both.transpose(0, 2, 1) if weight else both)
        elif (
            rest == "mlp.experts.down_proj"
        ):  # (experts, width, hidden) -> (experts, hidden, width)
            stored = _store(writer, f"{blk}.ffn_down_exps.weight", data.transpose(0, 2, 1), qtype)
            encoded[hf_name] = torch.from_numpy(np.ascontiguousarray(stored.transpose(0, 2, 1)))
        elif rest == "mlp.experts.down_proj_bias":
            writer.add_tensor(f"{blk}.ffn_down_exps.bias", data)
        else:
            base, suffix = rest.rsplit(".", 1)
            writer.add_tensor(f"{blk}.{names[base]}.{suffix}", data)
        encoded.setdefault(hf_name, tensor)
    save(writer)
    return encoded


@pytest.mark.parametrize(
    "qtype, quantization, fused",
    [
        (Q.F32, "none", False),
        (Q.F32, "none", True),
        (Q.MXFP4, "none", False),
        (Q.MXFP4, "gguf", True),
    ],
)
def test_gpt_oss_gguf_matches_transformers(
    qtype: Q, quantization: str, fused: bool, tmp_path
) -> None:
    """MXFP4 experts dequantize exactly as ggml does ("none"); kept packed ("gguf") they are
    re-quantized to int8 per row."""
    hf = _gpt_oss_model()
    path = tmp_path / "model.gguf"
    hf.load_state_dict(_write_gpt_oss_gguf(path, hf, qtype, fused))
    loaded = load_model(path, progress=False, quantization=quantization)
    cfg = loaded.config
    assert cfg.architecture == "gpt-oss" and cfg.attention_sinks and cfg.rope_local is None
    assert cfg.layer_types[:2] == [SLIDING_ATTENTION, "full_attention"]
    assert cfg.rope.scaling["truncate"] is False
    experts = loaded.model.layers[0].mlp.experts
    assert all(isinstance(e.gate_up_proj, QuantLinear) for e in experts) == (quantization == "gguf")
    if quantization == "none":
        _assert_matches_transformers(loaded, hf, atol=1e-4)
    else:
        _assert_matches_transformers(loaded, hf, atol=PACKED_ATOL, mean_atol=PACKED_MEAN_ATOL)


# ---------------------------------------------------------------- dispatch


@pytest.fixture(scope="module")
def gpt_oss_loads(tmp_path_factory) -> dict[str, object]:
    """The tiny gpt-oss as dense fp32 layers and with packed MXFP4 experts (fp32 and bf16)."""
    path = tmp_path_factory.mktemp("gpt-oss") / "model.gguf"
    _write_gpt_oss_gguf(path, _gpt_oss_model(), Q.MXFP4, fused=False)
    return {
        "dense": load_model(path, progress=False, quantization="none"),
        "packed": load_model(path, progress=False, quantization="gguf"),
        "packed-bf16": load_model(path, dtype="bf16", progress=False, quantization="gguf"),
    }


@pytest.fixture(scope="module")
def mixtral_loads(tmp_path_factory) -> dict[str, object]:
    """The tiny Mixtral as dense fp32 layers and as packed Q4_0 experts (fp32 and bf16)."""
    path = tmp_path_factory.mktemp("mixtral")
    hf = _hf_model("mixtral")
    _write_gguf(path / "model.gguf", hf, "mixtral", Q.Q4_0)
    return {
        "dense": load_model(path / "model.gguf", progress=False, quantization="none"),
        "packed": load_model(path / "model.gguf", progress=False, quantization="gguf"),
        "packed-bf16": load_model(
            path / "model.gguf", dtype="bf16", progress=False, quantization="gguf"
        ),
    }


@pytest.mark.parametrize("kind", ["dense", "packed", "packed-bf16"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_a_token_routed_in_a_batch_equals_the_token_alone(request, family: str, kind: str) -> None:
    loaded = request.getfixturevalue(f"{family}_loads")[kind]
    block = loaded.model.layers[0].mlp
    assert isinstance(block, MoE)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    x = x.to(loaded.dtype)
    with torch.no_grad():
        _, picked = torch.topk(block.router(x), block.settings.top_k)
        batched = block(x)
        alone = torch.cat([block(x[i : i + 1]) for i in range(len(x))])
    assert len(picked.unique()) == block.settings.num_experts  # the batch mixes every expert
    assert torch.equal(batched, alone)


@pytest.mark.parametrize("kind", ["dense", "packed", "packed-bf16"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_batched_prompts_give_the_logits_of_each_prompt_alone(
    request, family: str, kind: str
) -> None:
    loaded = request.getfixturevalue(f"{family}_loads")[kind]
    prompts = [[5, 9, 3, 70, 1, 1, 44], [8, 2, 60, 61, 62, 63, 64, 65, 66, 67, 11], [7, 7, 30]]
    runner = ModelRunner(loaded, num_blocks=16, block_size=4, kv_cache_dtype="float32")
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    with torch.no_grad():
        batched = runner.all_logits(prompts, [len(p) for p in prompts], tables)
        alone = torch.cat([runner.all_logits([p], [len(p)], [t]) for p, t in zip(prompts, tables)])
    assert torch.equal(batched, alone)


def test_each_expert_runs_once_over_its_tokens_and_unpicked_experts_not_at_all(
    mixtral_loads,
) -> None:
    block = mixtral_loads["packed"].model.layers[0].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4))
    calls: dict[int, list[int]] = {}
    hooks = [
        expert.register_forward_hook(
            lambda _m, inputs, _o, e=e: calls.setdefault(e, []).append(inputs[0].shape[0])
        )
        for e, expert in enumerate(block.experts)
    ]
    try:
        with torch.no_grad():
            _, picked = torch.topk(block.router(x), block.settings.top_k)
            block(x)
    finally:
        for hook in hooks:
            hook.remove()
    counts = torch.bincount(picked.flatten(), minlength=block.settings.num_experts).tolist()
    assert calls == {e: [n] for e, n in enumerate(counts) if n}
    assert len(calls) < block.settings.num_experts  # 5 tokens x 2 picks of 6 experts: some idle


def test_decode_stays_eager_and_tensor_parallelism_is_refused(mixtral_loads, tmp_path) -> None:
    runner = ModelRunner(mixtral_loads["packed"], num_blocks=4, block_size=4, compile=True)
    assert runner.decode_mode == "eager" and not runner.compile_requested
    _write_gguf(tmp_path / "model.gguf", _hf_model("mixtral"), "mixtral", Q.F32)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        load_model(tmp_path / "model.gguf", progress=False, shard=Shard(rank=0, size=2))
