"""The API key and body-size checks that run before any route; a clean end at forced shutdown."""

from __future__ import annotations

import asyncio
import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import APIError, error_body
from tokenmill.server.formatting import sse
from tokenmill.server.protocol import STRICT_REQUEST_FIELDS
from tokenmill.server.state import ServerConfig


class GuardMiddleware:
    """A plain ASGI middleware: it adds no task or stream of its own, so the cancellation of a
    request at shutdown passes straight through it to the route, and the request's validation
    sees the context it sets (`STRICT_REQUEST_FIELDS`)."""

    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await refusal.response(scope["path"])(scope, receive, send)
        STRICT_REQUEST_FIELDS.set(self.config.strict_request_fields)
        scope.setdefault("state", {})["tenant"] = self._tenant(scope)
        started = event_stream = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, event_stream
            if message["type"] == "http.response.start":
                started = True
                event_stream = any(
                    k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                    for k, v in message.get("headers", [])
                )
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            # uvicorn's forced exit (a second Ctrl-C) cancels every request: answer in OpenAI's
            # shape when nothing was sent yet, and end quietly instead of logging a traceback
            message = "the server is shutting down"
            if not started:
                error = APIError(503, message, type_="service_unavailable")
                await error.response(scope["path"])(scope, receive, send)
                return
            tail = b""  # end the body cleanly, with an in-band error event when it is a stream
            if event_stream:
                tail = (sse(error_body(message, "service_unavailable")) + sse("[DONE]")).encode()
            await send({"type": "http.response.body", "body": tail, "more_body": False})

    def _refusal(self, scope: Scope) -> APIError | None:
        """The error that refuses this request before it reaches a route, if any."""
        config, path = self.config, scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        protected = path.startswith(("/v1/", "/api/")) or path in ("/tokenize", "/detokenize")
        protected &= path != "/api/version"  # public, as /version is
        protected |= path == "/health" and config.protect_health
        protected |= path == "/metrics" and config.protect_metrics
        keyed = config.api_key or config.api_keys
        if keyed and protected and self._key_tenant(headers) is None:
            return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > config.max_body_bytes:
            return APIError(
                413,
                f"Request body of {length} bytes exceeds the limit of "
                f"{config.max_body_bytes} bytes.",
                code="request_too_large",
            )
        return None

    def _key_tenant(self, headers: dict[str, str]) -> str | None:
        """The tenant of the key the request carries (as a Bearer token or in X-API-Key): its
        entry in the keys file, "" for the server's own key; None for no known key. Every key is
        compared, each in constant time."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = headers.get("x-api-key", "")
        given = token.strip().encode()
        tenant = None
        if self.config.api_key and hmac.compare_digest(given, self.config.api_key.encode()):
            tenant = ""
        for key, name in self.config.api_keys.items():
            if hmac.compare_digest(given, key.encode()):
                tenant = name
        return tenant

    def _tenant(self, scope: Scope) -> str:
        """Who sends the request, for fair scheduling: its key's tenant ("" without keys)."""
        if not self.config.api_keys:
            return ""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        return self._key_tenant(headers) or ""
