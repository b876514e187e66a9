"""Block pool: free queue order and links, reference counts, the hash map, and block hashes."""

from __future__ import annotations

import random

import pytest

from tokenmill.engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tokenmill.engine.request import Sequence, SequenceStatus, hash_block_tokens


def make_sequence(tokens: list[int], extra_key: str | None = None, block_size: int = 4) -> Sequence:
    return Sequence("r", tokens, extra_key=extra_key, block_size=block_size)


def check_queue_links(queue: FreeBlockQueue) -> list[int]:
    """Walk the list both ways; return the ids front to back."""
    forward = list(queue)
    node, backward = queue._tail.prev_free, []
    while node is not queue._head:
        backward.append(node)
        node = node.prev_free
    assert forward == backward[::-1]
    assert len(forward) == len(queue)
    return [b.block_id for b in forward]


def test_free_queue_removes_from_middle_and_keeps_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert check_queue_links(queue) == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.remove(blocks[4])
    assert check_queue_links(queue) == [1, 3, 2]
    with pytest.raises(ValueError):
        queue.remove(blocks[4])
    for _ in range(3):
        queue.popleft()
    assert check_queue_links(queue) == []
    with pytest.raises(IndexError):
        queue.popleft()


def test_new_blocks_come_from_the_head_and_evict_their_hash() -> None:
    pool = BlockPool(4)
    request = make_sequence(list(range(8)))
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1] and all(b.ref_cnt == 1 for b in blocks)
    pool.cache_full_blocks(request, blocks, 0, 2)
    assert pool.get_cached_block(request.block_hashes[1]) is blocks[1]
    pool.free_blocks(reversed(blocks))
    assert check_queue_links(pool.free_queue) == [2, 3, 1, 0]
    assert pool.usage == 0.0
    # The never-used blocks go first, then the freed tail block 1 loses its cached content.
    assert [b.block_id for b in pool.get_new_blocks(3)] == [2, 3, 1]
    assert pool.get_cached_block(request.block_hashes[1]) is None
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(request.block_hashes[0]) is blocks[0]
    assert pool.usage == 0.75
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_touch_takes_a_free_cached_block_off_the_queue() -> None:
    pool = BlockPool(3)
    request = make_sequence(list(range(4)))
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [block], 0, 1)
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    assert block not in pool.get_new_blocks(2)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 0


def test_duplicate_content_is_not_cached_twice() -> None:
    pool = BlockPool(2)
    first, second = make_sequence(list(range(4))), make_sequence(list(range(4)))
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(first, [a], 0, 1)
    pool.cache_full_blocks(second, [b], 0, 1)
    assert pool.get_cached_block(first.block_hashes[0]) is a
    assert b.block_hash is None


def test_reset_prefix_cache_waits_for_all_blocks_to_be_free() -> None:
    pool = BlockPool(2)
    request = make_sequence(list(range(4)))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and blocks[0].block_hash is None


def test_caching_disabled_caches_nothing() -> None:
    pool = BlockPool(2, enable_caching=False)
    request = make_sequence(list(range(4)))
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, blocks, 0, 1)
    assert pool.cached == {} and blocks[0].block_hash is None


def scratch_hashes(tokens: list[int], block_size: int, extra_key: str | None) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hashes.append(
            hash_block_tokens(
                hashes[-1] if hashes else None, tokens[start : start + block_size], extra_key
            )
        )
    return hashes


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_block_hashes_are_incremental_and_match_from_scratch(block_size: int) -> None:
    rng = random.Random(block_size)
    prompt = [rng.randrange(50000) for _ in range(37)]
    request = Sequence("r", prompt, extra_key="lora-1", block_size=block_size)
    for _ in range(70):
        before = list(request.block_hashes)
        request.append_output_token(rng.randrange(50000))
        assert request.block_hashes[: len(before)] == before  # only ever extended
        assert len(request.block_hashes) == request.num_tokens // block_size
    assert request.block_hashes == scratch_hashes(request.all_token_ids, block_size, "lora-1")
    assert request.all_token_ids == request.prompt_token_ids + request.output_token_ids
    assert (
        request.num_tokens == 107
        and request.num_prompt_tokens == 37
        and request.num_output_tokens == 70
    )
    resumed = Sequence(
        "r2",
        request.all_token_ids[:37],
        extra_key="lora-1",
        block_size=block_size,
        output_token_ids=request.output_token_ids[:],
    )
    assert resumed.block_hashes == request.block_hashes


def test_block_hash_depends_on_parent_tokens_and_extra_key() -> None:
    tokens = [1, 2, 3, 4]
    base = hash_block_tokens(None, tokens, None)
    assert base == hash_block_tokens(None, tokens, None)
    assert (
        len(
            {
                base,
                hash_block_tokens(None, tokens, ""),
                hash_block_tokens(None, tokens, "a"),
                hash_block_tokens(base, tokens, None),
                hash_block_tokens(None, [1, 2, 3, 5], None),
            }
        )
        == 5
    )


def test_sequence_status_is_finished() -> None:
    finished = {s for s in SequenceStatus if s.is_finished}
    assert finished == {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    }
