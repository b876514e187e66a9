"""Continuous batching: each step mixes decodes and prefill chunks under a token budget.

The scheduler only decides *how many* new tokens each request computes this step; the KV cache
manager decides *where* they go. Running requests are served first (a decode is one token, an
unfinished prefill continues with its next chunk); then waiting requests are admitted while the
budget, the sequence cap and the block pool allow. When the pool runs dry, the lowest-priority,
latest-arrived running request is preempted: its blocks are freed and it is recomputed later
(its full blocks usually come back as prefix-cache hits).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # "fcfs" or "priority" (lower value first, then arrival)

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r} (choose fcfs or priority)")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


@dataclass
class SchedulerOutput:
    """One step: the requests to run, in batch order, and how many new tokens each computes."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class WaitingQueue:
    """Waiting requests ordered by (priority, arrival) for the priority policy, arrival for FCFS.

    Preempted requests keep their original arrival order, so they resume before newer ones.
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple] = []
        self._counter = itertools.count()
        self._removed: set[str] = set()
        self._size = 0

    def _key(self, req: Request) -> tuple:
        if self.policy == "priority":
            return (req.priority, req.arrival_time, next(self._counter))
        return (req.arrival_time, next(self._counter))

    def push(self, req: Request) -> None:
        self._removed.discard(req.request_id)
        heapq.heappush(self._heap, (*self._key(req), req))
        self._size += 1

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][-1].request_id in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[-1].request_id)

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._heap[0][-1] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        self._size -= 1
        return heapq.heappop(self._heap)[-1]

    def remove(self, req: Request) -> None:
        """Lazy removal (aborts): O(1) now, skipped when it reaches the front."""
        self._removed.add(req.request_id)
        self._size -= 1

    def __len__(self) -> int:
        return self._size


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def finish(self, req: Request, status: RequestStatus, uncache: bool = False) -> None:
        """End a request (stopped, length, aborted, error): it releases everything it held."""
        if req.request_id not in self.requests:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req, uncache=uncache)
        del self.requests[req.request_id]

    def _victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(req)
        out.preempted.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        # 1. running requests, oldest first; preempt from the back when blocks run out
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, num_new) is None:
                victim = self._victim()
                if victim.request_id in scheduled:  # never take back what this step already gave
                    idx = out.requests.index(victim)
                    budget += out.num_new_tokens.pop(idx)
                    out.requests.pop(idx)
                    scheduled.discard(victim.request_id)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            scheduled.add(req.request_id)
            budget -= num_new

        # 2. admit waiting requests (none when this step had to preempt: the pool is full)
        while not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req is None:
                break
            hits, num_hit_tokens = [], 0
            if getattr(req.sampling_params, "prompt_logprobs", None) is None:  # those need every prompt logit
                hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(req, num_new, hits, num_hit_tokens) is None:
                break
            self.waiting.pop()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
            req.num_computed_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.requests.append(req)
            out.num_new_tokens.append(num_new)
            scheduled.add(req.request_id)
            budget -= num_new
        return out
