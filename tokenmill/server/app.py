"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.errors import InvalidRequestError, QueueFullError, TokenmillError
from tokenmill.server.metrics import RequestTimer, ServerMetrics
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

log = logging.getLogger("tokenmill.server")
STATIC = Path(__file__).parent / "static"


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(status_code=self.status, content=error_body(self.message, self.type, self.param, self.code))


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 << 20
    protect_health: bool = False  # require the API key on /health too
    protect_metrics: bool = False  # and on /metrics
    allowed_origins: list[str] = field(default_factory=list)  # CORS allowlist; empty: CORS off
    request_timeout: float | None = None  # seconds from arrival to the end of generation


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="tokenmill", version=__version__)
    app.state.engine = engine
    app.state.config = config
    metrics = ServerMetrics(engine.engine.stats)
    tokenizer = engine.tokenizer
    max_model_len = engine.engine.max_model_len
    vocab_size = engine.engine.loaded.config.vocab_size
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    # ------------------------------------------------------------------ plumbing

    app.add_middleware(GuardMiddleware, config=config)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException):
        kinds = {404: "not_found_error", 405: "invalid_request_error"}
        message = "The request body could not be parsed." if exc.status_code == 400 else str(exc.detail)
        return APIError(exc.status_code, message, type_=kinds.get(exc.status_code, "invalid_request_error")).response()

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError):
        return APIError(400, str(exc), param=exc.param).response()

    @app.exception_handler(TokenmillError)
    async def on_tokenmill_error(_: Request, exc: TokenmillError):
        if isinstance(exc, QueueFullError):
            response = APIError(503, str(exc), type_="server_overloaded", code="queue_full").response()
            response.headers["Retry-After"] = str(exc.retry_after)
            return response
        if isinstance(exc, EngineDeadError):
            return APIError(503, str(exc), type_="service_unavailable").response()
        return APIError(400, str(exc)).response()

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return APIError(400, "The request body is not valid JSON.").response()
        if first.get("type") == "extra_forbidden":
            return APIError(400, f"Unrecognized request argument supplied: {param}", param=param).response()
        message = "; ".join(f"{'.'.join(str(x) for x in e['loc'] if x != 'body')}: {e['msg']}" for e in errors[:5])
        return APIError(422, message, param=param).response()

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal error: {exc!r}", type_="internal_error").response()

    def check_model(name: str | None) -> None:
        if name is not None and name != config.served_model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    # ------------------------------------------------------------------ simple routes

    @app.get("/health")
    async def health():
        if not engine.is_healthy:
            return APIError(503, f"engine stopped: {engine.error!r}", type_="service_unavailable").response()
        return {"status": "ok", "decode": engine.engine.runner.decode_mode}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "tokenmill", "max_model_len": max_model_len,
        }]}

    @app.get("/", include_in_schema=False)
    async def index():
        page = STATIC / "index.html"
        if not page.is_file():
            return JSONResponse({"message": "tokenmill is running; the API is under /v1"})
        return FileResponse(page)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("give either prompt or messages")
        if req.messages is not None:
            text = tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in req.messages],
                                                 add_generation_prompt=req.add_generation_prompt)
            ids = tokenizer.encode(text, add_bos=False)
        else:
            ids = tokenizer.encode(req.prompt, add_bos=None if req.add_special_tokens else False)
        body: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [tokenizer.id_to_piece(i) for i in ids]
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids must be in [0, {vocab_size}), got {bad[0]}", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    # ------------------------------------------------------------------ generation

    async def start(prompts: list[str | list[int]], params, prefix: str, priority: int) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await engine.add_request(prompt, params, f"{prefix}-{i}", priority=priority))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def collect(streams: list[RequestStream], raw: Request) -> list[RequestOutput]:
        """Final outputs of every stream; a client that goes away aborts them all."""
        timers = [RequestTimer(metrics) for _ in streams]

        async def drain(stream: RequestStream, timer: RequestTimer) -> RequestOutput:
            last = None
            async for out in stream:
                timer.tokens(sum(len(c.token_ids_delta) for c in out.outputs))
                last = out
            timer.finish([c.finish_reason for c in last.outputs])
            return last

        task = asyncio.gather(*(drain(s, t) for s, t in zip(streams, timers)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # never an unretrieved error
        deadline = None if config.request_timeout is None else time.monotonic() + config.request_timeout
        try:
            while True:
                wait = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0))
                done, _ = await asyncio.wait({task}, timeout=wait)
                if done:
                    finals = task.result()
                    failed = next((o.error for o in finals if o.error), None)
                    if failed:
                        raise APIError(500, failed, type_="internal_error")
                    return finals
                if await raw.is_disconnected():
                    task.cancel()
                    raise APIError(499, "client disconnected")
                if deadline is not None and time.monotonic() > deadline:
                    task.cancel()
                    raise APIError(504, f"the request timed out after {config.request_timeout} s", type_="timeout")
        finally:
            task.cancel()
            for s in streams:
                s.close()

    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all streams as they come."""
        timers = [RequestTimer(metrics) for _ in streams]

        def timed(i: int, out: RequestOutput) -> RequestOutput:
            timers[i].tokens(sum(len(c.token_ids_delta) for c in out.outputs))
            if out.finished:
                timers[i].finish([c.finish_reason for c in out.outputs])
            return out

        if len(streams) == 1 and config.request_timeout is None:
            # the usual request: its outputs straight through, without a task, a queue and a
            # wait_for's task between (a hop of each per token, on the thread that also serves
            # every other stream)
            try:
                async for out in streams[0]:
                    if timed(0, out).error:
                        raise TokenmillError(out.error)
                    yield 0, out
            finally:
                streams[0].close()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, timed(i, out)))
            except Exception as exc:  # noqa: BLE001 - forwarded to the response stream
                await queue.put((i, exc))
            await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        deadline = None if config.request_timeout is None else time.monotonic() + config.request_timeout
        try:
            while remaining:
                timeout = None if deadline is None else max(deadline - time.monotonic(), 0)
                try:
                    i, item = await asyncio.wait_for(queue.get(), timeout)
                except asyncio.TimeoutError:
                    raise TokenmillError(f"the request timed out after {config.request_timeout} s") from None
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    if item.error:
                        raise TokenmillError(item.error)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()

    def usage(finals: list[RequestOutput]) -> dict[str, Any]:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in finals)}}

    def sse(payload: dict | str) -> str:
        """One server-sent event; payloads hold no NaN/Infinity (see `_finite`)."""
        return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"

    async def event_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield sse(chunk)
        except TokenmillError as exc:
            yield sse(error_body(str(exc), "invalid_request_error" if isinstance(exc, InvalidRequestError)
                                 else "server_error"))
        except Exception as exc:  # noqa: BLE001 - the status line is already sent; report in-band
            log.exception("error while streaming")
            yield sse(error_body(f"internal error: {exc!r}", "internal_error"))
        yield sse("[DONE]")

    # ------------------------------------------------------------------ /v1/completions

    def completion_logprobs(out: CompletionOutput, prompt_part: dict | None) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        if prompt_part:
            tokens, token_lps, tops, offsets = (list(prompt_part[k]) for k in
                                                ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
        offset = offsets[-1] + len(tokens[-1]) if tokens else 0
        for token_id, entry in zip(out.token_ids, out.logprobs or []):
            chosen = entry[token_id]
            tokens.append(chosen.decoded_token)
            token_lps.append(_finite(chosen.logprob))
            tops.append({lp.decoded_token: _finite(lp.logprob) for lp in entry.values()})
            offsets.append(offset)
            offset += len(chosen.decoded_token)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def echo_logprobs(final: RequestOutput) -> dict:
        ids, lps = final.prompt_token_ids, final.prompt_logprobs or []
        tokens = [tokenizer.decode([t]) for t in ids]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else _finite(e[t].logprob) for t, e in zip(ids, lps)],
            "top_logprobs": [None if e is None else {lp.decoded_token: _finite(lp.logprob) for lp in e.values()}
                             for e in lps],
            "text_offset": offsets,
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        if req.suffix:
            raise InvalidRequestError("suffix is not supported by this server", param="suffix")
        if req.best_of not in (None, req.n):
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= 5:
            raise InvalidRequestError("logprobs must be between 0 and 5", param="logprobs")
        if req.echo and req.stream:
            raise InvalidRequestError("echo with stream is not supported", param="echo")
        params = req.sampling_params(req.max_tokens, req.logprobs)
        if req.echo and req.logprobs is not None:
            params.prompt_logprobs = req.logprobs
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await start(req.prompts(), params, rid, req.priority)
        base = {"id": rid, "object": "text_completion", "created": created, "model": config.served_model_name}
        n = req.n

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def chunks() -> AsyncIterator[dict]:
                finals: dict[int, RequestOutput] = {}
                async for i, out in merged(streams):
                    for c in out.outputs:
                        if not c.text_delta and not c.finished and not c.token_ids_delta:
                            continue
                        choice = {"index": i * n + c.index, "text": c.text_delta, "logprobs": None,
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                        if c.logprobs is not None and c.token_ids_delta:
                            delta = CompletionOutput(c.index, token_ids=c.token_ids[-len(c.token_ids_delta):],
                                                     logprobs=c.logprobs[-len(c.token_ids_delta):])
                            choice["logprobs"] = completion_logprobs(delta, None)
                        yield {**base, "choices": [choice]}
                    if out.finished:
                        finals[i] = out
                if include_usage:
                    yield {**base, "choices": [], "usage": usage(list(finals.values()))}

            return StreamingResponse(event_stream(chunks()), media_type="text/event-stream")

        finals = await collect(streams, raw)
        choices = []
        for i, final in enumerate(finals):
            prompt_text = final.prompt if final.prompt is not None else tokenizer.decode(final.prompt_token_ids)
            for c in final.outputs:
                lp = None
                if req.logprobs is not None:
                    lp = completion_logprobs(c, echo_logprobs(final) if req.echo else None)
                choices.append({"index": i * n + c.index, "text": (prompt_text if req.echo else "") + c.text,
                                "logprobs": lp, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**base, "choices": choices, "usage": usage(finals)}

    # ------------------------------------------------------------------ /v1/chat/completions

    def chat_logprobs(token_ids: list[int], entries: list, top_k: int) -> dict:
        content = []
        for token_id, entry in zip(token_ids, entries):
            chosen = entry[token_id]
            content.append({
                "token": chosen.decoded_token, "logprob": _finite(chosen.logprob),
                "bytes": list(chosen.decoded_token.encode()),
                "top_logprobs": [{"token": lp.decoded_token, "logprob": _finite(lp.logprob),
                                  "bytes": list(lp.decoded_token.encode())}
                                 for tid, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
                                 if lp.rank <= top_k],
            })
        return {"content": content}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        if req.tools and req.tool_choice != "none":
            raise InvalidRequestError("tool calling is not supported by this server", param="tools")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise InvalidRequestError("top_logprobs must be between 0 and 20", param="top_logprobs")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                 **(req.chat_template_kwargs or {}))
        except TokenmillError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors come from user-supplied messages
            raise InvalidRequestError(f"the chat template could not render these messages: {exc}",
                                      param="messages") from exc
        prompt_ids = tokenizer.encode(text, add_bos=False)  # the template writes BOS itself
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await start([prompt_ids], params, rid, req.priority)
        base = {"id": rid, "created": created, "model": config.served_model_name}

        def logprobs_of(token_ids: list[int], entries: list | None) -> dict | None:
            if not req.logprobs or entries is None:
                return None
            return chat_logprobs(token_ids, entries, req.top_logprobs or 0)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def chunks() -> AsyncIterator[dict]:
                chunk_base = {**base, "object": "chat.completion.chunk"}
                started: set[int] = set()
                final = None
                async for _, out in merged(streams):
                    for c in out.outputs:
                        if c.index not in started:
                            started.add(c.index)
                            yield {**chunk_base, "choices": [{"index": c.index, "delta": {"role": "assistant",
                                                              "content": ""}, "logprobs": None, "finish_reason": None}]}
                        if c.text_delta or c.token_ids_delta:
                            new = len(c.token_ids_delta)
                            lp = logprobs_of(c.token_ids[-new:], c.logprobs[-new:] if c.logprobs else None) if new else None
                            yield {**chunk_base, "choices": [{"index": c.index, "delta": {"content": c.text_delta},
                                                              "logprobs": lp, "finish_reason": None}]}
                        if c.finished:
                            yield {**chunk_base, "choices": [{"index": c.index, "delta": {}, "logprobs": None,
                                                              "finish_reason": c.finish_reason,
                                                              "stop_reason": c.stop_reason}]}
                    if out.finished:
                        final = out
                if include_usage and final is not None:
                    yield {**chunk_base, "choices": [], "usage": usage([final])}

            return StreamingResponse(event_stream(chunks()), media_type="text/event-stream")

        (final,) = await collect(streams, raw)
        choices = [{
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": logprobs_of(c.token_ids, c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        } for c in final.outputs]
        return {**base, "object": "chat.completion", "choices": choices, "usage": usage([final])}

    return app


class GuardMiddleware:
    """API key and body-size checks before any route runs (a plain ASGI middleware: it adds no
    task or stream of its own, so cancellation at shutdown passes straight through)."""

    def __init__(self, app, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        config, path = self.config, scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        protected = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
        protected |= (path == "/health" and config.protect_health) or (path == "/metrics" and config.protect_metrics)
        if config.api_key and protected and not _authorized(headers, config.api_key):
            return await APIError(401, "Incorrect API key provided.", code="invalid_api_key").response()(
                scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > config.max_body_bytes:
            return await APIError(413, f"Request body of {length} bytes exceeds the limit of "
                                       f"{config.max_body_bytes} bytes.", code="request_too_large").response()(
                scope, receive, send)
        started = event_stream = False

        async def tracking_send(message) -> None:
            nonlocal started, event_stream
            if message["type"] == "http.response.start":
                started = True
                event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", []))
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            # uvicorn's forced exit (a second Ctrl-C) cancels every request: answer in OpenAI's
            # shape when nothing was sent yet, and end quietly instead of logging a traceback
            if not started:
                await APIError(503, "the server is shutting down", type_="service_unavailable").response()(
                    scope, receive, send)
            else:  # end the body cleanly, with an in-band error event when it is a stream
                tail = b""
                if event_stream:
                    error = json.dumps(error_body("the server is shutting down", "service_unavailable"))
                    tail = f"data: {error}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})


def _finite(logprob: float) -> float:
    """JSON has no -inf: impossible tokens get -9999.0, as vLLM reports them."""
    return logprob if logprob > -9999.0 else -9999.0


def _authorized(headers: dict[str, str], api_key: str) -> bool:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        token = headers.get("x-api-key", "")
    return hmac.compare_digest(token.strip().encode(), api_key.encode())
