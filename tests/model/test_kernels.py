"""tokenmill's C++ CPU kernels: built on this machine, exact against a float reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch.utils import cpp_extension

from tests.model.test_gguf import as_llama_cpp_writes_q4_k, random_blocks
from tests.paged_cache import block_tables, filled_cache
from tests.threads import THREAD_COUNTS, torch_threads
from tokenmill.model import kernels
from tokenmill.model.attention import (
    AttentionBatch,
    _decode_attention,
    _matmul_decode_attention,
)
from tokenmill.model.config import RopeSettings
from tokenmill.model.quant import GGMLWeight
from tokenmill.model.quant_linear import (
    COARSE_X_BLOCK,
    MAX_STEP,
    Int4Rows,
    Int6Rows,
    QuantLinear,
    QuantTiles,
    dense_crossover,
    dense_packed_form,
    gguf_packed,
    int4_rows_layout,
    merge_packed,
    pack_fifth_bits,
    pack_int4_rows,
    pack_tiles,
    packed_form,
    q6_tiles,
    tiles_layout,
    unpack_int4_rows,
    unpack_int6_rows,
    unpack_tiles,
)
from tokenmill.model.transformer import RMSNorm, Rotary, apply_rotary
from tokenmill.sample.sampler import greedy_ids

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "c++")) is None,
    reason="no C++ compiler to build the kernels with",
)


def _int8_layer(
    rows: int, cols: int, seed: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randint(-127, 128, (rows, cols), dtype=torch.int8), (torch.rand(rows) / 100).to(
        dtype
    )


def int8_activations(x: torch.Tensor, per: int = 8, consecutive: bool = False) -> torch.Tensor:
    """x as the kernels multiply it: rounded to int8 with one scale (the largest magnitude / 127)
    per `per` values, 8 for the GEMVs (sub-block j of each block of 32 holding its elements 4j..4j+3
    and 16+4j..16+4j+3; consecutive: elements 8j..8j+7, as for the 6-bit tiles) or 32 for the
    tiles."""
    blocks = x.float().view(x.shape[0], -1, 2, 4, 4)  # (row, block, half, j, 4 elements)
    dims = (2, 4) if per == 8 else (2, 3, 4)
    if consecutive and per == 8:  # (row, block, 4 x 8 elements)
        blocks, dims = x.float().view(x.shape[0], -1, 4, 8), (3,)
    largest = blocks.abs().amax(dim=dims, keepdim=True)
    # a division, as the kernel's (`127 / tensor` would multiply by a rounded reciprocal)
    inverse = torch.where(
        largest > 0, torch.full_like(largest, 127).div(largest), torch.zeros_like(largest)
    )
    return (torch.round(blocks * inverse) * (largest / 127)).view_as(x.float())


def test_kernels_build_and_load(cpu_kernels: bool) -> None:
    marker = kernels.build_directory() / kernels.FAILED_MARKER
    assert cpu_kernels and kernels.loaded(), marker.read_text() if marker.exists() else "not loaded"


def test_eager_code_calls_the_bindings_and_compiled_code_the_dispatcher() -> None:
    """Python's eager code calls the kernels through their pybind11 bindings, which give what
    torch.ops.tokenmill gives; torch.compile traces through the dispatcher's ops (fullgraph: no
    break at a binding it cannot see into)."""
    bindings = kernels.ops()
    assert bindings is not torch.ops.tokenmill
    torch.manual_seed(7)
    x, weight = torch.randn(5, 64), torch.randn(64)
    gate_up, logits = torch.randn(5, 96), torch.randn(3, 1000)
    cos, sin = Rotary(RopeSettings(theta=10000.0), 32).tables(torch.arange(5), torch.float32)
    heads = x.view(5, 2, 32)
    for name, args in [
        ("rms_norm", (x, weight, 1e-6)),
        ("rotary", (heads, cos, sin)),
        ("gated_activation", (gate_up, "silu")),
        ("greedy_ids", (logits,)),
    ]:
        assert torch.equal(
            getattr(bindings, name)(*args), getattr(torch.ops.tokenmill, name)(*args)
        )

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return kernels.ops().rms_norm(x, weight, 1e-6)

    compiled = torch.compile(norm, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, weight), norm(x, weight))


def test_a_binding_lets_other_threads_run_python_while_it_computes() -> None:
    """A binding's call releases the GIL, as a call through the dispatcher does: the server's
    event loop and the background graph builds run while an eager step computes. The other thread
    wakes from its sleep before the long product returns; with the GIL held it could only wake
    after."""
    x, weight = torch.randn(512, 4096), torch.randn(8192, 4096)
    ready, times = threading.Event(), {}

    def multiply() -> None:
        ready.set()
        kernels.ops().dense_linear(x, weight, None)
        times["returned"] = time.perf_counter()

    worker = threading.Thread(target=multiply)
    worker.start()
    ready.wait()
    time.sleep(0.02)
    times["woke"] = time.perf_counter()
    worker.join()
    assert times["woke"] < times["returned"]


def _within_half_a_step(
    weight: torch.Tensor, exact: torch.Tensor, q: torch.Tensor, packed: Int4Rows
) -> bool:
    """Whether the row layout moved each weight by at most half its row's unit per unit of q (the
    scale's rounding to a step), plus float32's rounding: the lows are kept exactly."""
    return bool(((weight - exact).abs() <= q.float() * packed.units[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 9, 14])  # 14: blocks of 8 and 6 rows
@pytest.mark.parametrize("means", ["gemv", "dense copy", "chunks"])
# 3 and 9 blocks of 32: the kernels' unrolled steps and a block left
@pytest.mark.parametrize("cols", [96, 288])
def test_int8_linear_matches_a_float_reference(
    tokens: int, means: str, dtype: torch.dtype, cols: int
) -> None:
    # rows: not a multiple of the threads' share nor of a chunk
    weight, scale = _int8_layer(8197, cols, tokens, dtype)
    x = torch.randn(tokens, cols).to(dtype)
    multiplied = int8_activations(x) if means == "gemv" else x.float()  # the GEMV rounds x to int8
    reference = (multiplied @ weight.float().t()) * scale.float()
    dense = None
    if means == "dense copy":  # what the loader keeps: the dequantized weight, rounded to the dtype
        dense = (weight.float() * scale.float()[:, None]).to(dtype)
        reference = x.float() @ dense.float().t()
    out = torch.ops.tokenmill.int8_linear(
        x, weight, scale, dense, 16 if means == "gemv" else 0, 2048
    )
    assert out.dtype == dtype and out.shape == (tokens, 8197)
    tolerance = (
        dict(atol=2e-3, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )
    torch.testing.assert_close(out.float(), reference, **tolerance)


def test_int8_linear_rejects_what_it_cannot_multiply() -> None:
    weight, scale = _int8_layer(8, 96, 0)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        torch.ops.tokenmill.int8_linear(torch.randn(1, 96).half(), weight, scale, None, 4, 2048)
    with pytest.raises(RuntimeError, match="of x's dtype"):
        torch.ops.tokenmill.int8_linear(torch.randn(1, 96), weight, scale, None, 4, 2048)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tokenmill.int8_linear(
            torch.randn(1, 80).bfloat16(), weight[:, :80].contiguous(), scale, None, 4, 2048
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quant_linear_uses_the_kernel(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    kind, data = dense_packed_form(torch.randn(64, 128), "int8")
    layer = QuantLinear(64, 128, dtype, **{kind: data}, bias=torch.randn(64), tiles=False)
    x = torch.randn(3, 128).to(dtype)
    assert layer._native_fits(x)
    assert not layer._native_fits(x.half())  # other dtypes keep PyTorch's kernels
    packed = (
        torch.ops.aten._weight_int8pack_mm(x, layer.weight_int8, layer.scales) + layer.bias
    ).float()
    # the GEMV rounds x to int8
    assert ((layer(x).float() - packed).norm() / packed.norm()).item() < 2e-2


@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_int4_linear_switches_to_the_dense_copy_above_the_crossover(tokens: int) -> None:
    torch.manual_seed(5)
    kind, data = dense_packed_form(torch.randn(64, 128), "int4")
    layer = QuantLinear(64, 128, torch.float32, **{kind: data}, int4_rows=False, tiles=False)
    dense = torch.randn(64, 128)  # unrelated to the packed weight: shows which one was used
    x = torch.randn(tokens, 128)
    out = torch.ops.tokenmill.int4_linear(x, layer.packed, layer.scales_zeros, 32, dense, 3)
    assert layer.scales_zeros.dtype == torch.bfloat16  # an fp32 model runs the int4 kernel in bf16
    packed = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.bfloat16(), layer.packed, 32, layer.scales_zeros
    ).float()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, packed if tokens <= 3 else x @ dense.t())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 9, 14])  # 14: blocks of 8 and 6 rows
@pytest.mark.parametrize("dense", [False, True])
# 5, 9 and 23 groups of 32: blocks of 8 and 4 groups, a pair and a single group left
@pytest.mark.parametrize("cols", [160, 288, 736])
def test_int4_rows_linear_matches_a_float_reference(
    tokens: int, dtype: torch.dtype, dense: bool, cols: int
) -> None:
    torch.manual_seed(tokens)
    rows = 1037  # not a multiple of the threads' share
    q = torch.randint(0, 16, (rows, cols), dtype=torch.uint8)
    # float16 values, as Q4_0/Q4_1 files hold them (Q4_0's scales may be negative); a row of zeros
    scale = (torch.randn(rows, cols // 32) / 10).half().float()
    scale[1] = 0
    low = (torch.randn(rows, cols // 32) / 10).half().float()
    packed = pack_int4_rows(q, scale, low)
    assert packed.steps.abs().amax(dim=1)[2:].eq(MAX_STEP).all() and packed.units[1] > 0
    weight = unpack_int4_rows(packed)
    exact = (q.float().view(rows, -1, 32) * scale[..., None] + low[..., None]).view(rows, cols)
    assert _within_half_a_step(weight, exact, q, packed)
    x = torch.randn(tokens, cols).to(dtype)
    x[0, 32:64] = 0  # an all-zero block has no scale to divide by
    # unrelated: shows which one was used
    copy = torch.randn(rows, cols).to(dtype) if dense else None
    # the GEMV (on int8 activations) up to 4 rows, then the copy, or the GEMV still without one
    out = torch.ops.tokenmill.int4_rows_linear(x, *packed, None, copy, 4)
    assert out.dtype == dtype and out.shape == (tokens, rows)
    by_copy = dense and tokens > 4
    gemv = not by_copy
    reference = (int8_activations(x) if gemv else x.float()) @ (
        copy.float() if by_copy else weight
    ).t()
    tolerance = (
        dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )
    torch.testing.assert_close(out.float(), reference, **tolerance)
    if gemv:  # and the rounding costs about what it costs llama.cpp's Q8 activations
        exact = x.float() @ weight.t()
        assert ((out.float() - exact).norm() / exact.norm()).item() < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 13])
# blocks of 4 groups; pairs and single groups left
@pytest.mark.parametrize("cols", [96, 128, 160, 192, 224, 640])
def test_int4_rows_linear_takes_5bit_weights(tokens: int, dtype: torch.dtype, cols: int) -> None:
    torch.manual_seed(tokens + cols)
    rows = 67
    q = torch.randint(0, 32, (rows, cols))
    scale, low = torch.rand(rows, cols // 32) / 10, -torch.rand(rows, cols // 32) / 5
    packed = pack_int4_rows(q, scale, low)
    fifth = pack_fifth_bits(q)
    weight = unpack_int4_rows(packed, fifth)
    exact = (q.float().view(rows, -1, 32) * scale[..., None] + low.half().float()[..., None]).view(
        rows, cols
    )
    assert _within_half_a_step(weight, exact, q, packed)
    x = torch.randn(tokens, cols).to(dtype)
    out = torch.ops.tokenmill.int4_rows_linear(x, *packed, fifth, None, 64)
    reference = int8_activations(x) @ weight.t()
    tolerance = (
        dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )
    torch.testing.assert_close(out.float(), reference, **tolerance)
    without_fifth = torch.ops.tokenmill.int4_rows_linear(x, *packed, None, None, 64)
    assert not torch.allclose(without_fifth.float(), reference, atol=1e-2)  # the fifth bits count


def test_int4_rows_linear_rejects_what_it_cannot_multiply() -> None:
    packed = pack_int4_rows(
        torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2), torch.zeros(8, 2)
    )
    linear = torch.ops.tokenmill.int4_rows_linear
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        linear(torch.randn(1, 64).half(), *packed, None, None, 4)
    with pytest.raises(RuntimeError, match="K / 2"):
        linear(torch.randn(1, 96), *packed, None, None, 4)
    with pytest.raises(RuntimeError, match="steps_lows must be contiguous int16"):
        linear(
            torch.randn(1, 64), packed.nibbles, packed.steps_lows.int(), packed.units, None, None, 4
        )
    with pytest.raises(RuntimeError, match="units must be contiguous float32"):
        linear(
            torch.randn(1, 64), packed.nibbles, packed.steps_lows, packed.units[:4], None, None, 4
        )
    with pytest.raises(RuntimeError, match="fifth_bits"):
        linear(torch.randn(1, 64), *packed, packed.nibbles, None, 4)


def _q6_k_layer(rows: int, cols: int, seed: int) -> GGMLWeight:
    raw = random_blocks(Q.Q6_K, (rows, cols), np.random.default_rng(seed))
    return GGMLWeight(torch.from_numpy(raw), Q.Q6_K, (rows, cols))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 9, 14])  # 14: blocks of 8 and 6 rows
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("cols", [256, 768])
def test_int6_rows_linear_matches_a_float_reference(
    tokens: int, dtype: torch.dtype, dense: bool, cols: int
) -> None:
    assert kernels.load()
    rows = 1037  # not a multiple of the threads' share
    weight = _q6_k_layer(rows, cols, tokens + cols)
    weight.data.view(-1, 210)[: cols // 256, 208:210] = 0  # row 0's d: every scale 0, its unit 1
    kind, packed = gguf_packed([weight], tiles=False)
    assert kind == "int6" and isinstance(packed, Int6Rows)
    assert packed.units[0] == 1 and not packed.steps[0].any()
    assert packed.steps.abs().amax(dim=1)[1:].eq(MAX_STEP).all()
    unpacked, exact = unpack_int6_rows(packed), weight.dequantize().float()
    # each 16 values' scale within half a unit of its step: |q - 32| <= 32 units of q off
    assert ((unpacked - exact).abs() <= 16 * packed.units[:, None] + 1e-6 * exact.abs()).all()
    torch.manual_seed(tokens)
    x = torch.randn(tokens, cols).to(dtype)
    x[0, 32:64] = 0  # an all-zero block has no scale to divide by
    copy = torch.randn(rows, cols).to(dtype) if dense else None  # unrelated: shows which served
    out = torch.ops.tokenmill.int6_rows_linear(x, *packed, copy, 4)
    assert out.dtype == dtype and out.shape == (tokens, rows)
    by_copy = dense and tokens > 4
    reference = x.float() @ copy.float().t() if by_copy else int8_activations(x) @ unpacked.t()
    tolerance = (
        dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )
    scale = reference.abs().amax()
    torch.testing.assert_close(out.float() / scale, reference / scale, **tolerance)
    if not by_copy:  # every row as it comes alone, to the bit
        alone = [
            torch.ops.tokenmill.int6_rows_linear(x[i : i + 1], *packed, None, 4)
            for i in range(tokens)
        ]
        assert torch.equal(torch.cat(alone), out)


def test_q6_k_weights_stack_into_the_int6_row_layout() -> None:
    """A layer of Q6_K weights only takes the int6 row layout off the tiles (their rows stacked as
    laid out alone); with other types, or in tiles, it takes int8 rows as before."""
    assert kernels.load()
    parts = [_q6_k_layer(rows, 512, seed) for seed, rows in enumerate((48, 16))]
    kind, stacked = gguf_packed(parts, tiles=False)
    alone = [gguf_packed([part], tiles=False)[1] for part in parts]
    assert kind == "int6"
    for field, *pieces in zip(stacked, *alone, strict=True):
        assert torch.equal(field, torch.cat(pieces))
    layer = QuantLinear(64, 512, torch.float32, int6=stacked, tiles=False)
    torch.manual_seed(0)
    x = torch.randn(3, 512)
    assert layer._native_fits(x) and "(row layout)" in repr(layer)
    weight = unpack_int6_rows(stacked)
    reference = int8_activations(x) @ weight.t()
    scale = reference.abs().amax()  # the sums' float rounding, against the largest output
    torch.testing.assert_close(layer(x) / scale, reference / scale, atol=1e-5, rtol=0)
    # a dtype the kernel does not take: the unpacked weight, unrounded activations
    torch.testing.assert_close(layer(x.double()), x.double() @ weight.double().t())
    with pytest.raises(ValueError, match="Int6Rows take tiles=False"):
        QuantLinear(64, 512, torch.float32, int6=stacked, tiles=True)
    q4_k = GGMLWeight(
        torch.from_numpy(random_blocks(Q.Q4_K, (16, 512), np.random.default_rng(9))),
        Q.Q4_K,
        (16, 512),
    )
    assert gguf_packed([parts[0], q4_k], tiles=False)[0] == "int8"
    assert gguf_packed([parts[0], q4_k], tiles=True)[0] == "int8"
    # in tiles: 6-bit tiles, or int8 rows for a layer that multiplies on AMX
    kind, tiles = gguf_packed(parts, tiles=True)
    assert kind == "int6" and isinstance(tiles, QuantTiles) and tiles.bits == 6
    assert gguf_packed(parts, tiles=True, integer_kernel=False)[0] == "int8"


def test_q6_k_weights_keep_their_values_in_6bit_tiles() -> None:
    """The 6-bit tiles hold Q6_K's values exactly, in 6.625 bits a weight, and the rows of stacked
    weights as each laid out alone."""
    assert kernels.load()
    parts = [_q6_k_layer(rows, 768, seed) for seed, rows in enumerate((48, 16))]
    parts[0].data.view(-1, 210)[:3, 208:210] = 0  # row 0: d 0
    stacked = q6_tiles(parts)
    exact = torch.cat([part.dequantize().float() for part in parts])
    assert torch.equal(unpack_tiles(stacked), exact)
    assert (stacked.tiles.numel() + stacked.tile_scales.numel()) * 8 == 64 * 768 * 6.625
    alone = [q6_tiles([part]) for part in parts]
    for field in ("tiles", "tile_scales"):
        assert torch.equal(getattr(stacked, field), torch.cat([getattr(a, field) for a in alone]))


def test_int6_rows_linear_rejects_what_it_cannot_multiply() -> None:
    assert kernels.load()
    packed = gguf_packed([_q6_k_layer(8, 256, 0)], tiles=False)[1]
    linear = torch.ops.tokenmill.int6_rows_linear
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        linear(torch.randn(1, 256).half(), *packed, None, 4)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        linear(torch.randn(1, 128), packed.nibbles[:, :64].contiguous(), *packed[1:], None, 4)
    with pytest.raises(RuntimeError, match="highs must be"):
        linear(torch.randn(1, 256), packed.nibbles, packed.highs[:4], *packed[2:], None, 4)
    with pytest.raises(RuntimeError, match="steps must be contiguous int16"):
        linear(torch.randn(1, 256), *packed[:2], packed.steps.int(), packed.units, None, 4)
    with pytest.raises(RuntimeError, match="units must be contiguous float32"):
        linear(torch.randn(1, 256), *packed[:3], packed.units.double(), None, 4)


needs_avx512 = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512"
    or "avx512_vnni" not in kernels.cpu_flags().split(),
    reason="the tile kernel is built for AVX-512 with VNNI only",
)


def _random_tiles(rows: int, cols: int, bits: int, seed: int):
    torch.manual_seed(seed)
    q = torch.randint(0, 1 << bits, (rows, cols))
    if bits == 8:
        # an int8 row as the loader gives it: q + 128 with one scale per row and low = -128 scale
        scale = (torch.rand(rows, 1) / 100).expand(rows, cols // 32)
        low = -128 * scale
    else:  # float16 values, as the files hold them (Q4_0's scales may be negative); a row of zeros
        scale, low = (
            (torch.randn(rows, cols // 32) / 10).half().float(),
            (torch.randn(rows, cols // 32) / 10).half().float(),
        )
        scale[1] = 0
    return q, scale, low, pack_tiles(q, scale, low, bits)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 6, 7, 9, 15])  # every block of 1-8 rows
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("cols", [32, 160])
@pytest.mark.parametrize("x_block", [8, 32])
def test_quant_tiles_linear_matches_a_float_reference(
    tokens: int, dtype: torch.dtype, bits: int, cols: int, x_block: int
) -> None:
    rows = 16 * 37  # tiles not a multiple of the threads' share nor of a chunk
    _, _, _, packed = _random_tiles(rows, cols, bits, tokens + bits)
    weight = unpack_tiles(packed)
    x = torch.randn(tokens, cols).to(dtype)
    if cols > 32:
        x[0, :32] = 0  # an all-zero block has no scale to divide by
    out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, x_block)
    assert out.dtype == dtype and out.shape == (tokens, rows)
    # x rounded to int8, a scale per x_block values, whatever the row count
    reference = int8_activations(x, per=x_block) @ weight.t()
    tolerance = (
        dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )
    torch.testing.assert_close(out.float(), reference, **tolerance)
    if bits == 5:
        without_fifth = torch.ops.tokenmill.quant_tiles_linear(
            x, packed.tiles, packed.tile_scales, None, 4, None, 64
        )
        # the fifth bits count
        assert not torch.allclose(without_fifth.float(), reference, atol=1e-2)


@needs_avx512
@pytest.mark.parametrize("tokens", [3, 4])
def test_quant_tiles_linear_switches_to_the_dense_copy_beyond_its_rows(tokens: int) -> None:
    _, _, _, packed = _random_tiles(32, 64, 4, 0)
    copy = torch.randn(32, 64)  # unrelated to the packed weight: shows which one was used
    x = torch.randn(tokens, 64)
    out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, copy, 3)
    reference = x @ copy.t() if tokens > 3 else int8_activations(x) @ unpack_tiles(packed).t()
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_quant_tiles_linear_into_writes_the_products_into_the_given_tensor(
    bits: int, dtype: torch.dtype
) -> None:
    """The products quant_tiles_linear makes, to the bit, written into the caller's tensor, also
    where a dense copy multiplies; a tensor that cannot hold them is refused."""
    rows, cols = 16 * 37, 256
    if bits == 6:
        packed = q6_tiles([_q6_k_layer(rows, cols, bits)])
    else:
        _, _, _, packed = _random_tiles(rows, cols, bits, bits)
    into_op = kernels.ops().quant_tiles_linear_into
    x = torch.randn(5, cols).to(dtype)
    copy = torch.randn(rows, cols).to(dtype)  # unrelated to the packed weight
    for dense, max_rows in ((None, 1 << 30), (copy, 4)):
        expected = torch.ops.tokenmill.quant_tiles_linear(x, *packed, dense, max_rows, 32)
        into = torch.full((5, rows), float("nan"), dtype=dtype)
        out = into_op(x, *packed, dense, max_rows, 32, -1, -1, into)
        assert out.data_ptr() == into.data_ptr() and torch.equal(into, expected)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    fits = torch.empty(5, rows, dtype=dtype)
    for wrong in (fits[:4], fits.to(other), torch.empty(rows, 5, dtype=dtype).t()):
        with pytest.raises(RuntimeError, match="into must be a contiguous tensor of x's dtype"):
            into_op(x, *packed, None, 1 << 30, 32, -1, -1, wrong)


@needs_avx512
@pytest.mark.parametrize("exact_in_half", [True, False])
def test_quant_tiles_keep_group_scales_in_float16_only_where_exact(exact_in_half: bool) -> None:
    torch.manual_seed(2)
    q = torch.randint(0, 16, (32, 64))
    scale, low = torch.rand(32, 2) / 10, -torch.rand(32, 2) / 10
    if exact_in_half:  # Q4_0 / Q4_1 / Q5_0: float16 in the file
        scale, low = scale.half().float(), low.half().float()
    packed = pack_tiles(q, scale, low, 4)
    assert packed.tile_scales.dtype == (torch.float16 if exact_in_half else torch.float32)
    weight = (q.view(32, 2, 32) * scale[..., None] + low[..., None]).view(32, 64)
    torch.testing.assert_close(unpack_tiles(packed), weight)  # exact either way
    x = torch.randn(3, 64)
    out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, 8)
    torch.testing.assert_close(out, int8_activations(x) @ weight.t(), atol=1e-4, rtol=1e-4)


def _k_quant_scales(rows: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group scales and lows as llama.cpp writes the K-quants: 6-bit multiples of a float16 unit
    per row and block of 8 groups, the block's largest multiple 63; a row of zeros."""
    generator = torch.Generator().manual_seed(seed)
    units = torch.rand(2, rows, groups // 8, 1, generator=generator).half().float() / 100
    multiples = torch.randint(0, 64, (2, rows, groups // 8, 8), generator=generator).float()
    multiples[..., 3] = 63
    values = (units * multiples).view(2, rows, groups)
    values[:, 1] = 0
    return values[0], -values[1]


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 3, 9])
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("x_block", [8, 32])
def test_compact_tile_scales_give_the_products_of_float32_ones(
    tokens: int, dtype: torch.dtype, bits: int, x_block: int
) -> None:
    rows, cols = 16 * 37, 512
    torch.manual_seed(tokens)
    q = torch.randint(0, 1 << bits, (rows, cols))
    scale, low = _k_quant_scales(rows, cols // 32, tokens)
    compact = pack_tiles(q, scale, low, bits)
    full = pack_tiles(q, scale, low, bits, compact=False)
    assert compact.tile_scales.dtype == torch.uint8 and full.tile_scales.dtype == torch.float32
    assert compact.tile_scales.nbytes * 128 == full.tile_scales.nbytes * 48  # bytes per group
    assert torch.equal(unpack_tiles(compact), unpack_tiles(full))
    x = torch.randn(tokens, cols).to(dtype)
    products = [
        torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, x_block)
        for packed in (compact, full)
    ]
    assert torch.equal(*products)


@pytest.mark.parametrize("case", ["not multiples", "peak not 63", "groups not in blocks"])
def test_tile_scales_stay_float_where_the_compact_form_would_change_them(case: str) -> None:
    rows, groups = 32, 16
    scale, low = _k_quant_scales(rows, groups, 0)
    if case == "not multiples":
        scale[5, 3] += 1e-4
    elif case == "peak not 63":  # the unit is taken as the largest / 63
        unit = scale[7, 3] / 63
        scale[7, :8] = (scale[7, :8] / unit).round().clamp(max=62) * unit
    else:
        scale, low = scale[:, :12], low[:, :12]
    q = torch.randint(0, 16, (rows, scale.shape[1] * 32))
    packed = pack_tiles(q, scale, low, 4)
    assert packed.tile_scales.dtype == torch.float32
    weight = (q.view(rows, -1, 32) * scale[..., None] + low[..., None]).view(rows, -1)
    assert torch.equal(unpack_tiles(packed), weight)


@needs_avx512
@pytest.mark.parametrize("tokens", [4, 5])
def test_quant_tiles_linear_takes_fine_activation_scales_beyond_max_coarse_rows(
    tokens: int,
) -> None:
    _, _, _, packed = _random_tiles(32, 64, 8, 1)
    x = torch.randn(tokens, 64)
    out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, 32, 4)
    reference = int8_activations(x, per=32 if tokens <= 4 else 8) @ unpack_tiles(packed).t()
    torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)


