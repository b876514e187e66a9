"""DataParallelEngine: N engine replicas as Ray actors behind one `AsyncLLMEngine`-shaped client.

The server holds one `DataParallelEngine` as it would hold an `AsyncLLMEngine`: the same
add_request / generate / abort, tokenizer, model_config, stats and health. Requests are
tokenized, validated and hashed into prefix-cache blocks here, in the serving process, by the
engine's own `InputProcessor` (and `Sequence` hashing); a `Router` picks a replica, and the
replica (`EngineReplica`) gets token ids. One task per replica on the server's event loop takes
the outputs of all its requests in one batch per call (`EngineReplica.take`) and hands each to
its request's stream. A background thread polls every replica for its counters and prefix-cache
events.

A replica whose process dies is restarted by Ray (`max_restarts`); its requests that had no
output yet are sent to another replica, the others fail at once with `EngineDeadError` (503).
Until its poll answers again, the restarted replica gets no requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine.async_engine import EngineClient, EngineDeadError, process_request
from tokenmill.engine.embedding import EmbeddingInput, prepare_inputs
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.llm_engine import EngineStats, LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.replica import EngineReplica, ReplicaInfo, ReplicaReport, StatsSnapshot
from tokenmill.engine.request import BlockHash
from tokenmill.engine.router import NoReplicaError, Router
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.model.config import ModelConfig
from tokenmill.model.loader import open_model_info
from tokenmill.sample import SamplingParams
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")

# Object store of a Ray instance started here: outputs are small, and the machine is shared.
LOCAL_OBJECT_STORE_BYTES = 128 << 20
POLL_INTERVAL_S = 0.1
# How long a take waits for outputs before answering with none: bounds how long a pump task
# outlives its event loop's requests.
TAKE_TIMEOUT_S = 1.0
PREFILL_REPLICA = 0  # with prefill/decode disaggregation


def import_ray(option: str = "--data-parallel-size above 1") -> Any:
    """The ray module, or an error that says how to install it (option: what needs it)."""
    try:
        import ray
    except ImportError as exc:
        raise TokenmillError(
            f"{option} runs on Ray, which is not installed: pip install 'tokenmill[ray]' "
            "(or pip install ray)"
        ) from exc
    return ray


@dataclass
class _Replica:
    handle: Any  # the Ray actor
    up: bool = True
    stats: StatsSnapshot = field(default_factory=lambda: StatsSnapshot(-1, EngineStats()))
    decode_mode: str = "eager"
    error: str | None = None
    restarts: int = 0  # times it went down and came back
    pending: Any = None  # the poll in flight (an ObjectRef)
    streams: dict[str, ReplicaStream] = field(default_factory=dict)  # its requests, by id
    taken: int = -1  # seq of the last output taken from it


class DataParallelEngine(EngineClient):
    def __init__(
        self,
        model: str | Path,
        num_replicas: int,
        engine_options: dict[str, Any] | None = None,
        router: str = "prefix",
        ray_address: str | None = None,
        num_threads: int | None = None,
        pd_disaggregation: bool = False,
    ) -> None:
        """model: a model path (the same path on every node of a cluster); engine_options:
        `LLMEngine` overrides for every replica; router: a policy of `Router`; ray_address:
        an existing Ray cluster to join (None: the one this process is connected to, else a
        local one started here); num_threads: torch threads per replica (default: this
        machine's cores shared out among the replicas); pd_disaggregation: replica 0 prefills
        every prompt and hands its KV blocks to the replica that decodes it (one of the others),
        through Ray's object store."""
        if num_replicas < 1:
            raise InvalidRequestError("the data-parallel size must be at least 1")
        if pd_disaggregation and num_replicas < 2:
            raise InvalidRequestError(
                "prefill/decode disaggregation needs a data-parallel size of at least 2 (one "
                "prefill replica, the rest decode)"
            )
        options = dict(engine_options or {})
        if pd_disaggregation and options.get("speculative_config") is not None:
            raise InvalidRequestError(
                "prefill/decode disaggregation does not move a draft model's KV cache: drop "
                "speculative decoding, or the disaggregation"
            )
        self.pd_disaggregation = pd_disaggregation
        self._model_path = Path(model)
        self._replicas: list[_Replica] = []
        self._stop = threading.Event()  # set by shutdown
        self._pump_loop: asyncio.AbstractEventLoop | None = None  # where the pump tasks run
        self._pump_tasks: list[asyncio.Task] = []
        self._poller: threading.Thread | None = None
        # here first: a bad model path fails before any replica starts
        self._config, tokenizer = open_model_info(model)
        if tokenizer is None:
            raise InvalidRequestError(f"{model}: the model has no tokenizer")
        self._tokenizer = tokenizer
        ray = self._ray = import_ray()
        self._owns_ray = False
        threads = num_threads or max(1, (os.cpu_count() or 1) // num_replicas)
        if not ray.is_initialized():
            if ray_address is None:
                ray.init(
                    # Ray's CPUs are counted, not enforced: room for every replica asked for
                    num_cpus=max(os.cpu_count() or 1, threads * num_replicas),
                    include_dashboard=False,
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    logging_level=logging.WARNING,
                )
            else:
                ray.init(address=ray_address, logging_level=logging.WARNING)
            self._owns_ray = True
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < threads * num_replicas:
            self.shutdown()
            raise InvalidRequestError(
                f"the Ray cluster has {cpus:g} CPUs, and {num_replicas} replicas of {threads} "
                f"threads need {threads * num_replicas}: lower --threads-per-replica or "
                "--data-parallel-size, or add nodes"
            )
        actor = ray.remote(EngineReplica).options(
            num_cpus=threads, max_restarts=-1, max_task_retries=0
        )
        self._replicas = [
            _Replica(actor.remote(str(model), options, threads)) for _ in range(num_replicas)
        ]
        try:
            infos: list[ReplicaInfo] = ray.get([r.handle.info.remote() for r in self._replicas])
        except Exception:
            self.shutdown()
            raise
        self.infos = infos
        first = infos[0]
        self.input_processor = InputProcessor(
            tokenizer, self._config.vocab_size, first.max_model_len, first.block_size
        )
        self.router = Router(num_replicas, router, capacity=first.max_num_seqs)
        self._lock = threading.Lock()  # the router and the replicas' state: poller and loop
        self._streams: dict[str, ReplicaStream] = {}
        self._poller = threading.Thread(target=self._poll_loop, name="tokenmill-dp-poll")
        self._poller.daemon = True
        self._poller.start()

    # ------------------------------------------------------------------ read-only state

    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self._config

    @property
    def embeddings_only(self) -> bool:
        """False: replicas serve generative models (and their embeddings), not encoders."""
        return False

    @property
    def model_path(self) -> Path:
        return self._model_path

    @property
    def max_model_len(self) -> int:
        return self.infos[0].max_model_len

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks of all replicas together."""
        return sum(info.num_kv_blocks for info in self.infos)

    @property
    def decode_mode(self) -> str:
        """'compiled' once every replica is, 'compiling' while any is, else 'eager'."""
        modes = {r.decode_mode for r in self._replicas if r.up}
        if modes == {"compiled"}:
            return "compiled"
        return "compiling" if "compiling" in modes else "eager"

    def stats(self) -> EngineStats:
        """All replicas' counters summed (KV usage: their mean), as last polled."""
        total = EngineStats()
        per = self.replica_stats()
        for f in fields(EngineStats):
            if f.name != "tenant_served_tokens":
                setattr(total, f.name, sum(getattr(s, f.name) for s in per))
        total.kv_usage = total.kv_usage / len(per)
        for s in per:  # a tenant's counters on every replica it has requests on
            for tenant, value in s.tenant_served_tokens.items():
                total.tenant_served_tokens[tenant] = (
                    total.tenant_served_tokens.get(tenant, 0) + value
                )
        return total

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's counters, as last polled."""
        return [r.stats.stats for r in self._replicas]

    def replica_health(self) -> list[dict[str, Any]]:
        return [
            {"replica": i, "status": "ok" if r.up else "down", "restarts": r.restarts}
            for i, r in enumerate(self._replicas)
        ]

    @property
    def is_healthy(self) -> bool:
        """True while any replica is up."""
        return any(r.up for r in self._replicas) and not self._stop.is_set()

    @property
    def error(self) -> str | None:
        if self.is_healthy:
            return None
        errors = [r.error for r in self._replicas if r.error]
        return f"no engine replica is up ({'; '.join(errors) or 'restarting'})"

    def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """As `AsyncLLMEngine.tokenize`, here in the serving process."""
        return self.input_processor.tokenize(
            prompt, messages, add_special_tokens, add_generation_prompt, chat_template_kwargs, tools
        )

    def start_compile(self) -> None:
        for r in self._replicas:
            r.handle.start_compile.remote()
            # until its next poll tells (eager where compilation is off)
            r.decode_mode = "compiling"

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        extra_key: str | None = None,
        tenant: str = "",
    ) -> ReplicaStream:
        """Validate, route and queue a request; raises here if no replica can take it."""
        self._check_alive()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        request = await process_request(
            self.input_processor, prompt, params, request_id, priority, extra_key, tenant
        )
        self._ensure_pumps()
        stream = ReplicaStream(
            self,
            request_id,
            request.prompt,
            request.prompt_token_ids,
            params,
            priority,
            extra_key,
            request.sequences[0].block_hashes,
            tenant,
        )
        await stream.start(set())
        self._streams[request_id] = stream
        return stream

    async def embed(
        self, inputs: list[EmbeddingInput], truncate: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """As `AsyncLLMEngine.embed`: tokenized here, embedded by the least-loaded replica."""
        self._check_alive()
        ids = prepare_inputs(
            inputs,
            lambda text, cut: self._tokenizer.encode(text)[:cut],
            self._config.vocab_size,
            self.max_model_len,
            truncate,
        )
        with self._lock:
            up = [i for i, r in enumerate(self._replicas) if r.up]
            if not up:
                raise EngineDeadError("no engine replica is up to serve the request")
            replica = min(up, key=lambda i: self.router.load(i))
        vectors = await self._replicas[replica].handle.call.remote(_Embed(ids))
        return vectors, sum(len(t) for t in ids)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.replica is not None:
            await self._replicas[stream.replica].handle.abort.remote(request_id)

    async def call(self, fn: Callable[[LLMEngine], Any], replica: int = 0) -> Any:
        """Run fn(engine) on one replica's engine thread (fn must pickle: Ray ships it)."""
        return await self._replicas[replica].handle.call.remote(fn)

    def replica_pid(self, replica: int) -> int:
        """The process id of a replica's actor (tests kill it)."""
        return self._ray.get(self._replicas[replica].handle.info.remote()).pid

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout)
        for task in self._pump_tasks:
            if self._pump_loop is not None and not self._pump_loop.is_closed():
                self._pump_loop.call_soon_threadsafe(task.cancel)
        for r in self._replicas:
            try:
                self._ray.kill(r.handle, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._owns_ray:
            self._ray.shutdown()

    # ------------------------------------------------------------------ outputs (the loop's)

    def _ensure_pumps(self) -> None:
        """One output pump per replica, on the running event loop (new ones for a new loop)."""
        loop = asyncio.get_running_loop()
        if self._pump_loop is loop:
            return
        for task in self._pump_tasks:
            if not task.get_loop().is_closed():
                task.get_loop().call_soon_threadsafe(task.cancel)
        self._pump_loop = loop
        self._pump_tasks = [loop.create_task(self._pump(i)) for i in range(len(self._replicas))]

    async def _pump(self, replica: int) -> None:
        """Take the replica's outputs and hand them to their streams; when the replica dies,
        fail its streams at once."""
        ray = self._ray
        r = self._replicas[replica]
        while not self._stop.is_set():
            try:
                items = await r.handle.take.remote(r.taken, TAKE_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                why = f"engine replica {replica} died: {type(exc).__name__}"
                self._went_down(replica, why)
                r.taken = -1  # the restarted process numbers its outputs from 0
                for stream in list(r.streams.values()):
                    stream.queue.put_nowait(_ReplicaGone(why))
                await asyncio.sleep(POLL_INTERVAL_S)
                continue
            for seq, request_id, item in items:
                if seq > r.taken:
                    r.taken = seq
                    stream = r.streams.get(request_id)
                    if stream is not None:
                        stream.queue.put_nowait(item)

    # ------------------------------------------------------------------ routing (the loop's)

    def _check_alive(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(f"the engine stopped: {self.error}")

    def _route(self, block_hashes: list[BlockHash], exclude: set[int]) -> tuple[int, int]:
        """The replica for a request, and how many of its leading blocks the replica holds."""
        if self.pd_disaggregation:
            exclude = exclude | {PREFILL_REPLICA}  # it only prefills
        with self._lock:
            try:
                replica = self.router.choose(block_hashes, exclude)
            except NoReplicaError:
                raise EngineDeadError("no engine replica is up to serve the request") from None
            cached = self.router.replicas[replica].cached_prefix(block_hashes)
            self.router.started(replica, block_hashes)
            return replica, cached

    def _finished(self, replica: int, request_id: str) -> None:
        with self._lock:
            self.router.finished(replica)
        self._streams.pop(request_id, None)
        self._replicas[replica].streams.pop(request_id, None)

    def _went_down(self, replica: int, why: str) -> None:
        with self._lock:
            r = self._replicas[replica]
            if r.up:
                log.warning("engine replica %d is down: %s", replica, why)
                r.up, r.error = False, why
                self.router.set_up(replica, False)

    # ------------------------------------------------------------------ polling (its thread)

    def _poll_loop(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                self._poll_once()
            except Exception:  # noqa: BLE001 - keep polling: routing depends on it
                log.exception("polling the engine replicas failed")

    def _poll_once(self) -> None:
        ray = self._ray
        for i, r in enumerate(self._replicas):
            if r.pending is None:
                r.pending = r.handle.poll.remote()
            ready, _ = ray.wait([r.pending], timeout=0)
            if not ready:
                continue
            ref, r.pending = r.pending, None
            try:
                report: ReplicaReport = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - the actor died: Ray restarts it
                self._went_down(i, f"its process died ({type(exc).__name__})")
                continue
            self._apply(i, report)

    def _apply(self, replica: int, report: ReplicaReport) -> None:
        r = self._replicas[replica]
        if not report.healthy:
            self._went_down(replica, f"its engine stopped: {report.error}")
            # its engine loop is gone for good: restart the process
            self._ray.kill(r.handle, no_restart=False)
            return
        with self._lock:
            if not r.up:
                log.warning("engine replica %d is back", replica)
                r.up, r.error = True, None
                r.stats = StatsSnapshot(-1, EngineStats())  # a new process counts from 0
                r.restarts += 1
                self.router.set_up(replica, True)
            r.decode_mode = report.decode_mode
            self.router.apply_events(replica, report.events)
        self._update_stats(replica, report.stats)

    def _update_stats(self, replica: int, snapshot: StatsSnapshot) -> None:
        """Keep the replica's latest counters (polls and final outputs race each other)."""
        with self._lock:
            r = self._replicas[replica]
            if snapshot.seq > r.stats.seq:
                r.stats = snapshot
                self.router.set_kv_usage(replica, snapshot.stats.kv_usage)


@dataclass
class _Embed:
    """fn(engine) for `EngineReplica.call`: embed these token ids (a class, which pickles by
    reference, rather than a closure)."""

    ids: list[list[int]]

    def __call__(self, engine: LLMEngine) -> torch.Tensor:
        return engine.embed(self.ids)


class _ReplicaGone(Exception):
    """The replica's process died under a request."""


class ReplicaStream:
    """Outputs of one accepted request from its replica; `async with` aborts it if left early,
    as `RequestStream` does."""

    def __init__(
        self,
        engine: DataParallelEngine,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        extra_key: str | None,
        block_hashes: list[BlockHash],
        tenant: str = "",
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        self.extra_key = extra_key
        self.block_hashes = block_hashes
        self.tenant = tenant
        self.replica: int | None = None
        # outputs from the replica's pump; a fresh queue for each replica tried
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self._delivered = False  # an output reached the caller: no retry elsewhere

    async def start(self, exclude: set[int]) -> None:
        """Queue the request on a replica the router picks (not one of exclude), moving on to
        another while the one picked turns out dead."""
        while True:
            replica, cached = self.engine._route(self.block_hashes, exclude)
            handle = self.engine._replicas[replica].handle
            self.replica = replica
            if self.engine.pd_disaggregation and cached < len(self.block_hashes):
                await self._prefill_elsewhere(replica)
            self.queue = asyncio.Queue()
            self.engine._replicas[replica].streams[self.request_id] = self
            ray = self.engine._ray
            try:
                refused = await handle.submit.remote(
                    self.prompt_token_ids,
                    self.params,
                    self.request_id,
                    self.priority,
                    self.extra_key,
                    self.tenant,
                )
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self._release()
                self.engine._went_down(replica, f"engine replica {replica} died: {exc!r}")
                exclude.add(replica)
                continue
            if refused is not None:
                self._release()
                raise refused
            return

    async def _prefill_elsewhere(self, replica: int) -> None:
        """With prefill/decode disaggregation, for a prompt the decode replica lacks: have the
        prefill replica run it and the decode replica take its KV blocks. Where the handoff
        fails (a replica died), the decode replica prefills the prompt itself."""
        engine = self.engine
        prefiller = engine._replicas[PREFILL_REPLICA]
        if not prefiller.up:
            return
        kv = prefiller.handle.prefill.remote(
            self.prompt_token_ids, f"{self.request_id}-prefill", self.priority, self.extra_key
        )
        try:
            # the decode replica reads the blocks from the object store: they never pass here
            await engine._replicas[replica].handle.import_prefix.remote(kv)
        except Exception as exc:  # noqa: BLE001 - the decode replica computes the prompt itself
            # (a dead decode replica fails the generate call that follows, which is retried)
            log.warning(
                "prefill of %s on replica %d failed: %r", self.request_id, PREFILL_REPLICA, exc
            )

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, _ReplicaGone):
            gone = item
            failed = self.replica
            assert failed is not None
            self._release()
            self.engine._went_down(failed, str(gone))
            if self._delivered:
                self.finished = True
                raise EngineDeadError(f"{gone}; the request cannot go on") from None
            await self.start({failed})  # nothing was sent yet: another replica serves it
            self.engine._streams[self.request_id] = self
            return await self.__anext__()
        if isinstance(item, Exception):
            self.finished = True
            self._release()
            raise item
        if isinstance(item, tuple):  # the final output, with the replica's counters
            item, snapshot = item
            assert self.replica is not None
            self.engine._update_stats(self.replica, snapshot)
        if self.prompt is not None:
            item.prompt = self.prompt  # the replica got token ids
        self._delivered = True
        if item.finished:
            self.finished = True
            self._release()
        return item

    async def __aenter__(self) -> ReplicaStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; aborts the request if it has not finished. Idempotent."""
        if not self.finished and self.replica is not None:
            handle = self.engine._replicas[self.replica].handle
            handle.abort.remote(self.request_id)  # a dead replica drops it with the request
        self.finished = True
        self._release()

    def _release(self) -> None:
        if self.replica is not None:
            self.engine._finished(self.replica, self.request_id)
            self.replica = None
