"""What every route shares: the server's configuration, its models and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.model_registry import LEASES, ModelRegistry, ServedModel, parse_keep_alive
from tokenmill.server.response_store import ResponseStore


@dataclass
class ServerConfig:
    served_model_name: str  # of the one engine build_app may serve (a registry names its models)
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

    models: ModelRegistry
    config: ServerConfig
    metrics: ServerMetrics
    responses: ResponseStore = field(default_factory=ResponseStore)  # of /v1/responses

    async def model(
        self, request: Request, name: str | None, keep_alive: str | float | None = None
    ) -> ServedModel:
        """The model a request names (None: the server's default), loaded if it was not, and held
        until the response has been sent (see `ReleaseModels`); 404 for a model this server does
        not serve. keep_alive: Ollama's, for how long the model stays loaded after the request."""
        seconds = None if keep_alive is None else parse_keep_alive(keep_alive)
        served = await self.models.acquire(name, seconds)
        request.scope.setdefault("state", {}).setdefault(LEASES, []).append(served)
        return served


def tenant(request: Request, user: str | None) -> str:
    """Who sent a request, for fair scheduling: its API key's tenant (see `ServerConfig.api_keys`),
    else the request's `user` field, else "" (everyone anonymous alike)."""
    return getattr(request.state, "tenant", "") or user or ""


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