# By the CPU's flags, not by what the build made of them: on a CPU with AMX a build or a process
# without the AMX path fails these tests instead of skipping them.
needs_amx = pytest.mark.skipif(
    not kernels.cpu_has_amx(), reason="the tile kernel's AMX path runs only on a CPU with AMX"
)


@needs_amx
# padded to blocks of 16 rows; 64 rows a pass, from 256 (300) in panels: 32 rows x 2 tiles a pass
@pytest.mark.parametrize("tokens", [1, 16, 17, 70, 300])
@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("half_scales", [True, False])
def test_quant_tiles_linear_on_amx_multiplies_the_bf16_weights(
    tokens: int, bits: int, half_scales: bool
) -> None:
    _, _, _, packed = _random_tiles(16 * 37, 160, bits, tokens + bits)
    if not half_scales:
        packed = packed._replace(tile_scales=packed.tile_scales.float())
    assert packed.tile_scales.dtype == (
        torch.float16 if half_scales and bits != 8 else torch.float32
    )
    x = torch.randn(tokens, 160, dtype=torch.bfloat16)
    reference = x.float() @ unpack_tiles(packed).bfloat16().float().t()  # no int8 activations

    def error(amx_min_rows: int) -> float:
        out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, 8, -1, amx_min_rows)
        assert out.dtype == torch.bfloat16 and out.shape == (tokens, 16 * 37)
        return ((out.float() - reference).norm() / reference.norm()).item()

    assert error(tokens) < 2.5e-3  # the output's bf16 rounding
    assert error(tokens + 1) > 3e-3  # below amx_min_rows, the int8 products


