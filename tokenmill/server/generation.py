"""One request's run through the engine, the path that streaming and non-streaming responses share.

A `RequestRun` starts one engine stream per prompt, and its outputs come through one iterator
that times them (`RequestTimer`), raises for a request the engine failed, enforces the server's
`request_timeout` (`RequestTimeoutError`, however the response is sent) and closes the streams
when it ends, which aborts whatever has not finished. Streaming responses iterate `outputs()`;
a client that hangs up cancels the response, which ends the iteration. Non-streaming responses
call `finals()`, which collects from the same iterator and also notices a client that hangs up.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.sample import SamplingParams
from tokenmill.server.errors import APIError, GenerationError, RequestTimeoutError
from tokenmill.server.metrics import RequestTimer
from tokenmill.server.model_registry import ServedModel
from tokenmill.server.state import ServerState

# How often a non-streaming request checks whether its client is still there: a shorter period
# frees the engine sooner after a hang-up, at the cost of more wake-ups per waiting request.
DISCONNECT_POLL_S = 0.5


class RequestRun:
    """The engine streams of one API request (one per prompt), read as one."""

    def __init__(
        self,
        streams: list[RequestStream],
        timers: list[RequestTimer],
        timeout: float | None,
        deadline: float | None,
    ) -> None:
        self.streams = streams
        self.timers = timers
        self.timeout = timeout
        self.deadline = deadline  # time.monotonic() by which the request must end

    @classmethod
    async def start(
        cls,
        state: ServerState,
        model: ServedModel,
        prompts: list[str | list[int]],
        params: SamplingParams,
        request_id: str,
        priority: int,
        tenant: str = "",
    ) -> RequestRun:
        """Queue every prompt on the model's engine (prompt i as request `{request_id}-{i}`);
        raises here, before any
        response is sent, if the engine refuses one (the ones already queued are aborted)."""
        timeout = state.config.request_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                stream = await model.engine.add_request(
                    prompt, params, f"{request_id}-{i}", priority=priority, tenant=tenant
                )
                streams.append(stream)
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        timers = [RequestTimer(state.metrics) for _ in streams]
        return cls(streams, timers, timeout, deadline)

    def close(self) -> None:
        """Stop listening, aborting the prompts that have not finished. Idempotent."""
        for stream in self.streams:
            stream.close()

    async def outputs(
        self, watch_deadline: bool = True
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream as they come; the streams are closed when the
        iteration ends, however it ends. watch_deadline=False leaves the deadline to the caller."""
        deadline = self.deadline if watch_deadline else None
        try:
            if len(self.streams) == 1 and deadline is None:
                # The usual request: its outputs straight through, with no task, queue or timer
                # between. A hop per token would run on the thread that serves every other stream.
                async for out in self.streams[0]:
                    yield 0, self._observe(0, out)
            else:
                async for item in self._merged(deadline):
                    yield item
        finally:
            self.close()

    async def finals(self, is_disconnected: Callable[[], Awaitable[bool]]) -> list[RequestOutput]:
        """Each prompt's final output. The outputs are read by a task of their own while this one
        watches the deadline and the client, so neither costs anything per token."""

        async def collect() -> list[RequestOutput]:
            ends: dict[int, RequestOutput] = {}
            async for i, out in self.outputs(watch_deadline=False):
                if out.finished:
                    ends[i] = out
            return [ends[i] for i in range(len(self.streams))]

        task = asyncio.create_task(collect())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never unretrieved
        try:
            while not task.done():
                await asyncio.wait(
                    {task}, timeout=max(min(DISCONNECT_POLL_S, self._time_left()), 0)
                )
                if task.done():
                    break
                if await is_disconnected():
                    raise APIError(499, "client disconnected")
                if self._time_left() <= 0:
                    raise self._timeout_error()
            return task.result()
        finally:
            task.cancel()
            self.close()

    def _observe(self, i: int, out: RequestOutput) -> RequestOutput:
        """Time prompt i's output; raises if the engine failed the request."""
        timer = self.timers[i]
        timer.tokens(sum(len(c.token_ids_delta) for c in out.outputs))
        if out.finished:
            timer.finish([c.finish_reason for c in out.outputs])
        if out.error:
            error = InvalidRequestError if out.error_is_input else GenerationError
            raise error(out.error)
        return out

    async def _merged(self, deadline: float | None) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of all streams through one queue, one pump task per stream."""
        queue: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, self._observe(i, out)))
            except Exception as exc:  # noqa: BLE001 - raised again by the reader
                queue.put_nowait((i, exc))
            queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        remaining = len(tasks)
        try:
            while remaining:
                wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    i, item = await asyncio.wait_for(queue.get(), wait)
                except asyncio.TimeoutError:
                    raise self._timeout_error() from None
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    def _time_left(self) -> float:
        """Seconds until the deadline (infinite without one)."""
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def _timeout_error(self) -> RequestTimeoutError:
        return RequestTimeoutError(
            f"the request timed out after {self.timeout} s (the server's "
            f"--request-timeout); ask for fewer tokens with max_tokens"
        )
