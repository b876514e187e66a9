"""/tokenize and /detokenize (vLLM's extras): the engine's tokenization, as the model sees it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.server.state import State
from tokenmill.server.tool_calling import template_messages

router = APIRouter()


@router.post("/tokenize", response_model=None)
async def tokenize(req: TokenizeRequest, raw: Request, state: State) -> dict[str, Any]:
    engine = (await state.model(raw, req.model)).engine
    messages = None if req.messages is None else template_messages(req.messages)
    ids = engine.tokenize(
        req.prompt,
        messages,
        add_special_tokens=req.add_special_tokens,
        add_generation_prompt=req.add_generation_prompt,
        tools=[tool.model_dump(exclude_none=True) for tool in req.tools] if req.tools else None,
    )
    body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [engine.tokenizer.id_to_piece(i) for i in ids]
    return body


@router.post("/detokenize", response_model=None)
async def detokenize(req: DetokenizeRequest, raw: Request, state: State) -> dict[str, str]:
    engine = (await state.model(raw, req.model)).engine
    vocab_size = engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token ids must be in [0, {vocab_size}), got {bad[0]}", param="tokens"
        )
    return {"prompt": engine.tokenizer.decode(req.tokens)}
