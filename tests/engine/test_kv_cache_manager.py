"""KV cache manager: prefix hits, LRU eviction, all-or-nothing allocation, and a leak/consistency
simulation of a scheduler that also checks every request reads back exactly its own tokens."""

from __future__ import annotations

import random

import pytest

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Sequence, SequenceStatus

BS = 16


def make_sequence(
    rid: str, tokens: list[int], extra_key: str | None = None, block_size: int = BS
) -> Sequence:
    return Sequence(rid, tokens, extra_key=extra_key, block_size=block_size)


def schedule_prompt(manager: KVCacheManager, request: Sequence) -> list[int]:
    """Hit the cache, allocate the rest of the prompt and mark it computed; returns the block
    ids."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit) is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.seq_id)


def test_shared_prefix_hits_its_full_blocks() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    prefix = list(range(1000, 1200))
    first = make_sequence("a", prefix + list(range(30)))
    first_ids = schedule_prompt(manager, first)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (230, 0)

    second = make_sequence("b", prefix + list(range(100, 140)))
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 192 and [b.block_id for b in hits] == first_ids[:12]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (470, 192)
    new_blocks = manager.allocate_slots(second, second.num_tokens - num_hit, hits, num_hit)
    assert new_blocks is not None and len(new_blocks) == 3  # 240 tokens = 15 blocks, 12 shared
    assert manager.get_block_ids("b")[:12] == first_ids[:12]
    assert all(b.ref_cnt == 2 for b in hits)
    assert manager.num_free_blocks == 64 - 15 - 3

    other_key = make_sequence("c", prefix + list(range(30)), extra_key="adapter-7")
    assert manager.get_computed_blocks(other_key) == ([], 0)


@pytest.mark.parametrize(("prompt_len", "expected_hit"), [(64, 48), (70, 64), (16, 0), (1, 0)])
def test_a_fully_cached_prompt_still_computes_a_token(prompt_len: int, expected_hit: int) -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    schedule_prompt(manager, make_sequence("a", list(range(prompt_len))))
    again = make_sequence("b", list(range(prompt_len)))
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == expected_hit == len(hits) * BS
    assert num_hit < again.num_tokens


def test_decoded_blocks_are_cached_once_computed() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    request = make_sequence("a", list(range(10)))
    schedule_prompt(manager, request)
    request.append_output_token(500)
    while request.num_tokens < 33:  # decode: compute the last token, sample the next
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        request.append_output_token(500 + request.num_tokens)
    assert len(manager.get_block_ids("a")) == 2  # 32 computed tokens; token 33 not yet scheduled
    follower = make_sequence("b", request.all_token_ids[:])
    hits, num_hit = manager.get_computed_blocks(follower)
    assert num_hit == 32 and [b.block_id for b in hits] == manager.get_block_ids("a")


def test_parallel_samples_share_the_prompt_through_the_cache() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(50))
    parent_ids = schedule_prompt(manager, make_sequence("p", prompt))
    for i in range(3):
        assert schedule_prompt(manager, make_sequence(f"c{i}", prompt))[:3] == parent_ids[:3]
    assert [manager.block_pool.blocks[i].ref_cnt for i in parent_ids] == [4, 4, 4, 1]
    assert manager.num_free_blocks == 16 - 4 - 3


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_freed_first() -> None:
    manager = KVCacheManager(num_blocks=12, block_size=BS)
    a, b = make_sequence("a", list(range(49))), make_sequence("b", list(range(100, 149)))
    a_ids, b_ids = schedule_prompt(manager, a), schedule_prompt(manager, b)
    manager.free(a)
    manager.free(b)
    manager.free(b)  # idempotent
    assert manager.num_free_blocks == 12 and manager.get_block_ids("a") == []
    queue = [blk.block_id for blk in manager.block_pool.free_queue]
    assert queue == [8, 9, 10, 11] + a_ids[::-1] + b_ids[::-1]

    # 5 new blocks: the 4 never used, then a's uncached tail block; both prefixes stay cached.
    filler = make_sequence("f", list(range(500, 580)))
    assert [blk.block_id for blk in manager.allocate_slots(filler, 80)] == [8, 9, 10, 11, a_ids[3]]
    assert manager.get_computed_blocks(make_sequence("a2", a.prompt_token_ids))[1] == 48

    # b's prefix is hit: touched off the free queue, so the allocations below never get it.
    b2 = make_sequence("b2", b.prompt_token_ids)
    hits, num_hit = manager.get_computed_blocks(b2)
    assert num_hit == 48
    assert manager.allocate_slots(b2, 1, hits, num_hit) is not None
    assert manager.get_block_ids("b2") == b_ids[:3] + [a_ids[2]]  # a's last cached block evicted
    assert manager.get_computed_blocks(make_sequence("a3", a.prompt_token_ids))[1] == 32
    taken = manager.allocate_slots(make_sequence("g", list(range(700, 732))), 32)
    assert [blk.block_id for blk in taken] == [a_ids[1], a_ids[0]]
    assert manager.num_free_blocks == 1 and not set(b_ids[:3]) & {blk.block_id for blk in taken}
    assert [blk.block_id for blk in manager.block_pool.free_queue] == [b_ids[3]]


def snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (
        [(blk.ref_cnt, blk.block_hash) for blk in pool.blocks],
        [blk.block_id for blk in pool.free_queue],
        dict(pool.cached),
        {rid: list(table) for rid, table in manager._tables.items()},
        dict(manager._num_cached_blocks),
    )


def test_allocate_slots_is_all_or_nothing() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    cached = make_sequence("a", list(range(65)))
    schedule_prompt(manager, cached)  # 5 blocks, the first 4 cached
    manager.free(cached)
    # the 3 never used + a's uncached tail
    schedule_prompt(manager, make_sequence("b", list(range(900, 964))))

    # 4 free blocks, all of them hits: touching them leaves none for the 2 new blocks needed.
    again = make_sequence("c", list(range(65)) + list(range(200, 216)))
    hits, num_hit = manager.get_computed_blocks(again)
    assert num_hit == 64 and manager.num_free_blocks == 4
    before = snapshot(manager)
    assert manager.allocate_slots(again, again.num_tokens - num_hit, hits, num_hit) is None
    assert snapshot(manager) == before
    assert manager.get_block_ids("c") == []

    big = make_sequence("d", list(range(300, 400)))
    assert manager.allocate_slots(big, 100) is None
    assert snapshot(manager) == before
    # 3 hits + 1 new block fit exactly: the new block is the 4th free one (evicting a's last cached
    # block).
    exact = make_sequence("e", list(range(64)))
    hits, num_hit = manager.get_computed_blocks(exact)
    assert num_hit == 48
    assert manager.allocate_slots(exact, 16, hits, num_hit) is not None
    assert manager.num_free_blocks == 0


def test_stale_hits_and_bad_arguments_are_refused() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_sequence("a", list(range(33)))
    schedule_prompt(manager, a)
    manager.free(a)
    b = make_sequence("b", list(range(33)))
    hits, num_hit = manager.get_computed_blocks(b)
    with pytest.raises(ValueError):
        manager.allocate_slots(b, 1, hits, num_hit + 1)
    with pytest.raises(ValueError):
        manager.allocate_slots(b, 1, None, 16)
    manager.allocate_slots(make_sequence("x", list(range(100, 164))), 64)  # evicts b's hits
    with pytest.raises(RuntimeError):
        manager.allocate_slots(b, 1, hits, num_hit)
    with pytest.raises(ValueError):
        manager.get_computed_blocks(make_sequence("y", [1] * 40, block_size=8))


def test_reset_prefix_cache_and_disabled_caching() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_sequence("a", list(range(40)))
    schedule_prompt(manager, a)
    assert not manager.reset_prefix_cache()
    manager.free(a)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_sequence("b", list(range(40)))) == ([], 0)

    plain = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    schedule_prompt(plain, make_sequence("a", list(range(40))))
    assert plain.get_computed_blocks(make_sequence("b", list(range(40)))) == ([], 0)
    assert plain.block_pool.cached == {} and plain.prefix_cache_queries == 0
    assert plain.num_total_blocks == 8 and plain.usage == 3 / 8


# --- randomized scheduler simulation ---------------------------------------------------------


class Simulation:
    """A toy scheduler over a small pool. `slots` stands in for the KV cache: each computed token
    writes (extra_key, token) at its slot, and every running request must read back exactly its
    own tokens through its block table, so a wrong hit or a block reused too early shows up."""

    def __init__(self, seed: int, num_blocks: int = 48, block_size: int = 4) -> None:
        self.rng = random.Random(seed)
        self.bs = block_size
        self.manager = KVCacheManager(num_blocks, block_size)
        self.slots: list[tuple | None] = [None] * (num_blocks * block_size)
        self.prefixes = [
            [self.rng.randrange(100) for _ in range(self.rng.randrange(1, 40))] for _ in range(4)
        ]
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.max_out: dict[str, int] = {}
        self.next_id = 0
        self.num_preemptions = 0

    def new_request(self) -> None:
        prompt = self.rng.choice(self.prefixes) + [
            self.rng.randrange(100) for _ in range(self.rng.randrange(0, 30))
        ]
        if not prompt:
            prompt = [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = Sequence(
            rid, prompt, extra_key=self.rng.choice([None, None, "lora"]), block_size=self.bs
        )
        self.max_out[rid] = self.rng.randrange(1, 40)
        self.waiting.append(request)

    def compute(self, request: Sequence, num_tokens: int) -> None:
        table = self.manager.get_block_ids(request.seq_id)
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_tokens):
            block = self.manager.block_pool.blocks[table[pos // self.bs]]
            assert block.ref_cnt == 1, "writing into a shared block"
            self.slots[block.block_id * self.bs + pos % self.bs] = (
                request.extra_key,
                request.all_token_ids[pos],
            )
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(self.rng.randrange(100))

    def step(self) -> None:
        rng, manager = self.rng, self.manager
        if rng.random() < 0.3:
            self.new_request()
        for request in list(self.running):
            if request not in self.running:  # preempted earlier in this step
                continue
            num_new = min(rng.randrange(1, 20), request.num_tokens - request.num_computed_tokens)
            if manager.allocate_slots(request, num_new) is None:
                self.preempt(rng.choice(self.running))
                continue
            self.compute(request, num_new)
            if request.num_output_tokens >= self.max_out[request.seq_id]:
                self.finish(request, SequenceStatus.FINISHED_LENGTH)
        if self.waiting:
            request = self.waiting[0]
            hits, num_hit = manager.get_computed_blocks(request)
            num_new = min(rng.randrange(1, 40), request.num_tokens - num_hit)
            if manager.allocate_slots(request, num_new, hits, num_hit) is not None:
                request.num_computed_tokens = num_hit
                self.compute(request, num_new)
                request.status = SequenceStatus.RUNNING
                self.running.append(self.waiting.pop(0))
        if self.running and rng.random() < 0.05:
            self.finish(rng.choice(self.running), SequenceStatus.FINISHED_ABORTED)

    def preempt(self, request: Sequence) -> None:
        if request not in self.running:
            return
        self.manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = SequenceStatus.PREEMPTED
        self.running.remove(request)
        self.waiting.insert(0, request)

    def finish(self, request: Sequence, status: SequenceStatus) -> None:
        if request in self.running:
            self.running.remove(request)
            request.status = status
            self.manager.free(request)

    def check(self) -> None:
        manager, pool, bs = self.manager, self.manager.block_pool, self.bs
        refs = [0] * pool.num_blocks
        for request in self.running:
            table = manager.get_block_ids(request.seq_id)
            assert len(table) == -(-request.num_computed_tokens // bs)
            for block_id in table:
                refs[block_id] += 1
            for pos in range(request.num_computed_tokens):
                slot = table[pos // bs] * bs + pos % bs
                assert self.slots[slot] == (request.extra_key, request.all_token_ids[pos])
        assert [blk.ref_cnt for blk in pool.blocks] == refs
        free = [blk.block_id for blk in pool.free_queue]
        assert sorted(free) == [i for i, r in enumerate(refs) if r == 0]
        assert len(pool.free_queue) == len(free) == manager.num_free_blocks
        assert all(blk.block_hash == h for h, blk in pool.cached.items())
        assert sum(blk.block_hash is not None for blk in pool.blocks) == len(pool.cached)


@pytest.mark.parametrize("seed", range(6))
def test_random_schedule_never_leaks_or_corrupts(seed: int) -> None:
    sim = Simulation(seed)
    for _ in range(400):
        sim.step()
        sim.check()
    assert sim.manager.prefix_cache_hits > 0
    assert sim.num_preemptions > 0
    for request in sim.running + sim.waiting:
        sim.manager.free(request)
    sim.running.clear()
    sim.check()
    pool = sim.manager.block_pool
    assert sim.manager.num_free_blocks == pool.num_blocks and sim.manager.usage == 0.0
    assert all(blk.ref_cnt == 0 for blk in pool.blocks)
    assert sim.manager._tables == {} and sim.manager._num_cached_blocks == {}
    check_links = list(pool.free_queue)
    assert (
        len(check_links) == pool.num_blocks
        and len({blk.block_id for blk in check_links}) == pool.num_blocks
    )
    assert (
        pool.free_queue._head.next_free is check_links[0]
        and pool.free_queue._tail.prev_free is check_links[-1]
    )
    assert all(a.next_free is b and b.prev_free is a for a, b in zip(check_links, check_links[1:]))
