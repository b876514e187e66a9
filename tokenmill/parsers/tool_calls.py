"""Tool-call parsers: the calls a model writes in its own format, as OpenAI's `tool_calls`.

One parser per format, named as vLLM names them: "hermes" (`<tool_call>` JSON `</tool_call>`:
Hermes, Qwen2.5, Qwen3), "llama3_json" (Llama 3.1/3.2: the output is a JSON call, `; `
between calls) and "mistral" (`[TOOL_CALLS]` and a JSON array of calls). A call is a JSON object
with a string "name" and its "arguments" (or "parameters"), in either order; other keys are
ignored, and a missing arguments value is `{}`.

A parser instance reads one response choice. `feed` takes the output a piece at a time and
returns the new content and the new `ToolCallDelta`s, holding back only what it cannot yet tell
apart (a partial marker, a call whose name has not arrived); `finish` flushes the rest. `parse`
reads a whole output at once, through the same reader on a fresh instance, so for every way of
cutting an output into pieces the streamed content and calls add up to what `parse` returns.

Content is the text outside the calls, less the whitespace at the start of the output and right
after each call. Text that opens like a call but is not one (bad JSON, no name) stays content.
A call is committed once its name is read: its first delta carries its id and name, then its
arguments follow as the raw text the model writes (a string value goes out decoded, whole, once
it ends). The one difference between the two paths: when a committed call breaks off (the output
ends inside it, or its JSON goes wrong after the name), streaming has sent its name and part of
its arguments, while `parse` returns its text as content.

`grammar` gives an llguidance Lark grammar that forces the output to be calls in the format.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any, ClassVar

ARGUMENT_KEYS = ("arguments", "parameters")
WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments value as the model writes it (a string value decoded)
    id: str  # "call_" and 24 random hex digits


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of OpenAI's streamed `delta.tool_calls`."""

    index: int  # the call's place in the response
    id: str | None = None  # in the call's first delta only, with its name
    name: str | None = None
    arguments: str = ""  # the next piece of the arguments text