@needs_amx
@pytest.mark.parametrize("tokens", [256, 273])
def test_quant_tiles_linear_on_amx_in_panels_covers_every_tile_and_row(tokens: int) -> None:
    # 1600 wide: 50 groups a tile, panels of 4 of a thread's tiles; 11 tiles: odd ends of panels;
    # 273 rows: a last block of 16 rows alone
    _, _, _, packed = _random_tiles(16 * 11, 1600, 4, tokens)
    x = torch.randn(tokens, 1600, dtype=torch.bfloat16)
    reference = x.float() @ unpack_tiles(packed).bfloat16().float().t()
    out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, 8, -1, 0).float()
    row_errors = (out - reference).norm(dim=1) / reference.norm(dim=1)
    column_errors = (out - reference).norm(dim=0) / reference.norm(dim=0)
    assert row_errors.max() < 5e-3 and column_errors.max() < 5e-3


@needs_amx
@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("cols", [256, 512])  # 256: one block of scales a tile
def test_amx_takes_compact_tile_scales_as_their_float32_values(bits: int, cols: int) -> None:
    rows, tokens = 16 * 37, 20
    torch.manual_seed(bits)
    q = torch.randint(0, 1 << bits, (rows, cols))
    scale, low = _k_quant_scales(rows, cols // 32, bits)
    compact = pack_tiles(q, scale, low, bits)
    full = pack_tiles(q, scale, low, bits, compact=False)
    assert compact.tile_scales.dtype == torch.uint8
    x = torch.randn(tokens, cols, dtype=torch.bfloat16)
    products = [
        torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, 8, -1, 0)
        for packed in (compact, full)
    ]
    assert torch.equal(*products)
    reference = x.float() @ unpack_tiles(full).bfloat16().float().t()
    assert (products[0].float() - reference).norm() / reference.norm() < 2.5e-3


