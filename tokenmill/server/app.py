"""The OpenAI-compatible HTTP server: FastAPI routers over an AsyncLLMEngine.

`build_app` wires the pieces, each in a module of its own: the routers (`routes/`), what they
share (`state`: the configuration, the engine, the metrics), the request guard (`guard`), the
error mapping (`errors`), the request-running path (`generation`), OpenAI's response formatting
(`formatting`) and the Prometheus metrics (`metrics`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.data_parallel import DataParallelEngine
from tokenmill.server.errors import install_exception_handlers
from tokenmill.server.guard import GuardMiddleware
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.routes import (
    admin,
    anthropic,
    embeddings,
    models,
    ollama,
    openai,
    responses,
    tokenize,
    web,
)
from tokenmill.server.state import ServerConfig, ServerState

__all__ = ["ServerConfig", "build_app"]


def build_app(engine: AsyncLLMEngine | DataParallelEngine, config: ServerConfig) -> FastAPI:
    """The server's ASGI app; the engine (one, or data-parallel replicas) must be running, and
    outlives the app."""
    app = FastAPI(title="tokenmill", version=__version__)
    metrics = ServerMetrics(engine.stats, engine.replica_stats)
    app.state.server = ServerState(engine, config, metrics)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(GuardMiddleware, config=config)
    install_exception_handlers(app)
    routers = (admin, models, web, tokenize, openai, anthropic, ollama, responses, embeddings)
    for module in routers:
        app.include_router(module.router)
    return app
