"""Linear layers whose weights stay quantized in memory, with the kernel picked by batch size.

Decoding a few tokens is bound by the bytes of weight read per step, so small batches use
weight-only kernels that read the packed bytes directly: tokenmill's own for int8 (tokenmill/model/
kernels, faster than PyTorch's) and for int4 wherever they build (x86 with AVX2 or AVX-512);
PyTorch's int4 kernel elsewhere. On AVX-512 every packed layer whose rows come in whole tiles of 16
takes the tile layout (`pack_tiles`), whose outer-product kernel serves every batch size; on CPUs
with AMX, bf16 batches of `AMX_MIN_TOKENS` or more go from the same bytes to the matrix unit, or,
batch invariant, every prompt token and no output token (`prompt_rows`).
Elsewhere large batches (prefill, wide decode) are bound by arithmetic: with bf16 a dense matmul
wins, and a layer also holds a dense copy for them (`dense_min_tokens`); with fp32 on AVX2,
tokenmill's GEMVs keep up with a dense fp32 matmul at every size and serve alone.

GGUF formats map onto the int4 kernels' form (group of 32, w = scale * q + low, q in 0..15, as
ggml writes them) without loss for Q4_0, Q4_1 and Q4_K, and where tokenmill's int4 row kernel
serves, Q5_0, Q5_1 and Q5_K onto its 5-bit form (q in 0..31: the nibbles plus a plane of
fifth bits; 0.75 bytes per weight against 1 for int8). There, layers of Q6_K weights take a 6-bit
row layout of their own (`Int6Rows`: Q6_K's 16-value scales as integer steps); where the tile
layout serves, 6-bit tiles (`q6_tiles`: Q6_K's values exactly, 6.6 bits a weight). Other formats are
re-quantized to int8 with one scale per output row, which costs a little accuracy (reported by
`tokenmill perplexity`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from tokenmill.model import kernels, quant
from tokenmill.model.quant import GGMLWeight

Q = GGMLQuantizationType
INT4_GROUP = 32
INT4_EXACT = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
# MXFP4's doubled e2m1 values (-12..12) under a power-of-two scale are 5-bit q - 16 too
INT5_EXACT = frozenset({Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.MXFP4})
# An int8 matrix of at least this many weights (larger than the CPU caches: an output head) has
# kernels of its own and never gets a dense copy. At batch 1 in a compiled graph inductor's fused
# reduction ("streamed") reads its bytes faster than `_weight_int8pack_mm`. Beyond the GEMV's batch
# sizes (bf16, or without tokenmill's kernels) it is multiplied in row chunks dequantized on the fly
# ("chunked"), about as fast as a dense copy for a few dozen tokens without the copy's memory.
# Where the tile layout serves, such a matrix takes it like any other layer, in bf16 too, and from
# AMX_MIN_TOKENS on goes to AMX like the other tile layers. See the tuning log.
LARGE_INT8_WEIGHTS = 1 << 24
# Rows of such a matrix dequantized at a time (here and in `tokenmill::int8_linear`): larger chunks
# make fewer, larger matmuls, smaller ones stay in cache between the dequantization and the
# product. bf16 chunks of 8192 rows stay in cache; fp32 and other dtypes take 2048.
CHUNK_ROWS = {torch.bfloat16: 8192}
DEFAULT_CHUNK_ROWS = 2048
# Up to these many tokens `tokenmill::int8_linear` streams the int8 bytes (gemv.cpp), beyond them
# it multiplies in bf16: the crossovers against a layer's dense copy (GEMV_MAX_TOKENS) and, for a
# large matrix without one, against chunks dequantized on the fly (GEMV_MAX_TOKENS_NO_COPY).
GEMV_MAX_TOKENS = 4
GEMV_MAX_TOKENS_NO_COPY = 8
# For fp32 activations (CPUs without native bf16 matmuls) where tokenmill's row kernels serve (AVX2,
# AVX-512), the GEMVs on int8 activations keep up with a dense fp32 matmul at every batch size, or
# nearly, so there no layer keeps a dense copy: ~4 bytes per weight saved at little cost in prefill
# speed. Elsewhere every kind keeps one for batches beyond FP32_GEMV_MAX_TOKENS.
FP32_GEMV_MAX_TOKENS = 64
# Batch sizes from which a dense bf16 copy beats PyTorch's weight-only kernels, which serve until
# tokenmill's kernels are built, or where they cannot be (5- and 6-bit weights, which only
# tokenmill's row kernels read, take int4's). A lower value hands more batches to the copy's matmul
# (bound by arithmetic), a higher one keeps more on the packed kernel (bound by the bytes it reads).
PACKED_DENSE_CROSSOVER = {"int4": 16, "int5": 16, "int6": 16, "int8": 8}
# The same for the tile kernel against a bf16 copy on CPUs where oneDNN multiplies the copy on AMX
# but the tile kernel cannot (`amx_tiles()` false): below it the tiles' int8 products win (a bf16
# matmul of a few rows is bound by reading 2 bytes per weight), from it the matrix unit does.
# Without AMX the copy never wins, so there tile layers keep no copy (~2 bytes a weight saved).
TILES_DENSE_CROSSOVER = 48
# From these many bf16 tokens the tile kernel multiplies on AMX where it can (`amx_tiles`): each
# group of weights dequantized once to bf16 for the matrix unit, instead of the int8 products. The
# dequantization costs the same whatever the batch, so it pays from about a dozen rows on; below
# that the int8 products are as fast. On AMX the tiles keep up with a dense bf16 copy at every batch
# size, so there tile layers keep no copy.
AMX_MIN_TOKENS = 12


class _StepRows(threading.local):
    """The rows of the eager step this thread runs (`prompt_rows`); rows -1: none set."""

    rows = -1
    first_prompt = 0


_STEP_ROWS = _StepRows()


@contextmanager
def prompt_rows(first: int, rows: int) -> Iterator[None]:
    """Within, layer inputs of `rows` rows are a step's tokens: output tokens (and drafts) in rows
    [0, first), prompt tokens in rows [first, rows). Batch-invariant tile layers on AMX
    (`QuantLinear.prompts_on_amx`) multiply the prompt rows on the matrix unit and the output rows
    by the int8 products: a token's arithmetic follows where it comes from (the prompt, or the
    model's output), never its batch, and prompts prefill at the matrix unit's speed while decode
    steps read the compact int8 products' bytes. Inputs of other row counts (an output head's
    rows, a mixture's expert rows) take the int8 products. Thread-local: the compile thread traces
    decode graphs beside the engine's eager steps."""
    saved = _STEP_ROWS.rows, _STEP_ROWS.first_prompt
    _STEP_ROWS.rows, _STEP_ROWS.first_prompt = rows, first
    try:
        yield
    finally:
        _STEP_ROWS.rows, _STEP_ROWS.first_prompt = saved


@contextmanager
def step_rows_within(start: int, rows: int | None) -> Iterator[None]:
    """Within, layer inputs are rows [start, start + rows) of the step `prompt_rows` set (an MLP's
    chunk of them); rows None: rows of no step (a mixture's expert rows, gathered by expert)."""
    if _STEP_ROWS.rows < 0:
        yield
    elif rows is None:
        with prompt_rows(0, -1):
            yield
    else:
        first = min(max(_STEP_ROWS.first_prompt - start, 0), rows)
        with prompt_rows(first, rows):
            yield


