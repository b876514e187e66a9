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
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.parsers.tool_calls import WHITESPACE, partial_marker


class ReasoningParser:
    """Reasoning between `start` and `end` markers, then content."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

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


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}
