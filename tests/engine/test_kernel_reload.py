"""A first start serves while the CPU kernels build (`EngineConfig.serve_while_building`).

The kernels are built once per test session (tests/conftest.py), so a build in progress is
stood in for by a thread that ends when the test says: the model loads on PyTorch's layouts
(`kernels.deferred`), serves, and is reloaded onto the kernels' layouts once the "build" ends,
then swapped in between two steps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_runs import final_outputs
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model import kernels
from tokenmill.model.quant_linear import QuantLinear
from tokenmill.sample import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
ADOPT_TIMEOUT_S = 120.0

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason="needs tokenmill's CPU kernels (a compiler and AVX2)"
)


def _kernel_layers(engine: LLMEngine) -> int:
    """How many of the model's quantized layers are in a layout of tokenmill's kernels: the
    tile layout (AVX-512 with VNNI) or the row layouts (AVX2, and where tiles do not fit)."""
    return sum(
        1
        for m in engine.runner.model.modules()
        if isinstance(m, QuantLinear) and (m.tiles or m.row_layout)
    )


@pytest.fixture
def build_in_progress(monkeypatch) -> Iterator[threading.Event]:
    """A stand-in for the kernels' background build: it ends when the returned event is set."""
    ended = threading.Event()
    build = threading.Thread(target=ended.wait, daemon=True)
    build.start()
    monkeypatch.setattr(kernels, "build_in_background", lambda: build if build.is_alive() else None)
    yield ended
    ended.set()


def _engine(model: Path, **options) -> LLMEngine:
    return LLMEngine(model, num_kv_blocks=64, compile=False, **options)


def _greedy(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0)
    return [o.token_ids for o in final_outputs(engine, [(p, params) for p in PROMPTS])]


def test_the_model_serves_on_pytorchs_layouts_then_on_the_kernels(smollm2_gguf, build_in_progress):
    engine = _engine(smollm2_gguf, serve_while_building=True)
    assert engine.runner.reload_pending
    assert _kernel_layers(engine) == 0  # loaded without waiting for the build
    assert all(len(ids) == 8 for ids in _greedy(engine))
    assert not engine.adopt_reloaded_model()  # nothing to adopt while the build runs

    build_in_progress.set()
    deadline = time.monotonic() + ADOPT_TIMEOUT_S
    while not engine.adopt_reloaded_model():
        assert time.monotonic() < deadline, "the model was not reloaded onto the kernels"
        time.sleep(0.05)
    assert not engine.runner.reload_pending
    assert engine.loaded.model is engine.runner.model
    assert _kernel_layers(engine) > 0
    # after the swap, the answers of an engine that waited for the kernels
    assert _greedy(engine) == _greedy(_engine(smollm2_gguf))


def test_without_serve_while_building_the_load_waits_for_the_kernels(
    smollm2_gguf, build_in_progress
):
    engine = _engine(smollm2_gguf)
    assert not engine.runner.reload_pending
    assert _kernel_layers(engine) > 0


def test_an_idle_async_engine_adopts_the_reloaded_model(smollm2_gguf, build_in_progress):
    engine = AsyncLLMEngine(lambda: _engine(smollm2_gguf, serve_while_building=True))
    try:
        assert engine.engine.runner.reload_pending
        build_in_progress.set()
        deadline = time.monotonic() + ADOPT_TIMEOUT_S
        while engine.engine.runner.reload_pending:  # no request: the idle loop adopts it
            assert time.monotonic() < deadline, "the idle engine did not adopt the reloaded model"
            time.sleep(0.05)
        assert _kernel_layers(engine.engine) > 0
    finally:
        engine.shutdown()


def test_deferred_loads_take_pytorchs_layouts_even_with_the_kernels_loaded(smollm2_gguf):
    from tokenmill.model.loader import load_model

    with kernels.deferred():
        assert not kernels.load()
        loaded = load_model(smollm2_gguf, progress=False)
    assert kernels.load()
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert layers and not any(m.tiles or m.row_layout for m in layers)
