"""Megatron-style tensor-parallel shards of the generic decoder: which heads and which part of the
MLP's intermediate dimension each of N ranks holds, and the slices of the weights that give them.

Each rank holds a contiguous range of KV heads with the query heads of their groups (uneven splits
allowed: 3 KV heads over 2 ranks are 2 + 1), or, with fewer KV heads than ranks, one replicated KV
head and its share of that head's query heads. The MLP's intermediate dimension splits into
contiguous ranges that start and end on quantization-block boundaries of the down projection, so
its packed column slices are whole blocks. qkv and gate/up projections are column-parallel (their
output rows are sliced), o_proj and down_proj row-parallel (their input columns are sliced, their
outputs summed over the ranks by an all-reduce). Embedding, norms and the output head are whole on
every rank.

One rank computes the row-parallel projections the way `REDUCTION_PARTS` ranks would
(`PartedLinear`): each part's columns through a layer of their own, the partial sums added in rank
order, which is what an all-reduce over two ranks computes. Tensor parallelism over that many ranks
then repeats one rank's arithmetic exactly, and its outputs are one rank's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from gguf import GGML_QUANT_SIZES
from torch import nn

from tokenmill.errors import InvalidRequestError
from tokenmill.model.config import ModelConfig
from tokenmill.model.quant import GGMLWeight

# The ranks whose partial sums one rank's row-parallel projections reproduce (see PartedLinear)
REDUCTION_PARTS = 2


@dataclass(frozen=True)
class Shard:
    """One rank of `size` tensor-parallel ranks."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not one of {self.size} ranks")


@dataclass(frozen=True)
class ShardLayout:
    """The global indices one rank holds: query heads, KV heads, intermediate columns."""

    q_heads: range
    kv_heads: range
    ffn: range


