"""ggml block quantization formats, dequantized with vectorized torch code.

Each kernel reproduces ggml's reference dequantization (as in gguf-py's ``quants.py``)
operation by operation in float32, so results are bit-exact. Blocks are processed in
chunks so intermediates stay cache-sized instead of several times the tensor size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType

_DENSE_DTYPES: dict[GGMLQuantizationType, torch.dtype] = {
    Q.F32: torch.float32,
    Q.F16: torch.float16,
    Q.BF16: torch.bfloat16,
}

# Elements dequantized per chunk: big enough to amortize per-op overhead, small enough
# that the float32 intermediates of one chunk stay in cache.
CHUNK_ELEMENTS = 1 << 18

# Byte value -> its 8 bits spread over 8 bytes (bit i in byte i, shifted to 16), as one int64:
# a table lookup expands Q5_0/Q5_1 high bits in element order far faster than shifts would.
_Q5_HIGH_BITS = (
    (((torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1) << 4)
    .to(torch.uint8)
    .view(torch.int64)
    .view(-1)
)


@dataclass
class GGMLWeight:
    """A tensor kept in ggml's quantized block format (weights can stay quantized in memory
    later)."""

    # uint8, (rows, bytes_per_row); rows are independent, so row slices work on raw bytes
    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape in torch order (rows, cols)
    # drops the file pages behind `data` from memory once the loader has converted it (the pages
    # stay readable: a later access reads them again from the file)
    release: Callable[[], None] | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.qtype, self.shape, dtype)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 field at byte ``start`` of every block, as float32 of shape (n, 1)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _unpack(packed: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Split the bytes of ``packed`` (n, groups * k) into ``width``-bit fields, low bits first.

    Returns (n, groups * 8 // width, k) uint8: within each group, field f of byte i lands at
    (f, i), which is how ggml lays out the elements of its blocks. Contiguous scalar shifts
    and one cat are several times faster than one broadcast shift in torch.
    """
    n = packed.shape[0]
    p = packed.contiguous().view(n, groups, 1, -1)
    mask = (1 << width) - 1
    fields = [(p >> shift) & mask for shift in range(0, 8, width)]
    return torch.cat(fields, dim=2).view(n, -1, p.shape[-1])