@needs_amx
@pytest.mark.parametrize("tokens", [1, 17, 300])  # 300: in panels
@pytest.mark.parametrize("cols", [256, 768])
def test_amx_multiplies_6bit_tiles_as_their_bf16_weights(tokens: int, cols: int) -> None:
    rows = 16 * 37
    packed = q6_tiles([_q6_k_layer(rows, cols, tokens + cols)])
    torch.manual_seed(tokens)
    x = torch.randn(tokens, cols, dtype=torch.bfloat16)
    out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, 8, -1, 0)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, rows)
    reference = x.float() @ unpack_tiles(packed).bfloat16().float().t()  # no int8 activations
    assert ((out.float() - reference).norm() / reference.norm()).item() < 2.5e-3
    int8 = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, 8, -1, -1)
    assert ((int8.float() - reference).norm() / reference.norm()).item() > 3e-3
    alone = torch.cat(
        [
            torch.ops.tokenmill.quant_tiles_linear(x[i : i + 1], *packed, None, 1 << 30, 8, -1, 0)
            for i in range(0, tokens, 16)
        ]
    )
    assert torch.equal(out[::16], alone)


@needs_amx
@pytest.mark.parametrize("bits", [4, 5, 8])
def test_amx_rows_are_the_same_whatever_the_batch(bits: int) -> None:
    """Prompt rows of batch-invariant layers (`quant_linear.prompt_rows`): each row to the bit as
    alone, in blocks of 16 or 64 rows, in panels (256 rows on), on any threads."""
    _, _, _, packed = _random_tiles(16 * 11, 1600, bits, bits)
    x = torch.randn(300, 1600, dtype=torch.bfloat16)

    def amx(rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.tokenmill.quant_tiles_linear(rows, *packed, None, 1 << 30, 8, -1, 0)

    alone = torch.cat([amx(x[i : i + 1]) for i in range(0, 300, 23)])
    for threads in THREAD_COUNTS:
        with torch_threads(threads):
            for count in (17, 70, 256, 300):
                assert torch.equal(amx(x[:count])[::23], alone[: -(-count // 23)]), (count, threads)


@needs_amx
def test_quant_tiles_linear_keeps_float32_rows_off_amx() -> None:
    _, _, _, packed = _random_tiles(32, 64, 4, 3)
    x = torch.randn(20, 64)
    out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, 8, -1, 0)
    torch.testing.assert_close(
        out, int8_activations(x) @ unpack_tiles(packed).t(), atol=1e-4, rtol=1e-4
    )


@needs_avx512
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 6, 7, 9, 15])  # every block of 1-8 rows
@pytest.mark.parametrize("cols", [256, 768])
@pytest.mark.parametrize("x_block", [8, 32])
def test_quant_tiles_linear_multiplies_6bit_tiles(
    tokens: int, dtype: torch.dtype, cols: int, x_block: int
) -> None:
    """Q6_K's values times the activations rounded per x_block, each row to the bit as alone."""
    rows = 16 * 37  # tiles not a multiple of the threads' share nor of a chunk
    packed = q6_tiles([_q6_k_layer(rows, cols, tokens + cols)])
    weight = unpack_tiles(packed)
    torch.manual_seed(tokens)
    x = torch.randn(tokens, cols).to(dtype)
    x[0, 32:64] = 0  # an all-zero block has no scale to divide by
    out = torch.ops.tokenmill.quant_tiles_linear(x, *packed, None, 1 << 30, x_block)
    assert out.dtype == dtype and out.shape == (tokens, rows)
    reference = int8_activations(x, per=x_block, consecutive=True) @ weight.t()
    tolerance = (
        dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    )
    scale = reference.abs().amax()
    torch.testing.assert_close(out.float() / scale, reference / scale, **tolerance)
    alone = [
        torch.ops.tokenmill.quant_tiles_linear(x[i : i + 1], *packed, None, 1 << 30, x_block)
        for i in range(tokens)
    ]
    assert torch.equal(torch.cat(alone), out)


@needs_avx512
def test_quant_linear_takes_6bit_tiles_for_q6_k_weights() -> None:
    parts = [_q6_k_layer(32, 512, 3)]
    kind, packed = gguf_packed(parts, tiles=True)
    layer = QuantLinear(32, 512, torch.bfloat16, **{kind: packed})
    assert layer.tiles and layer.kind == "int6" and not layer.row_layout and "tiles" in repr(layer)
    assert layer.amx_min_tokens == -1  # AMX reads no 6-bit tiles, in any mode
    switching = QuantLinear(32, 512, torch.bfloat16, **{kind: packed}, batch_invariant=False)
    assert switching.amx_min_tokens == -1
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    weight = parts[0].dequantize().float()
    reference = int8_activations(x, consecutive=True) @ weight.t()
    torch.testing.assert_close(layer(x).float(), reference, atol=2e-2, rtol=2e-2)
    # a dtype the kernel does not take: the unpacked weight, unrounded activations
    torch.testing.assert_close(layer(x.double()), x.double() @ weight.double().t())


@needs_avx512
def test_quant_tiles_linear_rejects_6bit_tiles_it_cannot_multiply() -> None:
    packed = q6_tiles([_q6_k_layer(16, 512, 0)])
    linear = torch.ops.tokenmill.quant_tiles_linear
    with pytest.raises(RuntimeError, match="x's width K"):
        linear(torch.randn(1, 256), *packed, None, 4)
    with pytest.raises(RuntimeError, match="uint8 tile_scales"):
        linear(torch.randn(1, 512), packed.tiles, packed.tile_scales.float(), None, 6, None, 4)
    with pytest.raises(RuntimeError, match="of the weight's size"):
        linear(torch.randn(1, 512), packed.tiles[:-1], packed.tile_scales, None, 6, None, 4)
    with pytest.raises(RuntimeError, match="without fifth_masks"):
        linear(torch.randn(1, 512), packed.tiles, packed.tile_scales, packed.tiles, 6, None, 4)


@needs_avx512
def test_quant_tiles_linear_rejects_what_it_cannot_multiply() -> None:
    _, _, _, packed = _random_tiles(16, 64, 4, 0)
    linear = torch.ops.tokenmill.quant_tiles_linear
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        linear(torch.randn(1, 64).half(), *packed, None, 4)
    with pytest.raises(RuntimeError, match="x's width"):
        linear(torch.randn(1, 96), *packed, None, 4)
    with pytest.raises(RuntimeError, match="bits must be 4, 6 or 8"):
        linear(torch.randn(1, 64), packed.tiles, packed.tile_scales, None, 5, None, 4)
    with pytest.raises(RuntimeError, match="of the weight's size"):
        linear(torch.randn(1, 64), packed.tiles, packed.tile_scales, None, 8, None, 4)
    with pytest.raises(RuntimeError, match="tile_scales must be"):
        linear(torch.randn(1, 64), packed.tiles, packed.tile_scales.double(), None, 4, None, 4)
    with pytest.raises(RuntimeError, match="tile_scales must be"):
        # float16 only with a pair per group
        linear(
            torch.randn(1, 64),
            packed.tiles,
            packed.tile_scales[:, :1].half().contiguous(),
            None,
            4,
            None,
            4,
        )
    with pytest.raises(RuntimeError, match="fifth_masks"):
        linear(torch.randn(1, 64), packed.tiles, packed.tile_scales, packed.tiles, 4, None, 4)


@needs_avx512
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_quant_linear_takes_tiles_on_avx512(kind: str) -> None:
    torch.manual_seed(8)
    kind, data = dense_packed_form(torch.randn(96, 128), kind)
    tiles, rows = (
        QuantLinear(96, 128, torch.float32, **{kind: data}, tiles=flag) for flag in (None, False)
    )
    assert tiles_layout() and torch.ops.tokenmill.tiles_built()
    assert tiles.tiles and not rows.tiles and "tiles" in repr(tiles)
    x = torch.randn(11, 128)
    assert tiles._native_fits(x)
    if kind == "int8":
        weight = data[0].float() * data[1][:, None]
    else:  # the exact weight, where the row layout rounds the lows to float16
        q, scale, low = data
        weight = (q.float().view(96, -1, 32) * scale[..., None] + low[..., None]).view(96, 128)
    torch.testing.assert_close(tiles(x), int8_activations(x) @ weight.t(), atol=1e-4, rtol=1e-4)
    assert ((rows(x) - tiles(x)).norm() / tiles(x).norm()).item() < 1e-3
    coarse = QuantLinear(96, 128, torch.float32, **{kind: data}, x_block=COARSE_X_BLOCK)
    torch.testing.assert_close(
        coarse(x), int8_activations(x, per=32) @ weight.t(), atol=1e-4, rtol=1e-4
    )
    kind, data = dense_packed_form(torch.randn(100, 128), kind)
    # rows not in whole tiles of 16
    assert not QuantLinear(100, 128, torch.float32, **{kind: data}).tiles


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quant_linear_int4_layouts_agree(dtype: torch.dtype) -> None:
    torch.manual_seed(6)
    kind, data = dense_packed_form(torch.randn(96, 128), "int4")
    rows, tiles = (
        QuantLinear(96, 128, dtype, **{kind: data}, int4_rows=flag, tiles=False)
        for flag in (True, False)
    )
    x = torch.randn(3, 128).to(dtype)
    assert rows._native_fits(x) == (dtype != torch.float16)
    assert dtype != torch.float16 or rows._kernel(3) == "packed"
    out, reference = rows(x).float(), tiles(x).float()
    assert ((out - reference).norm() / reference.norm()).item() < 1e-2  # tiles run in bf16 for fp32


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# 37: a partial vector at each row's end
@pytest.mark.parametrize("tokens, width", [(1, 16), (7, 37), (300, 2048)])
def test_gated_activation_matches_eager(
    kind: str, dtype: torch.dtype, tokens: int, width: int
) -> None:
    torch.manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * width) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (
        torch.nn.functional.silu(gate)
        if kind == "silu"
        else torch.nn.functional.gelu(gate, approximate="tanh")
    )
    out = torch.ops.tokenmill.gated_activation(gate_up, kind)
    assert out.dtype == dtype and out.shape == (tokens, width)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(out.float(), act * up, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 17, 49152 + 5])  # within, across and beyond whole vectors
