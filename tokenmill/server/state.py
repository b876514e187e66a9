"""What every route shares: the server's configuration, the engine and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.data_parallel import DataParallelEngine
from tokenmill.server.errors import APIError
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.response_store import ResponseStore


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    api_keys: dict[str, str] = field(default_factory=dict)  # more keys, each to its tenant
    max_body_bytes: int = 16 << 20
    protect_health: bool = False  # require the API key on /health too
    protect_metrics: bool = False  # and on /metrics
    allowed_origins: list[str] = field(default_factory=list)  # CORS allowlist; empty: CORS off
    request_timeout: float | None = None  # seconds from arrival to the end of generation
    tool_call_parser: str | None = None  # a name in TOOL_PARSERS; None: the chat template's
    reasoning_parser: str | None = None  # a name in REASONING_PARSERS; None: no reasoning split
    strict_request_fields: bool = False  # refuse unknown request fields (else ignore them)


@dataclass
class ServerState:
    """Held by `app.state.server`; routes receive it through the `State` dependency."""

    engine: AsyncLLMEngine | DataParallelEngine
    config: ServerConfig
    metrics: ServerMetrics
    responses: ResponseStore = field(default_factory=ResponseStore)  # of /v1/responses

    def check_model(self, name: str | None) -> None:
        """Refuse a request for a model this server does not serve (None: the served one)."""
        if name is not None and name != self.config.served_model_name:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )

    def check_generates(self) -> None:
        """Refuse a generation request when the model is an encoder (embeddings only)."""
        if self.engine.embeddings_only:
            raise APIError(
                400,
                f"this model serves embeddings only: `{self.config.served_model_name}` is an "
                "encoder; use /v1/embeddings, or serve a generative model for completions",
                code="embeddings_only",
            )


def tenant(request: Request, user: str | None) -> str:
    """Who sent a request, for fair scheduling: its API key's tenant (see `ServerConfig.api_keys`),
    else the request's `user` field, else "" (everyone anonymous alike)."""
    return getattr(request.state, "tenant", "") or user or ""


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