def _float(q: torch.Tensor) -> torch.Tensor:
    """uint8 values below 128 to float32 (torch converts int8 faster than uint8)."""
    return q.view(torch.int8).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:34].contiguous().view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[:, 2:18], 1, 4).view(-1, 32)
    return _float(q).sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    q = _unpack(b[:, 4:20], 1, 4).view(-1, 32)
    return _float(q).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """5-bit values: low nibbles from ``qs``, bit j of the little-endian uint32 ``qh`` on top of
    element j."""
    high = _Q5_HIGH_BITS.index_select(0, qh.reshape(-1).int()).view(torch.uint8).view(-1, 32)
    return _unpack(qs, 1, 4).view(-1, 32) | high


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _float(_q5(b[:, 2:6], b[:, 6:22])).sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _float(_q5(b[:, 4:8], b[:, 8:24])).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]
    dl = (_f16(b, 80) * _float(scales & 0x0F)).view(n, 16, 1)
    ml = (_f16(b, 82) * _float(scales >> 4)).view(n, 16, 1)
    q = _unpack(b[:, 16:80], 2, 2).view(n, 16, 16)
    return _float(q).mul_(dl).sub_(ml).view(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    # 16 6-bit scales: low nibbles in bytes 96..103 (both halves), high 2 bits in 104..107.
    low = _unpack(b[:, 96:104], 1, 4).view(n, 16)
    high = _unpack(b[:, 104:108], 1, 2).view(n, 16)
    dl = (_f16(b, 108) * _float(low | (high << 4)).sub_(32)).view(n, 16, 1)
    ql = _unpack(b[:, 32:96], 2, 2).view(n, 16, 16)
    qh = _unpack(b[:, :32], 1, 1).view(n, 16, 16)  # a set hmask bit means no -4 offset
    return _float(ql | (qh << 2)).sub_(4).mul_(dl).view(n, 256)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte scales of Q4_K/Q5_K into 8 6-bit scales and 8 6-bit mins, as float32."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return _float(sc), _float(mn)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc).view(n, 8, 1)
    ml = (_f16(b, 2) * mn).view(n, 8, 1)
    q = _unpack(b[:, 16:144], 4, 4).view(n, 8, 32)
    return _float(q).mul_(dl).sub_(ml).view(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (_f16(b, 0) * sc).view(n, 8, 1)
    ml = (_f16(b, 2) * mn).view(n, 8, 1)
    low = _unpack(b[:, 48:176], 4, 4).view(n, 8, 32)
    high = _unpack(b[:, 16:48], 1, 1).view(n, 8, 32)
    return _float(low | (high << 4)).mul_(dl).sub_(ml).view(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    dl = (_f16(b, 208) * scales).view(n, 16, 1)
    low = _unpack(b[:, :128], 2, 4).view(n, 8, 32)
    high = _unpack(b[:, 128:192], 2, 2).view(n, 8, 32)
    q = _float(low | (high << 4)).sub_(32).view(n, 16, 16)
    return q.mul_(dl).view(n, 256)


# MXFP4's e2m1 values, doubled (ggml's kvalues_mxfp4): the block scale is half the power of two
_MXFP4_VALUES = torch.tensor(
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32
)


def mxfp4_scale(b: torch.Tensor) -> torch.Tensor:
    """The scale of each MXFP4 block (n, 17 bytes) as float32 (n, 1): 2^(e - 128) for its E8M0
    exponent byte e (ggml_e8m0_to_fp32_half's bits, for e < 2 too), which the doubled values
    multiply."""
    e = b[:, :1].to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


def mxfp4_values(b: torch.Tensor) -> torch.Tensor:
    """The doubled e2m1 values (n, 32) float32 of MXFP4 blocks: 32 4-bit codes, low nibbles
    first."""
    return _MXFP4_VALUES[_unpack(b[:, 1:17], 1, 4).view(-1, 32).long()]


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    """gpt-oss's experts: 32 e2m1 values under one power-of-two scale."""
    return mxfp4_values(b).mul_(mxfp4_scale(b))


_KERNELS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.MXFP4: _mxfp4,
}

SUPPORTED_QTYPES: frozenset[GGMLQuantizationType] = frozenset(_DENSE_DTYPES) | frozenset(_KERNELS)


def unsupported_qtype_message(qtype: GGMLQuantizationType) -> str:
    names = ", ".join(sorted(t.name for t in SUPPORTED_QTYPES))
    return f"unsupported quantization type {qtype.name} (supported: {names})"


def dequantize(
    data: torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode raw ggml bytes (uint8, rows of whole blocks) into a dense tensor of ``shape``."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(unsupported_qtype_message(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    cols = shape[-1] if shape else 1
    if cols % block_size or data.numel() != math.prod(shape) // block_size * type_size:
        raise ValueError(
            f"{data.numel()} bytes of {qtype.name} do not encode a tensor of shape {tuple(shape)}"
        )
    data = data.contiguous()
    if qtype in _DENSE_DTYPES:
        return data.view(-1).view(_DENSE_DTYPES[qtype]).to(dtype).view(shape)
    kernel = _KERNELS[qtype]
    blocks = data.view(-1, type_size)
    step = max(1, CHUNK_ELEMENTS // block_size)
    if blocks.shape[0] <= step:
        # one chunk, no loop: a loop over a size would freeze it in a compiled graph
        return kernel(blocks).to(dtype).view(shape)
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype)
    for start in range(0, blocks.shape[0], step):
        out[start : start + step] = kernel(blocks[start : start + step])
    return out.view(shape)
