"""Batch invariance of linear layers: a row's output is the same bits whatever its batch.

Every kernel a packed layer can run (the tile kernel at both activation roundings and as an
output head, with GGUF's Q4_K in compact scales and Q6_K in 6-bit tiles too; the row kernels for
int4, 5-bit and int8 weights) is checked in float32 and bf16 at batch sizes across every
threshold the kernels know of (1, the GEMV sizes, tiles of rows, 64);
dense fp32 layers (`DenseLinear`) at every batch up to 40 and past a block of rows, and end to end
on a tiny fp32 model, whose requests give the same tokens alone and in batches.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import nn

from tests.engine_runs import final_outputs
from tests.model.test_gguf import as_llama_cpp_writes_q4_k, random_blocks
from tests.threads import THREAD_COUNTS, torch_threads
from tests.tiny_models import build_tiny_model
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model import kernels, quant_linear, transformer
from tokenmill.model.dense_linear import DenseLinear
from tokenmill.model.loader import load_model
from tokenmill.model.quant import GGMLWeight
from tokenmill.model.quant_linear import (
    COARSE_X_BLOCK,
    FINE_X_BLOCK,
    QuantLinear,
    gguf_packed,
    quantize_int4,
    quantize_int8,
)
from tokenmill.sample import SamplingParams

# Which kernels this CPU should run, by its flags rather than by what the build gave: a kernel that
# should be there and is not fails `_layer`'s check instead of dropping out of the test.
CAPABILITY = torch.backends.cpu.get_cpu_capability()
ROW_KERNELS = CAPABILITY in ("AVX2", "AVX512")
TILE_KERNEL = CAPABILITY == "AVX512" and "avx512_vnni" in kernels.cpu_flags().split()

pytestmark = pytest.mark.skipif(
    not ROW_KERNELS, reason="tokenmill's kernels build only for x86 CPUs with AVX2 or AVX-512"
)

BATCHES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 16, 17, 31, 32, 33, 48, 64, 65, 100]
# 23 groups of 32: the row kernels' blocks of 8 and 4 groups (their low terms in the loop for a
# few rows, after it for more), a pair and a single one left
OUT, IN = 96, 736


def _weights(kind: str) -> dict[str, tuple[torch.Tensor, ...]]:
    torch.manual_seed(7)
    weight = torch.randn(OUT, IN)
    if kind == "int8":
        return {"int8": quantize_int8(weight)}
    q, scale, low = quantize_int4(weight)
    if kind == "int5":  # a fifth bit on every other weight
        q = q + 16 * (torch.arange(IN) % 2).to(torch.uint8)
        scale = scale / 2
    return {kind: (q, scale, low)}


def _layouts() -> list[tuple[str, dict]]:
    """(name, QuantLinear options) of every kernel this CPU runs."""
    layouts = []
    if TILE_KERNEL:
        for kind in ("int4", "int5", "int8"):
            for x_block in (FINE_X_BLOCK, COARSE_X_BLOCK):
                layouts.append(
                    (f"tiles-{kind}-x{x_block}", {"kind": kind, "tiles": True, "x_block": x_block})
                )
        layouts.append(
            ("tiles-head", {"kind": "int8", "tiles": True, "x_block": COARSE_X_BLOCK, "head": True})
        )
    layouts += [
        (f"rows-{kind}", {"kind": kind, "tiles": False, "int4_rows": True})
        for kind in ("int4", "int5")
    ]
    layouts += [
        ("rows-int8", {"kind": "int8", "tiles": False}),
        ("rows-int8-head", {"kind": "int8", "tiles": False, "head": True}),
    ]
    return layouts


def _layer(options: dict, dtype: torch.dtype, invariant: bool, monkeypatch) -> QuantLinear:
    options = dict(options)
    kind, head = options.pop("kind"), options.pop("head", False)
    if head:  # counts as a large int8 matrix: an output head's kernels
        monkeypatch.setattr(quant_linear, "LARGE_INT8_WEIGHTS", OUT * IN)
    layer = QuantLinear(OUT, IN, dtype, **_weights(kind), batch_invariant=invariant, **options)
    assert layer._native_fits(torch.zeros(1, IN, dtype=dtype))  # tokenmill's kernel, not a fallback
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("name", "options"), _layouts(), ids=[n for n, _ in _layouts()])
def test_each_row_is_the_same_whatever_the_batch(name, options, dtype, monkeypatch) -> None:
    _check_rows(_layer(options, dtype, invariant=True, monkeypatch=monkeypatch), IN, dtype, name)


def _check_rows(layer: QuantLinear, in_features: int, dtype: torch.dtype, name: str) -> None:
    """Every batch of BATCHES gives each row the bits the row gives alone, on any number of
    threads."""
    torch.manual_seed(11)
    x = (torch.randn(max(BATCHES), in_features) * torch.rand(max(BATCHES), 1) * 4).to(dtype)
    _rows_equal_alone(layer, x, BATCHES, name)


def _rows_equal_alone(
    layer: nn.Module, x: torch.Tensor, batches: list[int], name: str
) -> torch.Tensor:
    """The first n rows of x for each n in batches, on each of THREAD_COUNTS threads, give the bits
    each row gives alone; returns the rows alone."""
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    for threads in THREAD_COUNTS:
        with torch_threads(threads):
            for batch in batches:
                rows = layer(x[:batch])
                assert torch.equal(rows, alone[:batch]), f"{name}, {batch} rows, {threads} threads"
    return alone


# GGUF's K-quants as the loader lays them out for the tile kernel (`gguf_packed`): Q4_K in 4-bit
# tiles with compact scales, Q6_K in 6-bit tiles; 768 columns, 3 of their blocks of 256
K_QUANT_IN = 768


@pytest.mark.skipif(not TILE_KERNEL, reason="the tile kernel is built for AVX-512 with VNNI only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("x_block", [FINE_X_BLOCK, COARSE_X_BLOCK])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K], ids=["q4_k", "q6_k"])
def test_k_quant_tile_rows_are_the_same_whatever_the_batch(qtype, x_block, dtype) -> None:
    assert kernels.load()
    rng = np.random.default_rng(int(qtype))
    raw = torch.from_numpy(random_blocks(qtype, (OUT, K_QUANT_IN), rng))
    if qtype == Q.Q4_K:
        as_llama_cpp_writes_q4_k(raw, rng)
    kind, packed = gguf_packed([GGMLWeight(raw, qtype, (OUT, K_QUANT_IN))], tiles=True)
    assert packed.tile_scales.dtype == torch.uint8  # compact scales, or the 6-bit tiles' own
    layer = QuantLinear(OUT, K_QUANT_IN, dtype, **{kind: packed}, x_block=x_block)
    assert layer.tiles and layer._native_fits(torch.zeros(1, K_QUANT_IN, dtype=dtype))
    _check_rows(layer, K_QUANT_IN, dtype, f"{qtype.name}, x_block {x_block}")


# 129 blocks of 32: the int8 row kernel takes several rows over stretches of a row (two whole ones
# and a last block), each of its partial sums over the same blocks in the same order as one row's
WIDE_IN = 4128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wide_int8_rows_are_the_same_whatever_the_batch(dtype) -> None:
    torch.manual_seed(5)
    weight = torch.randn(OUT, WIDE_IN)
    layer = QuantLinear(OUT, WIDE_IN, dtype, int8=quantize_int8(weight), tiles=False)
    assert layer._native_fits(torch.zeros(1, WIDE_IN, dtype=dtype))
    x = (torch.randn(20, WIDE_IN) * torch.rand(20, 1) * 4).to(dtype)
    alone = _rows_equal_alone(layer, x, [2, 3, 8, 9, 17, 20], "wide int8")
    q, scale = quantize_int8(weight)
    expected = F.linear(x.float(), q.float() * scale[:, None])
    # the activations' rounding to int8 (~0.4% a product) and bf16's
    tolerance = 0.05 * expected.abs().max().item()
    torch.testing.assert_close(alone.float(), expected, rtol=0.05, atol=tolerance)


@pytest.mark.skipif(not kernels.cpu_has_amx(), reason="prompt rows take AMX on AMX CPUs only")
@pytest.mark.parametrize("kind", ["int4", "int5", "int8", "q4_k", "q6_k"])
def test_prompt_rows_take_amx_and_output_rows_the_int8_products(kind) -> None:
    """Within a step's rows (`prompt_rows`) a batch-invariant bf16 tile layer multiplies the
    prompt rows on AMX and the output rows by the int8 products: each row gives the bits it gives
    alone as its kind, whatever the split and the batch, and the two kinds differ."""
    if kind in ("q4_k", "q6_k"):
        qtype, rng = Q[kind.upper()], np.random.default_rng(3)
        raw = torch.from_numpy(random_blocks(qtype, (OUT, K_QUANT_IN), rng))
        if qtype == Q.Q4_K:
            as_llama_cpp_writes_q4_k(raw, rng)
        packed_kind, packed = gguf_packed([GGMLWeight(raw, qtype, (OUT, K_QUANT_IN))], tiles=True)
        weights, width = {packed_kind: packed}, K_QUANT_IN
    else:
        weights, width = _weights(kind), IN
    layer = QuantLinear(OUT, width, torch.bfloat16, **weights, tiles=True)
    assert layer.prompts_on_amx
    torch.manual_seed(13)
    x = (torch.randn(70, width) * torch.rand(70, 1) * 4).bfloat16()
    as_output = torch.cat([layer(x[i : i + 1]) for i in range(70)])  # outside a step: int8
    as_prompt = []
    for i in range(70):
        with quant_linear.prompt_rows(0, 1):
            as_prompt.append(layer(x[i : i + 1]))
    as_prompt = torch.cat(as_prompt)
    assert not torch.equal(as_prompt, as_output)
    with quant_linear.prompt_rows(0, 1):
        assert torch.equal(layer(x[:2]), as_output[:2])  # 2 rows are not the step's 1
    for threads in THREAD_COUNTS:
        with torch_threads(threads):
            for first, rows in ((0, 70), (70, 70), (1, 70), (33, 70), (5, 17), (16, 17)):
                expected = torch.cat([as_output[:first], as_prompt[first:rows]])
                with quant_linear.prompt_rows(first, rows):
                    assert torch.equal(layer(x[:rows]), expected), (first, rows, threads)
                    into = torch.empty(rows, OUT, dtype=torch.bfloat16)
                    layer.forward_into(x[:rows], into)
                    assert torch.equal(into, expected), (first, rows, threads)


@pytest.mark.skipif(not TILE_KERNEL, reason="the tile kernel is built for AVX-512 with VNNI only")
def test_without_invariance_a_single_row_rounds_finer(monkeypatch) -> None:
    """The switch that batch invariance turns off exists: the test above would see it."""
    options = {"kind": "int4", "tiles": True, "x_block": COARSE_X_BLOCK}
    fast = _layer(options, torch.bfloat16, invariant=False, monkeypatch=monkeypatch)
    torch.manual_seed(11)
    x = (torch.randn(4, IN) * torch.rand(4, 1) * 4).to(torch.bfloat16)
    assert not torch.equal(fast(x[:1]), fast(x)[:1])


# Dense fp32 layers (`DenseLinear`, `tokenmill::dense_linear`): (out, in) shapes with K below,
# at and past the vector width's multiples, past the kernel's K slice (1024), and N off the
# register tile (4 columns) and off a column block
DENSE_SHAPES = [(96, 224), (37, 50), (5, 17), (130, 2100), (1030, 64)]
DENSE_BATCHES = [*range(1, 41), 300]  # 300: past a block of 256 rows


def _dense_layer(out_features: int, in_features: int, bias: bool) -> DenseLinear:
    torch.manual_seed(out_features + in_features)
    layer = DenseLinear(in_features, out_features, bias=bias).requires_grad_(False)
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("out_features", "in_features"), DENSE_SHAPES)
def test_dense_fp32_rows_are_the_same_whatever_the_batch(out_features, in_features, bias) -> None:
    assert kernels.loaded()  # tokenmill's kernel, not F.linear
    layer = _dense_layer(out_features, in_features, bias)
    torch.manual_seed(3)
    x = torch.randn(max(DENSE_BATCHES), in_features) * torch.rand(max(DENSE_BATCHES), 1) * 4
    alone = _rows_equal_alone(layer, x, DENSE_BATCHES, f"dense {out_features}x{in_features}")
    # rows in another order, and rows behind others: each still its own result
    order = torch.randperm(x.shape[0])
    assert torch.equal(layer(x[order]), alone[order])
    assert torch.equal(layer(x[7:40]), alone[7:40])
    # the same products as PyTorch's, to fp32 rounding (which grows with the sum's length)
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(alone, expected, rtol=1e-4, atol=1e-5 * in_features)


def test_dense_fp32_takes_leading_dimensions_and_leaves_bf16_to_pytorch() -> None:
    layer = _dense_layer(24, 40, bias=True)
    x = torch.randn(3, 5, 40)
    y = layer(x)
    assert y.shape == (3, 5, 24)
    assert torch.equal(y[1], layer(x[1]))
    bf16 = layer.to(torch.bfloat16)
    assert torch.equal(bf16(x[0].bfloat16()), F.linear(x[0].bfloat16(), bf16.weight, bf16.bias))


WORDS = ["red", "apples", "the river", "seven", "quietly", "north", "a lamp", "over"]
# 24 prompts of 2 to ~60 tokens, the longer ones cut into chunks by the batched engine's budget
ENGINE_PROMPTS = [" ".join(WORDS[i % 8 :] + WORDS[: i % 8]) * (1 + i % 5) for i in range(24)]


def _generate(engine: LLMEngine, requests: list[tuple[str, SamplingParams]], per_step: int) -> list:
    """Each request's tokens and their logprobs (which show a difference in the logits' last
    bits), per_step requests added before each step."""
    return [
        (o.token_ids, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)])
        for o in final_outputs(engine, requests, per_step)
    ]


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-tied"), tie_word_embeddings=True)


def test_fp32_layers_multiply_through_the_kernel_only_when_invariant(tiny_model_dir) -> None:
    invariant = load_model(tiny_model_dir, dtype="float32", progress=False).model
    assert isinstance(invariant.lm_head, DenseLinear)
    assert all(isinstance(m.mlp.down_proj, DenseLinear) for m in invariant.layers)
    for options in ({"dtype": "float32", "batch_invariant": False}, {"dtype": "bfloat16"}):
        model = load_model(tiny_model_dir, progress=False, **options).model
        assert type(model.lm_head) is nn.Linear, options
        assert all(type(m.mlp.down_proj) is nn.Linear for m in model.layers), options


@pytest.mark.parametrize(
    "options",
    [
        {"dtype": "float32"},
        {"dtype": "bfloat16"},
        {"dtype": "float32", "quantization": "int4"},
        {"dtype": "bfloat16", "quantization": "int4"},
    ],
)
@pytest.mark.parametrize("first_prompt", [None, 0, 20, 48])
def test_mlp_chunks_of_rows_give_the_rows_of_one_call(
    tiny_model_dir, monkeypatch, options, first_prompt
) -> None:
    """A prompt's rows pass through the MLP in chunks (`MLP_CHUNK_BYTES`); the chunks, a short
    last one among them, change no bit of any row, within a step whose rows from first_prompt on
    are prompt tokens (`quant_linear.prompt_rows`) too."""
    mlp = load_model(tiny_model_dir, progress=False, **options).model.layers[0].mlp
    x = torch.randn(50, mlp.gate_up_proj.in_features).to(getattr(torch, options["dtype"]))
    first = 50 if first_prompt is None else first_prompt
    with quant_linear.prompt_rows(first, 50):
        whole = mlp(x)
    chunks = []
    forward = transformer.MLP._forward
    monkeypatch.setattr(
        transformer.MLP,
        "_forward",
        lambda self, part: chunks.append(len(part)) or forward(self, part),
    )
    row_bytes = mlp.chunk_width * x.element_size()
    assert mlp.chunk_width == mlp.gate_up_proj.out_features
    monkeypatch.setattr(transformer, "MLP_CHUNK_BYTES", 16 * row_bytes)
    with quant_linear.prompt_rows(first, 50):
        assert torch.equal(mlp(x), whole)
    assert chunks == [16, 16, 16, 2]


def test_fp32_model_requests_give_the_same_tokens_alone_and_batched(tied_model_dir) -> None:
    """A tiny HF model in fp32, dense layers and a tied head: greedy requests arriving over several
    steps, in chunks under a small token budget, and seeded sampled ones among them, each give the
    tokens and logprobs it gives alone."""
    options = dict(dtype="float32", quantization="none", compile=False, num_kv_blocks=256)
    alone_engine = LLMEngine(str(tied_model_dir), **options)
    model = alone_engine.loaded.model
    assert model.lm_head is None and model.invariant_head  # the tied head through the kernel
    assert all(isinstance(m.attn.qkv_proj, DenseLinear) for m in model.layers)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    sampled = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=12, logprobs=0)
        for i in range(8)
    ]
    requests = [(p, greedy) for p in ENGINE_PROMPTS] + list(zip(ENGINE_PROMPTS, sampled))
    alone = [_generate(alone_engine, [request], per_step=1)[0] for request in requests]
    batched_engine = LLMEngine(str(tied_model_dir), max_num_batched_tokens=48, **options)
    batched = _generate(batched_engine, requests, per_step=6)
    differ = [i for i, (a, b) in enumerate(zip(batched, alone)) if a != b]
    assert not differ, f"requests {differ} differ from their runs alone"


@pytest.mark.skipif(not kernels.cpu_has_amx(), reason="prompt rows take AMX on AMX CPUs only")
def test_amx_prompt_rows_give_the_same_tokens_batched_preempted_and_cached(tiny_model_dir) -> None:
    """A bf16 model of packed tile layers on AMX computes prompt tokens on the matrix unit and
    output tokens by the int8 products (`quant_linear.prompt_rows`): requests still give the
    tokens and logprobs they give alone when batched in mixed steps, when preempted and
    recomputed, and when a prompt repeats an earlier request's prompt and output (its output's
    blocks are keyed apart in the prefix cache)."""
    options = dict(dtype="bfloat16", quantization="int4", compile=False)
    alone_engine = LLMEngine(str(tiny_model_dir), num_kv_blocks=256, **options)
    assert alone_engine.input_processor.outputs_keyed_apart
    assert all(m.attn.qkv_proj.prompts_on_amx for m in alone_engine.loaded.model.layers)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    sampled = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=40, logprobs=0)
        for i in range(6)
    ]
    requests = [(p, greedy) for p in ENGINE_PROMPTS[:12]] + list(zip(ENGINE_PROMPTS, sampled))
    alone = [_generate(alone_engine, [request], per_step=1)[0] for request in requests]
    batched_engine = LLMEngine(
        str(tiny_model_dir), num_kv_blocks=40, max_num_batched_tokens=48, **options
    )
    batched = _generate(batched_engine, requests, per_step=6)
    assert batched_engine.scheduler.num_preemptions > 0
    differ = [i for i, (a, b) in enumerate(zip(batched, alone)) if a != b]
    assert not differ, f"requests {differ} differ from their runs alone"
    # a next turn: the first request's prompt and output as a prompt, after the first request
    # (its output's blocks cached) and on an engine that never saw it
    prompt = alone_engine.tokenizer.encode(ENGINE_PROMPTS[0]) + alone[0][0]
    after = _generate(alone_engine, [(prompt, greedy)], per_step=1)
    fresh_engine = LLMEngine(str(tiny_model_dir), num_kv_blocks=256, **options)
    assert after == _generate(fresh_engine, [(prompt, greedy)], per_step=1)
