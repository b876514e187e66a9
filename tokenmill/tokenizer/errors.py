"""The tokenizer layer's error."""

from __future__ import annotations

from tokenmill.errors import TokenmillError


class TokenizerError(TokenmillError):
    """A vocabulary, tokenizer folder or chat template cannot be used; the message says what is
    wrong."""
