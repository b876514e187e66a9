"""/v1/models: the one model this server serves."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from tokenmill.server.state import State

router = APIRouter()


@router.get("/v1/models", response_model=None)
async def models(state: State) -> dict[str, Any]:
    model = {
        "id": state.config.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "tokenmill",
        "max_model_len": state.engine.max_model_len,
    }
    return {"object": "list", "data": [model]}
