"""/v1/models: the models this server serves, loaded or not, each with its status."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from tokenmill.server.state import State

router = APIRouter()


@router.get("/v1/models", response_model=None)
async def models(state: State) -> dict[str, Any]:
    """OpenAI's model list, with vLLM's max_model_len where a model is loaded and a status:
    "loaded", "loading" or "available" (loaded by the first request that names it)."""
    created = int(time.time())
    registry = state.models
    data = []
    for entry in registry.entries.values():
        model = _model(entry.name, created, entry.status)
        if entry.engine is not None:
            model["max_model_len"] = entry.engine.max_model_len
        data.append(model)
    if registry.finder is not None:
        for name in registry.finder.names():
            if name not in registry.entries:
                data.append(_model(name, created, "available"))
    return {"object": "list", "data": data}


def _model(name: str, created: int, status: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "tokenmill",
        "status": status,
    }
