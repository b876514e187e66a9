"""Which engine replica serves a request: by cached prefix, by load, or in turn.

The router keeps a view of each replica: the block hashes its prefix cache holds (from the
replica's cache events, see `BlockPool.record_events`, plus the blocks of the requests routed to
it, which it caches as soon as it prefills them), its requests in flight, its KV usage and
whether it is up. It does no I/O and takes no locks: `DataParallelEngine` feeds it and asks it.

Policies:
- "prefix" scores replica i as `hit_i - load_weight * load_i`, where hit_i is the fraction of
  the request's full blocks that i holds as a cached prefix (the leading blocks, up to the first
  one it lacks) and load_i = max(requests_i / capacity, kv_usage_i), a fraction of the replica
  full. The highest score wins; equal scores go to the least-loaded replica. With the default
  weight a cached prefix outweighs any imbalance short of one replica being far fuller than the
  other, and a prompt no replica holds goes to the least-loaded one.
- "least-load": the fewest requests in flight, then the lowest KV usage.
- "round-robin": each up replica in turn.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from tokenmill.engine.block_pool import CacheEvent
from tokenmill.engine.request import BlockHash

ROUTER_POLICIES = ("prefix", "least-load", "round-robin")


class NoReplicaError(RuntimeError):
    """Every replica is down."""


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    cached: set[BlockHash] = field(default_factory=set)
    requests: int = 0  # in flight: routed to it and not yet finished
    kv_usage: float = 0.0  # fraction of its KV blocks in use (0-1), as last reported
    up: bool = True

    def cached_prefix(self, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of the request that this replica holds."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.cached:
                break
            n += 1
        return n


class Router:
    def __init__(
        self,
        num_replicas: int,
        policy: str = "prefix",
        capacity: int = 64,
        load_weight: float = 1.0,
    ) -> None:
        """capacity: the requests that fill a replica (its max_num_seqs); load_weight: how much
        a replica's load counts against its cached prefix (prefix policy)."""
        if policy not in ROUTER_POLICIES:
            raise ValueError(
                f"unknown router {policy!r} (choose from {', '.join(ROUTER_POLICIES)})"
            )
        if num_replicas < 1 or capacity < 1:
            raise ValueError("num_replicas and capacity must be at least 1")
        self.policy = policy
        self.capacity = capacity
        self.load_weight = load_weight
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self._next = 0  # round-robin: the replica to try first

    # ------------------------------------------------------------------ what the replicas report

    def apply_events(self, replica: int, events: Iterable[CacheEvent]) -> None:
        cached = self.replicas[replica].cached
        for stored, block_hash in events:
            if stored:
                cached.add(block_hash)
            else:
                cached.discard(block_hash)

    def set_kv_usage(self, replica: int, usage: float) -> None:
        self.replicas[replica].kv_usage = usage

    def set_up(self, replica: int, up: bool) -> None:
        """Mark a replica up or down; one that goes down loses its cache (it restarts empty)."""
        view = self.replicas[replica]
        if not up:
            view.cached.clear()
            view.kv_usage = 0.0
        view.up = up

    # ------------------------------------------------------------------ routing

    def load(self, replica: int) -> float:
        view = self.replicas[replica]
        return max(view.requests / self.capacity, view.kv_usage)

    def choose(self, block_hashes: Sequence[BlockHash] = (), exclude: Collection[int] = ()) -> int:
        """The replica for a request whose prompt has these full-block hashes, other than those
        in exclude (which failed it already); raises NoReplicaError when none is up."""
        up = [i for i, view in enumerate(self.replicas) if view.up and i not in exclude]
        if not up:
            raise NoReplicaError("no engine replica is up")
        if self.policy == "round-robin":
            n = len(self.replicas)
            pick = min(up, key=lambda i: (i - self._next) % n)
            self._next = (pick + 1) % n
            return pick
        if self.policy == "least-load" or not block_hashes:
            return min(up, key=self._load_key)
        total = len(block_hashes)

        def score(i: int) -> float:
            hit = self.replicas[i].cached_prefix(block_hashes) / total
            return hit - self.load_weight * self.load(i)

        best = max(score(i) for i in up)
        return min((i for i in up if score(i) >= best - 1e-9), key=self._load_key)

    def _load_key(self, i: int) -> tuple[int, float, int]:
        view = self.replicas[i]
        return (view.requests, view.kv_usage, i)

    def started(self, replica: int, block_hashes: Sequence[BlockHash] = ()) -> None:
        """A request went to this replica: count it, and take its prompt's blocks as cached there
        (the replica's events confirm them, or evict them, later)."""
        view = self.replicas[replica]
        view.requests += 1
        view.cached.update(block_hashes)

    def finished(self, replica: int) -> None:
        view = self.replicas[replica]
        view.requests = max(view.requests - 1, 0)
