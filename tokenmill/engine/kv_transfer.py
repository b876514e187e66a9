"""Moving a prompt's KV cache between engines, through the prefix cache (prefill/decode
disaggregation, see `DataParallelEngine`).

The prefill engine runs the prompt, whose full blocks then stay in its prefix cache;
`export_prefix` copies the K/V of the leading blocks it holds. The decode engine's
`import_prefix` writes them into free blocks of its own pool and publishes them in its prefix
cache under the same hashes, so that the request, queued there next, finds them as a cache hit
and computes only its last partial block. Both engines must run the same model with the same
block size and KV dtype. Call both on the engine's thread (`AsyncLLMEngine.call`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request import BlockHash


@dataclass
class PrefixKV:
    """The K/V of a run of leading blocks: (layers, blocks * block_size, kv_heads, head_dim)."""

    block_hashes: list[BlockHash]
    k: torch.Tensor
    v: torch.Tensor


def _slots(block_ids: list[int], block_size: int) -> torch.Tensor:
    starts = torch.tensor(block_ids, dtype=torch.int64) * block_size
    return (starts[:, None] + torch.arange(block_size)).reshape(-1)


def export_prefix(engine: LLMEngine, block_hashes: list[BlockHash]) -> PrefixKV:
    """The K/V of the leading blocks of block_hashes that the engine's prefix cache holds."""
    pool = engine.kv.block_pool
    ids: list[int] = []
    for block_hash in block_hashes:
        block = pool.get_cached_block(block_hash)
        if block is None:
            break
        ids.append(block.block_id)
    cache = engine.runner.cache
    slots = _slots(ids, cache.block_size)
    return PrefixKV(
        block_hashes[: len(ids)],
        torch.stack([k[slots] for k in cache.k]),
        torch.stack([v[slots] for v in cache.v]),
    )


def import_prefix(engine: LLMEngine, kv: PrefixKV) -> int:
    """Publish the blocks of kv in the engine's prefix cache (those it lacks); returns how many
    leading blocks it holds afterwards. Stops early when the pool has no free block to spare."""
    pool = engine.kv.block_pool
    cache = engine.runner.cache
    size = cache.block_size
    held = []  # every block of the run, pinned while the run is written
    try:
        for i, block_hash in enumerate(kv.block_hashes):
            block = pool.get_cached_block(block_hash)
            if block is not None:
                pool.touch([block])
            elif pool.num_free_blocks:
                block = pool.get_new_blocks(1)[0]
                rows = slice(i * size, (i + 1) * size)
                slots = slice(block.block_id * size, (block.block_id + 1) * size)
                for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
                    k[slots] = kv.k[layer, rows]
                    v[slots] = kv.v[layer, rows]
                pool.publish(block, block_hash)
            else:
                break
            held.append(block)
    finally:
        pool.free_blocks(reversed(held))  # cached and free: the tail is evicted first
    return len(held)
