"""/v1/messages: Anthropic's Messages API, as the `anthropic` SDK and Claude-speaking tools send it.

A request is translated into a chat completion request (system prompt, text, tool use and tool
result blocks into OpenAI's messages; tools and tool_choice into OpenAI's), run through the same
chat path (`tokenmill.server.chat`), and its output read back as Anthropic's content blocks:
one JSON message, or the Messages stream's events (message_start, content_block_start / delta /
stop per block, message_delta with the stop reason, message_stop).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from tokenmill.errors import InvalidRequestError
from tokenmill.server.chat import ChatSetup, chat_choices, chat_chunks, chat_setup, translated
from tokenmill.server.errors import api_error
from tokenmill.server.formatting import stream_json
from tokenmill.server.generation import RequestRun
from tokenmill.server.protocol import ChatCompletionRequest, _Strict
from tokenmill.server.state import State, tenant

router = APIRouter()
PATH = "/v1/messages"


class AnthropicMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)


class AnthropicToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(_Strict):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion."""
        messages: list[dict[str, Any]] = []
        if self.system:
            messages.append({"role": "system", "content": _text(self.system, "system")})
        for i, message in enumerate(self.messages):
            messages.extend(_chat_messages(message, i))
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
        }
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        if self.tool_choice is not None:
            choice = self.tool_choice
            if choice.type == "tool":
                body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                    choice.type
                ]
        return translated(ChatCompletionRequest, body)


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise InvalidRequestError(
                f"{where}: only text blocks are supported here, got {block.get('type')!r}"
            )
        texts.append(block["text"])
    return "".join(texts)


def _chat_messages(message: AnthropicMessage, index: int) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages: text and tool_use blocks make one message,
    each tool_result block a tool message of its own."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in message.content:
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use" and message.role == "assistant":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {
                    "id": block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind == "tool_result" and message.role == "user":
            content = block.get("content", "")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.get("tool_use_id"),
                    "content": _text(content, f"messages[{index}].tool_result"),
                }
            )
        else:
            raise InvalidRequestError(
                f"messages[{index}]: a {message.role} message cannot hold a {kind!r} block here "
                "(supported: text, tool_use from the assistant, tool_result from the user)"
            )
    chat: list[dict[str, Any]] = list(results)
    if texts or calls or not results:
        entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if calls:
            entry["tool_calls"] = calls
        chat.append(entry)
    return chat


@router.post(PATH, response_model=None)
async def messages(req: MessagesRequest, raw: Request, state: State) -> dict | StreamingResponse:
    model = await state.model(raw, req.model)
    chat = req.chat_request()
    setup = chat_setup(chat, state, model)
    message_id = f"msg_{uuid.uuid4().hex}"
    user = (req.metadata or {}).get("user_id")
    run = await RequestRun.start(
        state, model, [setup.prompt_ids], setup.params, message_id, 0, tenant(raw, user)
    )
    head = {"id": message_id, "type": "message", "role": "assistant", "model": model.name}
    if req.stream:
        events = _events(run, chat, setup, head, len(setup.prompt_ids))
        return StreamingResponse(_sse(events), media_type="text/event-stream")
    (final,) = await run.finals(raw.is_disconnected)
    (choice,) = chat_choices(final, chat, setup)
    stop_reason, stop_sequence = _stop_reason(choice["finish_reason"], choice["stop_reason"])
    return {
        **head,
        "content": _content_blocks(choice["message"]),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {
            "input_tokens": len(final.prompt_token_ids),
            "output_tokens": len(final.outputs[0].token_ids),
            "cache_read_input_tokens": final.num_cached_tokens,
        },
    }


def _content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls", []):
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"] or "{}"),
            }
        )
    return blocks


def _stop_reason(finish_reason: str | None, stop: str | int | None) -> tuple[str, str | None]:
    """Anthropic's stop reason (and the stop sequence met) for OpenAI's finish reason."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls":
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


async def _events(
    run: RequestRun,
    chat: ChatCompletionRequest,
    setup: ChatSetup,
    head: dict[str, Any],
    input_tokens: int,
) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The Messages stream's events, from the chat path's chunks: a text block while text
    comes, a tool_use block per tool call (its input as partial JSON)."""
    start = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {"input_tokens": input_tokens, "output_tokens": 0}
    yield "message_start", {"type": "message_start", "message": start}
    index = -1  # of the open block
    open_kind: str | None = None
    calls: dict[int, int] = {}  # tool call index -> block index
    output_tokens = 0
    finish: tuple[str | None, str | int | None] = (None, None)
    async for chunk in chat_chunks(run, {}, chat, setup):
        if not chunk["choices"]:  # the last chunk: usage
            output_tokens = chunk["usage"]["completion_tokens"]
            continue
        (choice,) = chunk["choices"]
        delta = choice["delta"]
        if choice["finish_reason"] is not None:
            finish = (choice["finish_reason"], choice.get("stop_reason"))
        if text := delta.get("content"):
            if open_kind != "text":
                if open_kind is not None:
                    yield _block_stop(index)
                index, open_kind = index + 1, "text"
                block = {"type": "text", "text": ""}
                yield _block_start(index, block)
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "text_delta", "text": text},
                },
            )
        for call in delta.get("tool_calls", []):
            if call["index"] not in calls:
                if open_kind is not None:
                    yield _block_stop(index)
                index, open_kind = index + 1, "tool_use"
                calls[call["index"]] = index
                block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"]}
                yield _block_start(index, {**block, "input": {}})
            if arguments := call["function"].get("arguments"):
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": calls[call["index"]],
                        "delta": {"type": "input_json_delta", "partial_json": arguments},
                    },
                )
    if open_kind is not None:
        yield _block_stop(index)
    stop_reason, stop_sequence = _stop_reason(*finish)
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens},
        },
    )
    yield "message_stop", {"type": "message_stop"}


def _block_start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_start", {
        "type": "content_block_start",
        "index": index,
        "content_block": block,
    }


def _block_stop(index: int) -> tuple[str, dict[str, Any]]:
    return "content_block_stop", {"type": "content_block_stop", "index": index}


async def _sse(events: AsyncIterator[tuple[str, dict[str, Any]]]) -> AsyncIterator[str]:
    """Named server-sent events; an error midway is an `error` event in Anthropic's shape."""
    try:
        async for name, data in events:
            yield f"event: {name}\ndata: {stream_json(data)}\n\n"
    except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
        yield f"event: error\ndata: {stream_json(api_error(exc).body(PATH))}\n\n"
