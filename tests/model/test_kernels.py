"""tokenmill's C++ CPU kernels: built on this machine, exact against a float reference."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from tokenmill.model import kernels
from tokenmill.model.quant_linear import QuantLinear, dense_packed_form

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None,
                                reason="no C++ compiler to build the kernels with")


def _int8_layer(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return torch.randint(-127, 128, (rows, cols), dtype=torch.int8), (torch.rand(rows) / 100).to(torch.bfloat16)


def test_kernels_build_and_load(cpu_kernels: bool) -> None:
    marker = kernels.build_directory() / kernels.FAILED_MARKER
    assert cpu_kernels and kernels.loaded(), marker.read_text() if marker.exists() else "not loaded"


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("means", ["gemv", "dense copy", "chunks"])
def test_int8_linear_matches_a_float_reference(tokens: int, means: str) -> None:
    weight, scale = _int8_layer(8197, 96, tokens)  # rows: not a multiple of the threads' share nor of a chunk
    x = torch.randn(tokens, 96).to(torch.bfloat16)
    reference = (x.float() @ weight.float().t()) * scale.float()
    dense = None
    if means == "dense copy":  # what the loader keeps: the dequantized weight, rounded to bf16
        dense = (weight.float() * scale.float()[:, None]).to(torch.bfloat16)
        reference = x.float() @ dense.float().t()
    out = torch.ops.tokenmill.int8_linear(x, weight, scale, dense, 16 if means == "gemv" else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, 8197)
    torch.testing.assert_close(out.float(), reference, atol=2e-3, rtol=2e-2)  # bf16 rounding


def test_int8_linear_rejects_what_it_cannot_multiply() -> None:
    weight, scale = _int8_layer(8, 96, 0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.tokenmill.int8_linear(torch.randn(1, 96), weight, scale, None, 4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tokenmill.int8_linear(torch.randn(1, 80).bfloat16(), weight[:, :80].contiguous(), scale, None, 4)


def test_quant_linear_uses_the_kernel_for_bf16() -> None:
    torch.manual_seed(4)
    kind, data = dense_packed_form(torch.randn(64, 128), "int8")
    layer = QuantLinear(64, 128, torch.bfloat16, **{kind: data}, bias=torch.randn(64))
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert layer._kernel(3, layer._native_fits(x)) == "native"
    assert not layer._native_fits(x.float())  # fp32 activations keep PyTorch's kernels
    packed = torch.ops.aten._weight_int8pack_mm(x, layer.weight_int8, layer.scales) + layer.bias
    torch.testing.assert_close(layer(x).float(), packed.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_int4_linear_switches_to_the_dense_copy_above_the_crossover(tokens: int) -> None:
    torch.manual_seed(5)
    kind, data = dense_packed_form(torch.randn(64, 128), "int4")
    layer = QuantLinear(64, 128, torch.float32, **{kind: data})
    dense = torch.randn(64, 128)  # unrelated to the packed weight: shows which one was used
    x = torch.randn(tokens, 128)
    out = torch.ops.tokenmill.int4_linear(x, layer.packed, layer.scales_zeros, 32, dense, 3)
    packed = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, 32, layer.scales_zeros)
    torch.testing.assert_close(out, packed if tokens <= 3 else x @ dense.t())


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, width", [(1, 16), (7, 37), (300, 2048)])  # 37: a partial vector at each row's end
def test_gated_activation_matches_eager(kind: str, dtype: torch.dtype, tokens: int, width: int) -> None:
    torch.manual_seed(tokens)
    gate_up = (torch.randn(tokens, 2 * width) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) if kind == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    out = torch.ops.tokenmill.gated_activation(gate_up, kind)
    assert out.dtype == dtype and out.shape == (tokens, width)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(out.float(), act * up, **tolerance)


def test_gated_activation_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="unknown activation"):
        torch.ops.tokenmill.gated_activation(torch.zeros(2, 8), "relu")
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.tokenmill.gated_activation(torch.zeros(8, 4).t(), "silu")
