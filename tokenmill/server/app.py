"""The OpenAI-compatible HTTP server: FastAPI routers over one or several models' engines.

`build_app` wires the pieces, each in a module of its own: the routers (`routes/`), what they
share (`state`: the configuration, the models (`model_registry`), the metrics), the request guard
(`guard`), the error mapping (`errors`), the request-running path (`generation`), OpenAI's
response formatting (`formatting`) and the Prometheus metrics (`metrics`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from tokenmill import __version__
from tokenmill.server.errors import install_exception_handlers
from tokenmill.server.guard import GuardMiddleware
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.model_registry import Engine, ModelRegistry, ModelSource, ReleaseModels
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


def build_app(served: ModelRegistry | Engine, config: ServerConfig) -> FastAPI:
    """The server's ASGI app over a registry of models, or over one running engine (one, or
    data-parallel replicas) served as `config.served_model_name`; the engines outlive the app."""
    app = FastAPI(title="tokenmill", version=__version__)
    registry = served if isinstance(served, ModelRegistry) else serving(config, served)
    app.state.server = ServerState(registry, config, ServerMetrics(registry))
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(GuardMiddleware, config=config)
    app.add_middleware(ReleaseModels)
    install_exception_handlers(app)
    routers = (admin, models, web, tokenize, openai, anthropic, ollama, responses, embeddings)
    for module in routers:
        app.include_router(module.router)
    return app


def serving(config: ServerConfig, engine: Engine) -> ModelRegistry:
    """A registry of one running engine, kept loaded as `config.served_model_name`."""
    registry = ModelRegistry()
    source = ModelSource(
        config.served_model_name, engine.model_path, 0, lambda: engine, pinned=True
    )
    registry.add(source, engine)
    return registry
