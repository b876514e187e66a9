"""Paged KV caches filled with random rows, and block tables over them, for the attention tests."""

from __future__ import annotations

import torch

from tokenmill.model.attention import KVCache


def filled_cache(
    block_size: int,
    num_blocks: int,
    cache_dtype: torch.dtype,
    kv_heads: int = 2,
    head_dim: int = 32,
) -> KVCache:
    """A one-layer cache with random K and V in every slot but the zero pad slot."""
    cache = KVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=cache_dtype,
    )
    cache.k[0][:-1].normal_()
    cache.v[0][:-1].normal_()
    return cache


def block_tables(context_lens: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    """Block tables for these contexts, blocks out of order."""
    order, tables = torch.randperm(num_blocks).tolist(), []
    for context in context_lens:
        tables.append(order[: -(-context // block_size)])
        order = order[len(tables[-1]) :]
    return tables
