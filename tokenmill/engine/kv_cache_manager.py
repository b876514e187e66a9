"""Per-sequence block tables on top of the block pool, with automatic prefix caching.

Each step the scheduler, for a sequence it is about to run:
  1. if the sequence has no blocks yet (new, or preempted), asks `get_computed_blocks` for the
     longest cached prefix and passes the result straight to
  2. `allocate_slots`, which touches those blocks, grows the block table for the new tokens, or
     returns None when the pool cannot fit them (the scheduler then preempts or waits);
  3. adds the number of tokens computed to `seq.num_computed_tokens` after the step, and
     calls `free` when the sequence finishes, is aborted or is preempted (then resetting
     `num_computed_tokens` to 0 itself).
Nothing may allocate between steps 1 and 2: an allocation could evict the blocks just found.

A block joins the prefix cache in the `allocate_slots` call whose step fills it, before the
forward pass has run. A sequence scheduled later in the same step may hit it: that is safe
because each attention layer writes the whole step's K/V before any sequence reads its context.

Parallel sampling (n > 1) needs nothing special: the n sequences of a request have the same
prompt and extra key. Once the first one is scheduled, the others find its full prompt blocks in
the prefix cache (all but the block holding the last prompt token, which each sequence computes
itself to get its own logits) and share them by reference count. With prefix caching disabled,
each sequence computes the whole prompt.
"""

from __future__ import annotations

from tokenmill.engine.block_pool import BlockPool, KVCacheBlock
from tokenmill.engine.request import Sequence


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self._tables: dict[str, list[KVCacheBlock]] = {}
        # Leading blocks of each table already published to the prefix cache (or hits from it).
        self._num_cached_blocks: dict[str, int] = {}
        # Cumulative token counts: tokens looked up, and tokens found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the sequence, and its token count.

        The hit stops short of the last token: the model must run at least one token of the
        sequence to produce logits. This may recompute up to a whole block, since hits are whole
        blocks.
        """
        if not self.enable_prefix_caching:
            return [], 0
        self._check_block_size(seq)
        max_blocks = max(seq.num_tokens - 1, 0) // self.block_size
        blocks = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_tokens
        return blocks, num_tokens

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the computed ones (and the new hits).

        Returns the blocks newly allocated (the table's tail beyond the hits), or None, changing
        nothing, when the free blocks cannot cover them.
        """
        self._check_block_size(seq)
        hits = new_computed_blocks or []
        table = self._tables.get(seq.seq_id, [])
        if hits:
            self._check_hits(seq, table, hits, num_new_computed_tokens)
        elif num_new_computed_tokens:
            raise ValueError("num_new_computed_tokens given without new_computed_blocks")

        num_tokens = seq.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = max(-(-num_tokens // self.block_size) - len(table) - len(hits), 0)
        # Touching a free hit takes it off the free queue, so it can't also serve as a new block.
        num_free_hits = sum(1 for block in hits if block.ref_cnt == 0)
        if num_needed > self.block_pool.num_free_blocks - num_free_hits:
            return None

        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        table.extend(hits)
        table.extend(new_blocks)
        self._tables[seq.seq_id] = table
        if self.enable_prefix_caching:
            num_cached = self._num_cached_blocks.get(seq.seq_id, len(hits))
            # Publish the blocks that will be full of known, computed tokens once this step has run.
            num_full = min(num_tokens, seq.num_tokens) // self.block_size
            if num_full > num_cached:
                self.block_pool.cache_full_blocks(seq, table, num_cached, num_full)
                num_cached = num_full
            self._num_cached_blocks[seq.seq_id] = num_cached
        return new_blocks

    def free(self, seq: Sequence, uncache: bool = False) -> None:
        """Release the sequence's blocks, tail first so its prefix stays cached longest. Idempotent.

        With uncache, its blocks also leave the prefix cache: after a failed step they were
        published but perhaps never written.
        """
        table = self._tables.pop(seq.seq_id, None)
        self._num_cached_blocks.pop(seq.seq_id, None)
        if table is not None:
            if uncache:
                self.block_pool.uncache(table)
            self.block_pool.free_blocks(reversed(table))

    def get_block_ids(self, seq_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(seq_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content; False (nothing done) while any sequence holds blocks."""
        return self.block_pool.reset_prefix_cache()

    def _check_block_size(self, seq: Sequence) -> None:
        if seq.block_size != self.block_size:
            raise ValueError(
                f"sequence {seq.seq_id} hashes blocks of {seq.block_size} tokens, "
                f"the cache uses {self.block_size}"
            )

    def _check_hits(
        self, seq: Sequence, table: list[KVCacheBlock], hits: list[KVCacheBlock], num_tokens: int
    ) -> None:
        """Hits must start an empty table and still be cached under the sequence's own hashes;
        a mismatch means the scheduler let something evict them after `get_computed_blocks`."""
        if table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} already has computed blocks")
        if num_tokens != len(hits) * self.block_size:
            raise ValueError(f"{len(hits)} computed blocks do not hold {num_tokens} tokens")
        for block, block_hash in zip(hits, seq.block_hashes):
            if block.block_hash != block_hash:
                raise RuntimeError(
                    f"block {block.block_id} was evicted before sequence {seq.seq_id} took it"
                )
