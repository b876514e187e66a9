"""Each supported family: tiny random HF model -> safetensors -> tokenmill, logits equal
transformers'."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tokenmill.engine.kv_memory import blocks_for_budget
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model import kernels, transformer
from tokenmill.model.attention import KVCache
from tokenmill.model.config import RopeSettings
from tokenmill.model.loader import load_model
from tokenmill.model.quant_linear import QuantLinear
from tokenmill.model.transformer import Rotary

BLOCK = 4
COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
# special tokens inside the tiny vocabulary (the defaults of newer configs lie outside it)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHITECTURES = {
    "llama2": ("LlamaConfig", dict(rope_theta=10000.0)),
    "llama3": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
            tie_word_embeddings=True,
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=7, head_dim=24)),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma": ("GemmaConfig", dict(head_dim=16, hidden_activation="gelu_pytorch_tanh")),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=15.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=32,
            sliding_window=6,
            query_pre_attn_scalar=24,
            rope_local_base_freq=10000.0,
            rope_theta=1000000.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    # fused qkv and gate/up projections, every layer windowed (Phi-3-mini's 2047 at scale)
    "phi3": ("Phi3Config", dict(sliding_window=9, rope_theta=10000.0, **TOKEN_IDS)),
    # Phi-4-mini's shape: LongRoPE (short factors within the original context) on 3/4 of
    # each head
    "phi4_mini": (
        "Phi3Config",
        dict(
            rope_scaling=dict(
                rope_type="longrope",
                short_factor=[1.0, 1.25, 1.5, 2.0, 3.0, 4.0],
                long_factor=[1.5, 2.0, 4.0, 8.0, 16.0, 32.0],
            ),
            original_max_position_embeddings=64,  # cos and sin scaled for 4x the context
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            **TOKEN_IDS,
        ),
    ),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 0, 1], rope_theta=2000000.0, **TOKEN_IDS)),
    "olmo2": ("Olmo2Config", dict(rope_theta=500000.0, **TOKEN_IDS)),
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.03,
            logits_scaling=4.0,
            **TOKEN_IDS,
        ),
    ),
    # two layer shapes (global: wider heads, one KV head, values from the keys' projection,
    # a quarter of each head rotated), the last two layers sharing the caches of layers 1 and 2
    # with double-wide MLPs, per-layer inputs
    "gemma4": (
        "Gemma4TextConfig",
        dict(
            num_hidden_layers=5,
            head_dim=16,
            global_head_dim=32,
            num_global_key_value_heads=1,
            attention_k_eq_v=True,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=96,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention"]
            + ["sliding_attention"] * 2
            + ["full_attention"],
            final_logit_softcapping=30.0,
            **TOKEN_IDS,
        ),
    ),
}

PROMPT_LENS = [3, 11, 20]
DECODE_STEPS = 8


def _hf_model(name: str) -> transformers.PreTrainedModel:
    config_class, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**(COMMON | extra))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms, so that the (1 + w) Gemma convention is exercised
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(0.0, 0.3)
        for pname, b in model.named_buffers():  # Gemma 4's scalars, 1 when initialized
            if pname.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return model.eval()


def _tokenmill_steps(
    loaded,
    prompts: list[list[int]],
    continuations: list[list[int]],
    kv_cache_dtype: str = "float32",
) -> list[torch.Tensor]:
    """Prefill all prompts in one batch, then feed the continuations one token per step, batched."""
    max_len = max(len(p) for p in prompts) + DECODE_STEPS
    blocks_per_seq = -(-max_len // BLOCK)
    # a float32 cache: these compare the model's arithmetic with transformers' (a float16 one, the
    # default on CPU, rounds keys and values to 11 bits: its own tests are in test_attention.py)
    runner = ModelRunner(
        loaded,
        num_blocks=blocks_per_seq * len(prompts) + 1,
        block_size=BLOCK,
        kv_cache_dtype=kv_cache_dtype,
    )
    # interleave the blocks of different sequences so that block tables really matter
    tables = [
        [1 + s + len(prompts) * b for b in range(blocks_per_seq)] for s in range(len(prompts))
    ]
    lens = [len(p) for p in prompts]
    outputs = [runner.all_logits(prompts, lens, tables)]
    for step in range(DECODE_STEPS):
        lens = [n + 1 for n in lens]
        outputs.append(runner.all_logits([[c[step]] for c in continuations], lens, tables))
    return outputs


@pytest.mark.parametrize(
    ("name", "batch_invariant"),
    [(name, True) for name in ARCHITECTURES]
    # Gemma 4's KV-sharing layers read this step's K/V back from their source layer's cache:
    # through SDPA too, where prompts otherwise attend to their own K/V as computed
    + [("gemma4", False)],
)
def test_logits_match_transformers(name: str, batch_invariant: bool, tmp_path) -> None:
    hf = _hf_model(name)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype="fp32", progress=False, batch_invariant=batch_invariant)

    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, COMMON["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS
    ]
    continuations = [
        torch.randint(0, COMMON["vocab_size"], (DECODE_STEPS,), generator=gen).tolist()
        for _ in prompts
    ]
    with torch.no_grad():
        ours = _tokenmill_steps(loaded, prompts, continuations)
        offsets = [0] + torch.cumsum(torch.tensor(PROMPT_LENS), 0).tolist()
        for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
            full = torch.tensor([prompt + cont])
            ref = hf(full).logits[0].float()
            prefill = ours[0][offsets[i] : offsets[i + 1]]
            torch.testing.assert_close(prefill, ref[: len(prompt)], atol=1e-4, rtol=0)
            decode = torch.stack([ours[1 + s][i] for s in range(DECODE_STEPS)])
            torch.testing.assert_close(decode, ref[len(prompt) :], atol=1e-4, rtol=0)
    assert ref.abs().max() > 0.05, "logits too small for the comparison to mean anything"


@pytest.mark.parametrize("config_class", ["LlamaConfig", "Qwen2Config"])
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"), [("fp32", "float32"), ("fp32", "float16"), ("bf16", "auto")]
)
def test_eager_steps_rotate_and_write_the_cache_in_one_op(
    config_class: str, dtype: str, kv_cache_dtype: str, tmp_path, monkeypatch
) -> None:
    """Heads of 32, which `tokenmill::rotary_write_kv` takes: prompts (whose attention reads their
    K/V back from the cache) and decode steps give the logits of the separate ops, bit for bit."""
    # where the kernels should build and did not, test_kernels_build_and_load fails
    if not kernels.loaded():
        pytest.skip("tokenmill's kernels are not built on this CPU or without a C++ compiler")
    config = getattr(transformers, config_class)(
        **(COMMON | dict(num_attention_heads=2, num_key_value_heads=1))
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype=dtype, progress=False)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    continuations = [torch.randint(0, 96, (DECODE_STEPS,), generator=gen).tolist() for _ in prompts]

    fused_calls = []

    def counted(*args: object) -> bool:
        fits = fused_write_fits(*args)
        fused_calls.append(fits)
        return fits

    fused_write_fits = transformer._fused_write_fits
    monkeypatch.setattr(transformer, "_fused_write_fits", counted)
    with torch.no_grad():
        fused = _tokenmill_steps(loaded, prompts, continuations, kv_cache_dtype)
    assert fused_calls and all(fused_calls)
    monkeypatch.setattr(transformer, "_fused_write_fits", lambda *args: False)
    with torch.no_grad():
        separate = _tokenmill_steps(loaded, prompts, continuations, kv_cache_dtype)
    for ours, reference in zip(fused, separate):
        assert torch.equal(ours, reference)


def test_an_eager_step_calls_its_hot_modules_without_hook_dispatch(
    tiny_model_dir, monkeypatch
) -> None:
    """Norms, attention, decoder layers and packed linear layers are plain method calls (the
    "Plain calls" note in transformer.py): of an eager step's module calls, only the model's own
    and its MLPs' go through nn.Module's hook dispatch."""
    loaded = load_model(tiny_model_dir, quantization="int4", progress=False)
    assert isinstance(loaded.model.layers[0].attn.qkv_proj, QuantLinear)
    runner = ModelRunner(loaded, num_blocks=8, block_size=16, compile=False)
    dispatched: list[str] = []
    call_impl = torch.nn.Module._call_impl

    def counted(module: torch.nn.Module, *args: object, **kwargs: object) -> object:
        dispatched.append(type(module).__name__)
        return call_impl(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "_call_impl", counted)
    runner.last_token_logits([[5, 9, 3]], [3], [[0]])
    layers = len(loaded.model.layers)
    assert sorted(set(dispatched)) == ["Embedding", "MLP", "Transformer"]
    assert dispatched.count("MLP") == layers


def test_rope_tables_are_the_float32_angles_cos_and_sin_rounded_once() -> None:
    """Each table entry is the float32 angle's cos or sin, correctly rounded from float64 (numpy's
    float64 functions as the reference), so a step's rotation does not depend on which thread or
    which of ATen's float32 implementations computed it."""
    positions = torch.arange(4096)
    inv_freq = RopeSettings(theta=1_000_000.0).inv_freq(128)
    cos, sin = Rotary(RopeSettings(theta=1_000_000.0), 128).tables(positions, torch.float32)
    angles = (positions.float()[:, None] * inv_freq[None, :]).numpy().astype(np.float64)
    assert torch.equal(cos[:, 0], torch.from_numpy(np.cos(angles).astype(np.float32)))
    assert torch.equal(sin[:, 0], torch.from_numpy(np.sin(angles).astype(np.float32)))


