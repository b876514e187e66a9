"""The KV pool's memory: how many blocks a budget buys, and warming the pool while idle."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import psutil

from tokenmill.engine.block_pool import BlockPool
from tokenmill.errors import InvalidRequestError
from tokenmill.model.attention import KVCache, resolve_kv_cache_dtype
from tokenmill.model.loader import LoadedModel

GiB = 1 << 30
# `KVWarmer` writes this much of one of the pool's tensors a call: the delay it can add to a
# request that arrives meanwhile (smaller: more calls to warm the pool; see the tuning log)
KV_WARM_BYTES = 2 << 20
# ... and keeps this much of the pool warm past the blocks used so far, not all of it: the
# process stays as large as its use
KV_WARM_AHEAD = 1 * GiB


def default_kv_budget(available: int) -> int:
    """A quarter of the free RAM, at most 4 GiB, rounded down to a power of two: the compiled
    decode graphs are specialized to the pool's size, and a size that followed the free memory
    exactly would need a new graph (minutes of compilation) on almost every start."""
    quarter = max(available // 4, 1)
    return min(4 * GiB, 1 << (quarter.bit_length() - 1))


def blocks_for_budget(
    budget: int | None, loaded: LoadedModel, block_size: int, kv_cache_dtype: str
) -> int:
    """The KV blocks that `budget` bytes hold (default: `default_kv_budget` of the free RAM) for
    this model, with the KV cache dtype `kv_cache_dtype` (see `resolve_kv_cache_dtype`)."""
    budget = budget or default_kv_budget(psutil.virtual_memory().available)
    config = loaded.config
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, loaded.dtype, loaded.model.device.type)
    per_block = KVCache.bytes_per_block(
        config.num_layers,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        dtype,
        shared_kv=config.latent_kv,
        shapes=config.kv_cache_shapes(),  # each layer's own, none for layers sharing a cache
    )
    if budget < per_block:
        raise InvalidRequestError(
            f"KV cache memory {budget} bytes holds no block of {per_block} bytes"
        )
    return budget // per_block


class KVWarmer:
    """Faults in the KV pool a little at a time, while the engine has nothing to run.

    The pool is allocated unwritten (zeroing gigabytes would delay the start by seconds), so the
    step that first writes a block pays for its memory, with the other cores waiting. Each `warm`
    call writes `KV_WARM_BYTES` of one layer's keys or values, up to `KV_WARM_AHEAD` past the
    blocks used so far. Only blocks that no sequence holds and the prefix cache does not keep are
    written (zeros: their contents are never read unwritten).
    """

    def __init__(self, cache: KVCache, pool: BlockPool) -> None:
        self._units = self._warm_units(cache, pool)

    def warm(self) -> bool:
        """Warm one more unit; False while the pool is warm `KV_WARM_AHEAD` past its use."""
        return next(self._units, False)

    @staticmethod
    def _warm_units(cache: KVCache, pool: BlockPool) -> Iterator[bool]:
        if cache.k[0].device.type != "cpu":  # device memory is resident once allocated
            return
        blocks, tensors = pool.blocks, cache.tensors
        block_bytes = [t[: cache.block_size].nbytes for t in tensors]  # layers may differ
        span = max(1, KV_WARM_BYTES // max(block_bytes))
        ahead = KV_WARM_AHEAD // sum(block_bytes)
        for first in range(0, len(blocks), span):
            while first >= pool.used_end + ahead:
                yield False
            for tensor in tensors:
                # found again for each tensor: steps may have taken or cached blocks in between
                ids = range(first, min(len(blocks), first + span))
                for unheld, run in itertools.groupby(
                    ids, key=lambda i: blocks[i].ref_cnt == 0 and blocks[i].block_hash is None
                ):
                    if unheld:
                        run = list(run)
                        cache.zero_blocks(tensor, run[0], run[-1] + 1)
                yield True