def test_greedy_ids_match_torch_max(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(width)
    logits = torch.randn(6, width)
    logits[1] = logits[1].round()  # ties: the first highest wins
    logits[2, -1] = 100.0  # the highest in the tail past the last whole vector
    logits[3, width // 2] = float("inf")
    logits[4, width // 3] = float("-inf")
    logits[5, width - 1] = float("nan")  # NaN counts as the highest, as torch.max has it
    logits = logits.to(dtype)
    assert torch.equal(torch.ops.tokenmill.greedy_ids(logits), logits.max(dim=-1).indices)
    assert torch.equal(greedy_ids(logits), logits.max(dim=-1).indices)


def test_greedy_ids_refuse_what_they_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="2-D float32 or bfloat16"):
        torch.ops.tokenmill.greedy_ids(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="at least one column"):
        torch.ops.tokenmill.greedy_ids(torch.zeros(2, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 17, 49152 + 5])
def test_sample_ids_take_the_first_token_past_each_rows_draw(
    dtype: torch.dtype, width: int
) -> None:
    torch.manual_seed(width)
    logits = (torch.randn(8, width) * 3).to(dtype)
    logits[:, ::3] = float("-inf")  # filtered out: never picked
    logits[:, 1 % width] = 2.0
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.0, 1.3, 0.9, 1.0])
    uniforms = torch.tensor([0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.999, 1.0 - 2.0**-24])
    ids = torch.ops.tokenmill.sample_ids(logits, 1 / temperature, uniforms)
    weights = (logits.double() / temperature.double()[:, None]).softmax(dim=-1)
    cdf = weights.cumsum(dim=-1)
    for row in range(8):
        token = int(ids[row])
        assert weights[row, token] > 0, (row, token)
        threshold = float(uniforms[row])
        before = float(cdf[row, token - 1]) if token else 0.0
        # the kernel's fp32 sums may cross the threshold a token early or late only within their
        # rounding
        assert before <= threshold + 1e-5 and float(cdf[row, token]) > threshold - 1e-5, (
            row,
            token,
        )


