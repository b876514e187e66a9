"""A chat request made ready for the engine and its output read back: the chat template, tools,
reasoning and sampling parameters of /v1/chat/completions, which the other chat APIs (Anthropic's
Messages, Ollama's chat, OpenAI's Responses) reach by translating their requests into it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tokenmill.engine.outputs import RequestOutput, TokenLogprobs
from tokenmill.errors import InvalidRequestError
from tokenmill.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from tokenmill.sample import SamplingParams
from tokenmill.server.formatting import chat_logprobs, usage
from tokenmill.server.generation import RequestRun
from tokenmill.server.model_registry import ServedModel
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.state import ServerState
from tokenmill.server.tool_calling import ChoiceParser, ToolPlan, plan_tools, template_messages

RequestT = TypeVar("RequestT", bound=BaseModel)
# Prompt tokens searched for an opened reasoning block (the template's generation prompt)
REASONING_PROMPT_TAIL = 16


def translated(model: type[RequestT], body: dict[str, Any]) -> RequestT:
    """Another API's request translated into `model` (a chat completion or completion request);
    what does not validate is the client's error, named by the OpenAI field it became."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'request'}: {e['msg']}"
            for e in exc.errors()[:5]
        )
        raise InvalidRequestError(f"invalid request ({problems})") from None


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


def chat_setup(req: ChatCompletionRequest, state: ServerState, model: ServedModel) -> ChatSetup:
    """The prompt's token ids (the messages and tools rendered by the model's chat template), the
    engine parameters and the output's parsers, refusing what this server does not support."""
    model.check_generates()
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise InvalidRequestError("top_logprobs must be between 0 and 20", param="top_logprobs")
    engine = model.engine
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
    if reasoning is not None and reasoning.special_markers:
        if params.structured_outputs is not None:
            # the answer opens with a channel header of its own, which no constraint allows
            raise InvalidRequestError(
                "output constraints (response_format, structured_outputs, a forced tool call) "
                f"are not supported with --reasoning-parser {reasoning.name} yet: drop them, or "
                "serve without the reasoning parser"
            )
        params.skip_special_tokens = False  # harmony's channel markers are special tokens
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


def chat_choices(
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
                "logprobs": chat_logprobs_block(req, c.token_ids, c.logprobs),
                "finish_reason": finish_reason(c.finish_reason, parser),
                "stop_reason": c.stop_reason,
            }
        )
    return choices


def finish_reason(reason: str | None, parser: ChoiceParser) -> str | None:
    """OpenAI's "tool_calls" for an output that ended by itself after calling a tool."""
    return "tool_calls" if reason == "stop" and parser.called else reason


def chat_logprobs_block(
    req: ChatCompletionRequest, token_ids: list[int], entries: list[TokenLogprobs] | None
) -> dict | None:
    if not req.logprobs or entries is None:
        return None
    return chat_logprobs(token_ids, entries, req.top_logprobs or 0)


async def chat_chunks(
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
                yield _chunk(base, c.index, {"role": "assistant", "content": ""})
            parser = parsers[c.index]
            new = len(c.token_ids_delta)
            if c.text_delta or new:
                entries = c.logprobs[-new:] if c.logprobs and new else None
                logprobs = chat_logprobs_block(req, c.token_ids[-new:], entries) if new else None
                delta = parser.feed(c.text_delta)
                if delta or logprobs:
                    yield _chunk(base, c.index, delta, logprobs)
            if c.finished:
                rest = parser.finish()
                if rest:
                    yield _chunk(base, c.index, rest)
                yield _chunk(
                    base,
                    c.index,
                    {},
                    finish_reason=finish_reason(c.finish_reason, parser),
                    stop_reason=c.stop_reason,
                )
        if out.finished:
            final = out
    if req.stream_options and req.stream_options.include_usage and final is not None:
        yield {**base, "choices": [], "usage": usage([final])}


def _chunk(
    base: dict, index: int, delta: dict, logprobs: dict | None = None, **finish: Any
) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None, **finish}
    return {**base, "choices": [choice]}