def test_longrope_takes_the_long_factors_past_the_original_context(tmp_path) -> None:
    """Decode steps past Phi-3's original context rotate with the long factors, as transformers'
    generation does (its cache keeps each earlier key as it was rotated)."""
    config_class, extra = ARCHITECTURES["phi4_mini"]
    original = 12
    extra = extra | dict(original_max_position_embeddings=original)
    config = getattr(transformers, config_class)(**COMMON, **extra)
    assert config.rope_parameters["original_max_position_embeddings"] == original
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype="fp32", progress=False)

    gen = torch.Generator().manual_seed(1)
    # prompts within the original context, whose decode steps cross it (or stay short of it)
    lens = [3, 9, original]
    prompts = [torch.randint(0, COMMON["vocab_size"], (n,), generator=gen).tolist() for n in lens]
    continuations = [
        torch.randint(0, COMMON["vocab_size"], (DECODE_STEPS,), generator=gen).tolist()
        for _ in prompts
    ]
    with torch.no_grad():
        ours = _tokenmill_steps(loaded, prompts, continuations)
        for i, (prompt, cont) in enumerate(zip(prompts, continuations)):
            out = hf(torch.tensor([prompt]), use_cache=True)
            ref = []
            for token in cont:
                out = hf(torch.tensor([[token]]), cache=out.cache, use_cache=True)
                ref.append(out.logits[0, -1])
            decode = torch.stack([ours[1 + s][i] for s in range(DECODE_STEPS)])
            torch.testing.assert_close(decode, torch.stack(ref), atol=1e-4, rtol=0)