def test_sample_ids_refuse_what_they_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="2-D float32 or bfloat16"):
        torch.ops.tokenmill.sample_ids(
            torch.zeros(2, 4, dtype=torch.float16), torch.ones(2), torch.zeros(2)
        )
    with pytest.raises(RuntimeError, match="one float32 per row"):
        torch.ops.tokenmill.sample_ids(torch.zeros(2, 4), torch.ones(3), torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 576), (1, 16), (7, 4, 256)])
# a bf16 model's norms are bf16
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_eager_norm(
    dtype: torch.dtype, shape: tuple[int, ...], weight_dtype: torch.dtype
) -> None:
    torch.manual_seed(len(shape))
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data.normal_()
    norm.to(weight_dtype)
    x = torch.randn(*shape).to(dtype)
    if len(shape) == 3:  # heads of a fused projection's output: a strided view
        x = (
            torch.randn(shape[0], shape[1] * shape[2] + 32)
            .to(dtype)[:, : shape[1] * shape[2]]
            .view(shape)
        )
    x32 = x.float()
    reference = (
        x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()
    ).to(dtype)
    out = torch.ops.tokenmill.rms_norm(x, norm.weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, reference, **tolerance)
    torch.testing.assert_close(norm(x), out, atol=0, rtol=0)  # eager steps take it


def test_rms_norm_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="multiple of"):
        torch.ops.tokenmill.rms_norm(torch.zeros(2, 20), torch.ones(20), 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        torch.ops.tokenmill.rms_norm(torch.zeros(2, 32), torch.ones(32, dtype=torch.float16), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        torch.ops.tokenmill.rms_norm(torch.zeros(32, 2).t(), torch.ones(32), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, head_dim", [(9, 64), (1, 256), (3, 32)])
def test_rotary_matches_the_rotate_half_embedding(
    dtype: torch.dtype, heads: int, head_dim: int
) -> None:
    torch.manual_seed(heads)
    tokens = 21
    # heads of a fused projection's output: a strided view
    x = (
        torch.randn(tokens, heads * head_dim + 64)
        .to(dtype)[:, : heads * head_dim]
        .view(tokens, heads, head_dim)
    )
    cos, sin = Rotary(RopeSettings(theta=10000.0), head_dim).tables(
        torch.arange(100, 100 + tokens), dtype
    )
    half = head_dim // 2
    x1, x2, c, s = x[..., :half].double(), x[..., half:].double(), cos.double(), sin.double()
    reference = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    out = torch.ops.tokenmill.rotary(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.double(), reference, **tolerance)
    # eager steps take it
    torch.testing.assert_close(apply_rotary(x, cos, sin), out, atol=0, rtol=0)


def test_rotary_refuses_what_it_cannot_compute() -> None:
    cos = sin = torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="contiguous heads"):
        torch.ops.tokenmill.rotary(torch.zeros(2, 32, 2).transpose(1, 2), cos, sin)
    with pytest.raises(RuntimeError, match="multiple of"):
        torch.ops.tokenmill.rotary(
            torch.zeros(2, 1, 24), torch.zeros(2, 1, 12), torch.zeros(2, 1, 12)
        )
    with pytest.raises(RuntimeError, match="tables of x's dtype"):
        torch.ops.tokenmill.rotary(torch.zeros(2, 1, 32), cos.bfloat16(), sin.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_write_kv_equals_the_ops_it_replaces(
    dtype: torch.dtype, cache_dtype: torch.dtype, tokens: int
) -> None:
    torch.manual_seed(tokens)
    heads, kv_heads, head_dim = 6, 2, 64
    width = (heads + 2 * kv_heads) * head_dim
    # a fused projection's output with a bias column block after it: rows strided, columns not
    qkv = (torch.randn(tokens, width + 32) * 4).to(dtype)[:, :width]
    cos, sin = Rotary(RopeSettings(theta=10000.0), head_dim).tables(
        torch.randint(0, 5000, (tokens,)), dtype
    )
    slots = torch.randperm(300)[:tokens]
    caches = [torch.randn(300, kv_heads, head_dim).to(cache_dtype) for _ in range(2)]
    k_cache, v_cache = (c.clone() for c in caches)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q = apply_rotary(q.reshape(tokens, heads, head_dim), cos, sin)
    expected_k = apply_rotary(k.reshape(tokens, kv_heads, head_dim), cos, sin)
    caches[0].index_copy_(0, slots, expected_k.to(cache_dtype))
    caches[1].index_copy_(0, slots, v.reshape(tokens, kv_heads, head_dim).to(cache_dtype))

    out = torch.ops.tokenmill.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads)
    assert out.dtype == dtype and out.shape == (tokens, heads, head_dim) and out.is_contiguous()
    assert torch.equal(out, expected_q)
    assert torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])


def test_rotary_write_kv_refuses_what_it_cannot_compute() -> None:
    qkv, cos, sin = torch.zeros(2, 4 * 32), torch.zeros(2, 1, 16), torch.zeros(2, 1, 16)
    cache = torch.zeros(8, 1, 32)
    slots = torch.tensor([0, 1])

    def write(**changed: object) -> None:
        args = dict(qkv=qkv, cos=cos, sin=sin, k_cache=cache, v_cache=cache.clone(), slots=slots)
        args.update(changed)
        torch.ops.tokenmill.rotary_write_kv(*args.values(), 2)

    write()
    with pytest.raises(RuntimeError, match="outside the cache"):
        write(slots=torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="width must be"):
        write(qkv=torch.zeros(2, 5 * 32))
    with pytest.raises(RuntimeError, match="int64"):
        write(slots=slots.int())
    with pytest.raises(RuntimeError, match="one dtype"):
        write(v_cache=cache.half())
    with pytest.raises(RuntimeError, match="tables of x's dtype"):
        write(cos=cos.bfloat16(), sin=sin.bfloat16())


