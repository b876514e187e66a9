"""Batch invariance of packed layers: a row's output is the same bits whatever its batch.

Every kernel a packed layer can run (the tile kernel at both activation roundings and as an
output head, the row kernels for int4, 5-bit and int8 weights) is checked in float32 and bf16 at
batch sizes across every threshold the kernels know of (1, the GEMV sizes, tiles of rows, 64).
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.model import kernels, quant_linear
from tokenmill.model.quant_linear import (
    COARSE_X_BLOCK,
    FINE_X_BLOCK,
    QuantLinear,
    quantize_int4,
    quantize_int8,
)

# Which kernels this CPU should run, by its flags rather than by what the build gave: a kernel that
# should be there and is not fails `_layer`'s check instead of dropping out of the test.
CAPABILITY = torch.backends.cpu.get_cpu_capability()
ROW_KERNELS = CAPABILITY in ("AVX2", "AVX512")
TILE_KERNEL = CAPABILITY == "AVX512" and "avx512_vnni" in kernels.cpu_flags().split()

pytestmark = pytest.mark.skipif(
    not ROW_KERNELS, reason="tokenmill's kernels build only for x86 CPUs with AVX2 or AVX-512"
)

BATCHES = [1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 48, 64, 65, 100]
OUT, IN = 96, 224  # 7 groups of 32: the row kernels' blocks of 4 groups, a pair and a single one


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
    layer = _layer(options, dtype, invariant=True, monkeypatch=monkeypatch)
    torch.manual_seed(11)
    x = (torch.randn(max(BATCHES), IN) * torch.rand(max(BATCHES), 1) * 4).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    for batch in BATCHES:
        assert torch.equal(layer(x[:batch]), alone[:batch]), f"{name}, {batch} rows"


@pytest.mark.skipif(not TILE_KERNEL, reason="the tile kernel is built for AVX-512 with VNNI only")
def test_without_invariance_a_single_row_rounds_finer(monkeypatch) -> None:
    """The switch that batch invariance turns off exists: the test above would see it."""
    options = {"kind": "int4", "tiles": True, "x_block": COARSE_X_BLOCK}
    fast = _layer(options, torch.bfloat16, invariant=False, monkeypatch=monkeypatch)
    torch.manual_seed(11)
    x = (torch.randn(4, IN) * torch.rand(4, 1) * 4).to(torch.bfloat16)
    assert not torch.equal(fast(x[:1]), fast(x)[:1])
