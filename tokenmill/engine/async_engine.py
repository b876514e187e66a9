"""AsyncLLMEngine: the step loop runs in a background thread; asyncio code streams outputs.

The model forward pass is blocking CPU/GPU work, so it lives on its own thread and never stalls
the event loop. A request is tokenized, validated and fanned out into its sequences on the event
loop's thread, by the engine's stateless `InputProcessor`, which also serves `tokenize`: every
endpoint tokenizes in that one place. The processed request and aborts reach the engine thread
through a command queue (the engine's state is touched by that thread only); outputs come back
to each request's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine.embedding import EmbeddingEngine, EmbeddingInput, prepare_inputs
from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.llm_engine import EngineStats, LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import Request
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.model.config import ModelConfig
from tokenmill.model.encoder import EncoderConfig
from tokenmill.sample import SamplingParams
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")

# How long `AsyncLLMEngine.shutdown` waits for the step in progress. Steps take seconds at most
# (a long prompt chunk of a 1.5B model); the wait matters because the engine thread is a daemon,
# and one still inside a kernel when the interpreter exits would abort it (see
# engine/stoppable_thread.py). A step past this is stuck (a tensor-parallel worker gone).
ENGINE_STOP_TIMEOUT_S = 60.0


class EngineDeadError(TokenmillError):
    """The engine loop crashed; no request can be served until the process restarts."""


AnyEngine = LLMEngine | EmbeddingEngine


async def process_request(
    processor: InputProcessor,
    prompt: str | list[int],
    params: SamplingParams,
    request_id: str,
    priority: int,
    extra_key: str | None,
    tenant: str,
) -> Request:
    """The request tokenized, validated and fanned out into its sequences (`InputProcessor`): on
    the calling thread, or on a worker thread where its output constraint's grammar may take a
    while to compile, so that the event loop goes on streaming the other requests' tokens."""
    process = functools.partial(
        processor.process, request_id, prompt, params, priority, extra_key=extra_key, tenant=tenant
    )
    return await asyncio.to_thread(process) if params.structured_outputs else process()