def prompts_apart(dtype: torch.dtype, batch_invariant: bool) -> bool:
    """Whether a model of this dtype may compute prompt and output tokens with different
    products here (`prompt_rows`): batch invariant, bf16, on a CPU with AMX."""
    return batch_invariant and dtype == torch.bfloat16 and kernels.cpu_has_amx()


def prompt_split(rows: int) -> int:
    """How many leading rows of a layer input of `rows` rows hold output tokens (`prompt_rows`):
    all of them outside a step's rows or while tracing a graph."""
    if _STEP_ROWS.rows != rows or torch.compiler.is_compiling():
        return rows
    return _STEP_ROWS.first_prompt


def dense_crossover(kind: str, dtype: torch.dtype, tiles: bool = False) -> int:
    """The batch size (tokens) from which a dense copy of a layer beats its kind's kernels (tiles:
    the tile kernel's); 0 where none does (the layer keeps no copy)."""
    if dtype == torch.float32:
        return 0 if int4_rows_layout() else FP32_GEMV_MAX_TOKENS + 1
    if tiles:
        return TILES_DENSE_CROSSOVER if kernels.cpu_has_amx() and not amx_tiles() else 0
    return PACKED_DENSE_CROSSOVER[kind]


def int4_rows_layout() -> bool:
    """Whether int4 weights take tokenmill's row layout and kernel (`tokenmill::int4_rows_linear`,
    built here if need be) wherever those load: on AVX2, where it streams int4 weights faster than
    PyTorch's int4 kernel, and on AVX-512, where it matches PyTorch's at batch 1 and is faster at a
    few dozen tokens. It also keeps 5-bit weights exact."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") and kernels.load()


def takes_tiles(rows: int, cols: int) -> bool:
    """Whether a packed matrix of this shape takes the tile layout (`tiles_layout`) by default."""
    return tiles_layout() and rows % TILE_ROWS == 0 and cols % INT4_GROUP == 0


def tiles_layout() -> bool:
    """Whether packed weights take the tile layout and kernel (`tokenmill::quant_tiles_linear`,
    AVX-512 with VNNI only) wherever those load: faster than the row GEMVs at every batch size,
    and as fast as a dense fp32 matmul on a prompt's hundreds of tokens."""
    return (
        torch.backends.cpu.get_cpu_capability() == "AVX512"
        and kernels.load()
        and torch.ops.tokenmill.tiles_built()
    )


def amx_tiles() -> bool:
    """Whether the tile kernel multiplies batches of `AMX_MIN_TOKENS` bf16 tokens or more on AMX
    here (a CPU with AMX-BF16, and Linux granting the process the AMX state)."""
    return tiles_layout() and torch.ops.tokenmill.amx_usable()


class Int4Rows(NamedTuple):
    """int4 or 5-bit weights in the row layout of `int4_rows_linear`: w = step x unit x q + low."""

    # (rows, cols / 2) uint8: per group of 32, byte j holds q of elements j and 16 + j
    nibbles: torch.Tensor
    # (rows, cols / 32, 2) int16: each group's scale in units, its low's float16 bits
    steps_lows: torch.Tensor
    units: torch.Tensor  # (rows,) float32: the row's largest scale magnitude / MAX_STEP

    @property
    def steps(self) -> torch.Tensor:
        return self.steps_lows[..., 0]

    @property
    def lows(self) -> torch.Tensor:
        return self.steps_lows[..., 1].contiguous().view(torch.float16)


MAX_STEP = 32767  # int16's: steps times the kernel's int16 pair sums (< 2^15) still fit int32


