"""/v1/completions and /v1/chat/completions: OpenAI's generation endpoints.

Each route checks its request, turns it into engine prompts and sampling parameters, starts a
`RequestRun`, and formats what the run yields: every output as a chunk of a server-sent event
stream, or the final outputs as one JSON body.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tokenmill.engine.outputs import RequestOutput, TokenLogprobs
from tokenmill.errors import InvalidRequestError
from tokenmill.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from tokenmill.sample import SamplingParams
from tokenmill.server.formatting import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    event_stream,
    usage,
)
from tokenmill.server.generation import RequestRun
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokenmill.server.state import ServerState, State
from tokenmill.server.tool_calling import ChoiceParser, ToolPlan, plan_tools, template_messages
from tokenmill.tokenizer import Tokenizer

router = APIRouter()

# Prompt tokens searched for an opened reasoning block (the template's generation prompt)
REASONING_PROMPT_TAIL = 16


@router.post("/v1/completions", response_model=None)
async def completions(
    req: CompletionRequest, raw: Request, state: State
) -> dict | StreamingResponse:
    state.check_model(req.model)
    state.check_generates()
    params = _completion_params(req)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    base = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.config.served_model_name,
    }
    run = await RequestRun.start(state, req.prompts(), params, request_id, req.priority)
    if req.stream:
        return _event_stream(_completion_chunks(run, base, req.n, _include_usage(req)))
    finals = await run.finals(raw.is_disconnected)
    choices = _completion_choices(finals, req, state.engine.tokenizer)
    return {**base, "choices": choices, "usage": usage(finals)}


@router.post("/v1/chat/completions", response_model=None)
async def chat(req: ChatCompletionRequest, raw: Request, state: State) -> dict | StreamingResponse:
    state.check_model(req.model)
    state.check_generates()
    setup = _chat_setup(req, state)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    base = {"id": request_id, "created": int(time.time()), "model": state.config.served_model_name}
    run = await RequestRun.start(state, [setup.prompt_ids], setup.params, request_id, req.priority)
    if req.stream:
        chunk_base = {**base, "object": "chat.completion.chunk"}
        return _event_stream(_chat_chunks(run, chunk_base, req, setup))
    (final,) = await run.finals(raw.is_disconnected)
    choices = _chat_choices(final, req, setup)
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


# ---------------------------------------------------------------------------- chat completions


@dataclass
class ChatSetup:
    """A chat request made ready for the engine, and how to read its output."""

    prompt_ids: list[int]
    params: SamplingParams
    tool_plan: ToolPlan
    reasoning: type[ReasoningParser] | None
    prompt_opens_reasoning: bool

    def output_parser(self) -> ChoiceParser:
        """A fresh parser for one choice's output."""
        reasoning = self.reasoning(self.prompt_opens_reasoning) if self.reasoning else None
        return ChoiceParser(self.tool_plan, reasoning)


def _chat_setup(req: ChatCompletionRequest, state: ServerState) -> ChatSetup:
    """The prompt's token ids (the messages and tools rendered by the chat template), the engine
    parameters and the output's parsers, refusing what this server does not support."""
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise InvalidRequestError("top_logprobs must be between 0 and 20", param="top_logprobs")
    engine = state.engine
    plan = plan_tools(req, engine.tokenizer, state.config.tool_call_parser)
    prompt_ids = engine.tokenize(
        messages=template_messages(req.messages),
        add_generation_prompt=req.add_generation_prompt,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=plan.tools,
    )
    max_tokens = req.max_tokens
    if req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
    params = req.sampling_params(max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    if plan.constraint is not None:
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice forces a tool call, which leaves no room for another output "
                "constraint: drop response_format / structured_outputs, or use tool_choice auto",
                param="tool_choice",
            )
        params.structured_outputs = plan.constraint
    if plan.parser is not None:
        params.skip_special_tokens = False  # call markers may be special tokens
    reasoning = REASONING_PARSERS.get(state.config.reasoning_parser or "")
    opens = False
    if reasoning is not None:
        prompt_tail = engine.tokenizer.decode(prompt_ids[-REASONING_PROMPT_TAIL:])
        opens = reasoning.opens_reasoning(prompt_tail)
        if params.structured_outputs is not None:  # the constraint starts after the reasoning
            params.structured_outputs = replace(
                params.structured_outputs,
                reasoning_markers=(reasoning.start, reasoning.end),
                reasoning_opened=opens,
            )
    return ChatSetup(prompt_ids, params, plan, reasoning, opens)


def _chat_choices(
    final: RequestOutput, req: ChatCompletionRequest, setup: ChatSetup
) -> list[dict[str, Any]]:
    choices = []
    for c in final.outputs:
        parser = setup.output_parser()
        message = parser.message(c.text)
        choices.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": _chat_logprobs(req, c.token_ids, c.logprobs),
                "finish_reason": _finish_reason(c.finish_reason, parser),
                "stop_reason": c.stop_reason,
            }
        )
    return choices


def _finish_reason(reason: str | None, parser: ChoiceParser) -> str | None:
    """OpenAI's "tool_calls" for an output that ended by itself after calling a tool."""
    return "tool_calls" if reason == "stop" and parser.called else reason


def _chat_logprobs(
    req: ChatCompletionRequest, token_ids: list[int], entries: list[TokenLogprobs] | None
) -> dict | None:
    if not req.logprobs or entries is None:
        return None
    return chat_logprobs(token_ids, entries, req.top_logprobs or 0)


async def _chat_chunks(
    run: RequestRun, base: dict, req: ChatCompletionRequest, setup: ChatSetup
) -> AsyncIterator[dict]:
    """Per choice: a chunk with the assistant role, one per new piece of text (as content,
    reasoning or tool-call deltas, see `ChoiceParser`), one with the finish reason."""
    final = None
    parsers: dict[int, ChoiceParser] = {}
    async for _, out in run.outputs():
        for c in out.outputs:
            if c.index not in parsers:
                parsers[c.index] = setup.output_parser()
                yield _chat_chunk(base, c.index, {"role": "assistant", "content": ""})
            parser = parsers[c.index]
            new = len(c.token_ids_delta)
            if c.text_delta or new:
                entries = c.logprobs[-new:] if c.logprobs and new else None
                logprobs = _chat_logprobs(req, c.token_ids[-new:], entries) if new else None
                delta = parser.feed(c.text_delta)
                if delta or logprobs:
                    yield _chat_chunk(base, c.index, delta, logprobs)
            if c.finished:
                rest = parser.finish()
                if rest:
                    yield _chat_chunk(base, c.index, rest)
                yield _chat_chunk(
                    base,
                    c.index,
                    {},
                    finish_reason=_finish_reason(c.finish_reason, parser),
                    stop_reason=c.stop_reason,
                )
        if out.finished:
            final = out
    if _include_usage(req) and final is not None:
        yield {**base, "choices": [], "usage": usage([final])}


def _chat_chunk(
    base: dict, index: int, delta: dict, logprobs: dict | None = None, **finish: Any
) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None, **finish}
    return {**base, "choices": [choice]}
