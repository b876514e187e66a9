"""/v1/completions and /v1/chat/completions: OpenAI's generation endpoints.

Each route checks its request, turns it into engine prompts and sampling parameters, starts a
`RequestRun`, and formats what the run yields: every output as a chunk of a server-sent event
stream, or the final outputs as one JSON body.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.sample import SamplingParams
from tokenmill.server.chat import chat_choices, chat_chunks, chat_setup
from tokenmill.server.formatting import (
    completion_logprobs,
    echo_logprobs,
    event_stream,
    usage,
)
from tokenmill.server.generation import RequestRun
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokenmill.server.state import State, tenant
from tokenmill.tokenizer import Tokenizer

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(
    req: CompletionRequest, raw: Request, state: State
) -> dict | StreamingResponse:
    model = await state.model(raw, req.model, req.keep_alive)
    model.check_generates()
    params = _completion_params(req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.name,
    }
    run = await RequestRun.start(
        state, model, req.prompts(), params, request_id, req.priority, tenant(raw, req.user)
    )
    if req.stream:
        return _event_stream(_completion_chunks(run, base, req.n, _include_usage(req)))
    finals = await run.finals(raw.is_disconnected)
    choices = _completion_choices(finals, req, model.engine.tokenizer)
    return {**base, "choices": choices, "usage": usage(finals)}


@router.post("/v1/chat/completions", response_model=None)
async def chat(req: ChatCompletionRequest, raw: Request, state: State) -> dict | StreamingResponse:
    model = await state.model(raw, req.model, req.keep_alive)
    setup = chat_setup(req, state, model)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    base = {"id": request_id, "created": int(time.time()), "model": model.name}
    run = await RequestRun.start(
        state,
        model,
        [setup.prompt_ids],
        setup.params,
        request_id,
        req.priority,
        tenant(raw, req.user),
    )
    if req.stream:
        chunk_base = {**base, "object": "chat.completion.chunk"}
        return _event_stream(chat_chunks(run, chunk_base, req, setup))
    (final,) = await run.finals(raw.is_disconnected)
    choices = chat_choices(final, req, setup)
    return {**base, "object": "chat.completion", "choices": choices, "usage": usage([final])}


def _event_stream(chunks: AsyncIterator[dict]) -> StreamingResponse:
    return StreamingResponse(event_stream(chunks), media_type="text/event-stream")


def _include_usage(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---------------------------------------------------------------------------- completions


def _completion_params(req: CompletionRequest) -> SamplingParams:
    """Engine parameters of a completion request, refusing what this server does not support."""
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
    return params


async def _completion_chunks(
    run: RequestRun, base: dict, n: int, include_usage: bool
) -> AsyncIterator[dict]:
    """One chunk per choice that moved; choice i * n + j is prompt i's sequence j."""
    finals: list[RequestOutput] = []
    async for i, out in run.outputs():
        for c in out.outputs:
            new = len(c.token_ids_delta)
            if not c.text_delta and not c.finished and not new:
                continue
            choice = {
                "index": i * n + c.index,
                "text": c.text_delta,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if c.logprobs is not None and new:
                choice["logprobs"] = completion_logprobs(c.token_ids[-new:], c.logprobs[-new:])
            yield {**base, "choices": [choice]}
        if out.finished:
            finals.append(out)
    if include_usage:
        yield {**base, "choices": [], "usage": usage(finals)}


def _completion_choices(
    finals: list[RequestOutput], req: CompletionRequest, tokenizer: Tokenizer
) -> list[dict[str, Any]]:
    choices = []
    for i, final in enumerate(finals):
        prefix, echoed = "", None
        if req.echo:
            prefix = (
                final.prompt
                if final.prompt is not None
                else tokenizer.decode(final.prompt_token_ids)
            )
            if req.logprobs is not None:
                echoed = echo_logprobs(final, tokenizer)
        for c in final.outputs:
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(c.token_ids, c.logprobs, echoed)
            choices.append(
                {
                    "index": i * req.n + c.index,
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    return choices
