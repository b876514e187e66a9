"""The web chat page at /, a single static file that talks to /v1/chat/completions."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response

PAGE = Path(__file__).resolve().parent.parent / "static" / "index.html"

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index() -> Response:
    if not PAGE.is_file():
        return JSONResponse({"message": "tokenmill is running; the API is under /v1"})
    return FileResponse(PAGE)
