"""Errors a user can hit, each carrying a one-line message that says what was wrong."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class for errors reported to users as one line, without a traceback."""


class ModelFileError(TokenmillError):
    """A model file is malformed, truncated or unsupported.

    The message names the file, the tensor (when one is involved) and the problem, so the
    user knows which download to redo or which format to convert.
    """

    def __init__(self, path: object, problem: str, tensor: str | None = None) -> None:
        self.path = str(path)
        self.tensor = tensor
        self.problem = problem
        where = f"{self.path}: tensor '{tensor}'" if tensor else self.path
        super().__init__(f"{where}: {problem}")


class ModelNotFoundError(TokenmillError):
    """A model name is neither a catalog alias nor an existing path."""


class InvalidRequestError(TokenmillError, ValueError):
    """A request or command-line input the model cannot serve (empty prompt, too long, ...).

    `param` names the offending request field, for API error bodies.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(TokenmillError):
    """The waiting queue is at its limit: the client should retry later (HTTP 503 + Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after
