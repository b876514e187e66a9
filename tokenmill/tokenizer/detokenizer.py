"""Streaming detokenization: text for each generated token as soon as it is final.

Decoding one token alone loses context (SentencePiece drops a leading space at the start of a text,
a multi-byte character can span several byte tokens), and decoding everything again per token is
quadratic. As vLLM does, two small windows are decoded instead: the tokens of the last emitted
chunk (the prefix, which gives context) and those plus the ones not emitted yet. What the longer
one adds is the new text, held back while it ends in U+FFFD, i.e. in an incomplete UTF-8 sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.tokenizer.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first generated one, enough to settle its leading
# space.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text one token at a time; `push` per token, `flush` at the
    end."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # the prefix window, then the tokens not emitted yet
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._read_offset = len(self._ids)  # end of the prefix window

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text that became final with it (often "")."""
        self._ids.append(token_id)
        prefix_text, text = self._decode_windows()
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        del self._ids[: self._read_offset]  # the tokens just emitted become the next prefix window
        self._read_offset = len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held back at the end of generation (e.g. an incomplete character)."""
        prefix_text, text = self._decode_windows()
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return text[len(prefix_text) :]

    def _decode_windows(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[: self._read_offset], skip_special_tokens=self._skip_special)
        return prefix, decode(self._ids, skip_special_tokens=self._skip_special)