class _CallObject:
    """One call object read a piece at a time, without waiting for its end: it finds the name
    and where the arguments value begins and ends, and checks each value with `json.loads` as it
    ends."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments: str | None = None  # once the arguments value ends
        self.status = "more"  # "done" at the closing brace, "fail" at what breaks the object
        self._expect = "{"  # outside values: "{", '"' (a key), ":", "value" or ",}"
        # what the value being read is: "key", "name", "arguments" or "other"; None between
        self._role: str | None = None
        self._key = ""
        self._raw = ""  # the text of the value being read, unless it is the arguments
        self._args_raw: str | None = None  # the text of the arguments value, once it begins
        self._sent = 0  # how much of it `take_arguments` has given
        self._depth = 0  # of the value being read, in brackets and braces
        self._in_string = False
        self._escaped = False

    def read(self, text: str) -> int:
        """Reads text up to the end of the object, the end of the name, or a character that
        breaks the object (left unread): how many characters it read."""
        i = 0
        while i < len(text) and self.status == "more":
            if self._role is not None:
                j, ended = self._scan(text, i)
                if self._role == "arguments":
                    self._args_raw += text[i:j]
                else:
                    self._raw += text[i:j]
                i = j
                if ended and self._end_value() == "name":
                    break  # the caller commits the call before reading on
                continue
            c = text[i]
            if c in WHITESPACE:
                pass
            elif self._expect == "value":
                self._start_value()
                continue  # the value's first character is part of it
            elif c == '"' and self._expect == '"':
                self._role = "key"
                continue
            elif c == self._expect == "{":
                self._expect = '"'
            elif c == self._expect == ":":
                self._expect = "value"
            elif c == "," and self._expect == ",}":
                self._expect = '"'
            elif c == "}" and self._expect == ",}":
                self._close()
            else:
                self.status = "fail"
                break
            i += 1
        return i

    def take_arguments(self) -> str:
        """The arguments text not taken yet: the raw text of an object (or other non-string)
        value as it arrives, a string value decoded once it ends; nothing before the name."""
        raw = self._args_raw
        if self.name is None or not raw or self._sent == len(raw):
            return ""
        if raw[0] != '"':
            piece = raw[self._sent :]
        elif self.arguments is not None:
            piece = self.arguments
        else:
            return ""
        self._sent = len(raw)
        return piece

    def _start_value(self) -> None:
        if self._key == "name" and self.name is None:
            self._role = "name"
        elif self._key in ARGUMENT_KEYS and self._args_raw is None:
            self._role, self._args_raw = "arguments", ""
        else:
            self._role = "other"

    def _scan(self, text: str, i: int) -> tuple[int, bool]:
        """Reads the value's characters from text[i]: (where it stopped, whether the value ended
        there). It follows strings and nesting only; `json.loads` checks the rest at the end."""
        for j in range(i, len(text)):
            c = text[j]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
                    if not self._depth:
                        return j + 1, True
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]" and self._depth:
                self._depth -= 1
                if not self._depth:
                    return j + 1, True
            elif not self._depth and not (c.isalnum() or c in "+-."):
                return j, True  # the end of a number or literal
        return len(text), False

    def _end_value(self) -> str | None:
        """Checks the value just read and records it: its role."""
        role, self._role = self._role, None
        raw = self._args_raw if role == "arguments" else self._raw
        self._raw = ""
        try:
            value = json.loads(raw)
        except ValueError:
            self.status = "fail"
            return role
        self._expect = ",}"
        if role == "key":
            self._key, self._expect = value, ":"
        elif role == "name":
            if isinstance(value, str) and value:
                self.name = value
            else:
                self.status = "fail"
        elif role == "arguments":
            self.arguments = value if isinstance(value, str) else raw
        return role

    def _close(self) -> None:
        if self.name is None:
            self.status = "fail"
            return
        if self._args_raw is None:
            self._args_raw = self.arguments = "{}"
        self.status = "done"


@dataclass
class _Call:
    """A committed call: where its text starts in the output, and where it breaks off if so."""

    id: str
    reader: _CallObject
    start: int
    end: int | None = None


class ToolParser(ABC):
    """Reads the tool calls of one response choice; a subclass describes its format.

    A run of calls opens at `opener` in the content (`_opening`), then has `begin`, the calls with
    `separator` between them, and `closer`, each after optional whitespace."""

    name: ClassVar[str]
    opener: ClassVar[str]
    begin: ClassVar[str] = ""
    separator: ClassVar[str] = ""
    closer: ClassVar[str] = ""

    def __init__(self, names: Collection[str] | None = None) -> None:
        self._names = names  # the functions there are: a call to another name is content
        self._buf = ""  # output not read yet
        self._pos = 0  # where _buf starts in the output
        self._state = "content"  # or "begin", "call", "after" (a call)
        self._fresh = True  # at the start of the output or after a call: whitespace is dropped
        self._held: str | None = None  # text read since a run or a separator, until a name
        self._held_at = 0
        self._reader: _CallObject | None = None
        self._call: _Call | None = None  # the committed call being read
        self._count = 0  # calls committed
        self._log: list[str | _Call] = []  # content and calls in output order, for `parse`
        self._content: list[str] = []  # what the current feed returns
        self._deltas: list[ToolCallDelta] = []

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output: (its content, None where empty; its calls)."""
        parser = type(self)(self._names)
        parser._advance(text, final=True)
        content: list[str] = []
        calls: list[ToolCall] = []
        for item in parser._log:
            if isinstance(item, str):
                content.append(item)
            elif item.reader.status == "done":
                calls.append(ToolCall(item.reader.name, item.reader.arguments, item.id))
            else:
                content.append(text[item.start : item.end])
        joined = "".join(content)
        return (joined if joined.strip() else None), calls

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """The next piece of output: (new content, new tool-call deltas)."""
        return self._advance(delta, final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The end of the output: what was held back, as content or deltas."""
        return self._advance("", final=True)

    @property
    def called(self) -> bool:
        """Whether any call has been committed."""
        return self._count > 0

    @abstractmethod
    def grammar(self, tools: list[dict], parallel: bool, token: Callable[[str], str]) -> str:
        """An llguidance Lark grammar forcing the output to be one call (or, where parallel, one
        or more) to any of the OpenAI `tools`, with arguments valid against its parameters
        schema (tools must not be empty). `token(marker)` renders a marker for Lark: a special
        token reference (`<tool_call>`, or `<[id]>` where the marker, like `[TOOL_CALLS]`, is
        not in angle brackets) or a string literal."""

    def _opening(self) -> tuple[int, int | None]:
        """(i, n): _buf[:i] is content; a run opens at i with an opener of n characters, or, where
        n is None, the text from i may still open one (held back until the output ends)."""
        i = self._buf.find(self.opener)
        if i >= 0:
            return i, len(self.opener)
        return len(self._buf) - partial_marker(self._buf, self.opener), None

    def _advance(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        steps = {
            "content": self._read_content,
            "begin": self._read_begin,
            "call": self._read_call,
            "after": self._read_after,
        }
        while steps[self._state](final):
            pass
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    # Each _read_* step reads from _buf in its state: whether to step again (False: it needs
    # more output, or there is none)

    def _read_content(self, final: bool) -> bool:
        if self._fresh:
            self._take(len(self._buf) - len(self._buf.lstrip(WHITESPACE)))
        i, n = self._opening()
        if n is None and final:
            i = len(self._buf)
        self._emit_content(self._take(i))
        if n is None:
            return False
        self._held, self._held_at = "", self._pos
        self._take(n)
        self._state = "begin"
        return True

    def _read_begin(self, final: bool) -> bool:
        rest = self._buf.lstrip(WHITESPACE)
        if rest.startswith(self.begin):
            self._take(len(self._buf) - len(rest) + len(self.begin))
            self._reader, self._state = _CallObject(), "call"
        elif final or not self.begin.startswith(rest):
            self._rewind()
        else:
            return False
        return True

    def _read_call(self, final: bool) -> bool:
        reader = self._reader
        self._take(reader.read(self._buf))
        if self._call is None and reader.name is not None and reader.status != "fail":
            if self._names is not None and reader.name not in self._names:
                self._rewind()
                return True
            self._commit()
        if self._call is not None:
            self._emit_arguments(reader.take_arguments())
        if reader.status == "more":
            if self._buf:  # the name has just ended: read on
                return True
            if not final:
                return False
        if reader.status == "done":
            self._state, self._call = "after", None
        elif self._call is None:
            self._rewind()
        else:  # the committed call breaks off (or the output ends in it); what follows is content
            self._call.end = self._pos
            self._end_run()
        return True

    def _read_after(self, final: bool) -> bool:
        self._take(len(self._buf) - len(self._buf.lstrip(WHITESPACE)))
        if self.separator and self._buf.startswith(self.separator):
            self._held, self._held_at = "", self._pos
            self._take(len(self.separator))
            self._reader, self._state = _CallObject(), "call"
        elif self.closer and self._buf.startswith(self.closer):
            self._take(len(self.closer))
            self._end_run()
        elif not final and any(m.startswith(self._buf) for m in (self.separator, self.closer) if m):
            return False  # _buf may still begin either
        else:
            self._end_run()  # anything else ends the run, and is content
        return True

    def _take(self, n: int) -> str:
        """Consumes n characters of _buf."""
        text, self._buf = self._buf[:n], self._buf[n:]
        self._pos += n
        if self._held is not None:
            self._held += text
        return text

    def _rewind(self) -> None:
        """What the run holds is not a call after all: its first character is content, and the
        rest is read again."""
        self._buf, self._pos = self._held + self._buf, self._held_at
        self._held, self._reader, self._state = None, None, "content"
        self._emit_content(self._take(1))

    def _commit(self) -> None:
        call = _Call(id="call_" + secrets.token_hex(12), reader=self._reader, start=self._held_at)
        self._held, self._call = None, call
        self._log.append(call)
        self._deltas.append(ToolCallDelta(index=self._count, id=call.id, name=call.reader.name))
        self._count += 1

    def _end_run(self) -> None:
        self._state, self._fresh, self._reader, self._call = "content", True, None, None

    def _emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)
            self._log.append(text)
            self._fresh = False

    def _emit_arguments(self, piece: str) -> None:
        if not piece:
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == self._count - 1:
            self._deltas[-1] = replace(last, arguments=last.arguments + piece)
        else:
            self._deltas.append(ToolCallDelta(index=self._count - 1, arguments=piece))


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one tag per call. As
    llama.cpp reads Hermes 2 Pro, a call may also come bare, without the tags, where it opens the
    output or follows another call (Qwen2.5-Coder writes its calls so)."""

    name = "hermes"
    opener = "<tool_call>"
    closer = "</tool_call>"

    def _opening(self) -> tuple[int, int | None]:
        after_calls = all(isinstance(item, _Call) for item in self._log)
        if after_calls and self._buf.startswith("{"):
            return 0, 0
        return super()._opening()

    def grammar(self, tools: list[dict], parallel: bool, token: Callable[[str], str]) -> str:
        call = f'{token(self.opener)} "\\n" {_json(_call_schema(tools, "arguments"))} "\\n" '
        # Qwen2.5 writes a newline after a call, before the end or the next call
        return _lark(call + token(self.closer), '"\\n"' if parallel else None, '"\\n"')


class Llama3JsonToolParser(ToolParser):
    """`{"name": "f", "parameters": {...}}`, `; ` between calls, optionally after
    `<|python_tag|>`: only where the output (after whitespace) opens with it."""

    name = "llama3_json"
    opener = "<|python_tag|>"
    separator = ";"

    def _opening(self) -> tuple[int, int | None]:
        if self._log:  # calls open the output or not at all
            return len(self._buf), None
        if self._buf.startswith(self.opener):
            return 0, len(self.opener)
        if self._buf.startswith("{"):
            return 0, 0
        if self.opener.startswith(self._buf):
            return 0, None  # may still be the opener
        return len(self._buf), None

    def grammar(self, tools: list[dict], parallel: bool, token: Callable[[str], str]) -> str:
        return _lark(_json(_call_schema(tools, "parameters")), '"; "' if parallel else None)


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`."""

    name = "mistral"
    opener = "[TOOL_CALLS]"
    begin = "["
    separator = ","
    closer = "]"

    def grammar(self, tools: list[dict], parallel: bool, token: Callable[[str], str]) -> str:
        schema = _call_schema(tools, "arguments")
        calls = {"type": "array", "items": {"anyOf": schema.pop("anyOf")}, "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        # the model may write a space before the array, as its tokenizer joins " [" in one token
        return _lark(f'{token(self.opener)} " "? {_json({**calls, **schema})}', None)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def tool_parser_for_template(chat_template: str) -> str | None:
    """The name of the parser for the tool calls a chat template's model writes, or None where
    the template does not render tools."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or '"parameters": ' in chat_template:
        return "llama3_json"
    return None


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (and is shorter than it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _call_schema(tools: list[dict], arguments_key: str) -> dict[str, Any]:
    """The JSON schema of one call object, {"name": ..., arguments_key: ...}, to any of the
    tools; each tool's parameters schema moves under "$defs", its local references with it."""
    choices, defs = [], {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        defs[f"t{i}"] = _rebase(function.get("parameters") or {"type": "object"}, f"#/$defs/t{i}")
        choices.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    arguments_key: {"$ref": f"#/$defs/t{i}"},
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return {"anyOf": choices, "$defs": defs}


def _rebase(schema: Any, base: str) -> Any:
    """schema with its local references ("#...") made relative to base."""
    if isinstance(schema, dict):
        return {
            key: base + value[1:]
            if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _rebase(value, base)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_rebase(value, base) for value in schema]
    return schema


def _json(schema: dict[str, Any]) -> str:
    """An inline llguidance JSON schema, written as the models write JSON: ", " and ": " between
    items and keys, no other whitespace."""
    compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return "%json " + json.dumps({**schema, "x-guidance": compact})


def _lark(call: str, separator: str | None, trailer: str | None = None) -> str:
    """A grammar of one call, or, with a separator, of one or more calls, then optionally the
    trailer a model writes after its last call (and may write before another one)."""
    end = f" {trailer}?" if trailer else ""
    if separator is None:
        return f"start: {call}{end}\n"
    return f"start: call ({separator} call)*{end}\ncall: {call}\n"
