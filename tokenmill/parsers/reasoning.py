"""Reasoning parsers: the `<think>...</think>` part of an output as OpenAI-style
`reasoning_content`, apart from the answer's `content`.

The reasoning is the text between `<think>` and `</think>`, where the output opens with `<think>`
(after whitespace) or the prompt already opened it (the chat template's generation prompt ends
inside `<think>`); output that never closes it is all reasoning. Otherwise the whole output is
content. Each part loses its leading whitespace: the newlines models write after `<think>` and
`</think>` (Qwen3's chat template strips those after `</think>` too when it renders the turn
again), so that a part that is only whitespace is empty.

A parser instance reads one response choice: `feed` takes the output a piece at a time and holds
back only what may still be a marker; `parse` reads a whole output through a fresh instance, so
for every way of cutting an output into pieces the streamed parts add up to what `parse` returns.

gpt-oss writes the harmony format instead (`HarmonyReasoningParser`): messages on channels, the
reasoning on `analysis`, the answer on `final`.
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.parsers.tool_calls import WHITESPACE, partial_marker


class ReasoningParser:
    """Reasoning between `start` and `end` markers, then content."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # the markers are special tokens, which the output's text must keep (skip_special_tokens off)
    special_markers: ClassVar[bool] = False

    def __init__(self, prompt_opens_reasoning: bool = False) -> None:
        self._prompt_opens_reasoning = prompt_opens_reasoning
        self._state = "reasoning" if prompt_opens_reasoning else "undecided"  # or "content"
        self._buf = ""  # output not returned yet
        self._fresh = {"reasoning": True, "content": True}  # whether the part has no text yet

    @classmethod
    def opens_reasoning(cls, prompt_text: str) -> bool:
        """Whether a rendered prompt leaves reasoning open: its last start marker comes after its
        last end marker."""
        return prompt_text.rfind(cls.start) > prompt_text.rfind(cls.end)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """A whole output: (reasoning_content, content), None where empty."""
        parser = type(self)(self._prompt_opens_reasoning)
        reasoning, content = parser.feed(text)
        more_reasoning, more_content = parser.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def feed(self, delta: str) -> tuple[str, str]:
        """The next piece of output: (new reasoning, new content)."""
        return self._advance(delta, final=False)

    def finish(self) -> tuple[str, str]:
        """The end of the output: what was held back."""
        return self._advance("", final=True)

    @property
    def reasoning_ended(self) -> bool:
        """Whether the rest of the output is content: the reasoning is closed, or the output
        does not open any."""
        return self._state == "content"

    def _advance(self, delta: str, final: bool) -> tuple[str, str]:
        self._buf += delta
        reasoning = ""
        if self._state == "undecided":
            head = self._buf.lstrip(WHITESPACE)
            if head.startswith(self.start):
                self._buf, self._state = head[len(self.start) :], "reasoning"
            elif final or not self.start.startswith(head):
                self._state = "content"
        if self._state == "reasoning":
            i = self._buf.find(self.end)
            if i >= 0:
                reasoning, self._buf = self._buf[:i], self._buf[i + len(self.end) :]
                self._state = "content"
            else:
                i = len(self._buf) - (0 if final else partial_marker(self._buf, self.end))
                reasoning, self._buf = self._buf[:i], self._buf[i:]
        content = ""
        if self._state == "content":
            content, self._buf = self._buf, ""
        return self._part("reasoning", reasoning), self._part("content", content)

    def _part(self, part: str, text: str) -> str:
        """text as the next piece of a part, less the part's leading whitespace."""
        if self._fresh[part]:
            text = text.lstrip(WHITESPACE)
            self._fresh[part] = not text
        return text


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


_MESSAGE = "<|message|>"
_CHANNEL = "<|channel|>"
_MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")


class HarmonyReasoningParser(ReasoningParser):
    """gpt-oss's harmony format: after the prompt's `<|start|>assistant`, messages of a header
    (`<|channel|>NAME`, later ones after `<|start|>assistant`) then `<|message|>`, the text, and
    `<|end|>` (`<|return|>` for the last, `<|call|>` for a tool call). The text of `analysis`
    messages is the reasoning, that of `final` ones the content; a message on another channel
    (`commentary`: tool calls and preambles) is content as written, header and end included.
    Output that does not open with a header is all content."""

    name = "gpt-oss"
    start = _CHANNEL + "analysis" + _MESSAGE
    end = "<|end|>"
    special_markers = True

    def __init__(self, prompt_opens_reasoning: bool = False) -> None:
        super().__init__(prompt_opens_reasoning)
        # "header" (before the first or between messages), "reasoning" or "content" (a message's
        # text), "raw" (a message on another channel), "plain" (no harmony: all content)
        self._state = "reasoning" if prompt_opens_reasoning else "header"

    @property
    def reasoning_ended(self) -> bool:
        return self._state in ("content", "plain")

    def _advance(self, delta: str, final: bool) -> tuple[str, str]:
        self._buf += delta
        reasoning, content = "", ""
        while True:
            if self._state == "plain":
                content, self._buf = content + self._buf, ""
                break
            if self._state == "header":
                head = self._buf.lstrip(WHITESPACE)
                i = head.find(_MESSAGE)
                if i < 0:
                    if final or not _may_open_header(head):
                        self._state = "plain"
                        continue
                    break
                header, self._buf = head[:i], head[i + len(_MESSAGE) :]
                channel = _channel(header)
                self._state = {"analysis": "reasoning", "final": "content"}.get(channel, "raw")
                if self._state == "raw":
                    content += header + _MESSAGE
                continue
            # a message's text, up to the first end marker
            ends = [(i, m) for m in _MESSAGE_ENDS if (i := self._buf.find(m)) >= 0]
            if ends:
                i, marker = min(ends)
                text, self._buf = self._buf[:i], self._buf[i + len(marker) :]
            else:
                held = 0 if final else max(partial_marker(self._buf, m) for m in _MESSAGE_ENDS)
                text, self._buf = (
                    self._buf[: len(self._buf) - held],
                    self._buf[len(self._buf) - held :],
                )
                marker = ""
            if self._state == "reasoning":
                reasoning += text
            else:
                content += text + (marker if self._state == "raw" else "")
            if not ends:
                break
            self._state = "header"
        return self._part("reasoning", reasoning), self._part("content", content)


def _may_open_header(text: str) -> bool:
    """Whether text (without leading whitespace) is, or may still become, a message header."""
    return any(m.startswith(text) or text.startswith(m) for m in (_CHANNEL, "<|start|>"))


def _channel(header: str) -> str:
    """The channel a header names (`<|start|>assistant<|channel|>final` gives "final")."""
    _, _, rest = header.partition(_CHANNEL)
    return rest.split("<|", 1)[0].split(" ", 1)[0].strip()


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, HarmonyReasoningParser)
}
