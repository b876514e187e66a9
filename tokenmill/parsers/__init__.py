"""Output parsers: a model's tool calls and reasoning, read from its text as a whole or as it
streams (pure text processing, no model or tokenizer)."""

from tokenmill.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from tokenmill.parsers.tool_calls import (
    TOOL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    tool_parser_for_template,
)

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ReasoningParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "tool_parser_for_template",
]
