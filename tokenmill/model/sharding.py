"""Tensor-parallel shards of the generic decoder: which heads, which part of the MLP's
intermediate size and which part of the hidden size each of N ranks holds, and the rows of the
weights that give them.

Each rank holds a contiguous range of KV heads with the query heads of their groups (uneven splits
allowed: 3 KV heads over 2 ranks are 2 + 1), or, with fewer KV heads than ranks, one replicated KV
head and its share of that head's query heads; and contiguous ranges of the intermediate and hidden
sizes. Every projection is column-parallel: a rank computes some of its output rows over the whole
input. qkv and gate/up compute this rank's heads and intermediate rows; the ranks then gather the
attention output (every head) and the intermediate activations, and o_proj and down_proj compute
this rank's rows of the hidden size, which the ranks gather again. Each output element is thus one
rank's whole sum, in the order one rank alone sums it, so tensor parallelism gives one rank's
results bit for bit; Megatron's row-parallel o_proj and down_proj, whose partial sums an all-reduce
adds, would add them in another order. Embedding, norms and the output head are whole on every
rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tokenmill.errors import InvalidRequestError
from tokenmill.model.config import GatherWidths, ModelConfig
from tokenmill.model.quant import GGMLWeight
from tokenmill.model.quant_linear import TILE_ROWS


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
    """The global indices one rank holds: query heads, KV heads, intermediate columns, and the
    output rows of o_proj and down_proj."""

    q_heads: range
    kv_heads: range
    ffn: range
    hidden: range


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


def row_ranges(count: int, size: int, what: str) -> list[range]:
    """Contiguous ranges of `count` output rows (of the MLP's intermediate size, or of the hidden
    size), as even as whole tiles of the packed kernels (`TILE_ROWS`) allow where `count` is made
    of them, so that a rank's rows take the kernel and layout one rank's would."""
    if count < size:
        raise InvalidRequestError(
            f"the model's {count} {what} cannot be split over {size} ranks; choose a smaller "
            "--tensor-parallel-size"
        )
    align = TILE_ROWS if count % TILE_ROWS == 0 and count // TILE_ROWS >= size else 1
    return [range(r.start * align, r.stop * align) for r in _split(count // align, size)]


def layout(cfg: ModelConfig, shard: Shard) -> ShardLayout:
    if cfg.qk_norm_whole and shard.size > 1:
        raise InvalidRequestError(
            f"{cfg.architecture}'s q/k norms span every head of the projection, so a rank's "
            "share of the heads cannot be normalized alone; run it with --tensor-parallel-size 1"
        )
    q, kv = head_ranges(cfg.num_heads, cfg.num_kv_heads, shard.size)[shard.rank]
    ffn = row_ranges(cfg.intermediate_size, shard.size, "intermediate columns")[shard.rank]
    hidden = row_ranges(cfg.hidden_size, shard.size, "hidden dimensions")[shard.rank]
    return ShardLayout(q_heads=q, kv_heads=kv, ffn=ffn, hidden=hidden)


def sharded_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of one rank's model: its own head and intermediate counts, every rank's
    contributions to the gathers, the rest the same."""
    lays = [layout(cfg, Shard(r, shard.size)) for r in range(shard.size)]
    lay = lays[shard.rank]
    return replace(
        cfg,
        num_heads=len(lay.q_heads),
        num_kv_heads=len(lay.kv_heads),
        intermediate_size=len(lay.ffn),
        gather=GatherWidths(
            attention=tuple(len(r.q_heads) * cfg.head_dim for r in lays),
            intermediate=tuple(len(r.ffn) for r in lays),
            hidden=tuple(len(r.hidden) for r in lays),
        ),
        layer_types=list(cfg.layer_types),
    )


def slice_rows(w: torch.Tensor | GGMLWeight, rows: range) -> torch.Tensor | GGMLWeight:
    """Rows [rows.start, rows.stop) of a weight or bias; a packed weight's rows are raw bytes."""
    if isinstance(w, GGMLWeight):
        return GGMLWeight(
            w.data[rows.start : rows.stop], w.qtype, (len(rows), w.shape[1]), w.release
        )
    return w[rows.start : rows.stop]
