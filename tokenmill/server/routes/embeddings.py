"""/v1/embeddings: OpenAI's embeddings API, from an encoder (see `EmbeddingEngine`) or from a
generative model's pooled final hidden states (see `LLMEngine.embed`)."""

from __future__ import annotations

import base64
from typing import Any

import torch
from fastapi import APIRouter, Request

from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol import EmbeddingRequest
from tokenmill.server.state import State

router = APIRouter()


@router.post("/v1/embeddings", response_model=None)
async def embeddings(req: EmbeddingRequest, raw: Request, state: State) -> dict[str, Any]:
    model = await state.model(raw, req.model, req.keep_alive)
    dimensions = model.engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != dimensions:
        raise InvalidRequestError(
            f"this model's embeddings have {dimensions} dimensions and cannot be shortened; "
            f"leave dimensions out or set it to {dimensions}",
            param="dimensions",
        )
    vectors, tokens = await model.engine.embed(_inputs(req.input), req.truncate_prompt_tokens)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(row, req.encoding_format)}
        for i, row in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model.name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _inputs(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The request's inputs as a list: a lone text or a lone list of token ids is one input."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]  # type: ignore[list-item]
    return list(value)  # type: ignore[arg-type]


def _encode(row: torch.Tensor, encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or as OpenAI's base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii")
    return row.tolist()
