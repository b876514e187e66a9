"""Packed linear layers: `--quantization int8|int4` of dense checkpoints, kernel choice by batch
size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from tests.model.test_gguf import random_blocks
from tests.model.test_kernels import int8_activations
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model import kernels, quant_linear
from tokenmill.model.loader import load_model
from tokenmill.model.quant import GGMLWeight
from tokenmill.model.quant_linear import (
    AMX_MIN_TOKENS,
    PACKED_DENSE_CROSSOVER,
    TILES_DENSE_CROSSOVER,
    Int4Rows,
    QuantLinear,
    amx_tiles,
    dense_packed_form,
    exact_groups,
    int4_rows_layout,
    merge_packed,
    pack_fifth_bits,
    pack_int4_rows,
    pack_tiles,
    packed_form,
    tiles_layout,
    unpack_int4_rows,
    unpack_tiles,
)

PROMPTS = [[5, 9, 30, 71, 12, 44, 8], list(range(40, 60))]


def _logits(loaded) -> torch.Tensor:
    runner = ModelRunner(loaded, num_blocks=8, block_size=16)
    return runner.all_logits(PROMPTS, [len(p) for p in PROMPTS], [[0, 1], [2, 3]])


# Relative error of the logits of the (deliberately chaotic, 0.3-std) tiny model, which amplifies
# every weight error; per-layer accuracy is checked tightly below, and the real-model cost is a
# perplexity figure (SmolLM2 on GPL-3, 4 chunks: none 18.20, int8 18.44, int4 19.03).
@pytest.mark.parametrize(("mode", "max_error"), [("int8", 0.1), ("int4", 0.7)])
def test_quantized_dense_checkpoint_runs_packed(
    tiny_model_dir, mode: str, max_error: float
) -> None:
    dense = _logits(load_model(tiny_model_dir, progress=False))
    loaded = load_model(tiny_model_dir, progress=False, quantization=mode, dense_min_tokens=0)
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.kind == mode for m in layers) and all(m.dense is None for m in layers)
    quantized = _logits(loaded)
    assert ((quantized - dense).norm() / dense.norm()).item() < max_error


@pytest.mark.parametrize(("mode", "max_error"), [("int8", 0.01), ("int4", 0.1)])
def test_packed_layer_accuracy(mode: str, max_error: float) -> None:
    torch.manual_seed(2)
    weight, x = torch.randn(256, 128), torch.randn(16, 128)
    kind, data = dense_packed_form(weight, mode)
    out = QuantLinear(256, 128, torch.float32, **{kind: data})(x)
    reference = x @ weight.t()
    assert ((out - reference).norm() / reference.norm()).item() < max_error


def test_kernel_choice_by_batch_size_gives_the_same_numbers() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    kind, data = dense_packed_form(weight, "int4")
    layer = QuantLinear(
        96,
        64,
        torch.float32,
        **{kind: data},
        dense=_int4_dense(*data),
        dense_min_tokens=4,
        batch_invariant=False,
    )
    x = torch.randn(6, 64)
    packed_rows = torch.cat([layer(x[i : i + 1]) for i in range(6)])  # one token: the int4 kernel
    dense_rows = layer(x)  # six tokens: the dense copy
    # the int4 kernel runs in bf16 (int4_kernel_dtype): the two agree to bf16's precision
    assert ((packed_rows - dense_rows).norm() / dense_rows.norm()).item() < 1e-2


def test_large_int8_matrix_goes_in_chunks_without_a_dense_copy(monkeypatch) -> None:
    torch.manual_seed(3)
    monkeypatch.setattr(quant_linear, "LARGE_INT8_WEIGHTS", 100 * 64)
    # 100 rows: three whole chunks and a part
    monkeypatch.setitem(quant_linear.CHUNK_ROWS, torch.float32, 32)
    kind, data = dense_packed_form(torch.randn(100, 64), "int8")
    layer = QuantLinear(100, 64, torch.float32, **{kind: data})
    x = torch.randn(5, 64)
    assert layer.large_int8 and layer._kernel(5) == "chunked" and layer._kernel(1) == "packed"
    weight = data[0].float() * data[1][:, None]
    # with tokenmill's kernels, up to 8 tokens take the GEMV, which rounds x to int8
    multiplied = int8_activations(x) if layer._native_fits(x) else x
    torch.testing.assert_close(layer(x), multiplied @ weight.t(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer(x[:1]), multiplied[:1] @ weight.t(), atol=1e-4, rtol=1e-4)


def test_loader_gives_a_large_int8_head_no_dense_copy(tiny_model_dir, monkeypatch) -> None:
    monkeypatch.setattr(quant_linear, "LARGE_INT8_WEIGHTS", 320 * 64)  # the tiny model's head only
    loaded = load_model(
        tiny_model_dir,
        progress=False,
        quantization="int8",
        dense_min_tokens=2,
        batch_invariant=False,
    )
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert [m.out_features for m in layers if m.dense is None] == [320]
    assert all(m.dense is not None for m in layers if m.out_features != 320)


def test_large_int8_matrix_in_whole_tiles_takes_the_tile_kernel_in_bf16(monkeypatch) -> None:
    torch.manual_seed(4)
    monkeypatch.setattr(quant_linear, "LARGE_INT8_WEIGHTS", 96 * 64)
    kind, data = dense_packed_form(torch.randn(96, 64), "int8")
    layer = QuantLinear(96, 64, torch.bfloat16, **{kind: data})
    # where the tile kernel serves, the head's chunks give way to it at every batch size
    assert layer.tiles == tiles_layout() and layer.large_int8 == (not layer.tiles)
    weight = data[0].float() * data[1][:, None]
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    for tokens in (1, 8, 40):
        expected = x[:tokens].float() @ weight.t()
        error = (layer(x[:tokens]).float() - expected).norm() / expected.norm()
        assert error < 2e-2, (tokens, error)  # x rounded to int8 (tiles) or the output to bf16


def test_bf16_tile_layers_keep_dense_copies_only_where_the_copies_alone_have_amx(
    tiny_model_dir,
) -> None:
    loaded = load_model(
        tiny_model_dir, dtype="bf16", progress=False, quantization="int4", batch_invariant=False
    )
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert layers
    for m in layers:
        if m.tiles and amx_tiles():  # the tile kernel's AMX path serves wide batches
            assert m.dense is None and m.amx_min_tokens == AMX_MIN_TOKENS
        else:
            copy_from = PACKED_DENSE_CROSSOVER["int4"]
            if m.tiles:  # without AMX the tile kernel beats a bf16 copy at every batch size
                copy_from = TILES_DENSE_CROSSOVER if kernels.cpu_has_amx() else 0
            assert m.dense_min_tokens == copy_from and (m.dense is None) == (copy_from == 0)
            assert m.amx_min_tokens == -1


def test_merging_int4_with_int8_parts_brings_them_to_int8() -> None:
    torch.manual_seed(1)
    a, b = torch.randn(32, 64), torch.randn(16, 64)
    kind, (q8, scales) = merge_packed([dense_packed_form(a, "int4"), dense_packed_form(b, "int8")])
    assert kind == "int8" and q8.shape == (48, 64) and scales.shape == (48,)
    torch.testing.assert_close(q8.float() * scales[:, None], torch.cat([a, b]), atol=0.35, rtol=0)


def test_pytorch_int4_packing_in_chunks_of_rows_gives_the_whole_matrix_packing() -> None:
    # PyTorch's int4 layout (no tiles, no row layout) packs a chunk of rows at a time; the chunks
    # stack to what packing the whole matrix gives, also past a last partial chunk
    torch.manual_seed(3)
    rows = 2 * quant_linear.INT4PACK_CHUNK_ROWS + 48
    kind, data = dense_packed_form(torch.randn(rows, 128), "int4")
    layer = QuantLinear(rows, 128, torch.float32, **{kind: data}, int4_rows=False, tiles=False)
    whole = torch.ops.aten._convert_weight_to_int4pack_for_cpu(data[0].to(torch.int32), 1)
    assert torch.equal(layer.packed, whole)


def _int4_dense(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    groups = q.float().view(q.shape[0], -1, 32)
    return (groups * scale[..., None] + low[..., None]).view(q.shape)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_gguf_int4_formats_keep_their_values(qtype: Q) -> None:
    """exact_groups gives ggml's own dequantization, and the row layout keeps it (Q4_K's products of
    a float16 and a 6-bit scale are rounded to float16 there)."""
    shape = (6, 512)
    raw = torch.from_numpy(random_blocks(qtype, shape, np.random.default_rng(int(qtype))))
    weight = GGMLWeight(raw, qtype, shape)
    q, scale, low = exact_groups(weight)
    torch.testing.assert_close(
        _int4_dense(q, scale, low), weight.dequantize(), rtol=1e-6, atol=1e-6
    )
    packed = pack_int4_rows(q, scale, low)
    rows = unpack_int4_rows(packed)
    assert (
        (rows - weight.dequantize()).abs() <= _layout_bound(q, packed, low, qtype == Q.Q4_K)
    ).all()


def _layout_bound(
    q: torch.Tensor, packed: Int4Rows, low: torch.Tensor, rounded_lows: bool
) -> torch.Tensor:
    """How far the row layout may move each weight: its scale to the nearest step of the row's unit
    (half a unit per unit of q), its low to float16 (half a step of float16's, 2^-11 of it) unless
    the file holds it in float16 already, and float32's rounding."""
    lows = low.abs().repeat_interleave(32, dim=1) * 2.0**-11 if rounded_lows else 0
    return q.float() * packed.units[:, None] / 2 + lows + 1e-6


def _mxfp4_blocks(shape: tuple[int, int], exponents: range) -> torch.Tensor:
    """Random MXFP4 blocks with exponent bytes in this range."""
    rng = np.random.default_rng(39)
    raw = random_blocks(Q.MXFP4, shape, rng)
    raw.reshape(-1, 17)[:, 0] = rng.integers(exponents.start, exponents.stop, raw.size // 17)
    return torch.from_numpy(raw)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.MXFP4])
