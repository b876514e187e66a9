"""Dense linear layers whose float32 products are batch invariant on CPU.

PyTorch's fp32 matmul (MKL or oneDNN) picks its kernel by the number of rows, and its kernels sum a
row's products in different orders, so a row's last bits depend on how many rows share the call.
`tokenmill::dense_linear` (kernels/dense.cpp) sums every output element in one fixed order
whatever the batch, the row's place in it and the threads. Batch-invariant models (the default)
route their dense fp32 layers and a tied output head through it wherever it takes the tensors
(CPU, float32, the kernels loaded); bf16 and everything else keep `F.linear` (oneDNN's bf16
matmul is row invariant on the CPUs measured).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model import kernels


def invariant_kernel_builds() -> bool:
    """Whether `tokenmill::dense_linear` serves on this machine: x86 with AVX2 or AVX-512, the
    kernels built (here, once, if need be) and loaded."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and kernels.load()


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), by `tokenmill::dense_linear` where it takes the tensors (so each
    row's result is the same bits whatever the batch), else by `F.linear`."""
    if not _kernel_fits(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    y = kernels.ops().dense_linear(rows, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _kernel_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether tokenmill's dense kernel (loaded in the background or by the loader, CPU only)
    takes these tensors: float32 on CPU, a contiguous weight."""
    return (
        kernels.loaded()
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    )


class DenseLinear(nn.Linear):
    """nn.Linear whose float32 products on CPU are batch invariant (`invariant_linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)

    def bound(self, x: torch.Tensor) -> object:
        """The layer as `tokenmill::decoder_layer` multiplies rows like x by it (a `BoundLinear`):
        through the op `invariant_linear` would call."""
        if _kernel_fits(x, self.weight, self.bias):
            return kernels.ops().bind_dense_linear(self.weight, self.bias)
        return kernels.ops().bind_linear(self.weight, self.bias)
