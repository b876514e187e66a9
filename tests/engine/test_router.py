"""The data-parallel router: prefix routing, load as tie-break and counterweight, the plain
policies, and the prefix-cache events it reads from a block pool."""

from __future__ import annotations

import pytest

from tokenmill.engine.block_pool import BlockPool
from tokenmill.engine.request import Sequence
from tokenmill.engine.router import NoReplicaError, Router


def hashes(tokens: list[int], block_size: int = 4) -> list[bytes]:
    """The engine's own block hashes of a prompt."""
    return Sequence("s", tokens, block_size=block_size).block_hashes


PREFIX_A = list(range(100, 116))  # 4 blocks
PREFIX_B = list(range(200, 216))


def test_prefix_picks_the_replica_holding_the_prefix() -> None:
    router = Router(3)
    router.apply_events(2, [(True, h) for h in hashes(PREFIX_A)])
    assert router.choose(hashes(PREFIX_A + [1, 2, 3, 4])) == 2
    # a longer cached prefix beats a shorter one
    router.apply_events(1, [(True, h) for h in hashes(PREFIX_B)[:2]])
    router.apply_events(0, [(True, h) for h in hashes(PREFIX_B)])
    assert router.choose(hashes(PREFIX_B + [5, 6, 7, 8])) == 0


def test_only_a_leading_run_counts_as_a_prefix() -> None:
    router = Router(2)
    blocks = hashes(PREFIX_A)
    router.apply_events(0, [(True, h) for h in blocks[1:]])  # all but the first block
    router.apply_events(1, [(True, blocks[0])])
    assert router.choose(blocks) == 1


def test_evicted_blocks_no_longer_attract() -> None:
    router = Router(2)
    blocks = hashes(PREFIX_A)
    router.apply_events(1, [(True, h) for h in blocks])
    router.apply_events(1, [(False, blocks[0])])
    router.started(0)  # replica 0 busier: without a prefix the load decides
    assert router.choose(blocks) == 1
    router.finished(0)
    assert router.choose(blocks) == 0  # equal scores: the lower index among the least loaded


def test_load_breaks_ties_and_outweighs_a_prefix_when_far_fuller() -> None:
    router = Router(2, capacity=8)
    router.started(0)
    assert router.choose(hashes(PREFIX_A)) == 1  # no prefix anywhere: least load
    router.finished(0)
    router.apply_events(0, [(True, h) for h in hashes(PREFIX_A)])
    for _ in range(3):
        router.started(0)
    assert router.choose(hashes(PREFIX_A)) == 0  # prefix (1.0) beats the load (3/8)
    for _ in range(6):
        router.started(0)
    assert router.choose(hashes(PREFIX_A)) == 1  # 9/8 full: the idle replica wins
    router.set_kv_usage(1, 0.99)
    router.set_kv_usage(0, 0.0)
    assert router.load(1) == pytest.approx(0.99)


def test_routed_prompts_count_as_cached_at_once() -> None:
    """Concurrent requests with one prefix follow the first before any event arrives."""
    router = Router(2)
    first = router.choose(hashes(PREFIX_A + [1, 2, 3, 4]))
    router.started(first, hashes(PREFIX_A + [1, 2, 3, 4]))
    assert router.choose(hashes(PREFIX_A + [9, 9, 9, 9])) == first
    other = router.choose(hashes(PREFIX_B))
    assert other != first  # a new prefix goes to the less-loaded replica


def test_round_robin_and_least_load() -> None:
    rr = Router(3, policy="round-robin")
    assert [rr.choose() for _ in range(4)] == [0, 1, 2, 0]
    rr.set_up(1, False)
    assert [rr.choose() for _ in range(3)] == [2, 0, 2]
    ll = Router(3, policy="least-load")
    ll.apply_events(2, [(True, h) for h in hashes(PREFIX_A)])
    ll.started(0)
    assert ll.choose(hashes(PREFIX_A)) == 1  # ignores prefixes
    ll.set_kv_usage(1, 0.5)
    assert ll.choose() == 2


def test_down_replicas_are_skipped_and_forgotten() -> None:
    router = Router(2)
    router.apply_events(0, [(True, h) for h in hashes(PREFIX_A)])
    router.set_up(0, False)
    assert router.choose(hashes(PREFIX_A)) == 1
    router.set_up(0, True)
    router.started(1)
    assert router.choose(hashes(PREFIX_A)) == 0 and not router.replicas[0].cached
    assert router.choose(hashes(PREFIX_A), exclude={0}) == 1  # 0 failed the request already
    router.set_up(0, False)
    router.set_up(1, False)
    with pytest.raises(NoReplicaError):
        router.choose()


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="round-robin"):
        Router(2, policy="random")


def test_block_pool_events_follow_the_cache() -> None:
    pool = BlockPool(2)
    pool.record_events()
    seq = Sequence("s", list(range(8)), block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(seq, blocks, 0, 2)
    assert pool.drain_events() == [(True, h) for h in seq.block_hashes]
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(1)  # evicts the tail block, freed first
    assert pool.drain_events() == [(False, seq.block_hashes[1])]
    assert pool.drain_events() == []
    router = Router(1)
    router.apply_events(0, [(True, h) for h in seq.block_hashes] + [(False, seq.block_hashes[1])])
    assert router.replicas[0].cached == {seq.block_hashes[0]}
    assert BlockPool(1).drain_events() == []  # not recording
