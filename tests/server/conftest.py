"""A tokenmill server on a free loopback port, serving the tiny model, for the API tests."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn

from tests.threads import torch_threads
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.data_parallel import DataParallelEngine
from tokenmill.engine.embedding import EmbeddingEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig, build_app, serving
from tokenmill.server.model_registry import ModelRegistry

MODEL_NAME = "tiny"
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(
        self,
        engine: LLMEngine | EmbeddingEngine | DataParallelEngine | ModelRegistry,
        config: ServerConfig,
    ) -> None:
        """engine: an engine to run, running data-parallel replicas, or a registry of models
        (which this server then shuts down)."""
        if isinstance(engine, ModelRegistry):
            self.registry = engine
        else:
            self.async_engine = (
                engine if isinstance(engine, DataParallelEngine) else AsyncLLMEngine(engine)
            )
            self.registry = serving(config, self.async_engine)
        self.app = build_app(self.registry, config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.registry.shutdown()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread while this module's server runs: on a shared, busy CPU torch's spinning
    OpenMP workers can slow the tiny model by an order of magnitude."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def server(tiny_loaded):
    running = RunningServer(
        LLMEngine(tiny_loaded, num_kv_blocks=256, max_model_len=512),
        ServerConfig(MODEL_NAME, api_key=API_KEY, max_body_bytes=1 << 20),
    )
    yield running
    running.stop()


@pytest.fixture()
def http(server):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as client:
        yield client