class EngineClient:
    """What the engines the server drives share beyond their own `add_request`: the one engine in
    this process (`AsyncLLMEngine`) and its replicas on Ray (`DataParallelEngine`)."""

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        extra_key: str | None = None,
        tenant: str = "",
    ) -> Any:
        """Queue a request; returns its stream of outputs (an async iterator and context)."""
        raise NotImplementedError

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        extra_key: str | None = None,
        tenant: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs; leaving the iteration early aborts the request."""
        stream = await self.add_request(prompt, params, request_id, priority, extra_key, tenant)
        async with stream:
            async for out in stream:
                yield out


class AsyncLLMEngine(EngineClient):
    def __init__(self, engine: AnyEngine | Callable[[], AnyEngine]) -> None:
        """engine: a built engine, or a function that builds one on the engine thread (raising here
        if it fails). An `EmbeddingEngine` (encoder-only model) serves `embed` only.

        Pass the function where speed matters: the model should be loaded by the thread that runs
        it. OpenMP (libgomp) keeps a pool of worker threads for every thread that has started
        parallel work; while the loading thread's pool lives on, the engine thread's workers barely
        spin between the hundreds of parallel regions of a step and sleep instead, which makes a
        small model's decode steps much slower (see the tuning log).
        """
        self._commands: queue.Queue[tuple[Callable[[], Any], Future | None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        built: Future = Future()
        self._thread = threading.Thread(
            target=self._loop, args=(engine, built), name="tokenmill-engine", daemon=True
        )
        self.engine: AnyEngine  # set on the engine thread, before it serves anything
        self._thread.start()
        built.result()  # raises what building the engine raised

    # ------------------------------------------------------------------ public read-only state
    # What front ends (the server, the CLI) may read; everything else is the engine thread's.

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def embeddings_only(self) -> bool:
        """Whether the model is an encoder: it serves `embed`, not generation."""
        return isinstance(self.engine, EmbeddingEngine)

    @property
    def model_config(self) -> ModelConfig | EncoderConfig:
        if isinstance(self.engine, EmbeddingEngine):
            return self.engine.config
        return self.engine.loaded.config

    @property
    def model_path(self) -> Path:
        """The model's file or directory."""
        if isinstance(self.engine, EmbeddingEngine):
            return self.engine.path
        return self.engine.loaded.path

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_kv_blocks(self) -> int:
        return 0 if isinstance(self.engine, EmbeddingEngine) else self.engine.kv.num_total_blocks

    @property
    def decode_mode(self) -> str:
        """'compiled', 'compiling' or 'eager' (see `ModelRunner.decode_mode`): 'compiling' while
        the draft model's graphs (speculative decoding) are still being built, too; 'eager' for
        an encoder."""
        if isinstance(self.engine, EmbeddingEngine):
            return "eager"
        mode = self.engine.runner.decode_mode
        drafter = self.engine.drafter
        return "compiling" if drafter is not None and drafter.decode_mode == "compiling" else mode

    def stats(self) -> EngineStats:
        """The engine's live counters, updated after every step (read them, don't write them)."""
        return self.engine.stats

    def replica_stats(self) -> list[EngineStats]:
        """Per-replica counters: none for a single engine (see `DataParallelEngine`)."""
        return []

    def replica_health(self) -> list[dict[str, Any]]:
        """Per-replica state for /health: none for a single engine."""
        return []

    def start_compile(self) -> None:
        """Start the decode-graph compilation that the engine deferred (see
        `EngineConfig.defer_compile`); an encoder compiles nothing."""
        if isinstance(self.engine, EmbeddingEngine):
            return
        self.engine.runner.start_compile()
        if self.engine.drafter is not None:
            self.engine.drafter.start_compile()

    def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a text prompt, or of chat messages (and tools) rendered with the model's
        chat template, as `add_request` tokenizes them (see `InputProcessor.tokenize`). Raises
        InvalidRequestError for input that cannot be tokenized."""
        if isinstance(self.engine, EmbeddingEngine):
            if messages is not None or prompt is None:
                raise InvalidRequestError(
                    "this model serves embeddings only: tokenize a prompt, not messages"
                )
            tokenizer = self.engine.tokenizer
            if add_special_tokens:  # framed as `embed` frames a text ([CLS] ... [SEP])
                return tokenizer.encode_framed(prompt)
            return tokenizer.encode(prompt, add_bos=False)
        return self.engine.input_processor.tokenize(
            prompt, messages, add_special_tokens, add_generation_prompt, chat_template_kwargs, tools
        )

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread

    def _loop(self, engine: AnyEngine | Callable[[], AnyEngine], built: Future) -> None:
        try:
            self.engine = engine if isinstance(engine, AnyEngine) else engine()
        except BaseException as exc:  # noqa: BLE001 - raised again by __init__
            built.set_exception(exc)
            return
        built.set_result(None)
        warming = True  # the KV pool, while idle (see LLMEngine.warm_kv_cache)
        try:
            while not self._stop.is_set():
                self._run_commands(block=not warming and not self.engine.has_unfinished_requests())
                if not self.engine.has_unfinished_requests():
                    self.engine.adopt_reloaded_model()  # else the next step does
                    if warming:
                        warming = self.engine.warm_kv_cache()
                else:
                    warming = True  # steps take blocks: more of the pool may want warming when idle
                    outputs = self.engine.step()
                    self._deliver((out.request_id, out) for out in outputs)
                    if outputs:
                        # Hand the GIL to the event loop now, while it has tokens to send: most
                        # torch ops keep the GIL, so otherwise the loop waits out a whole switch
                        # interval (`sys.getswitchinterval()`) before it can send them.
                        time.sleep(0)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter and to /health
            log.exception("engine loop crashed")
            self.error = exc
            # an error of its own for each stream that raises it
            message = f"the engine stopped: {exc!r}"
            self._deliver(
                (request_id, EngineDeadError(message)) for request_id in list(self._streams)
            )
            self._fail_pending_commands(exc)
        finally:
            self.engine.shutdown()  # on the thread that ran the collectives

    def _run_commands(self, block: bool) -> None:
        try:
            command, future = (
                self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            try:
                result = command()
                if future is not None:
                    future.set_result(result)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                if future is None:
                    raise
                future.set_exception(exc)
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_pending_commands(self, exc: BaseException) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.done():
                future.set_exception(EngineDeadError(f"the engine stopped: {exc!r}"))

    def _deliver(self, items: Iterable[tuple[str, RequestOutput | Exception]]) -> None:
        """Outputs (or errors) to their requests' streams, with one wake-up of each event loop for
        all of them: a wake-up per output would write the loop's self-pipe and hand it the GIL once
        per stream (see the tuning log)."""
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | Exception]]
        ] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, queued in by_loop.items():
            loop.call_soon_threadsafe(_put_all, queued)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")

    def _submit(self, command: Callable[[], Any]) -> Future:
        self._check_alive()
        future: Future = Future()
        self._commands.put((command, future))
        return future

    # ------------------------------------------------------------------ asyncio side

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        extra_key: str | None = None,
        tenant: str = "",
    ) -> RequestStream:
        """Queue a request; raises here (not later) if the engine refuses it.

        The request is tokenized, validated and fanned out into its sequences here, on the
        calling thread (see `InputProcessor`), or on a worker thread where its output
        constraint's grammar may take a while to compile, so that the event loop goes on
        streaming the other requests' tokens meanwhile; the engine thread only checks it against
        the engine's state (request id in use, queue full) and queues it."""
        self._check_alive()
        request = await process_request(
            self.engine.input_processor, prompt, params, request_id, priority, extra_key, tenant
        )
        stream = RequestStream(self, request_id)
        self._streams[request_id] = (asyncio.get_running_loop(), stream.queue)
        try:
            await asyncio.wrap_future(self._submit(lambda: self.engine.enqueue(request)))
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    def _release(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        if not finished and self.error is None:
            self._commands.put((lambda: self.engine.abort_request(request_id), None))

    async def embed(
        self, inputs: list[EmbeddingInput], truncate: int | None = None
    ) -> tuple[torch.Tensor, int]:
        """Embed texts or token id lists on the engine thread; returns the float32 vectors
        (num_inputs, dimensions) and the number of tokens embedded. An encoder pools as its
        sentence-transformers config says; a decoder pools its final hidden states as
        `EngineConfig.embedding_pooling` says. Raises InvalidRequestError for input the model
        cannot take."""
        self._check_alive()
        engine = self.engine
        # tokenized here, off the engine thread, as `add_request` does: it is stateless
        if isinstance(engine, EmbeddingEngine):
            ids = engine.prepare(inputs, truncate)
        else:
            ids = prepare_inputs(
                inputs,
                lambda text, cut: engine.tokenizer.encode(text)[:cut],
                engine.loaded.config.vocab_size,
                engine.max_model_len,
                truncate,
            )
        vectors = await asyncio.wrap_future(self._submit(lambda: engine.embed(ids)))
        return vectors, sum(len(t) for t in ids)

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(lambda: self.engine.abort_request(request_id)))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread (for reads that must not race a step)."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    def shutdown(self, timeout: float = ENGINE_STOP_TIMEOUT_S) -> None:
        """Stop the engine thread after its step in progress, waiting up to timeout seconds."""
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the engine's step did not end within %.0f s of shutdown", timeout)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class RequestStream:
    """Outputs of one accepted request. Use `async with` so that leaving early aborts it."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; aborts the request if it has not finished. Idempotent."""
        self.engine._release(self.request_id, self.finished)
        self.finished = True