def _split(count: int, parts: int) -> list[range]:
    """count items in `parts` contiguous ranges, the first ones one longer where it is uneven."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        ranges.append(range(start, end))
        start = end
    return ranges


def head_ranges(num_heads: int, num_kv_heads: int, size: int) -> list[tuple[range, range]]:
    """(query heads, KV heads) of each rank."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv = _split(num_kv_heads, size)
        return [(range(r.start * group, r.stop * group), r) for r in kv]
    if size % num_kv_heads or group % (size // num_kv_heads):
        raise InvalidRequestError(
            f"{num_kv_heads} KV heads with {num_heads} query heads cannot be shared by "
            f"{size} ranks: with fewer KV heads than ranks, the ranks must be a multiple of the "
            "KV heads and each KV head's query heads must split evenly among its ranks; choose "
            "another --tensor-parallel-size"
        )
    per_kv = size // num_kv_heads  # ranks sharing one KV head
    q_each = group // per_kv
    layouts = []
    for rank in range(size):
        kv, j = divmod(rank, per_kv)
        start = kv * group + j * q_each
        layouts.append((range(start, start + q_each), range(kv, kv + 1)))
    return layouts


def ffn_ranges(intermediate: int, size: int, align: int) -> list[range]:
    """Contiguous ranges of the intermediate dimension, each a whole number of `align` columns
    (the down projection's quantization block), as even as that allows."""
    units, rest = divmod(intermediate, align)
    if rest or units < size:
        raise InvalidRequestError(
            f"the MLP's {intermediate} intermediate columns cannot be split over {size} ranks "
            f"in whole quantization blocks of {align}; choose a smaller --tensor-parallel-size"
        )
    return [range(r.start * align, r.stop * align) for r in _split(units, size)]


def layout(cfg: ModelConfig, shard: Shard, ffn_align: int = 1) -> ShardLayout:
    if cfg.qk_norm_whole and shard.size > 1:
        raise InvalidRequestError(
            f"{cfg.architecture}'s q/k norms span every head of the projection, so a rank's "
            "share of the heads cannot be normalized alone; run it with --tensor-parallel-size 1"
        )
    q, kv = head_ranges(cfg.num_heads, cfg.num_kv_heads, shard.size)[shard.rank]
    ffn = ffn_ranges(cfg.intermediate_size, shard.size, ffn_align)[shard.rank]
    return ShardLayout(q_heads=q, kv_heads=kv, ffn=ffn)


def sharded_config(cfg: ModelConfig, lay: ShardLayout, size: int) -> ModelConfig:
    """The config of one rank's model: its own head and intermediate counts, the rest the same."""
    return replace(
        cfg,
        num_heads=len(lay.q_heads),
        num_kv_heads=len(lay.kv_heads),
        intermediate_size=len(lay.ffn),
        tensor_parallel_size=size,
        layer_types=list(cfg.layer_types),
    )


def block_elements(w: torch.Tensor | GGMLWeight) -> int:
    """Columns per quantization block of a weight (1 for a dense tensor)."""
    return GGML_QUANT_SIZES[w.qtype][0] if isinstance(w, GGMLWeight) else 1


def slice_rows(w: torch.Tensor | GGMLWeight, rows: range) -> torch.Tensor | GGMLWeight:
    """Rows [rows.start, rows.stop) of a weight or bias; a packed weight's rows are raw bytes."""
    if isinstance(w, GGMLWeight):
        return GGMLWeight(
            w.data[rows.start : rows.stop], w.qtype, (len(rows), w.shape[1]), w.release
        )
    return w[rows.start : rows.stop]


def slice_columns(
    w: torch.Tensor | GGMLWeight, cols: range, name: str
) -> torch.Tensor | GGMLWeight:
    """Columns [cols.start, cols.stop) of a weight. A packed weight's slice is whole blocks of each
    row's bytes; a split inside a block is refused (dequantizing it would give up the packed
    form)."""
    if not isinstance(w, GGMLWeight):
        return w[:, cols.start : cols.stop]
    block, type_size = GGML_QUANT_SIZES[w.qtype]
    if cols.start % block or cols.stop % block:
        raise InvalidRequestError(
            f"{name}: tensor parallelism splits its {w.shape[1]} columns at "
            f"{cols.start}..{cols.stop}, inside a {w.qtype.name} block of {block} columns; choose "
            "a --tensor-parallel-size whose head split falls on block boundaries, or load with "
            "--quantization none"
        )
    first, last = cols.start // block * type_size, cols.stop // block * type_size
    data = w.data[:, first:last].contiguous()
    return GGMLWeight(data, w.qtype, (w.shape[0], len(cols)), w.release)


def slice_packed(kind: str, data: tuple[torch.Tensor, ...], cols: range) -> tuple:
    """Columns of a packed form (see `quant_linear.packed_form`): int8 keeps its one scale per
    whole row; int4 and int5 slice their groups of 32 with their scales."""
    if kind == "int8":
        q8, scale = data
        return q8[:, cols.start : cols.stop].contiguous(), scale
    group = data[0].shape[1] // data[1].shape[1]
    if cols.start % group or cols.stop % group:
        raise ValueError(f"columns {cols.start}..{cols.stop} split a group of {group}")
    g0, g1 = cols.start // group, cols.stop // group
    q, scale, low = data
    return (
        q[:, cols.start : cols.stop].contiguous(),
        scale[:, g0:g1].contiguous(),
        low[:, g0:g1].contiguous(),
    )


class PartedLinear(nn.Module):
    """A row-parallel projection on one rank, computed as `len(parts)` ranks compute it: part i
    multiplies input columns columns[i] (with the bias, if any, in part 0, as rank 0 adds it) and
    the partial sums are added in order."""

    def __init__(self, parts: list[nn.Module], columns: list[range]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.columns = [(c.start, c.stop) for c in columns]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = None
        for (start, stop), part in zip(self.columns, self.parts):
            y = part(x[:, start:stop].contiguous())
            out = y if out is None else out + y
        return out
