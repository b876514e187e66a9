"""AsyncLLMEngine: the step loop runs in a background thread; asyncio code streams outputs.

The model forward pass is blocking CPU/GPU work, so it lives on its own thread and never stalls
the event loop. Requests and aborts reach that thread through a command queue (the engine is
touched by one thread only); outputs come back to each request's asyncio queue with
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, AsyncIterator, Callable

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import TokenmillError
from tokenmill.sample import SamplingParams

log = logging.getLogger("tokenmill.engine")


class EngineDeadError(TokenmillError):
    """The engine loop crashed; no request can be served until the process restarts."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], Any], Future | None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="tokenmill-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # ------------------------------------------------------------------ engine thread

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                self._run_commands(block)
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiter and to /health
            log.exception("engine loop crashed")
            self.error = exc
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine stopped: {exc!r}"))
            self._fail_pending_commands(exc)

    def _run_commands(self, block: bool) -> None:
        try:
            command, future = self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
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

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _submit(self, command: Callable[[], Any]) -> Future:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        future: Future = Future()
        self._commands.put((command, future))
        return future

    # ------------------------------------------------------------------ asyncio side

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        extra_key: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs; leaving the iteration early aborts the request."""
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            await asyncio.wrap_future(self._submit(
                lambda: self.engine.add_request(request_id, prompt, params, priority=priority, extra_key=extra_key)
            ))
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.error is None:
                self._commands.put((lambda: self.engine.abort_request(request_id), None))

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(lambda: self.engine.abort_request(request_id)))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread (for reads that must not race a step)."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
