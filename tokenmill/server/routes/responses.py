"""/v1/responses: OpenAI's Responses API, as `client.responses.create` sends it.

A request's input items (messages, function calls and their outputs) and instructions become a
chat completion request, run through the chat path (`tokenmill.server.chat`); its output comes
back as output items (a message of output_text, function calls), whole or as the Responses
stream's events. Responses are kept in a bounded in-memory store (`store`, on by default), so a
request naming a `previous_response_id` continues that conversation: its input and output come
before the new input, its instructions do not (as OpenAI does); GET /v1/responses/{id} returns a
stored response.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from tokenmill.errors import InvalidRequestError
from tokenmill.server.chat import ChatSetup, chat_choices, chat_chunks, chat_setup, translated
from tokenmill.server.errors import api_error
from tokenmill.server.formatting import sse
from tokenmill.server.generation import RequestRun
from tokenmill.server.protocol import ChatCompletionRequest, _Strict
from tokenmill.server.response_store import StoredResponse
from tokenmill.server.state import State, tenant

router = APIRouter()


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None


# ---------------------------------------------------------------------------- input


def _input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        else:
            raise InvalidRequestError(
                f"input[{i}]: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output are)",
                param="input",
            )
    return messages


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"input[{index}].content must be text or parts", param="input")
    texts = []
    for part in content:
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise InvalidRequestError(
                f"input[{index}]: content parts of type {part.get('type')!r} are not supported",
                param="input",
            )
        texts.append(part.get("text", ""))
    return "".join(texts)


def _chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat completion request, and the conversation to store (without instructions)."""
    conversation = history + _input_messages(req.input)
    messages = list(conversation)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "parallel_tool_calls": req.parallel_tool_calls,
        "stream": req.stream,
        "stream_options": {"include_usage": True} if req.stream else None,
    }
    if req.tools:
        body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(req.tools)]
    if isinstance(req.tool_choice, dict):
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    text_format = (req.text or {}).get("format") or {"type": "text"}
    if text_format.get("type") == "json_schema":
        schema = {"name": text_format.get("name", "output"), "schema": text_format.get("schema")}
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif text_format.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    return translated(ChatCompletionRequest, body), conversation


def _chat_tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A forced function, {"type": "function", "name": ...}, as chat completions name it."""
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequestError(
            'tool_choice must be "auto", "none", "required" or {"type": "function", "name": '
            f"NAME}} naming one of the tools; got {json.dumps(choice)[:200]}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequestError(
            f"tools[{index}]: tools of type {tool.get('type')!r} are not supported (function is)",
            param="tools",
        )
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


# ---------------------------------------------------------------------------- output


def _output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
    for call in message.get("tool_calls", []):
        function = call["function"]
        items.append(_function_call_item(call["id"], function["name"], function["arguments"]))
    return items


def _function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content if text or status == "completed" else [],
    }


def _body(
    req: ResponsesRequest,
    response_id: str,
    created: int,
    status: Literal["in_progress", "completed", "incomplete"],
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    model: str,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _conversation_output(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as the chat messages that continue the conversation."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


# ---------------------------------------------------------------------------- routes


@router.post("/v1/responses", response_model=None)
async def create(req: ResponsesRequest, raw: Request, state: State) -> dict | StreamingResponse:
    served = await state.model(raw, req.model)
    store = state.responses
    history = store.get(req.previous_response_id).messages if req.previous_response_id else []
    chat, conversation = _chat_request(req, history)
    setup = chat_setup(chat, state, served)
    response_id = f"resp_{uuid.uuid4().hex}"
    created = int(time.time())
    run = await RequestRun.start(
        state, served, [setup.prompt_ids], setup.params, response_id, 0, tenant(raw, req.user)
    )
    model = served.name

    def finish(body: dict[str, Any]) -> dict[str, Any]:
        if req.store:
            stored = StoredResponse(body, conversation + _conversation_output(body["output"]))
            store.put(response_id, stored)
        return body

    if req.stream:
        events = _events(run, chat, setup, req, response_id, created, model, finish)
        return StreamingResponse(_sse(events), media_type="text/event-stream")
    (final,) = await run.finals(raw.is_disconnected)
    (choice,) = chat_choices(final, chat, setup)
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    usage = _usage(
        len(final.prompt_token_ids), len(final.outputs[0].token_ids), final.num_cached_tokens
    )
    output = _output_items(choice["message"])
    return finish(_body(req, response_id, created, status, output, usage, model))


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, state: State) -> dict[str, Any]:
    return state.responses.get(response_id).body


async def _events(
    run: RequestRun,
    chat: ChatCompletionRequest,
    setup: ChatSetup,
    req: ResponsesRequest,
    response_id: str,
    created: int,
    model: str,
    finish: Any,
) -> AsyncIterator[dict[str, Any]]:
    """The Responses stream: created, in_progress, the message item's text deltas, its done
    events, a function_call item per tool call, completed (or incomplete)."""
    body = _body(req, response_id, created, "in_progress", [], None, model)
    yield {"type": "response.created", "response": body}
    yield {"type": "response.in_progress", "response": body}
    message_id = f"msg_{uuid.uuid4().hex}"
    text, opened = "", False
    calls: dict[int, dict[str, str]] = {}
    reason, usage = None, None
    async for chunk in chat_chunks(run, {}, chat, setup):
        if not chunk["choices"]:
            u = chunk["usage"]
            cached = u["prompt_tokens_details"]["cached_tokens"]
            usage = _usage(u["prompt_tokens"], u["completion_tokens"], cached)
            continue
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        reason = choice["finish_reason"] or reason
        if piece := delta.get("content"):
            if not opened:
                opened = True
                item = _message_item(message_id, "", "in_progress")
                yield {"type": "response.output_item.added", "output_index": 0, "item": item}
                yield {
                    "type": "response.content_part.added",
                    "item_id": message_id,
                    "output_index": 0,
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                }
            text += piece
            yield {
                "type": "response.output_text.delta",
                "item_id": message_id,
                "output_index": 0,
                "content_index": 0,
                "delta": piece,
                "logprobs": [],
            }
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            entry["id"] = call.get("id") or entry["id"]
            entry["name"] = call["function"].get("name") or entry["name"]
            entry["arguments"] += call["function"].get("arguments") or ""
    output: list[dict[str, Any]] = []
    if opened:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        where = {"item_id": message_id, "output_index": 0, "content_index": 0}
        yield {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
        yield {"type": "response.content_part.done", **where, "part": part}
        item = _message_item(message_id, text, "completed")
        yield {"type": "response.output_item.done", "output_index": 0, "item": item}
        output.append(item)
    for _, call in sorted(calls.items()):
        item = _function_call_item(call["id"], call["name"], call["arguments"])
        index = len(output)
        yield {"type": "response.output_item.added", "output_index": index, "item": item}
        yield {
            "type": "response.function_call_arguments.done",
            "item_id": item["id"],
            "output_index": index,
            "arguments": call["arguments"],
        }
        yield {"type": "response.output_item.done", "output_index": index, "item": item}
        output.append(item)
    status = "incomplete" if reason == "length" else "completed"
    body = finish(_body(req, response_id, created, status, output, usage, model))
    yield {"type": f"response.{status}", "response": body}


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Named events with sequence numbers; an error midway is an `error` event."""
    number = 0
    try:
        async for event in events:
            event = {**event, "sequence_number": number}
            number += 1
            yield f"event: {event['type']}\n" + sse(event)
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        error = api_error(exc)
        event = {
            "type": "error",
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "sequence_number": number,
        }
        yield "event: error\n" + sse(event)