def pack_int4_rows(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> Int4Rows:
    """(q, scale, low) in the row layout of `int4_rows_linear`: 16 bytes per group of 32, byte j
    holding element j (low nibble) and element 16 + j (high); the scales as int16 steps of a unit
    per row (the largest one exact, the others within half a unit: 1.5e-5 of the row's largest),
    the lows in float16 (exact for Q4_0 and Q4_1, whose lows are float16 in the file)."""
    rows, cols = q.shape
    halves = (q & 0xF).reshape(rows, cols // INT4_GROUP, 2, INT4_GROUP // 2).to(torch.uint8)
    nibbles = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2)
    scale = scale.float()
    units = scale.abs().amax(dim=1) / MAX_STEP
    # a row of zero scales: any unit will do
    units = torch.where(units > 0, units, torch.ones_like(units))
    steps = torch.round(scale / units[:, None]).clamp(-MAX_STEP, MAX_STEP).to(torch.int16)
    steps_lows = torch.stack((steps, low.to(torch.float16).view(torch.int16)), dim=-1)
    return Int4Rows(nibbles.contiguous(), steps_lows.contiguous(), units.contiguous())


# The bit of a block's byte b that holds group 2 p + l's element 16 h + b, indexed [p, l, h, 1]
_FIFTH_BIT_SHIFTS = (
    4 * torch.arange(2).view(1, 2, 1)
    + 2 * torch.arange(2).view(2, 1, 1)
    + torch.arange(2).view(1, 1, 2)
).to(torch.uint8)[..., None]


def pack_fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """The fifth bits of 5-bit q (rows, cols) as `int4_rows_linear` reads them: 16 bytes per block
    of 4 groups of 32 (a last partial block padded with zeros). Byte b of a block holds in bit
    4 l + 2 p + h the fifth bit of group 2 p + l's element 16 h + b: bit k (and 4 + k) for the
    kernel's k-th vector of nibbles, pair p's low (h = 0) or high (h = 1) ones."""
    rows, cols = q.shape
    groups = cols // INT4_GROUP
    blocks = -(-groups // 4)
    bits = torch.zeros(rows, blocks * 4, INT4_GROUP, dtype=torch.uint8)
    bits[:, :groups] = (q.to(torch.uint8) >> 4).view(rows, groups, INT4_GROUP)
    planes = (bits.view(rows, blocks, 2, 2, 2, INT4_GROUP // 2) << _FIFTH_BIT_SHIFTS).sum(
        (2, 3, 4), dtype=torch.uint8
    )
    return planes.reshape(rows, blocks * 16).contiguous()


def unpack_int4_rows(rows: Int4Rows, fifth_bits: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight of `pack_int4_rows`' output (and `pack_fifth_bits`', for 5-bit
    weights)."""
    count = rows.nibbles.shape[0]
    groups = rows.nibbles.view(count, -1, 1, INT4_GROUP // 2)
    q = torch.cat((groups & 0xF, groups >> 4), dim=2).view(count, -1, INT4_GROUP).float()
    if fifth_bits is not None:
        planes = fifth_bits.view(count, -1, 1, 1, 1, INT4_GROUP // 2)
        bits = ((planes >> _FIFTH_BIT_SHIFTS) & 1).view(count, -1, INT4_GROUP)
        q += 16 * bits[:, : q.shape[1]].float()
    scale = rows.steps.float() * rows.units[:, None]
    return (q * scale[..., None] + rows.lows.float()[..., None]).view(count, -1)


class Int6Rows(NamedTuple):
    """6-bit weights (GGUF's Q6_K) in the row layout of `int6_rows_linear`:
    w = step x unit x (q - 32), q in 0..63, one step per 16 values."""

    # (rows, cols / 2) uint8: per pair of groups of 32, the low 4 bits of two vectors of 32 q (low
    # and high nibbles), each the pair's first (or second) halves in `INT6_HALF_ELEMENTS`' order
    nibbles: torch.Tensor
    # (rows, cols / 4) uint8: per quad of groups, the top 2 bits of its 4 vectors (bits 2k, 2k + 1)
    highs: torch.Tensor
    steps: torch.Tensor  # (rows, cols / 16) int16: each 16 values' scale in units
    units: torch.Tensor  # (rows,) float32: the row's largest scale magnitude / MAX_STEP


# The element of a group of 32 at each position of its first (row 0) and second (row 1) half in
# the int6 row layout: the activation sub-block j's 4j, 4j + 1, 16 + 4j, 16 + 4j + 1, then its
# 4j + 2, 4j + 3, 16 + 4j + 2, 16 + 4j + 3 (simd.h's `int6_halves`)
_FIRST_HALF = torch.tensor([0, 1, 16, 17]) + 4 * torch.arange(4)[:, None]
INT6_HALF_ELEMENTS = torch.stack((_FIRST_HALF.flatten(), _FIRST_HALF.flatten() + 2))
_HIGH_SHIFTS = (2 * torch.arange(4)).to(torch.uint8)[:, None]


def unpack_int6_rows(rows: Int6Rows) -> torch.Tensor:
    """The float32 weight of `q6_k_int6_rows`' output (on the rows' device)."""
    count, cols = rows.nibbles.shape[0], rows.nibbles.shape[1] * 2
    device = rows.nibbles.device
    pairs = rows.nibbles.view(count, -1, 1, INT4_GROUP)  # 32 bytes a pair of groups
    low = torch.cat((pairs & 0xF, pairs >> 4), dim=2)  # (row, pair, half, position)
    quads = rows.highs.view(count, -1, 1, INT4_GROUP)  # and a quad
    high = ((quads >> _HIGH_SHIFTS.to(device)) & 3).view(low.shape)
    halves = (low | (high << 4)).view(count, -1, 2, 2, INT4_GROUP // 2)  # (.., half, group, p)
    q = torch.empty(
        count, cols // (2 * INT4_GROUP), 2, INT4_GROUP, dtype=torch.uint8, device=device
    )
    q[..., INT6_HALF_ELEMENTS.to(device)] = halves.transpose(2, 3)
    scale = rows.steps.float() * rows.units[:, None]
    return ((q.view(count, -1, 16).float() - 32) * scale[..., None]).view(count, cols)


TILE_ROWS = 16  # weight rows per tile of `quant_tiles_linear`
# Activations per int8 scale in the tile kernel. One scale per 32 converts and scales each group's
# sums once instead of four times (faster) but rounds small activations next to large ones more
# coarsely (more perplexity). The layers whose inputs' outliers cost most at 32 keep 8 (the
# loader's `FINE_X_BLOCK_TARGETS`); the other layers and the output head take 32.
FINE_X_BLOCK = 8
COARSE_X_BLOCK = 32
# Without batch invariance, a coarse output head (tiles of a large int8 matrix) takes 8 beyond these
# many tokens: the logits of every prompt token (perplexity, prompt logprobs), where the coarse
# rounding's cost in quality shows; a decode batch (up to this many sequences) keeps 32, the faster.
# A single activation row (batch-1 decode) then also rounds per 8 in every tile layer, as fast as
# per 32 there and closer to the dequantized weights. Batch-invariant layers keep their own x_block
# whatever the row count.
HEAD_COARSE_MAX_TOKENS = 64
# Weights packed into tiles at a time: larger chunks make fewer, larger copies (faster loading),
# while the packing's temporaries stay the size of a chunk, not of the matrix
PACK_CHUNK_WEIGHTS = 1 << 22
# Weight rows that PyTorch's int4 packing (`_convert_weight_to_int4pack_for_cpu`, which takes q as
# int32) converts at a time: the 4-byte copy of q stays the size of a chunk, not of the matrix. A
# multiple of 64, the rows of the packing's blocks, so that the chunks' outputs stack to the
# whole's.
INT4PACK_CHUNK_ROWS = 256


# Groups per block of compact tile scales (`compact_tile_scales`), and the bytes of a block per tile
COMPACT_GROUPS = 8
COMPACT_BLOCK_BYTES = COMPACT_GROUPS * 32 + 128
# The multiple of its block's unit that a block's largest scale (or low) is: llama.cpp writes the
# K-quants' 6-bit scales as multiples of the block's largest / 63, so that one is 63
COMPACT_PEAK_MULTIPLE = 63


class QuantTiles(NamedTuple):
    """int4, 5-bit or int8 weights in the tile layout of `quant_tiles_linear`:
    w = scale x q + low; or 6-bit ones (`q6_tiles`), w = d x step x (q - 32)."""

    # uint8: per tile of 16 rows, group of 32 and sub-block j, the q of 16 rows x 8 elements (6-bit:
    # the 4-bit tiles' nibbles, then per pair of sub-blocks a vector of their q's top 2 bits)
    tiles: torch.Tensor
    # each group's (or row's) scale and low. Compact, (rows / 16, cols / 256, COMPACT_BLOCK_BYTES)
    # uint8, where every block of 8 groups of a row has its scales and lows as whole multiples
    # (0-63) of a float32 unit each (the K-quants: 4.75 bits a 4-bit weight); else
    # (rows / 16, cols / 32 or 1, 2, 16), float16 where that holds every group's exactly (Q4_0,
    # Q4_1, Q5_0: 5 bits), else float32 (6 bits). 6-bit: (rows / 16, cols / 256, Q6_BLOCK_BYTES)
    # uint8, per block of 256 the int8 steps [group, half, row c] and the rows' d as float32
    tile_scales: torch.Tensor
    # 5-bit: (rows / 16, cols / 32, 64) uint8, the fifth bits as byte masks
    fifth_masks: torch.Tensor | None
    bits: int  # 4 (5 with fifth_masks), 6 or 8


# Bytes of a 6-bit tile's scales per block of 256 columns: 16 rows x 16 int8 steps, 16 float32 d
Q6_BLOCK_BYTES = COMPACT_GROUPS * 32 + 64


def q6_tiles(weights: list[GGMLWeight]) -> QuantTiles:
    """Q6_K weights (their rows stacked) in the 6-bit tile layout (`QuantTiles`, `q6_k_tiles` in
    layout.cpp): the same values, 6.6 bits a weight where int8 rows take 8."""
    data = [w.data.contiguous() for w in weights]
    tiles, scales = kernels.ops().q6_k_tiles(data, weights[0].shape[1])
    return QuantTiles(tiles, scales, None, 6)


def _unpack_q6_tiles(tiles: QuantTiles) -> torch.Tensor:
    """The float32 weight of `q6_tiles`' output."""
    count, blocks, _ = tiles.tile_scales.shape
    groups = blocks * COMPACT_GROUPS
    b = tiles.tiles.view(count, groups, 384)
    nibbles = b[:, :, :256].view(count, groups, 4, 1, TILE_ROWS, 4)
    tops = b[:, :, 256:].view(count, groups, 2, 1, 1, TILE_ROWS, 4)
    # [tile, group, pair, odd, half, c, e]: bits 4 odd + 2 half of the pair's byte
    odd, half = torch.arange(2).view(2, 1, 1, 1), torch.arange(2).view(2, 1, 1)
    shifts = (4 * odd + 2 * half).to(torch.uint8)
    top = ((tops >> shifts) & 3).view(count, groups, 4, 2, TILE_ROWS, 4)
    q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=3) | (top << 4)  # [tile, group, j, half, c, e]
    q = q.permute(0, 4, 1, 3, 2, 5).reshape(count * TILE_ROWS, groups * INT4_GROUP).float() - 32
    scales = tiles.tile_scales[:, :, : COMPACT_GROUPS * 32].contiguous().view(torch.int8)
    steps = scales.view(count, blocks, COMPACT_GROUPS * 2, TILE_ROWS).permute(0, 3, 1, 2)
    d = tiles.tile_scales[:, :, COMPACT_GROUPS * 32 :].contiguous().view(torch.float32)
    d = d.view(count, blocks, TILE_ROWS).permute(0, 2, 1)  # [tile, c, block]
    step = (steps.float() * d[..., None]).reshape(count * TILE_ROWS, -1, 1)  # per 16 values
    return (q.view(count * TILE_ROWS, -1, 16) * step).view(count * TILE_ROWS, -1)


def _unit_multiples(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """values (rows, groups) as multiples (uint8) of one float32 unit per row and block of
    COMPACT_GROUPS groups, its largest magnitude / COMPACT_PEAK_MULTIPLE, multiple x unit equal
    to the value exactly; None where some block's values are no such multiples."""
    rows, groups = values.shape
    blocks = values.float().view(rows, groups // COMPACT_GROUPS, COMPACT_GROUPS)
    units = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)) / COMPACT_PEAK_MULTIPLE
    multiples = torch.where(units == 0, 0.0, blocks / units).round()
    if not bool(((multiples * units == blocks) & (multiples >= 0)).all()):
        return None
    return multiples.to(torch.uint8).view(rows, groups), units.view(rows, -1)


def compact_tile_scales(scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor | None:
    """Per-group scale and low (rows, groups) as compact tile scales (see `QuantTiles`), or None
    where the rows or groups do not come in whole tiles and blocks or a value is no multiple of
    its block's unit."""
    rows, groups = scale.shape
    if rows % TILE_ROWS or groups % COMPACT_GROUPS:
        return None
    if kernels.loaded():  # the same bytes in one pass (layout.cpp)
        return kernels.ops().compact_scales(scale.float().contiguous(), low.float().contiguous())
    parts = [_unit_multiples(values) for values in (scale, low)]
    if parts[0] is None or parts[1] is None:
        return None
    count, blocks = rows // TILE_ROWS, groups // COMPACT_GROUPS
    # multiples [tile, row c, block, group] -> [tile, block, group, scale/low, c]
    multiples = torch.stack(
        [m.view(count, TILE_ROWS, blocks, COMPACT_GROUPS).permute(0, 2, 3, 1) for m, _ in parts],
        dim=3,
    )
    # units [tile, row c, block] -> [tile, block, scale/low, c]
    units = torch.stack([u.view(count, TILE_ROWS, blocks).transpose(1, 2) for _, u in parts], 2)
    return torch.cat(
        (
            multiples.reshape(count, blocks, -1),
            units.contiguous().view(torch.uint8).view(count, blocks, -1),
        ),
        dim=2,
    )


def _expand_compact(tile_scales: torch.Tensor) -> torch.Tensor:
    """Compact tile scales as float32 (rows / 16, cols / 32, 2, 16)."""
    count, blocks, _ = tile_scales.shape
    multiples = tile_scales[:, :, : COMPACT_GROUPS * 32].reshape(
        count, blocks, COMPACT_GROUPS, 2, TILE_ROWS
    )
    units = tile_scales[:, :, COMPACT_GROUPS * 32 :].contiguous().view(torch.float32)
    units = units.view(count, blocks, 1, 2, TILE_ROWS)
    return (multiples.float() * units).view(count, blocks * COMPACT_GROUPS, 2, TILE_ROWS)


def _tile_scales(scale: torch.Tensor, low: torch.Tensor, compact: bool) -> torch.Tensor:
    """scale and low (rows, groups or 1) in one of `QuantTiles.tile_scales`' forms: compact where
    asked and they fit it, else float16 where that holds every per-group value exactly, else
    float32."""
    groups = scale.shape[1]
    if compact and groups > 1 and (packed := compact_tile_scales(scale, low)) is not None:
        return packed
    exact_half = groups > 1 and all(torch.equal(v.half().float(), v.float()) for v in (scale, low))
    # [row, group] -> [tile, group, scale/low, row c]
    by_tile = [v.float().view(-1, TILE_ROWS, groups).transpose(1, 2) for v in (scale, low)]
    return torch.stack(by_tile, dim=2).to(torch.float16 if exact_half else torch.float32)


def pack_tiles(
    q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bits: int, compact: bool = True
) -> QuantTiles:
    """(q, scale, low) (q unsigned, in 0..2^bits - 1, or for 8 bits int8, stored as q + 128; scale
    and low per group of 32) in the tile layout of `quant_tiles_linear`: per tile of 16 rows, group
    and sub-block j (its elements 4j..4j+3, then 16+4j..16+4j+3), byte 4c + e of each of the
    sub-block's two vectors holding row c's q at element 4j + e, then 16 + 4j + e. For 4 and 5 bits
    the two vectors share bytes (low and high nibbles), the fifth bits going to masks: bit 4c + e of
    one 64-bit word per vector. scale and low of shape (rows, 1) apply to every group: one pair per
    row is kept. compact: per-group scales take the compact form where they fit it (the integer
    kernel reads it; AMX does not). Packed over chunks of tiles into the outputs: a 262k-row
    output head never has a copy in memory whole."""
    rows, cols = q.shape
    groups, count = cols // INT4_GROUP, rows // TILE_ROWS
    if kernels.loaded() and (bits, q.dtype) in ((4, torch.uint8), (8, torch.int8)):
        # the same bytes in one pass (layout.cpp)
        return QuantTiles(
            kernels.ops().tile_bytes(q.contiguous(), bits),
            _tile_scales(scale, low, compact),
            None,
            bits,
        )
    tiles = torch.empty(count, groups, 4, 2 if bits == 8 else 1, TILE_ROWS, 4, dtype=torch.uint8)
    fifth = torch.empty(count, groups, 4, 2, 8, dtype=torch.uint8) if bits == 5 else None
    signed = q.dtype == torch.int8
    step = max(1, PACK_CHUNK_WEIGHTS // (cols * TILE_ROWS))
    for t0 in range(0, count, step):
        t1 = min(count, t0 + step)
        r0, r1 = t0 * TILE_ROWS, t1 * TILE_ROWS
        # [tile, row c, group, half h, sub-block j, element e] -> [tile, group, j, h, c, e], moving
        # the 4 bytes of e as one int32 rather than byte by byte
        part = q[r0:r1]
        part = (part.view(torch.uint8) if signed else part.to(torch.uint8)).view(
            t1 - t0, TILE_ROWS, groups, 2, 4, 4
        )
        out = tiles[t0:t1].view(torch.int32).squeeze(-1)  # [tile, group, j, h, c]
        if bits == 8:
            out.copy_(part.contiguous().view(torch.int32).squeeze(-1).permute(0, 2, 4, 3, 1))
            if signed:
                tiles[t0:t1].bitwise_xor_(0x80)  # two's complement q + 128
        else:
            # [tile, c, group, j, e]
            nibbles = (part[:, :, :, 0] & 0xF) | ((part[:, :, :, 1] & 0xF) << 4)
            out[:, :, :, 0].copy_(nibbles.view(torch.int32).squeeze(-1).permute(0, 2, 3, 1))
            if fifth is not None:
                flags = ((part.permute(0, 2, 4, 3, 1, 5) >> 4) & 1).reshape(
                    t1 - t0, groups, 4, 2, 8, 8
                )
                torch.sum(
                    flags << torch.arange(8, dtype=torch.uint8),
                    -1,
                    dtype=torch.uint8,
                    out=fifth[t0:t1],
                )
    return QuantTiles(
        tiles.view(-1),
        _tile_scales(scale, low, compact),
        None if fifth is None else fifth.view(count, groups, 64),
        8 if bits == 8 else 4,
    )


def unpack_tiles(tiles: QuantTiles) -> torch.Tensor:
    """The float32 weight of `pack_tiles`' (or `q6_tiles`') output."""
    if tiles.bits == 6:
        return _unpack_q6_tiles(tiles)
    count = tiles.tile_scales.shape[0]
    tile_scales = (
        _expand_compact(tiles.tile_scales)
        if tiles.tile_scales.dtype == torch.uint8
        else tiles.tile_scales
    )
    groups = tiles.tiles.numel() // (
        count * TILE_ROWS * INT4_GROUP // (1 if tiles.bits == 8 else 2)
    )
    if tiles.bits == 8:
        q = tiles.tiles.view(count, groups, 4, 2, TILE_ROWS, 4)
    else:
        b = tiles.tiles.view(count, groups, 4, 1, TILE_ROWS, 4)
        q = torch.cat((b & 0xF, b >> 4), dim=3)
        if tiles.fifth_masks is not None:
            masks = tiles.fifth_masks.view(count, groups, 4, 2, 8, 1)
            bits = ((masks >> torch.arange(8, dtype=torch.uint8)) & 1).view(
                count, groups, 4, 2, TILE_ROWS, 4
            )
            q = q + 16 * bits
    q = q.permute(0, 4, 1, 3, 2, 5).reshape(count * TILE_ROWS, groups, INT4_GROUP).float()
    scale, low = (
        tile_scales[:, :, k].float().transpose(1, 2).reshape(count * TILE_ROWS, -1, 1)
        for k in (0, 1)
    )
    return (q * scale + low).view(count * TILE_ROWS, groups * INT4_GROUP)


def int4_kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype PyTorch's int4 kernel runs in for a model in `dtype`: it is vectorized for bf16
    and not for fp32, so an fp32 model rounds its activations to bf16 for it."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def is_large_int8(kind: str, weights: int) -> bool:
    """Whether a packed matrix takes the large-int8 kernels (and so needs no dense copy)."""
    return kind == "int8" and weights >= LARGE_INT8_WEIGHTS


def keeps_no_dense_copy(kind: str, weights: int) -> bool:
    """Whether a packed matrix of `weights` weights never gets a dense copy: an output head in
    int8 (tiles or its own kernels serve every batch) or in 6-bit rows (their GEMV does), where a
    dense copy would take GBs."""
    return kind in ("int8", "int6") and weights >= LARGE_INT8_WEIGHTS


def exact_groups(w: GGMLWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, low) of a Q4_0/Q4_1/Q4_K weight (q in 0..15) or a Q5_0/Q5_1/Q5_K or MXFP4 one
    (q in 0..31): q (rows, cols), scale and low (rows, cols / 32) float32, with
    w = scale * q + low exactly as ggml dequantizes."""
    rows, cols = w.shape
    if w.qtype == Q.Q4_K and kernels.loaded():  # the same values in one pass (layout.cpp)
        return kernels.ops().q4_k_groups(w.data.contiguous(), rows, cols)
    _, type_size = quant.GGML_QUANT_SIZES[w.qtype]
    b = w.data.contiguous().view(-1, type_size)
    if w.qtype in (Q.Q4_0, Q.Q5_0):
        q = (
            quant._unpack(b[:, 2:18], 1, 4).view(-1, 32)
            if w.qtype == Q.Q4_0
            else quant._q5(b[:, 2:6], b[:, 6:22])
        )
        scale = quant._f16(b, 0)
        low = (-8 if w.qtype == Q.Q4_0 else -16) * scale
    elif w.qtype in (Q.Q4_1, Q.Q5_1):
        q = (
            quant._unpack(b[:, 4:20], 1, 4).view(-1, 32)
            if w.qtype == Q.Q4_1
            else quant._q5(b[:, 4:8], b[:, 8:24])
        )
        scale, low = quant._f16(b, 0), quant._f16(b, 2)
    elif w.qtype in (Q.Q4_K, Q.Q5_K):
        n = b.shape[0]
        sc, mn = quant._k_scale_min(b[:, 4:16])
        scale = (quant._f16(b, 0) * sc).view(-1, 1)
        low = -(quant._f16(b, 2) * mn).view(-1, 1)
        if w.qtype == Q.Q4_K:
            q = quant._unpack(b[:, 16:144], 4, 4)
        else:  # the fifth bits in bytes 16-47, the nibbles after them
            q = quant._unpack(b[:, 48:176], 4, 4) | (quant._unpack(b[:, 16:48], 1, 1) << 4)
        q = q.view(n * 8, 32)
    elif w.qtype == Q.MXFP4:
        q = (quant.mxfp4_values(b) + 16).to(torch.uint8)
        scale = quant.mxfp4_scale(b)
        low = -16 * scale
    else:
        raise ValueError(f"{w.qtype.name} has no exact 4- or 5-bit form")
    return q.reshape(rows, cols), scale.reshape(rows, cols // 32), low.reshape(rows, cols // 32)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization in groups of 32 (for `--quantization int4` of dense
    checkpoints)."""
    rows, cols = weight.shape
    g = weight.float().reshape(rows, cols // INT4_GROUP, INT4_GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.reshape(rows, cols), scale, lo


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit quantization with one scale per output row."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


# ("int4" | "int5", (q, scale, low), Int4Rows or 4-bit QuantTiles), ("int6", Int6Rows or 6-bit
# QuantTiles) or ("int8", (q8, scale))
Packed = tuple[str, tuple[torch.Tensor, ...]]


def packed_form(w: GGMLWeight) -> Packed:
    """A GGUF weight in the form the kernels read: exact int4 or 5-bit where the format and the
    kernels allow, else int8.

    Re-quantization runs over row chunks of about 1 MB of float32, so a large matrix (a 262k-row
    embedding used as the output head) never exists in float32 all at once and each chunk stays
    in cache between its passes.
    """
    if w.qtype in INT4_EXACT and w.shape[1] % INT4_GROUP == 0:
        return "int4", exact_groups(w)
    if (
        w.qtype in INT5_EXACT
        and w.shape[1] % INT4_GROUP == 0
        and int4_rows_layout()
        and _lows_fit_float16(w)
    ):
        return "int5", exact_groups(w)
    rows, cols = w.shape
    if w.qtype in (Q.Q6_K, Q.Q8_0) and kernels.loaded():  # the same values in one pass (layout.cpp)
        rows_of = (
            kernels.ops().q6_k_int8_rows if w.qtype == Q.Q6_K else kernels.ops().q8_0_int8_rows
        )
        return "int8", rows_of(w.data.contiguous(), rows, cols)
    q8 = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows)
    step = max(1, quant.CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        part = GGMLWeight(w.data[start : start + step], w.qtype, (min(step, rows - start), cols))
        q8[start : start + step], scales[start : start + step] = quantize_int8(part.dequantize())
    return "int8", (q8, scales)


# MXFP4's E8M0 exponent bytes whose lows (-16 x 2^(e - 128)) float16 holds exactly, as the row
# layout keeps them: scales 2^-28 to 2^11, far beyond any model's weights
_MXFP4_FLOAT16_LOWS = range(100, 140)


def _lows_fit_float16(w: GGMLWeight) -> bool:
    """Whether the row layout's float16 lows hold the weight's exactly (checked for MXFP4, whose
    lows are not float16 in the file)."""
    if w.qtype != Q.MXFP4:
        return True
    exponents = w.data.contiguous().view(-1, 17)[:, 0]
    low, high = _MXFP4_FLOAT16_LOWS.start, _MXFP4_FLOAT16_LOWS.stop
    return bool(((exponents >= low) & (exponents < high)).all())


def dense_packed_form(weight: torch.Tensor, mode: str) -> Packed:
    """A dense weight quantized for `--quantization int4|int8`."""
    if mode == "int4" and weight.shape[1] % INT4_GROUP == 0:
        return "int4", quantize_int4(weight)
    if mode in ("int4", "int8"):
        return "int8", quantize_int8(weight)
    raise ValueError(f"unknown quantization {mode!r} (choose int8 or int4)")


def merge_packed(parts: list[Packed]) -> Packed:
    """Stack the rows of several packed weights (q/k/v, gate/up) so one kernel call serves them.

    Parts of different kinds are brought to int8, the form every weight has, except int4 and int5
    parts: a 4-bit q is a 5-bit one with its fifth bit clear.
    """
    if len(parts) == 1:
        return parts[0]  # a copy of a 262k-row head would double its memory while loading
    if {kind for kind, _ in parts} == {"int4", "int5"}:
        parts = [("int5", data) for _, data in parts]
    if all(kind == parts[0][0] for kind, _ in parts):
        kind = parts[0][0]
        return kind, tuple(torch.cat(fields) for fields in zip(*(data for _, data in parts)))
    as_int8 = [
        ("int8", data) if kind == "int8" else ("int8", quantize_int8(_int4_weight(*data)))
        for kind, data in parts
    ]
    return merge_packed(as_int8)


def gguf_packed(weights: list[GGMLWeight], tiles: bool, integer_kernel: bool = True) -> Packed:
    """`merge_packed` of the weights' `packed_form`s, for a layer that takes the tile layout or
    (`tiles` False) not; integer_kernel: the layer multiplies every batch in the integer tile
    kernel (False for a layer that multiplies large batches on AMX, which reads only 4-, 5- and
    8-bit tiles, with float scales). Where the layer takes tiles, integer_kernel holds and every
    weight is Q6_K, they take the 6-bit tiles (`q6_tiles`, exact) rather than int8 re-rounded per
    row: fewer bytes for the same values. Where every weight is Q4_K, its rows come laid out
    already from one pass over the blocks (layout.cpp): in tiles (4-bit `QuantTiles`, the tile
    bytes of the merged groups' q, their scales compact where integer_kernel holds and they fit)
    or in the row layout (`Int4Rows`: `pack_int4_rows` of the merged groups), where the groups' q,
    a byte a weight, would take three more passes; for the row layout the same where every weight
    is Q4_0, or every one Q4_1. Where every weight is Q6_K, they take the int6 row
    layout (`Int6Rows`, exact but for the scales' steps) rather than int8 re-rounded per row,
    which `int6_rows_linear` multiplies faster."""
    qtypes = {w.qtype for w in weights}
    if tiles and integer_kernel and qtypes == {Q.Q6_K}:
        return "int6", q6_tiles(weights)
    if tiles and qtypes == {Q.Q4_K} and kernels.loaded():
        data, cols = [w.data.contiguous() for w in weights], weights[0].shape[1]
        q, scale, low = kernels.ops().q4_k_tiles(data, cols)
        return "int4", QuantTiles(q, _tile_scales(scale, low, integer_kernel), None, 4)
    if not tiles and int4_rows_layout():
        data, cols = [w.data.contiguous() for w in weights], weights[0].shape[1]
        if qtypes == {Q.Q4_K}:
            return "int4", Int4Rows(*kernels.ops().q4_k_int4_rows(data, cols))
        if qtypes in ({Q.Q4_0}, {Q.Q4_1}):
            return "int4", Int4Rows(*kernels.ops().q4_int4_rows(data, cols, qtypes == {Q.Q4_1}))
        if qtypes == {Q.Q6_K}:
            return "int6", Int6Rows(*kernels.ops().q6_k_int6_rows(data, cols))
    return merge_packed([packed_form(w) for w in weights])


def _int4_weight(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape
    groups = q.float().view(rows, cols // INT4_GROUP, INT4_GROUP)
    return (groups * scale[..., None] + low[..., None]).view(rows, cols)


class QuantLinear(nn.Module):
    """y = x W^T + b with W kept as packed int4 or 5-bit (groups of 32), 6-bit (Q6_K's sub-blocks
    of 16) or int8 (per row)."""

    def __init__(
        self,
        out_features: int,
        in_features: int,
        dtype: torch.dtype,
        int4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | Int4Rows | QuantTiles | None = None,
        int8: tuple[torch.Tensor, torch.Tensor] | None = None,
        int5: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        int6: Int6Rows | QuantTiles | None = None,
        bias: torch.Tensor | None = None,
        dense: torch.Tensor | None = None,
        dense_min_tokens: int = 1 << 30,
        int4_rows: bool | None = None,
        tiles: bool | None = None,
        x_block: int = FINE_X_BLOCK,
        batch_invariant: bool = True,
    ) -> None:
        """tiles: whether the weights take the tile layout of `quant_tiles_linear` (default: where
        it serves, `tiles_layout()`, and the shape fits); else int4_rows: the layout of int4 weights
        (default: `int4_rows_layout()`); 5-bit weights (int5: q in 0..31) have only those two.
        int4 may come laid out already (`Int4Rows`, no tiles, or 4-bit `QuantTiles`, tiles, from
        `gguf_packed`); int6 comes in its row layout (`Int6Rows`, no tiles) or in 6-bit tiles
        (`q6_tiles`, tiles). x_block:
        activations per int8 scale in the tile kernel, 8 or 32 (`FINE_X_BLOCK`, `COARSE_X_BLOCK`).
        batch_invariant: every row is computed alike whatever the batch (one kernel, one
        activation rounding, no AMX or dense-copy switch by row count); off, the kernel and
        rounding follow the batch size where that is faster or more exact."""
        super().__init__()
        if sum(data is not None for data in (int4, int5, int6, int8)) != 1:
            raise ValueError("give exactly one of int4, int5, int6 and int8")
        if batch_invariant and dense is not None:
            raise ValueError(
                "a dense copy switches the layer's arithmetic by batch size; give it "
                "only with batch_invariant=False"
            )
        self.out_features, self.in_features = out_features, in_features
        kinds = {"int4": int4, "int5": int5, "int6": int6}
        self.kind = next((kind for kind, data in kinds.items() if data is not None), "int8")
        six_bit_tiles = isinstance(int6, QuantTiles)
        laid_out_tiles = int6 if six_bit_tiles else int4 if isinstance(int4, QuantTiles) else None
        if tiles is None:
            tiles = laid_out_tiles is not None or (
                int6 is None and takes_tiles(out_features, in_features)
            )
        if laid_out_tiles is not None and not tiles:
            raise ValueError("weights laid out in tiles (QuantTiles) need tiles=True")
        if int6 is not None and tiles != six_bit_tiles:
            raise ValueError(
                "6-bit weights come laid out: Int6Rows take tiles=False, 6-bit QuantTiles "
                "tiles=True"
            )
        self.tiles = tiles
        self.x_block = x_block
        self.batch_invariant = batch_invariant
        if int4 is not None and int4_rows is None:
            int4_rows = int4_rows_layout()
        self.int4_rows = not tiles and (int5 is not None or (int4 is not None and int4_rows))
        # the row kernels' layouts
        self.row_layout = self.int4_rows or (int6 is not None and not tiles)
        if isinstance(int4, Int4Rows) and not self.int4_rows:
            raise ValueError("int4 weights in the row layout (Int4Rows) need int4_rows, no tiles")
        if laid_out_tiles is not None:
            packed = laid_out_tiles
        elif tiles:
            if int8 is not None:
                q8, scale = int8
                q, low, bits = q8, -128 * scale.float()[:, None], 8  # stored as q8 + 128
                scale = scale.float()[:, None]
            else:
                (q, scale, low), bits = int4 or int5, 4 if int5 is None else 5
            # AMX (which only switching layers take) reads float scales only
            packed = pack_tiles(q, scale, low, bits, compact=batch_invariant or not amx_tiles())
        if tiles:
            self.register_buffer("tile_q", packed.tiles)
            self.register_buffer("tile_scales", packed.tile_scales)
            self.register_buffer("fifth_masks", packed.fifth_masks)
            self.tile_bits = packed.bits
        elif self.int4_rows:
            rows = int4 if isinstance(int4, Int4Rows) else pack_int4_rows(*(int4 or int5))
            for name, tensor in rows._asdict().items():
                self.register_buffer(name, tensor)
            self.register_buffer("fifth_bits", None if int5 is None else pack_fifth_bits(int5[0]))
        elif isinstance(int6, Int6Rows):
            for name, tensor in int6._asdict().items():
                self.register_buffer(name, tensor)
        elif int4 is not None:
            q, scale, low = int4
            pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
            chunks = [
                q[r : r + INT4PACK_CHUNK_ROWS] for r in range(0, out_features, INT4PACK_CHUNK_ROWS)
            ]
            self.register_buffer("packed", torch.cat([pack(c.to(torch.int32), 1) for c in chunks]))
            # kernel layout: (groups, out_features, 2) holding (scale, zero),
            # w = scale * (q - 8) + zero
            zero = low + 8 * scale
            self.register_buffer(
                "scales_zeros",
                torch.stack((scale.t(), zero.t()), dim=-1)
                .to(int4_kernel_dtype(dtype))
                .contiguous(),
            )
        else:
            q8, scale = int8
            self.register_buffer("weight_int8", q8.contiguous())
            self.register_buffer("scales", scale.to(dtype))
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.dense = None if dense is None else nn.Parameter(dense.to(dtype), requires_grad=False)
        self.dense_min_tokens = dense_min_tokens
        large = is_large_int8(self.kind, out_features * in_features)  # an output head
        self.large_int8 = large and not tiles  # int8 rows kept
        switches = not batch_invariant
        # the tile kernel's; -1: no limit
        self.max_coarse_tokens = HEAD_COARSE_MAX_TOKENS if large and switches else -1
        amx = tiles and amx_tiles()
        # the tile kernel's; -1: never
        self.amx_min_tokens = AMX_MIN_TOKENS if amx and switches and not six_bit_tiles else -1
        # batch invariant: prompt rows on AMX, output rows on the int8 products (`prompt_rows`)
        self.prompts_on_amx = amx and batch_invariant and not large

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native_fits(x):
            if self.prompts_on_amx and 0 < prompt_split(x.shape[0]) < x.shape[0]:
                return self._split_forward(x, x.new_empty(x.shape[0], self.out_features))
            return self._native_forward(x)
        kernel = self._kernel(x.shape[0])
        if kernel == "dense":
            return F.linear(x, self.dense, self.bias)
        if kernel == "streamed":
            # a plain reduction that inductor turns into one pass over the int8 bytes
            y = ((self.weight_int8.float() * x.float()).sum(-1) * self.scales.float()).to(x.dtype)[
                None
            ]
        elif kernel == "chunked":
            # int8 values are exact in bf16; the row scales apply to the output
            rows = CHUNK_ROWS.get(x.dtype, DEFAULT_CHUNK_ROWS)
            chunks = [
                F.linear(x, self.weight_int8[start : start + rows].to(x.dtype))
                for start in range(0, self.out_features, rows)
            ]
            y = torch.cat(chunks, dim=-1) * self.scales
        elif self.tiles:  # a dtype or device the kernel does not take
            y = F.linear(x, unpack_tiles(self._tiles()).to(x.dtype))
        elif self.int4_rows:  # a dtype or device the kernel does not take
            y = F.linear(x, unpack_int4_rows(self._int4_rows(), self.fifth_bits).to(x.dtype))
        elif self.kind == "int6":  # the same
            y = F.linear(x, unpack_int6_rows(self._int6_rows()).to(x.dtype))
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(self.scales_zeros.dtype), self.packed, INT4_GROUP, self.scales_zeros
            ).to(x.dtype)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scales)
        return y if self.bias is None else y + self.bias

    __call__ = forward  # without nn.Module's hook dispatch: see "Plain calls" in transformer.py

    def forward_into(self, x: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """forward(x) written into `into`, a contiguous (rows of x, out_features) tensor of x's
        dtype that the caller reuses from call to call, where the tile kernel serves the layer
        (eager calls); elsewhere a new tensor, as forward's. A large output made anew on every
        call (an output head's for a batch, above glibc's 32 MB heap limit) is mapped and faulted
        in afresh each time."""
        bias = self._parameters.get("bias")  # as in _native_forward: no __getattr__ call
        # a traced graph sees the dispatcher's ops only, which write no given tensor
        eager_tiles = self.tiles and not torch.compiler.is_compiling()
        if not eager_tiles or bias is not None or not self._native_fits(x):
            return self.forward(x)
        if self.prompts_on_amx and 0 < prompt_split(x.shape[0]) < x.shape[0]:
            return self._split_forward(x, into)
        _, args = self._native_call(x.shape[0], x.dtype)
        return kernels.ops().quant_tiles_linear_into(x, *args, into)

    def _split_forward(self, x: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """forward(x) into `into` for a step whose leading rows hold output tokens and the rest
        prompt tokens (`prompt_rows`): each part by its own products, in place."""
        split, rows = prompt_split(x.shape[0]), x.shape[0]
        into_tiles = kernels.ops().quant_tiles_linear_into
        for start, end in ((0, split), (split, rows)):
            _, args = self._native_call(end - start, x.dtype, prompts=start > 0)
            into_tiles(x[start:end], *args, into[start:end])
        bias = self._parameters.get("bias")
        return into if bias is None else into.add_(bias)

    def _native_forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokenmill's op for the layer's layout on CPU (`_kernel`'s "native"), the hot path of
        eager steps."""
        name, args = self._native_call(x.shape[0], x.dtype)
        y = getattr(kernels.ops(), name)(x, *args)
        bias = self._parameters.get("bias")  # None is a plain attribute, a tensor a parameter
        return y if bias is None else y + bias

    def bound(self, x: torch.Tensor) -> object | None:
        """The layer as `tokenmill::decoder_layer` multiplies by it (a `BoundLinear`) for inputs
        like x: `_native_forward`'s op and arguments; None where that op does not take x, or x's
        rows are part prompt, part output tokens (`prompt_rows`)."""
        if not self._native_fits(x):
            return None
        if self.prompts_on_amx and 0 < prompt_split(x.shape[0]) < x.shape[0]:
            return None
        name, args = self._native_call(x.shape[0], x.dtype)
        return getattr(kernels.ops(), f"bind_{name}")(*args, self._parameters.get("bias"))

    def _native_call(
        self, tokens: int, dtype: torch.dtype, prompts: bool | None = None
    ) -> tuple[str, tuple]:
        """The name of tokenmill's op for the layer's layout and its arguments after x, for tokens
        rows of dtype, all prompt tokens or all output tokens (prompts None: as `prompt_split`
        says of `tokens` rows). It reads the module's tensors from its dicts rather than through
        nn.Module's __getattr__ (a Python call per lookup)."""
        buffers = self._buffers
        dense = self._parameters.get("dense") if self.dense_min_tokens > 0 else None
        max_gemv_tokens = self._gemv_max_tokens(dtype)
        if self.tiles:
            return "quant_tiles_linear", (
                buffers["tile_q"],
                buffers["tile_scales"],
                buffers["fifth_masks"],
                self.tile_bits,
                dense,
                max_gemv_tokens,
                self._x_block(tokens),
                self.max_coarse_tokens,
                self._amx_min_tokens(tokens, prompts),
            )
        if self.int4_rows:
            return "int4_rows_linear", (
                buffers["nibbles"],
                buffers["steps_lows"],
                buffers["units"],
                buffers["fifth_bits"],
                dense,
                max_gemv_tokens,
            )
        if self.kind == "int6":
            return "int6_rows_linear", (
                buffers["nibbles"],
                buffers["highs"],
                buffers["steps"],
                buffers["units"],
                dense,
                max_gemv_tokens,
            )
        if self.kind == "int4":  # PyTorch's packed layout
            return "int4_linear", (
                buffers["packed"],
                buffers["scales_zeros"],
                INT4_GROUP,
                dense,
                self.dense_min_tokens - 1,
            )
        return "int8_linear", (
            buffers["weight_int8"],
            buffers["scales"],
            dense,
            max_gemv_tokens,
            CHUNK_ROWS.get(dtype, DEFAULT_CHUNK_ROWS),
        )

    def _amx_min_tokens(self, tokens: int, prompts: bool | None) -> int:
        """The tile kernel's amx_min_rows for tokens rows: 0 (AMX) for prompt rows where
        `prompts_on_amx`, else the layer's batch-size switch (-1: never)."""
        if not self.prompts_on_amx:
            return self.amx_min_tokens
        if prompts is None:
            prompts = prompt_split(tokens) == 0
        return 0 if prompts else -1

    def _tiles(self) -> QuantTiles:
        return QuantTiles(self.tile_q, self.tile_scales, self.fifth_masks, self.tile_bits)

    def _int4_rows(self) -> Int4Rows:
        return Int4Rows(self.nibbles, self.steps_lows, self.units)

    def _int6_rows(self) -> Int6Rows:
        return Int6Rows(self.nibbles, self.highs, self.steps, self.units)

    def _x_block(self, tokens: int) -> int:
        """The tile kernel's activations per int8 scale for this many rows (`HEAD_COARSE_MAX_TOKENS`
        says when they follow the row count)."""
        return FINE_X_BLOCK if tokens == 1 and not self.batch_invariant else self.x_block

    def _gemv_max_tokens(self, dtype: torch.dtype) -> int:
        """The most tokens `int8_linear` and the row kernels multiply by their GEMV; beyond, the
        dense copy or, for a layer without one, the GEMV still (int4, 5- and 6-bit; every kind on
        fp32; every kind when batch invariant) or chunks dequantized on the fly (int8 on bf16)."""
        if self.batch_invariant:  # never leaves the GEMV (no dense copy: see __init__)
            return 1 << 30
        has_dense = self.dense is not None and self.dense_min_tokens > 0
        if self.kind == "int8" and dtype != torch.float32 and not self.tiles:
            return GEMV_MAX_TOKENS if has_dense else GEMV_MAX_TOKENS_NO_COPY
        return self.dense_min_tokens - 1 if has_dense else 1 << 30

    def _native_fits(self, x: torch.Tensor) -> bool:
        """Whether tokenmill's ops (built in the background, CPU only) take this input."""
        if not kernels.loaded() or not x.is_cpu:
            return False
        if self.tiles:
            return x.dtype in (torch.bfloat16, torch.float32)
        if self.kind != "int8":
            return not self.row_layout or x.dtype in (torch.bfloat16, torch.float32)
        return (
            x.dtype in (torch.bfloat16, torch.float32)
            and self.scales.dtype == x.dtype
            and self.in_features % 32 == 0
        )

    def _kernel(self, tokens: int) -> str:
        """Where tokenmill's ops do not take the input (`_native_fits`): 'dense', 'streamed'
        (compiled batch-1 of a large int8 matrix), 'chunked' (more tokens of a large int8 matrix)
        or 'packed'."""
        compiling = torch.compiler.is_compiling()
        if self.dense is not None and self.dense_min_tokens > 0:
            # One compiled graph serves every batch of 2+ tokens: a switch at each kernel's own
            # crossover would need a graph per range, each compiled anew. Between 2 tokens and the
            # crossover the two kernels are close, so the graph takes the dense copy.
            if tokens >= (
                2 if compiling else min(self.dense_min_tokens, PACKED_DENSE_CROSSOVER[self.kind])
            ):
                return "dense"
        if self.large_int8 and tokens > 1:
            return "chunked"
        if self.large_int8 and compiling:
            return "streamed"
        return "packed"

    def extra_repr(self) -> str:
        dense = f", dense for >= {self.dense_min_tokens} tokens" if self.dense is not None else ""
        rows = " (tiles)" if self.tiles else " (row layout)" if self.row_layout else ""
        return f"{self.in_features} -> {self.out_features}, {self.kind}{rows}{dense}"


class QuantEmbedding(nn.Module):
    """Token embedding kept in its ggml format; only the looked-up rows are dequantized."""

    def __init__(self, weight: GGMLWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype = weight.qtype
        self.shape = weight.shape
        self.dtype = dtype
        # a view of a GGUF file: rows are paged in as looked up
        self.register_buffer("data", weight.data)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.data.index_select(0, ids)
        return quant.dequantize(rows, self.qtype, (ids.shape[0], self.shape[1]), self.dtype)