@pytest.mark.parametrize("cols", [256, 288])  # 288: a last group without a pair
def test_gguf_5bit_formats_keep_their_values(qtype: Q, cols: int) -> None:
    """exact_groups gives ggml's own dequantization (q up to 31), and the row layout with its plane
    of fifth bits keeps it (Q5_K's scale products rounded to float16 as Q4_K's are). MXFP4's
    doubled e2m1 values are q - 16, their lows float16 where its exponents allow."""
    shape = (6, cols if qtype != Q.Q5_K else 256)
    raw = torch.from_numpy(random_blocks(qtype, shape, np.random.default_rng(int(qtype))))
    if qtype == Q.MXFP4:
        raw = _mxfp4_blocks(shape, quant_linear._MXFP4_FLOAT16_LOWS)
    weight = GGMLWeight(raw, qtype, shape)
    assert packed_form(weight)[0] == ("int5" if int4_rows_layout() else "int8")
    q, scale, low = exact_groups(weight)
    assert q.max() > 15 and q.max() <= 31
    torch.testing.assert_close(
        _int4_dense(q, scale, low), weight.dequantize(), rtol=1e-6, atol=1e-6
    )
    packed = pack_int4_rows(q, scale, low)
    rows = unpack_int4_rows(packed, pack_fifth_bits(q))
    assert (
        (rows - weight.dequantize()).abs() <= _layout_bound(q, packed, low, qtype == Q.Q5_K)
    ).all()


