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
    """200 while every loaded model's engine runs (with data parallelism: while any of its
    replicas is up), with each model's status ("loaded" or "loading") and decode mode, and the
    default model's decode mode and replicas; 503 once an engine has stopped."""
    body: dict[str, Any] = {"status": "ok"}
    models: dict[str, dict[str, Any]] = {}
    for entry in state.models.entries.values():
        engine = entry.engine
        if entry.status == "loading":
            models[entry.name] = {"status": "loading"}
        if engine is None:
            continue
        if not engine.is_healthy:
            message = f"engine of `{entry.name}` stopped: {engine.error!r}"
            return APIError(503, message, type_="service_unavailable").response()
        models[entry.name] = {"status": "loaded", "decode": engine.decode_mode}
        if entry.name == state.models.default_model:
            body["decode"] = engine.decode_mode
            if replicas := engine.replica_health():
                body["replicas"] = replicas
    body["models"] = models
    return body


@router.get("/version", response_model=None)
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