def test_gated_activation_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="unknown activation"):
        torch.ops.tokenmill.gated_activation(torch.zeros(2, 8), "relu")
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tokenmill.gated_activation(torch.zeros(8, 4).t(), "silu")


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16),
    ],
)
# query heads per KV head: 3, 4, 3, 7, 2, 1, 6 and 9 (attended up to 8 at a time with AVX-512, 9
# as 5 then 4; up to 4 with AVX2)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (9, 3, 64),
        (4, 1, 256),
        (6, 2, 16),
        (14, 2, 64),
        (4, 2, 48),
        (2, 2, 32),
        (12, 2, 128),
        (18, 2, 32),
    ],
)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 20.0)])
def test_decode_attention_matches_batched_matmuls(
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int | None,
    softcap: float | None,
) -> None:
    """Contexts shorter than, equal to and across the kernel's 64-position chunks, padded to the
    longest, blocks out of order; a window leaves whole chunks without an admitted key. A float32
    model's cache may be half precision: its rows are widened exactly, so float32's tolerance
    holds."""
    torch.manual_seed(head_dim)
    block_size, context_lens = 16, [3, 64, 200, 131]
    cache = filled_cache(block_size, 40, cache_dtype, kv_heads, head_dim)
    tables = block_tables(context_lens, block_size, 40)
    batch = AttentionBatch.build([1] * 4, context_lens, tables, block_size, cache.pad_slot)
    q = torch.randn(4, heads, head_dim).to(dtype)
    args = (
        q,
        cache.k[0],
        cache.v[0],
        batch.context_slots,
        batch.mask(window),
        head_dim**-0.5,
        softcap,
    )
    out = torch.ops.tokenmill.decode_attention(*args)
    assert out.dtype == dtype and out.shape == q.shape
    reference = _matmul_decode_attention(
        q.float(), cache.k[0].float(), cache.v[0].float(), *args[3:]
    )
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), reference, **tolerance)
    # the model's decode steps take it
    torch.testing.assert_close(_decode_attention(*args), out, atol=0, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_takes_any_admitted_keys_of_a_chunk(cache_dtype: torch.dtype) -> None:
    """Masks with holes anywhere: whole 64-position chunks admitted entirely, in part (scattered
    keys) or not at all, and a last chunk cut short. Each row's result is the matmuls' over its
    admitted keys, and the same alone as beside the others and on any number of threads; a table
    without columns gives zeros."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim, context = 6, 2, 32, 200
    slots = torch.randperm(800)[: 3 * context].view(3, context)
    k_cache = torch.randn(800, kv_heads, head_dim).to(cache_dtype)
    v_cache = torch.randn(800, kv_heads, head_dim).to(cache_dtype)
    mask = torch.rand(3, context) < 0.5
    mask[0, :128] = True  # two whole chunks
    mask[1, 64:128] = False  # a chunk with no admitted key between others
    mask[2, :192] = False  # only the short last chunk
    mask[2, 195] = True
    q = torch.randn(3, heads, head_dim)
    out = torch.ops.tokenmill.decode_attention(q, k_cache, v_cache, slots, mask, 0.3, None)
    reference = _matmul_decode_attention(
        q, k_cache.float(), v_cache.float(), slots, mask[:, None, None], 0.3, None
    )
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    for row in range(3):  # each row as it is alone
        alone = torch.ops.tokenmill.decode_attention(
            q[row : row + 1], k_cache, v_cache, slots[row : row + 1], mask[row : row + 1], 0.3, None
        )
        assert torch.equal(alone, out[row : row + 1])
    # Threads take ranges of (row, KV head, chunk) tasks: a range that holds a row's KV head whole
    # merges its chunks itself, one that cuts it leaves them to be merged after all ranges; either
    # way the same result
    for threads in (*THREAD_COUNTS, 4):
        with torch_threads(threads):
            again = torch.ops.tokenmill.decode_attention(
                q, k_cache, v_cache, slots, mask, 0.3, None
            )
        assert torch.equal(again, out)
    no_keys = torch.ops.tokenmill.decode_attention(
        q, k_cache, v_cache, slots[:, :0], mask[:, :0], 0.3, None
    )
    assert torch.equal(no_keys, torch.zeros_like(q))


@pytest.mark.parametrize("heads", [6, 7, 9, 12])
def test_decode_attention_gives_each_head_what_it_gives_alone(heads: int) -> None:
    """The query heads of a KV head attend in passes that share each key and value row; a head's
    result is the same bits whichever heads share its pass."""
    torch.manual_seed(heads)
    block_size, context_lens, head_dim = 16, [3, 64, 200, 131], 64
    cache = filled_cache(block_size, 40, torch.float16, 1, head_dim)
    tables = block_tables(context_lens, block_size, 40)
    batch = AttentionBatch.build([1] * 4, context_lens, tables, block_size, cache.pad_slot)
    q = torch.randn(4, heads, head_dim)
    rest = (cache.k[0], cache.v[0], batch.context_slots, batch.mask(None), head_dim**-0.5, None)
    together = torch.ops.tokenmill.decode_attention(q, *rest)
    for h in range(heads):
        alone = torch.ops.tokenmill.decode_attention(q[:, h : h + 1].contiguous(), *rest)
        assert torch.equal(together[:, h : h + 1], alone), f"head {h}"


def test_decode_attention_refuses_what_it_cannot_compute() -> None:
    cache = torch.zeros(10, 1, 16)
    slots, mask = torch.zeros(1, 3, dtype=torch.int64), torch.ones(1, 1, 1, 3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="head_dim 12 must be a multiple"):
        torch.ops.tokenmill.decode_attention(
            torch.zeros(1, 2, 12),
            torch.zeros(10, 1, 12),
            torch.zeros(10, 1, 12),
            slots,
            mask,
            1.0,
            None,
        )
    with pytest.raises(RuntimeError, match="q must be float32 or bfloat16"):
        torch.ops.tokenmill.decode_attention(
            torch.zeros(1, 2, 16, dtype=torch.float16), cache, cache, slots, mask, 1.0, None
        )
    with pytest.raises(RuntimeError, match="caches must be float32, float16 or bfloat16, both"):
        torch.ops.tokenmill.decode_attention(
            torch.zeros(1, 2, 16), cache.half(), cache, slots, mask, 1.0, None
        )
    with pytest.raises(RuntimeError, match="caches must be float32, float16 or bfloat16"):
        torch.ops.tokenmill.decode_attention(
            torch.zeros(1, 2, 16), cache.double(), cache.double(), slots, mask, 1.0, None
        )
    with pytest.raises(RuntimeError, match="one entry per slot"):
        torch.ops.tokenmill.decode_attention(
            torch.zeros(1, 2, 16), cache, cache, slots, mask[..., :2], 1.0, None
        )


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_fp32_batches_take_the_gemv_below_the_dense_copy(kind: str) -> None:
    torch.manual_seed(7)
    kind, data = dense_packed_form(torch.randn(96, 128), kind)
    copy = torch.randn(96, 128)  # unrelated to the packed weight: shows which one was used
    # where tokenmill's row kernels serve (AVX2) no layer keeps a dense copy by default (the GEMVs
    # keep up at any size); elsewhere copies serve from 65 tokens
    default = 0 if int4_rows_layout() else 65
    assert (
        dense_crossover("int8", torch.float32) == dense_crossover("int4", torch.float32) == default
    )
    crossover = 65  # a copy asked for (`dense_min_tokens`) serves from there
    layer = QuantLinear(
        96,
        128,
        torch.float32,
        **{kind: data},
        dense=copy,
        dense_min_tokens=crossover,
        int4_rows=True,
        tiles=False,
        batch_invariant=False,
    )
    packed = (
        unpack_int4_rows(layer._int4_rows())
        if kind == "int4"
        else data[0].float() * data[1][:, None]
    )
    assert layer._gemv_max_tokens(torch.float32) == 64
    for tokens in (1, 9, 64, 65):
        x = torch.randn(tokens, 128)
        # the GEMV's rounding
        reference = x @ copy.t() if tokens >= crossover else int8_activations(x) @ packed.t()
        torch.testing.assert_close(layer(x), reference, atol=1e-4, rtol=1e-4)
    without_copy = QuantLinear(96, 128, torch.float32, **{kind: data}, int4_rows=True, tiles=False)
    x = torch.randn(100, 128)  # without a copy, the GEMV at any size
    torch.testing.assert_close(
        without_copy(x), int8_activations(x) @ packed.t(), atol=1e-4, rtol=1e-4
    )


def test_a_build_clears_the_lock_file_of_a_build_killed_midway(monkeypatch, tmp_path) -> None:
    """torch's lock file, left by a process killed while it built (a server stopped during its
    first start), would make every later build wait forever: under tokenmill's OS lock it goes."""
    (tmp_path / kernels.TORCH_BUILD_LOCK).touch()
    seen = []
    monkeypatch.setattr(
        cpp_extension,
        "load",
        lambda **kw: seen.append((Path(kw["build_directory"]) / kernels.TORCH_BUILD_LOCK).exists()),
    )
    kernels._compile(tmp_path)
    assert seen == [False]


