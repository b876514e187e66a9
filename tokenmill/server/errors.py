"""Errors in each API's shape: one mapping from an exception to an HTTP status and error body.

The same mapping answers a request that failed before its response started (a status line and
a JSON body) and a stream that failed midway (the body as an in-band event). The body takes the
shape of the API the request's path belongs to: OpenAI's by default, Anthropic's under
/v1/messages, Ollama's under /api/.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.errors import InvalidRequestError, QueueFullError, TokenmillError

log = logging.getLogger("tokenmill.server")


class RequestTimeoutError(TokenmillError):
    """A request ran past the server's `request_timeout` (HTTP 504, or an in-band error event)."""


class GenerationError(TokenmillError):
    """The engine failed a request while generating it (HTTP 500, or an in-band error event)."""


class APIError(Exception):
    """An error with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.headers = param, code, headers

    def body(self, path: str = "") -> dict:
        """The error body in the shape of the API that serves `path`."""
        if path.startswith("/v1/messages"):
            kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        if path.startswith("/api/"):
            return {"error": self.message}
        return error_body(self.message, self.type, self.param, self.code)

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(status_code=self.status, content=self.body(path), headers=self.headers)


# Anthropic's error types by HTTP status
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def api_error(exc: Exception) -> APIError:
    """The status and body that report exc to the client; logs errors the server did not expect."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, QueueFullError):
        return APIError(
            503,
            str(exc),
            type_="server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type_="service_unavailable")
    if isinstance(exc, RequestTimeoutError):
        return APIError(504, str(exc), type_="timeout")
    if isinstance(exc, GenerationError):
        return APIError(500, str(exc), type_="internal_error")
    if isinstance(exc, TokenmillError):
        return APIError(400, str(exc))
    log.error("unexpected error", exc_info=exc)
    return APIError(500, f"internal error: {exc!r}", type_="internal_error")


def install_exception_handlers(app: FastAPI) -> None:
    """Every error a route or FastAPI itself raises answers in its API's error shape."""
    app.add_exception_handler(APIError, _on_error)
    app.add_exception_handler(TokenmillError, _on_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(Exception, _on_error)


async def _on_error(request: Request, exc: Exception) -> JSONResponse:
    return api_error(exc).response(request.url.path)


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kinds = {404: "not_found_error", 405: "invalid_request_error"}
    if exc.status_code == 400:
        message = "The request body could not be parsed."
    else:
        message = str(exc.detail)
    kind = kinds.get(exc.status_code, "invalid_request_error")
    return APIError(exc.status_code, message, type_=kind).response(request.url.path)


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _validation_error(exc).response(request.url.path)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    if first.get("type") == "json_invalid":
        return APIError(400, "The request body is not valid JSON.")
    if first.get("type") == "extra_forbidden":
        names = first.get("ctx", {}).get("names", "")
        param = ".".join(filter(None, [param, names]))
        return APIError(400, first["msg"], param=param)
    # 400 as OpenAI and vLLM answer a body of the wrong shape, not FastAPI's 422
    message = "; ".join(f"{_location(e)}: {e['msg']}" for e in errors[:5])
    return APIError(400, message, param=param)


def _location(error: dict) -> str:
    return ".".join(str(x) for x in error["loc"] if x != "body")
