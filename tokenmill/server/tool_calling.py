"""Tools and reasoning in chat completions: what the chat template gets, what constrains the
output, and how the output's text becomes `reasoning_content`, `content` and `tool_calls`.

`tool_choice` decides (OpenAI's defaults: "auto" where there are tools):
- "none": the template gets no tools and the output is plain text;
- "auto": the template gets the tools, and the model's own call format, parsed from its text by
  the model's tool parser, tells calls from content;
- "required" and a named function: a grammar in the model's call format forces one call (or,
  with `parallel_tool_calls`, one or more) whose arguments follow the function's parameters.

A `ChoiceParser` per response choice reads the output: first the reasoning parser (when the
server has one) takes the `<think>` part out, then the tool parser the calls, the same way for a
whole text and for a stream of pieces.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.parsers.reasoning import ReasoningParser
from tokenmill.parsers.tool_calls import (
    TOOL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    tool_parser_for_template,
)
from tokenmill.sample import StructuredOutputs
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from tokenmill.tokenizer import Tokenizer


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its prompt, its output constraint and its output."""

    tools: list[dict[str, Any]] | None  # for the chat template
    parser: type[ToolParser] | None  # reads calls out of the output
    constraint: StructuredOutputs | None  # forces calls ("required" or a named function)

    @property
    def names(self) -> frozenset[str]:
        """The functions the model may call: a "call" to another name is content."""
        return frozenset(t["function"]["name"] for t in self.tools or [])


def plan_tools(
    req: ChatCompletionRequest, tokenizer: Tokenizer, parser_name: str | None
) -> ToolPlan:
    """The request's tool plan; InvalidRequestError for a choice the tools cannot meet.
    parser_name is the server's `--tool-call-parser` (None: the one the chat template implies)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError(
                "tool_choice needs tools: give the functions the model may call in tools",
                param="tool_choice",
            )
        return ToolPlan(None, None, None)
    if choice == "none":
        return ToolPlan(None, None, None)
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools]
    name = parser_name or tool_parser_for_template(tokenizer.chat_template or "")
    if name is None:
        raise InvalidRequestError(
            "this model's chat template has no tool-call format: start the server with "
            f"--tool-call-parser (one of {', '.join(TOOL_PARSERS)}) or send no tools",
            param="tools",
        )
    parser = TOOL_PARSERS[name]
    if choice in (None, "auto"):
        return ToolPlan(tools, parser, None)
    forced, parallel = tools, req.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        forced = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not forced:
            raise InvalidRequestError(
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(t['function']['name'] for t in tools)})",
                param="tool_choice",
            )
        parallel = False
    grammar = parser().grammar(forced, parallel, lambda marker: _terminal(tokenizer, marker))
    return ToolPlan(tools, parser, StructuredOutputs(grammar=grammar))


def _terminal(tokenizer: Tokenizer, marker: str) -> str:
    """A call-format marker as a Lark terminal: llguidance reads an added token (such as Qwen's
    "<tool_call>") only by its id, and other text as a string."""
    token_id = tokenizer.added_token_id(marker)
    return json.dumps(marker) if token_id is None else f"<[{token_id}]>"


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them: OpenAI sends a tool call's arguments as JSON
    text, templates (as transformers passes them) take them as an object."""
    prepared = []
    for i, message in enumerate(messages):
        data = message.model_dump(exclude_none=True)
        calls = data.get("tool_calls")
        if calls is not None:
            data["tool_calls"] = [_template_call(call, i) for call in calls]
        prepared.append(data)
    return prepared


def _template_call(call: Any, message_index: int) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"messages[{message_index}].tool_calls: arguments must be JSON text ({exc})",
            param=f"messages.{message_index}.tool_calls",
        ) from exc
    return {**call, "function": {**function, "arguments": parsed}}


class ChoiceParser:
    """Splits one choice's output into reasoning, content and tool calls, whole or streamed."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self._tools = plan.parser(plan.names) if plan.parser is not None else None
        self._reasoning = reasoning
        self.called = False  # a tool call was seen: the choice finishes with "tool_calls"

    def message(self, text: str) -> dict[str, Any]:
        """The chat message of a whole output."""
        reasoning, content = None, text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.parse(text)
        calls: list[ToolCall] = []
        if self._tools is not None:
            content, calls = self._tools.parse(content or "")
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            self.called = True
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in calls
            ]
        return message

    def feed(self, text: str) -> dict[str, Any]:
        """The stream delta for the output's next piece of text (empty while held back)."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        calls: list[ToolCallDelta] = []
        if self._tools is not None and content:
            content, calls = self._tools.feed(content)
        return self._delta(reasoning, content, calls)

    def finish(self) -> dict[str, Any]:
        """The stream delta of whatever was held back when the output ends."""
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        calls: list[ToolCallDelta] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content) if content else ("", [])
            rest, last = self._tools.finish()
            content, calls = content + rest, calls + last
        return self._delta(reasoning, content, calls)

    def _delta(self, reasoning: str, content: str, calls: list[ToolCallDelta]) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            self.called = True
            delta["tool_calls"] = [_call_delta(call) for call in calls]
        return delta


def _call_delta(call: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's streamed form: id, type and name in a call's first piece, then arguments."""
    if call.name is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