def test_mxfp4_past_float16_lows_packs_as_int8() -> None:
    shape = (2, 64)
    weight = GGMLWeight(_mxfp4_blocks(shape, range(140, 256)), Q.MXFP4, shape)
    assert packed_form(weight)[0] == "int8"


def test_merging_int4_with_5bit_parts_keeps_both_exact() -> None:
    torch.manual_seed(4)
    four = ("int4", (torch.randint(0, 16, (8, 64)), torch.rand(8, 2), -torch.rand(8, 2)))
    five = ("int5", (torch.randint(0, 32, (4, 64)), torch.rand(4, 2), -torch.rand(4, 2)))
    kind, (q, scale, low) = merge_packed([four, five])
    assert kind == "int5"
    torch.testing.assert_close(
        _int4_dense(q, scale, low),
        torch.cat([_int4_dense(*four[1]), _int4_dense(*five[1])]),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("bits", [4, 5, 8])
def test_tile_layout_keeps_the_values(bits: int) -> None:
    torch.manual_seed(bits)
    q = torch.randint(0, 1 << bits, (48, 96))
    scale, low = torch.rand(48, 3), -torch.rand(48, 3)
    packed = pack_tiles(q, scale, low, bits)
    assert packed.tiles.numel() == 48 * 96 * (1 if bits == 8 else 0.5) and (
        packed.fifth_masks is not None
    ) == (bits == 5)
    torch.testing.assert_close(unpack_tiles(packed), _int4_dense(q, scale, low), rtol=0, atol=0)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_K, Q.MXFP4])
def test_gguf_formats_keep_their_values_in_tiles(qtype: Q) -> None:
    """Unlike the row layout, tiles hold each group's scale and low in float32: ggml's values
    exactly."""
    shape = (16, 256)
    raw = torch.from_numpy(random_blocks(qtype, shape, np.random.default_rng(int(qtype))))
    if qtype == Q.MXFP4:
        raw = _mxfp4_blocks(shape, quant_linear._MXFP4_FLOAT16_LOWS)
    weight = GGMLWeight(raw, qtype, shape)
    q, scale, low = exact_groups(weight)
    bits = 5 if qtype in quant_linear.INT5_EXACT else 4
    torch.testing.assert_close(
        unpack_tiles(pack_tiles(q, scale, low, bits)), weight.dequantize(), rtol=1e-6, atol=1e-6
    )


def test_batch_invariant_layers_keep_no_kernel_switch(tiny_model_dir) -> None:
    loaded = load_model(tiny_model_dir, dtype="bf16", progress=False, quantization="int8")
    assert loaded.batch_invariant
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert layers
    for m in layers:
        assert m.batch_invariant and m.dense is None and m.dense_min_tokens == 0
        assert m.amx_min_tokens == -1 and m.max_coarse_tokens == -1


def test_dense_copies_need_batch_invariance_off(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="no-batch-invariant"):
        load_model(tiny_model_dir, progress=False, quantization="int8", dense_min_tokens=16)
    kind, data = dense_packed_form(torch.randn(32, 64), "int8")
    with pytest.raises(ValueError, match="batch_invariant=False"):
        QuantLinear(32, 64, torch.float32, **{kind: data}, dense=torch.randn(32, 64))
