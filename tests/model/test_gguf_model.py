"""A tiny model written as GGUF (the way llama.cpp's converter writes it) equals its safetensors
twin."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize, quantize

from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model.loader import load_model
from tokenmill.model.quant_linear import (
    COARSE_X_BLOCK,
    FINE_X_BLOCK,
    QuantEmbedding,
    QuantLinear,
    int4_rows_layout,
)

VOCAB = 96
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    initializer_range=0.1,
)
# special tokens inside the tiny vocabulary (the defaults of newer configs lie outside it)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
HF_CONFIGS = {
    "llama": transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        initializer_range=0.1,
    ),
    "qwen2": transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=1000000.0,
        initializer_range=0.1,
        tie_word_embeddings=True,
    ),
    "gemma3": transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        sliding_window=5,
        max_position_embeddings=128,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        initializer_range=0.1,
        layer_types=["sliding_attention"] * 2 + ["full_attention"],
    ),
    # Phi-4-mini's shape: fused qkv and gate/up, LongRoPE on 3/4 of each head, a window
    "phi3": transformers.Phi3Config(
        **SMALL,
        rope_scaling=dict(
            rope_type="longrope",
            short_factor=[1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
            long_factor=[1.5, 2.0, 4.0, 8.0, 16.0, 32.0],
        ),
        original_max_position_embeddings=32,
        partial_rotary_factor=0.75,
        sliding_window=9,
        tie_word_embeddings=True,
        **TOKEN_IDS,
    ),
    # four layers: llama.cpp's NoPE step leaves the rope out of the fourth
    "smollm3": transformers.SmolLM3Config(**(SMALL | dict(num_hidden_layers=4)), **TOKEN_IDS),
    "olmo2": transformers.Olmo2Config(**SMALL, **TOKEN_IDS),
    "granite": transformers.GraniteConfig(
        **SMALL,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.03,
        logits_scaling=4.0,
        **TOKEN_IDS,
    ),
    # two layer shapes, KV shared by the last two layers (double-wide MLPs), per-layer inputs
    "gemma4": transformers.Gemma4TextConfig(
        **(SMALL | dict(num_hidden_layers=5)),
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=32,
        vocab_size_per_layer_input=VOCAB,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"]
        + ["sliding_attention"] * 2
        + ["full_attention"],
        final_logit_softcapping=30.0,
        **TOKEN_IDS,
    ),
}
# llama.cpp's converter reorders these families' q/k rows for interleaved rope
PERMUTED_QK = ("llama", "smollm3", "granite")

# HF name (after "model.layers.N.") -> GGUF name (after "blk.N.")
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up in one tensor
    "mlp.down_proj": "ffn_down",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
    # Gemma 4
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
    "layer_scalar": "layer_output_scale",
}


def _gguf_name(hf_name: str, arch: str) -> str:
    name = hf_name.removeprefix("model.")
    if name.endswith("layer_scalar"):  # Gemma 4's scalar, named a weight by the converter
        name += ".weight"
    globals_ = {
        "embed_tokens": "token_embd",
        "norm": "output_norm",
        "lm_head": "output",
        "embed_tokens_per_layer": "per_layer_token_embd",
        "per_layer_model_projection": "per_layer_model_proj",
        "per_layer_projection_norm": "per_layer_proj_norm",
    }
    base, _, suffix = name.rpartition(".")
    if base in globals_:
        return f"{globals_[base]}.{suffix}"
    _, layer, rest = base.split(".", 2)
    if rest == "post_attention_layernorm":
        post = arch in ("gemma3", "olmo2", "gemma4")
        return f"blk.{layer}.{'post_attention_norm' if post else 'ffn_norm'}.{suffix}"
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{suffix}"


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders q/k rows of Llama models for interleaved rope."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def add_tiny_vocab(writer: gguf.GGUFWriter, end: str = "<|end|>") -> None:
    """The tiny models' vocabulary, byte-level BPE: printable ASCII (its own byte-level form),
    one merge and the end token."""
    tokens = [chr(c) for c in range(33, 127)] + ["ab", end]
    assert len(tokens) == VOCAB
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (VOCAB - 1) + [3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(VOCAB - 1)


def save(writer: gguf.GGUFWriter) -> None:
    """Write the file: header, metadata, tensors."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_gguf(
    path: Path,
    hf: transformers.PreTrainedModel,
    arch: str,
    qtype: gguf.GGMLQuantizationType,
    quantize_embedding: bool = False,
) -> dict:
    """Write hf as llama.cpp would; returns the state dict that the GGUF actually encodes."""
    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_attention_heads)
    if arch == "gemma4":
        _write_gemma4_metadata(writer, cfg)
    else:
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = (
        cfg.rope_parameters["full_attention"]["rope_theta"]
        if arch in ("gemma3", "gemma4")
        else cfg.rope_parameters["rope_theta"]
    )
    writer.add_rope_freq_base(theta)
    if arch == "gemma3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_array(
            "gemma3.attention.sliding_window_pattern",
            [t == "sliding_attention" for t in cfg.layer_types],
        )
    if arch == "phi3":  # as convert_hf_to_gguf.py's Phi3MiniModel writes it
        rope = cfg.rope_parameters
        original = rope["original_max_position_embeddings"]
        rope_dims = int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_dimension_count(rope_dims)
        writer.add_sliding_window(cfg.sliding_window or 0)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            factors = np.array(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if arch == "granite":
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    add_tiny_vocab(writer)

    encoded = {}
    for hf_name, tensor in hf.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "gemma3" and "norm" in hf_name:
            data = data + 1.0  # llama.cpp stores Gemma norms as 1 + w
        if arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
            data = permute_qk(data, heads)
        if data.ndim == 2 and ("embed" not in hf_name or quantize_embedding):
            raw = quantize(data, qtype)
            writer.add_tensor(_gguf_name(hf_name, arch), raw, raw_dtype=qtype)
            data = dequantize(raw, qtype)
            if arch in PERMUTED_QK and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in hf_name else cfg.num_key_value_heads
                data = (
                    data.reshape(heads, data.shape[0] // heads // 2, 2, -1)
                    .swapaxes(1, 2)
                    .reshape(data.shape)
                )
        else:
            writer.add_tensor(_gguf_name(hf_name, arch), data)
        if arch == "gemma3" and "norm" in hf_name:
            data = data - 1.0
        encoded[hf_name] = torch.from_numpy(np.ascontiguousarray(data))
    save(writer)
    return encoded


def _write_gemma4_metadata(writer: gguf.GGUFWriter, cfg: transformers.Gemma4TextConfig) -> None:
    """Gemma 4's keys and rope factors, as convert_hf_to_gguf.py's Gemma4Model writes them."""
    layers = range(cfg.num_hidden_layers)
    shapes = [cfg.per_layer_config[i] for i in layers]
    swa = [t == "sliding_attention" for t in cfg.layer_types]
    full_head, swa_head = (shapes[swa.index(is_swa)].head_dim for is_swa in (False, True))
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    wide = 2 if cfg.use_double_wide_mlp else 1
    writer.add_feed_forward_length(
        [cfg.intermediate_size * (wide if i >= first_shared else 1) for i in layers]
    )
    writer.add_head_count_kv([s.num_key_value_heads for s in shapes])
    writer.add_key_length(full_head)
    writer.add_value_length(full_head)
    writer.add_key_length_swa(swa_head)
    writer.add_value_length_swa(swa_head)
    writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(full_head)
    writer.add_rope_dimension_count_swa(swa_head)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_sliding_window_pattern(swa)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_shared_kv_layers(cfg.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input)
    # proportional rope: the global layers' unrotated frequencies divided by 1e30
    rotated = int(full_head * cfg.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * rotated + [1e30] * (full_head // 2 - rotated)
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))


def _logits(loaded, prompts: list[list[int]]) -> torch.Tensor:
    # exact comparisons
    runner = ModelRunner(loaded, num_blocks=16, block_size=8, kv_cache_dtype="float32")
    tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
    return runner.all_logits(prompts, [len(p) for p in prompts], tables)


Q = gguf.GGMLQuantizationType
# quantized-in-memory tolerance: Q4_0/Q4_1/Q4_K map exactly onto the int4 kernel (Q5_0 onto its
# 5-bit form where tokenmill's row kernel serves) and Q8_0 is
# re-quantized to int8 with one scale per row (~0.07), but the GEMVs round the activations to int8,
# which moves these tiny models' logits by up to ~0.13
KEPT_ATOL = {Q.F32: 1e-4, Q.Q4_1: 2e-1, Q.Q5_0: 2e-1, Q.Q8_0: 2e-1}


@pytest.mark.parametrize("quantization", ["none", "gguf"])
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_1, Q.Q5_0])
@pytest.mark.parametrize("arch", list(HF_CONFIGS))
def test_gguf_equals_safetensors(arch: str, qtype: Q, quantization: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
        for name, b in hf.named_buffers():  # Gemma 4's scalars, 1 when initialized
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    gguf_path = tmp_path / "model.gguf"
    encoded = _write_gguf(gguf_path, hf, arch, qtype)
    hf.load_state_dict(encoded, strict=False)  # the twin holds exactly the (de)quantized weights
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)

    from_gguf = load_model(gguf_path, progress=False, quantization=quantization)
    from_hf = load_model(tmp_path / "hf", progress=False)
    for field in (
        "layer_types",
        "sliding_window",
        "rotary_dim",
        "no_rope_layers",
        "layer_head_dims",
        "layer_kv_heads",
        "layer_intermediate_sizes",
        "kv_shared_layers",
        "k_as_v_layers",
        "per_layer_input_size",
        "layer_scalars",
    ):
        assert getattr(from_gguf.config, field) == getattr(from_hf.config, field), field
    # the rope of every position, past a LongRoPE's original context too
    positions = torch.arange(64)
    for kind, rotary in from_gguf.model.rotaries.items():
        twin_tables = from_hf.model.rotaries[kind].tables(positions, torch.float32)
        torch.testing.assert_close(
            rotary.tables(positions, torch.float32), twin_tables, atol=1e-6, rtol=0
        )
    prompts = [[5, 9, 3, 70, 1, 1, 44], [8, 2, 60, 61, 62, 63, 64, 65, 66, 67, 11]]
    with torch.no_grad():
        ours = _logits(from_gguf, prompts)
        twin = _logits(from_hf, prompts)
        ref = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    if quantization == "none":  # dequantized exactly as ggml does: the twin's numbers
        torch.testing.assert_close(ours, twin, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(ours, twin, atol=KEPT_ATOL[qtype], rtol=0)
        kinds = {m.kind for m in from_gguf.model.modules() if isinstance(m, QuantLinear)}
        x_blocks = {
            name.rsplit(".", 1)[-1]: m.x_block
            for name, m in from_gguf.model.named_modules()
            if isinstance(m, QuantLinear)
        }
        if qtype != Q.F32:  # q/k/v and the down projection keep finer activation scales
            fine = {x_blocks.pop("qkv_proj"), x_blocks.pop("down_proj")}
            assert fine == {FINE_X_BLOCK} and set(x_blocks.values()) == {COARSE_X_BLOCK}
        if qtype == Q.Q5_0:
            assert kinds >= ({"int5"} if int4_rows_layout() else {"int8"})


def test_tied_embedding_is_looked_up_from_the_file_rows(tmp_path: Path) -> None:
    """A tied Q8_0 embedding is looked up from the file's rows exactly, not from the head's
    re-quantized int8 rows."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        HF_CONFIGS["qwen2"], dtype=torch.float32
    ).eval()
    encoded = _write_gguf(tmp_path / "model.gguf", hf, "qwen2", Q.Q8_0, quantize_embedding=True)
    hf.load_state_dict(encoded, strict=False)
    loaded = load_model(tmp_path / "model.gguf", progress=False, quantization="gguf")
    model = loaded.model
    assert isinstance(model.embed, QuantEmbedding) and model.lm_head.kind == "int8"
    ids = torch.arange(VOCAB)
    torch.testing.assert_close(
        model.embed(ids), encoded["model.embed_tokens.weight"], atol=1e-6, rtol=0
    )
    prompts = [[5, 9, 3, 70, 1, 1, 44]]
    with torch.no_grad():
        ours = _logits(loaded, prompts)
        ref = hf(torch.tensor(prompts)).logits[0]
    torch.testing.assert_close(ours, ref, atol=KEPT_ATOL[Q.Q8_0], rtol=0)
