"""Continuous batching: each step mixes decodes and prefill chunks under a token budget.

The scheduler works on sequences (a request with n > 1 has n of them). It only decides *how
many* new tokens each sequence computes this step; the KV cache manager decides *where* they go.
Running sequences are served first (a decode is one token, with its drafts under speculative
decoding as far as the budget and the pool allow without preempting; an unfinished prefill
continues with its next chunk); then waiting sequences are admitted while the budget, the
sequence cap and the block pool allow. When the pool runs dry, the lowest-priority,
latest-arrived running sequence is preempted: its blocks are freed and it is recomputed later
(its full blocks usually come back as prefix-cache hits).

The fair policy shares the steps' tokens between tenants (who sent a request: an API key's
tenant or the request's `user`) by virtual token counters (Sheng et al., "Fairness in Serving
Large Language Models", OSDI '24): each tenant's counter adds the prompt and output tokens it was
served, weighted; waiting sequences are admitted from the tenant with the lowest counter, and
when the sequence cap or the pool is full, a sequence of the tenant with the highest counter
gives up its place to it; and a new request of a tenant served no more than every other running
one gets a step of its own, so its first token is not held up by the others' batch. A tenant
that joins (or comes back) starts at the lowest active counter, so idle time is not saved up
against the others. With `max_running_per_tenant`, a tenant's sequences beyond that many running
wait, however low its counter, while other tenants' are admitted.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority", "fair")
# Weights of a prompt and an output token in the fair policy's counters (the paper's: an output
# token costs more to serve, and clients pay for it more)
FAIR_PROMPT_WEIGHT = 1.0
FAIR_OUTPUT_WEIGHT = 2.0


# The token budget of a step. A CPU's kernels multiply a few dozen rows as fast per row as
# thousands, so a larger budget only lengthens steps: a burst of new prompts prefilled together
# finishes together, every first token waiting on the last. Steps of 512 tokens admit them a few
# at a time, between the running sequences' decodes (see the tuning log).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    # "fcfs", "priority" (lower value first, then arrival) or "fair" (between tenants)
    policy: str = "fcfs"
    # fair policy: at most this many sequences of one tenant run at once (None: no limit)
    max_running_per_tenant: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(
                f"unknown scheduling policy {self.policy!r} (choose {', '.join(POLICIES)})"
            )
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.max_running_per_tenant is not None:
            if self.policy != "fair":
                raise ValueError(
                    "a per-tenant limit on running requests needs the fair scheduling policy "
                    "(--scheduling-policy fair)"
                )
            if self.max_running_per_tenant < 1:
                raise ValueError("the per-tenant limit on running requests must be at least 1")


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


class FairWaitingQueue:
    """Waiting sequences by tenant, each tenant's in arrival order; the front is the first of the
    tenant with the lowest counter, then of one with nothing running (a tenant joins at the
    lowest counter, a tie), then the earliest. Tenants with `max_running` sequences running have
    no front."""

    def __init__(
        self, served: dict[str, float], running: list[Sequence], max_running: int | None = None
    ) -> None:
        self.served = served
        self.running = running
        self.max_running = max_running
        self._queues: dict[str, WaitingQueue] = {}
        self._size = 0

    def _front_tenant(self) -> str | None:
        fronts = {t: q.peek() for t, q in self._queues.items()}
        fronts = {t: seq for t, seq in fronts.items() if seq is not None}
        running = Counter(s.tenant for s in self.running)
        if self.max_running is not None:
            fronts = {t: seq for t, seq in fronts.items() if running[t] < self.max_running}
        if not fronts:
            return None
        return min(
            fronts,
            key=lambda t: (self.served.get(t, 0.0), t in running, fronts[t].arrival_time),
        )

    def push(self, seq: Sequence) -> None:
        self._queues.setdefault(seq.tenant, WaitingQueue("fcfs")).push(seq)
        self._size += 1

    def peek(self) -> Sequence | None:
        tenant = self._front_tenant()
        return None if tenant is None else self._queues[tenant].peek()

    def pop(self) -> Sequence:
        self._size -= 1
        return self._queues[self._front_tenant()].pop()

    def remove(self, seq: Sequence) -> None:
        self._queues[seq.tenant].remove(seq)
        self._size -= 1

    def __len__(self) -> int:
        return self._size


def _chunk(seq: Sequence, start: int, budget: int) -> int:
    """The tokens seq computes from token `start` on in a step: as many as the budget allows, but
    never both prompt and output tokens (a preempted sequence recomputes its prompt, then its
    output): the model may compute the two kinds with different products (`StepBatch`)."""
    end = seq.num_prompt_tokens if start < seq.num_prompt_tokens else seq.num_tokens
    return min(end - start, budget)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.fair = config.policy == "fair"
        # the fair policy's virtual token counters of the tenants with unfinished sequences, and
        # their numbers of unfinished sequences
        self.served: dict[str, float] = {}
        self._active: Counter[str] = Counter()
        self.running: list[Sequence] = []
        self.waiting: WaitingQueue | FairWaitingQueue = (
            FairWaitingQueue(self.served, self.running, config.max_running_per_tenant)
            if self.fair
            else WaitingQueue(config.policy)
        )
        self.sequences: dict[str, Sequence] = {}  # every unfinished sequence, by id
        self.num_preemptions = 0

    def add_sequence(self, seq: Sequence) -> None:
        if self.fair and not self._active[seq.tenant]:  # (re)joining: lift to the lowest
            active = [self.served.get(t, 0.0) for t in self._active]
            self.served[seq.tenant] = min(active, default=0.0)
        self._active[seq.tenant] += 1
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
        self._active[seq.tenant] -= 1
        if not self._active[seq.tenant]:  # gone: a counter is kept for active tenants only
            del self._active[seq.tenant]
            self.served.pop(seq.tenant, None)

    def _victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival_time))
        if self.fair:
            return max(self.running, key=lambda s: (self.served.get(s.tenant, 0.0), s.arrival_time))
        return self.running[-1]

    def _fair_victim(self, seq: Sequence) -> Sequence | None:
        """The running sequence that gives up its place to waiting seq: the latest of the tenant
        with the highest counter, if that counter is above seq's tenant's (or equal to it, for a
        tenant with nothing running)."""
        others = [s for s in self.running if s.tenant != seq.tenant]
        if not others:
            return None
        victim = max(others, key=lambda s: (self.served.get(s.tenant, 0.0), s.arrival_time))
        mine, theirs = self.served.get(seq.tenant, 0.0), self.served.get(victim.tenant, 0.0)
        # a tenant with nothing running takes a place on a tie too (it joins at the lowest
        # counter); one with sequences running only from below, so places do not swap back
        newcomer = all(s.tenant != seq.tenant for s in self.running)
        return victim if mine < theirs or (newcomer and mine == theirs) else None

    def _unschedule(self, seq: Sequence, out: SchedulerOutput, scheduled: set[str]) -> int:
        """Take seq out of this step's batch if it is in it; returns the tokens given back."""
        if seq.seq_id not in scheduled:
            return 0
        idx = out.sequences.index(seq)
        out.sequences.pop(idx)
        scheduled.discard(seq.seq_id)
        return out.num_new_tokens.pop(idx)

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
        solo = self._solo_tenant() if self.fair else None
        if solo is not None:
            out = self._schedule(solo)
            if out.sequences:
                return out
        return self._schedule(None)

    def _solo_tenant(self) -> str | None:
        """Fair policy: the tenant whose new request runs in a step of its own, none of the more
        served tenants' work beside it: the front waiting sequence's, when that tenant has none
        running and its counter is at most every running tenant's. Its first token then comes as
        fast as on an idle engine, while the others lose one step."""
        seq = self.waiting.peek()
        running = {s.tenant for s in self.running}
        if seq is None or seq.tenant in running or not running:
            return None
        mine = self.served.get(seq.tenant, 0.0)
        return seq.tenant if mine <= min(self.served.get(t, 0.0) for t in running) else None

    def _schedule(self, solo: str | None) -> SchedulerOutput:
        """A step; with solo, only that tenant's sequences run in it."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        # 1. running sequences, oldest first (fair: the least served tenants' first); preempt
        # from the back when blocks run out
        running = list(self.running)
        if self.fair:
            running.sort(key=lambda s: self.served.get(s.tenant, 0.0))
        for seq in running:
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if solo is not None and seq.tenant != solo:
                continue
            if budget == 0:
                break
            num_new = _chunk(seq, seq.num_computed_tokens, budget)
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
                budget += self._unschedule(victim, out, scheduled)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            out.sequences.append(seq)
            out.num_new_tokens.append(num_new)
            scheduled.add(seq.seq_id)
            budget -= num_new

        # 2. admit waiting sequences (none when this step had to preempt: the pool is full;
        # fair: a sequence of a more served tenant gives up its place where one is needed)
        while (self.fair or not out.preempted) and budget > 0:
            seq = self.waiting.peek()
            if seq is None or (solo is not None and seq.tenant != solo):
                break
            if len(self.running) >= self.config.max_num_seqs:
                given_back = self._make_room(seq, out, scheduled)
                if given_back is None:
                    break
                budget += given_back
                continue
            hits, num_hit_tokens = [], 0
            if seq.params.prompt_logprobs is None:  # those need every prompt token's logits
                hits, num_hit_tokens = self.kv.get_computed_blocks(seq)
            num_new = _chunk(seq, num_hit_tokens, budget)
            if self.kv.allocate_slots(seq, num_new, hits, num_hit_tokens) is None:
                given_back = self._make_room(seq, out, scheduled)
                if given_back is None:
                    break
                budget += given_back
                continue
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
        if self.fair:
            self._count_served(out)
        return out

    def _make_room(self, seq: Sequence, out: SchedulerOutput, scheduled: set[str]) -> int | None:
        """Fair policy: preempt the sequence that gives up its place to waiting seq; returns the
        step's tokens it had (None where no sequence gives way)."""
        victim = self._fair_victim(seq) if self.fair else None
        if victim is None:
            return None
        given_back = self._unschedule(victim, out, scheduled)
        self._preempt(victim, out)
        return given_back

    def _count_served(self, out: SchedulerOutput) -> None:
        """Add the step's tokens to their tenants' counters: prompt tokens (prefill chunks,
        recomputation included) and output tokens (decodes and drafts), weighted."""
        for seq, num_new in zip(out.sequences, out.num_new_tokens):
            prompt = max(
                min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens)
                - seq.num_computed_tokens,
                0,
            )
            weighted = prompt * FAIR_PROMPT_WEIGHT + (num_new - prompt) * FAIR_OUTPUT_WEIGHT
            self.served[seq.tenant] = self.served.get(seq.tenant, 0.0) + weighted