def test_the_build_lock_goes_with_a_killed_holder_and_excludes_a_live_one(tmp_path) -> None:
    holder = (
        "import sys, time; from pathlib import Path; from tokenmill.model import kernels\n"
        "with kernels.build_lock(Path(sys.argv[1])):\n"
        "    print('held', flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", holder, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        acquired = threading.Event()

        def take() -> None:
            with kernels.build_lock(tmp_path):
                acquired.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        assert not acquired.wait(1.0)  # the live holder excludes it
        proc.kill()  # no cleanup runs: the OS releases the lock
        assert acquired.wait(30)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("cores", [1, 2, 3, 16])
@pytest.mark.parametrize("flags", ["flags : fma avx2", "flags : fma avx2 avx512f avx512bw"])
def test_translation_units_hold_every_source_once_and_share_the_build_evenly(
    cores: int, flags: str, monkeypatch, tmp_path
) -> None:
    # one unit per core, compiled at once: the build takes as long as its slowest unit
    assert {source.name for source in kernels.SOURCES} == {
        path.name for path in kernels.SOURCES[0].parent.glob("*.cpp")
    }
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    own = kernels.source_compile_seconds()
    assert own is (
        kernels.SOURCE_COMPILE_SECONDS
        if "avx512bw" in flags
        else kernels.SOURCE_COMPILE_SECONDS_AVX2
    )
    units = kernels._translation_units(tmp_path)
    assert len(units) == min(cores, len(kernels.SOURCES))
    shares = [
        [line.split('"')[1].rsplit("/", 1)[-1] for line in unit.read_text().splitlines()]
        for unit in units
    ]
    assert sorted(name for share in shares for name in share) == sorted(own)
    seconds = [sum(own[name] for name in share) for share in shares]
    assert max(seconds) <= 1.1 * max(sum(seconds) / len(units), max(own.values()))


def test_every_source_compiles_in_one_translation_unit(monkeypatch, tmp_path) -> None:
    # a unit includes several sources, and with one core all of them: the names each source keeps
    # to itself (anonymous namespaces) must not collide with another's, in any grouping
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    (unit,) = kernels._translation_units(tmp_path)
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    result = subprocess.run(
        [os.environ.get("CXX", "c++"), "-std=c++20", "-fsyntax-only", *kernels.CFLAGS]
        + ["-DTORCH_EXTENSION_NAME=tokenmill_kernels", *(f"-isystem{path}" for path in includes)]
        + [str(unit)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize(
    ("qtype", "compact"), [(Q.Q4_K, False), (Q.Q4_K, True), (Q.Q6_K, False), (Q.Q8_0, False)]
)
def test_layout_kernels_lay_gguf_weights_out_as_the_python_path_does(
    qtype: Q, compact: bool, monkeypatch
) -> None:
    # layout.cpp stands in for PyTorch's passes while a model loads: a model must load to the same
    # bits whether or not the kernels build
    assert kernels.load()
    shape = (48, 512)
    rng = np.random.default_rng(int(qtype))
    raw = torch.from_numpy(random_blocks(qtype, shape, rng))
    if qtype == Q.Q6_K:  # a row of zeros: its scale is the floor, 1e-12
        raw.view(-1, 210)[:2, 208:210] = 0
    if qtype == Q.Q8_0:  # the same: every block's d zero
        raw.view(-1, 34)[:16, :2] = 0
    if compact:
        as_llama_cpp_writes_q4_k(raw, rng)
    weight = GGMLWeight(raw, qtype, shape)

    def laid_out() -> tuple[str, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        kind, data = packed_form(weight)
        layer = QuantLinear(*shape, torch.float32, **{kind: data}, tiles=True)
        return kind, data, {name: b for name, b in layer.named_buffers() if b is not None}

    fast = laid_out()
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    slow = laid_out()
    assert fast[0] == slow[0] == ("int4" if qtype == Q.Q4_K else "int8")
    for a, b in zip(fast[1], slow[1], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert fast[2].keys() == slow[2].keys() and "tile_q" in fast[2]
    for name, buffer in fast[2].items():
        assert buffer.dtype == slow[2][name].dtype and torch.equal(buffer, slow[2][name]), name
    if qtype in (Q.Q6_K, Q.Q8_0):
        assert fast[1][1][0] == torch.tensor(1e-12) and not fast[1][0][0].any()
    else:  # compact scales are bytes, the others float16 or float32
        assert (fast[2]["tile_scales"].dtype == torch.uint8) == compact


def rows_laid_out_as_the_groups_path_does(
    weights: list[GGMLWeight],
) -> tuple[Int4Rows, tuple[torch.Tensor, ...]]:
    """`gguf_packed`'s one-pass row layout of weights (layout.cpp), checked against the groups'
    path (each weight's exact groups, merged, then packed); the layout and the groups."""
    kind, rows = gguf_packed(weights, tiles=False)
    assert kind == "int4" and isinstance(rows, Int4Rows)
    groups = merge_packed([packed_form(w) for w in weights])[1]
    for a, b in zip(rows, pack_int4_rows(*groups), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return rows, groups


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_q4_0_and_q4_1_weights_stack_into_the_row_layout_in_one_pass(qtype: Q) -> None:
    # as Q4_K's: the blocks' bytes go straight to the row layout (`q4_int4_rows`), to the bits of
    # the groups' path (exact_groups, merged, then packed)
    assert kernels.load()
    rng = np.random.default_rng(int(qtype) + 7)
    block_bytes = 18 if qtype == Q.Q4_0 else 20
    weights = [
        GGMLWeight(torch.from_numpy(random_blocks(qtype, (rows, 96), rng)), qtype, (rows, 96))
        for rows in (40, 8, 8)
    ]
    weights[1].data[3, 0 : 3 * block_bytes : block_bytes] = 0  # a row whose scales are all zero:
    weights[1].data[3, 1 : 3 * block_bytes : block_bytes] = 0  # its unit 1
    rows, _ = rows_laid_out_as_the_groups_path_does(weights)
    assert rows.units[40 + 3] == 1 and not rows.steps[40 + 3].any()
    x = torch.randn(5, 96)
    laid_out = QuantLinear(56, 96, torch.float32, int4=rows, tiles=False, int4_rows=True)
    reference = x @ torch.cat([w.dequantize() for w in weights]).T
    assert (laid_out(x) - reference).abs().max() <= 0.02 * reference.abs().max()
    # Q4_0 beside Q4_1 takes the groups' path
    other = Q.Q4_0 if qtype == Q.Q4_1 else Q.Q4_1
    mixed = [
        weights[0],
        GGMLWeight(torch.from_numpy(random_blocks(other, (8, 96), rng)), other, (8, 96)),
    ]
    assert not isinstance(gguf_packed(mixed, tiles=False)[1], Int4Rows)


def test_q4_k_weights_stack_into_the_row_layout_in_one_pass() -> None:
    # a q/k/v or gate/up projection of Q4_K weights goes from the file's blocks to the row layout
    # in one pass (`gguf_packed`), to the bits of the groups' path: merged, then packed
    assert kernels.load()
    rng = np.random.default_rng(4)
    weights = [
        GGMLWeight(torch.from_numpy(random_blocks(Q.Q4_K, (rows, 512), rng)), Q.Q4_K, (rows, 512))
        for rows in (48, 16, 16)
    ]
    weights[1].data[3, :2] = 0  # a row whose d is zero: every scale 0, its unit 1
    weights[1].data[3, 144 : 144 + 2] = 0
    rows, groups = rows_laid_out_as_the_groups_path_does(weights)
    assert rows.units[48 + 3] == 1 and not rows.steps[48 + 3].any()
    x = torch.randn(3, 512)
    laid_out = QuantLinear(80, 512, torch.float32, int4=rows, tiles=False, int4_rows=True)
    grouped = QuantLinear(80, 512, torch.float32, int4=groups, tiles=False, int4_rows=True)
    assert torch.equal(laid_out(x), grouped(x))
    with pytest.raises(ValueError, match="row layout"):
        QuantLinear(80, 512, torch.float32, int4=rows, tiles=False, int4_rows=False)
    # a layer with a weight of another type takes the groups' path
    q6_k = GGMLWeight(torch.from_numpy(random_blocks(Q.Q6_K, (16, 512), rng)), Q.Q6_K, (16, 512))
    assert gguf_packed([weights[0], q6_k], tiles=False)[0] == "int8"


@pytest.mark.parametrize("compact", [False, True])
def test_q4_k_weights_stack_into_tiles_in_one_pass(compact: bool, monkeypatch) -> None:
    # a q/k/v or gate/up projection of Q4_K weights in tiles goes from the file's blocks to the
    # tile bytes in one pass (`gguf_packed`: `q4_k_tiles`), to the bits of the groups' path (exact
    # groups, merged, then `pack_tiles`), with compact scales where they fit, float ones for a
    # layer that multiplies on AMX
    assert kernels.load()
    rng = np.random.default_rng(5)
    weights = [
        GGMLWeight(torch.from_numpy(random_blocks(Q.Q4_K, (rows, 768), rng)), Q.Q4_K, (rows, 768))
        for rows in (48, 16, 32)
    ]
    if compact:
        for w in weights:
            as_llama_cpp_writes_q4_k(w.data, rng)
    groups = merge_packed([packed_form(w) for w in weights])[1]
    for integer_kernel in (True, False):
        kind, tiled = gguf_packed(weights, tiles=True, integer_kernel=integer_kernel)
        assert kind == "int4" and isinstance(tiled, QuantTiles) and tiled.bits == 4
        assert tiled.fifth_masks is None
        packed = pack_tiles(*groups, 4, compact=integer_kernel)
        for a, b in [(tiled.tiles, packed.tiles), (tiled.tile_scales, packed.tile_scales)]:
            assert a.dtype == b.dtype and torch.equal(a, b)
    one_pass = QuantLinear(96, 768, torch.float32, int4=gguf_packed(weights, tiles=True)[1])
    grouped = QuantLinear(96, 768, torch.float32, int4=groups, tiles=True)
    buffers = {name: b for name, b in grouped.named_buffers() if b is not None}
    assert buffers.keys() == {name for name, b in one_pass.named_buffers() if b is not None}
    for name, buffer in one_pass.named_buffers():
        if buffer is not None:
            assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name])
    assert (one_pass.tile_scales.dtype == torch.uint8) == compact
    x = torch.randn(5, 768)
    assert torch.equal(one_pass(x), grouped(x))
    with pytest.raises(ValueError, match="need tiles=True"):
        QuantLinear(96, 768, torch.float32, int4=tiled, tiles=False)
    # without the kernels (while they build) the groups' path serves
    monkeypatch.setattr(kernels, "loaded", lambda: False)
    assert not isinstance(gguf_packed(weights, tiles=True)[1], QuantTiles)
