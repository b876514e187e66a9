"""/health, /version and /metrics: for load balancers, deploy scripts and Prometheus."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from tokenmill import __version__
from tokenmill.server.errors import APIError
from tokenmill.server.state import State

router = APIRouter()


@router.get("/health", response_model=None)
async def health(state: State) -> dict[str, Any] | JSONResponse:
    """200 while the engine runs (with data parallelism: while any replica is up), with its
    decode mode and each replica's state; 503 once it has stopped."""
    engine = state.engine
    if not engine.is_healthy:
        error = APIError(503, f"engine stopped: {engine.error!r}", type_="service_unavailable")
        return error.response()
    body: dict[str, Any] = {"status": "ok", "decode": engine.decode_mode}
    if replicas := engine.replica_health():
        body["replicas"] = replicas
    return body


@router.get("/version", response_model=None)
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
