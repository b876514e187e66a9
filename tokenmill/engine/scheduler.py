"""Continuous batching: each step mixes decodes and prefill chunks under a token budget.

The scheduler works on sequences (a request with n > 1 has n of them). It only decides *how
many* new tokens each sequence computes this step; the KV cache manager decides *where* they go.
Running sequences are served first (a decode is one token, with its drafts under speculative
decoding as far as the budget and the pool allow without preempting; an unfinished prefill
continues with its next chunk); then waiting sequences are admitted while the budget, the
sequence cap and the block pool allow. When the pool runs dry, the lowest-priority,
latest-arrived running sequence is preempted: its blocks are freed and it is recomputed later
(its full blocks usually come back as prefix-cache hits).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Sequence, SequenceStatus


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
    """One step: the sequences to run, in batch order, and how many new tokens each computes."""

    sequences: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.sequences)


class WaitingQueue:
    """Waiting sequences ordered by (priority, arrival) for the priority policy, arrival for FCFS.

    Preempted sequences keep their original arrival order, so they resume before newer ones.
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple] = []
        self._counter = itertools.count()
        self._removed: set[str] = set()
        self._size = 0

    def _key(self, seq: Sequence) -> tuple:
        if self.policy == "priority":
            return (seq.priority, seq.arrival_time, next(self._counter))
        return (seq.arrival_time, next(self._counter))

    def push(self, seq: Sequence) -> None:
        self._removed.discard(seq.seq_id)
        heapq.heappush(self._heap, (*self._key(seq), seq))
        self._size += 1

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][-1].seq_id in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[-1].seq_id)

    def peek(self) -> Sequence | None:
        self._drop_removed()
        return self._heap[0][-1] if self._heap else None

    def pop(self) -> Sequence:
        self._drop_removed()
        self._size -= 1
        return heapq.heappop(self._heap)[-1]

    def remove(self, seq: Sequence) -> None:
        """Lazy removal (aborts): O(1) now, skipped when it reaches the front."""
        self._removed.add(seq.seq_id)
        self._size -= 1

    def __len__(self) -> int:
        return self._size


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}  # every unfinished sequence, by id
        self.num_preemptions = 0

    def add_sequence(self, seq: Sequence) -> None:
        self.sequences[seq.seq_id] = seq
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def finish(self, seq: Sequence, status: SequenceStatus, uncache: bool = False) -> None:
        """End a sequence (stopped, length, aborted, error): it releases everything it held.
        Idempotent. With uncache, its blocks leave the prefix cache (see `KVCacheManager.free`)."""
        if seq.seq_id not in self.sequences:
            return
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED):
            self.waiting.remove(seq)
        seq.status = status
        self.kv.free(seq, uncache=uncache)
        del self.sequences[seq.seq_id]

    def _victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival_time))
        return self.running[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.draft_token_ids.clear()
        seq.draft_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        # 1. running sequences, oldest first; preempt from the back when blocks run out
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.draft_token_ids:  # a decode with drafts: verify as many as fit
                del seq.draft_token_ids[max(budget - num_new, 0) :]
                if self.kv.allocate_slots(seq, num_new + len(seq.draft_token_ids)) is not None:
                    num_new += len(seq.draft_token_ids)
                    out.sequences.append(seq)
                    out.num_new_tokens.append(num_new)
                    scheduled.add(seq.seq_id)
                    budget -= num_new
                    continue
                seq.draft_token_ids.clear()  # drafts never cost a preemption
            while self.kv.allocate_slots(seq, num_new) is None:
                victim = self._victim()
                if victim.seq_id in scheduled:  # never take back what this step already gave
                    idx = out.sequences.index(victim)
                    budget += out.num_new_tokens.pop(idx)
                    out.sequences.pop(idx)
                    scheduled.discard(victim.seq_id)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            out.sequences.append(seq)
            out.num_new_tokens.append(num_new)
            scheduled.add(seq.seq_id)
            budget -= num_new

        # 2. admit waiting sequences (none when this step had to preempt: the pool is full)
        while not out.preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            hits, num_hit_tokens = [], 0
            if seq.params.prompt_logprobs is None:  # those need every prompt token's logits
                hits, num_hit_tokens = self.kv.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(seq, num_new, hits, num_hit_tokens) is None:
                break
            self.waiting.pop()
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_hit_tokens
            seq.num_computed_tokens = num_hit_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.sequences.append(seq)
            out.num_new_tokens.append(num_new)
            scheduled.add(seq.seq_id)
            budget -= num_new
        return out
