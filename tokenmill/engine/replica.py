"""EngineReplica: one engine in a Ray actor, a replica of `DataParallelEngine`.

A plain class: `DataParallelEngine` makes it an actor with `ray.remote`, so importing this module
needs no Ray. The actor owns an `AsyncLLMEngine` and serves, over Ray's async actor calls:
`submit` (queue a request; a refusal comes back as the engine's own exception, returned rather
than raised, so that the caller gets it rather than Ray's wrapper), `take` (the outputs of all
its requests since the caller's last take, in one batch: one call per engine step for every
stream, where a Ray streaming generator per request costs a call per stream per step), `abort`,
and `poll` (the engine's counters and the prefix-cache changes since the last poll, for the
router). A request's final output comes with the engine's counters too (a `StatsSnapshot`), so
that a client that sees a request finish sees it counted in /metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from tokenmill.engine.async_engine import AsyncLLMEngine, RequestStream
from tokenmill.engine.block_pool import CacheEvent
from tokenmill.engine.kv_transfer import PrefixKV, export_prefix, import_prefix
from tokenmill.engine.llm_engine import EngineStats, LLMEngine
from tokenmill.engine.request import Sequence
from tokenmill.sample import SamplingParams


@dataclass
class ReplicaInfo:
    """What the client needs once, when the replica is up."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    pid: int


@dataclass
class StatsSnapshot:
    """The engine's counters at one moment; a higher seq is a later moment."""

    seq: int
    stats: EngineStats


@dataclass
class ReplicaReport:
    """What the client polls: the engine's counters and its prefix-cache changes."""

    stats: StatsSnapshot
    events: list[CacheEvent]
    decode_mode: str
    healthy: bool
    error: str | None


class EngineReplica:
    def __init__(self, model: str, options: dict[str, Any], num_threads: int) -> None:
        """model: a path every node can read; options: `LLMEngine` overrides; num_threads: the
        replica's torch threads (its share of the machine's cores)."""
        torch.set_num_threads(num_threads)

        def build() -> LLMEngine:
            torch.set_num_threads(num_threads)  # this thread runs the steps
            engine = LLMEngine(model, **options)
            engine.kv.block_pool.record_events()
            return engine

        self.engine = AsyncLLMEngine(build)
        self._snapshots = itertools.count()
        # (seq, request id, output or error), kept until a take acknowledges them
        self._outbox: list[tuple[int, str, Any]] = []
        self._seq = itertools.count()
        self._posted: asyncio.Event | None = None  # made on the actor's event loop
        self._pumps: dict[str, asyncio.Task] = {}

    def _snapshot(self) -> StatsSnapshot:
        return StatsSnapshot(next(self._snapshots), replace(self.engine.stats()))

    def info(self) -> ReplicaInfo:
        cfg = self.engine.engine.config
        return ReplicaInfo(
            max_model_len=self.engine.max_model_len,
            num_kv_blocks=self.engine.num_kv_blocks,
            block_size=cfg.block_size,
            max_num_seqs=cfg.max_num_seqs,
            pid=os.getpid(),
        )

    async def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int,
        extra_key: str | None,
        tenant: str = "",
    ) -> Exception | None:
        """Queue a request; its outputs come through `take`. Returns why the engine refused it,
        or None."""
        try:
            stream = await self.engine.add_request(
                prompt_token_ids, params, request_id, priority, extra_key, tenant
            )
        except Exception as exc:  # noqa: BLE001 - handed to the caller, which raises it
            return exc
        self._pumps[request_id] = asyncio.create_task(self._pump(request_id, stream))
        return None

    async def _pump(self, request_id: str, stream: RequestStream) -> None:
        try:
            async with stream:  # cancelled (aborted by the client): the request is aborted
                async for out in stream:
                    self._post(request_id, (out, self._snapshot()) if out.finished else out)
        except Exception as exc:  # noqa: BLE001 - handed to the caller, which raises it
            self._post(request_id, exc)
        finally:
            self._pumps.pop(request_id, None)

    def _post(self, request_id: str, item: Any) -> None:
        self._outbox.append((next(self._seq), request_id, item))
        self._event().set()

    def _event(self) -> asyncio.Event:
        if self._posted is None:
            self._posted = asyncio.Event()
        return self._posted

    async def take(self, after: int, timeout: float) -> list[tuple[int, str, Any]]:
        """The outputs posted after seq `after` (those up to it are acknowledged and dropped),
        waiting up to timeout seconds for one."""
        self._outbox = [item for item in self._outbox if item[0] > after]
        posted = self._event()
        if not self._outbox:
            posted.clear()
            try:
                await asyncio.wait_for(posted.wait(), timeout)
            except asyncio.TimeoutError:
                return []
            await asyncio.sleep(0)  # the other streams of the same step post theirs
        return list(self._outbox)

    async def prefill(
        self, prompt_token_ids: list[int], request_id: str, priority: int, extra_key: str | None
    ) -> PrefixKV:
        """Run the prompt (one token generated, then dropped) and export the K/V of its full
        blocks (prefill/decode disaggregation: this replica prefills, another decodes)."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in self.engine.generate(
            prompt_token_ids, params, request_id, priority, extra_key
        ):
            pass
        block_size = self.engine.engine.config.block_size
        hashes = Sequence("prefill", prompt_token_ids, block_size=block_size, extra_key=extra_key)
        return await self.engine.call(lambda e: export_prefix(e, hashes.block_hashes))

    async def import_prefix(self, kv: PrefixKV) -> int:
        """Publish a prefilled prompt's blocks in this replica's prefix cache."""
        return await self.engine.call(lambda e: import_prefix(e, kv))

    async def abort(self, request_id: str) -> None:
        task = self._pumps.pop(request_id, None)
        if task is not None:
            task.cancel()  # leaves the stream's `async with`, which aborts the request
        else:
            await self.engine.abort(request_id)

    async def poll(self) -> ReplicaReport:
        engine = self.engine
        events: list[CacheEvent] = []
        if engine.is_healthy:
            events = await engine.call(lambda e: e.kv.block_pool.drain_events())
        return ReplicaReport(
            stats=self._snapshot(),
            events=events,
            decode_mode=engine.decode_mode,
            healthy=engine.is_healthy,
            error=None if engine.error is None else repr(engine.error),
        )

    def start_compile(self) -> None:
        self.engine.start_compile()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await self.engine.call(fn)