def test_gemma4_cache_holds_the_writing_layers_in_their_shapes(tmp_path) -> None:
    """Layers sharing another layer's cache have no tensor, the others their own shape, and the
    KV memory accounting counts exactly those tensors."""
    _hf_model("gemma4").save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype="fp32", progress=False)
    config = loaded.config
    assert [config.kv_source(i) for i in range(5)] == [0, 1, 2, 2, 1]
    assert config.k_as_v_layers == (1,)
    runner = ModelRunner(loaded, num_blocks=6, block_size=BLOCK, kv_cache_dtype="float32")
    shapes = [tuple(t.shape[1:]) for t in runner.cache.k]
    assert shapes == [(2, 16), (1, 32), (2, 16)]
    per_block = KVCache.bytes_per_block(
        config.num_layers,
        BLOCK,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        shapes=config.kv_cache_shapes(),
    )
    assert per_block * 6 == sum(t[:-1].nbytes for t in runner.cache.k + runner.cache.v)
    assert blocks_for_budget(per_block * 6, loaded, BLOCK, "float32") == 6


def test_gemma4_multimodal_checkpoint_runs_its_text_model(tmp_path) -> None:
    """A Gemma4ForConditionalGeneration checkpoint loads its text_config and language model's
    weights (the vision tower is left out) and computes its text logits."""
    _, extra = ARCHITECTURES["gemma4"]
    text = transformers.Gemma4TextConfig(**(COMMON | extra))
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
    )
    config = transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.normal_(0.0, 0.3)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(tmp_path, dtype="fp32", progress=False)
    prompt = [5, 9, 3, 70, 1, 44]
    runner = ModelRunner(loaded, num_blocks=3, block_size=BLOCK, kv_cache_dtype="float32")
    with torch.no_grad():
        ours = runner.all_logits([prompt], [len(prompt)], [[0, 1]])
        ref = hf(input_ids=torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert ref.abs().max() > 0.05, "logits too small for the comparison to mean anything"
