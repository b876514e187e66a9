"""The pool of KV cache blocks: allocation, reference counts and the prefix cache.

A block is either in use (ref_cnt > 0, in one or more block tables) or free (ref_cnt == 0, in
the free queue). A free block may still hold a cached full block of tokens, findable by its
hash: it is reused in place by a prefix-cache hit (`touch`) until an allocation needs the
space. Allocations take the head of the free queue and frees append to its tail, so the queue is
the eviction order: least recently freed first.

With `record_events` on, the pool also logs every change to the prefix cache (a hash stored, a
hash evicted) in order, for a router that tracks which replica holds which prefixes; the reader
takes them with `drain_events`.

There is no reserved "null" block: block 0 is an ordinary block. (Attention pads block tables
with 0 but masks those positions out and never writes them.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from tokenmill.engine.request import BlockHash, Sequence

CacheEvent = tuple[bool, BlockHash]
"""A change to the prefix cache: (True, hash) when a block is stored, (False, hash) when evicted."""


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # set only while in the cache map
    block_hash: BlockHash | None = field(default=None, repr=False)
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    A deque cannot drop a block from the middle in O(1), which a prefix-cache hit on a free block
    needs. Sentinel head and tail nodes keep every operation branch-free.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail and node is not None:
            yield node
            node = node.next_free


class BlockPool:
    """All `num_blocks` blocks, the free queue, and the hash -> block map of cached blocks.

    The map holds one block per hash: when a block fills with content that is already cached
    elsewhere, it stays uncached (no dedup), so block tables never change under a sequence.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # one past the highest block id ever handed out (fresh blocks go in id order)
        self.used_end = 0
        # changes to `cached` since the last drain_events; None: not recorded
        self.events: list[CacheEvent] | None = None

    def record_events(self) -> None:
        """Start logging prefix-cache changes (see `drain_events`)."""
        if self.events is None:
            self.events = []

    def drain_events(self) -> list[CacheEvent]:
        """The prefix-cache changes since the last call, oldest first (empty unless recording)."""
        events, self.events = self.events, [] if self.events is not None else None
        return events or []

    def _evicted(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        if self.events is not None:
            self.events.append((False, block.block_hash))
        block.block_hash = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use; free blocks holding cached content count as unused."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take n blocks (ref_cnt 1) from the head of the free queue, evicting their cached
        content."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks: only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evicted(block)
            block.ref_cnt = 1
            blocks.append(block)
        self.used_end = max(self.used_end, max((b.block_id for b in blocks), default=-1) + 1)
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit), pulling free ones off the
        queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; those reaching 0 join the free queue in the given
        order.

        Callers pass a sequence's table tail first: the tail of a sequence is the part least
        likely to be shared, so it should be evicted before the prefix.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Withdraw blocks from the prefix cache (their contents may never have been computed)."""
        for block in blocks:
            if block.block_hash is not None:
                self._evicted(block)

    def cache_full_blocks(
        self,
        seq: Sequence,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Publish blocks[num_cached_blocks:num_full_blocks], now full, under the sequence's
        block hashes."""
        if not self.enable_caching:
            return
        if num_full_blocks > len(seq.block_hashes):
            raise ValueError(f"sequence {seq.seq_id} has only {len(seq.block_hashes)} full blocks")
        for block, block_hash in zip(
            blocks[num_cached_blocks:num_full_blocks],
            seq.block_hashes[num_cached_blocks:num_full_blocks],
        ):
            if block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block
                if self.events is not None:
                    self.events.append((True, block_hash))

    def publish(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Put one block, whose contents were written outside a step (a KV transfer), in the
        prefix cache under this hash; the hash must not be cached yet."""
        if not self.enable_caching or block_hash in self.cached:
            raise ValueError("prefix caching is off, or the block is cached already")
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.events is not None:
            self.events.append((True, block_hash))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content (e.g. after a weight update); refused while any block is in
        use, since running sequences would go on to cache blocks computed before the reset."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in list(self.cached.values()):
            self._evicted(block)
        return True
