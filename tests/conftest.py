"""Shared fixtures: the real models come from the catalog (pulled once into the model cache)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.catalog import pull


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch (and every process it starts, through
    OMP_NUM_THREADS) gets its share of the cores: the workers' threads together never outnumber
    them. Oversubscribed, torch's OpenMP workers spin at every parallel region's end waiting for a
    sibling the scheduler has parked, and two workers' steps each run many times slower (tuning
    log, "OpenMP threads outnumbering the cores"). Tests of how kernels share their work
    between threads set their thread counts themselves."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        return
    import torch

    threads = max(1, len(os.sched_getaffinity(0)) // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


# The files that take minutes (real models, compiled graphs), longest first: `scripts/test.sh`
# hands files to its workers in collection order (`--no-loadscope-reorder`), so these start at once
# and the short files fill the other worker's time, rather than one of these ending the run alone.
LONGEST_FILES = [
    "tests/test_real_batch_invariance.py",
    "tests/engine/test_speculative.py",
    "tests/engine/test_compiled_decode.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return pull("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    return pull("gemma-3-270m", progress=False)


@pytest.fixture(scope="session")
def qwen_coder_05b_gguf() -> Path:
    return pull("qwen2.5-coder-0.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def qwen_coder_15b_gguf() -> Path:
    return pull("qwen2.5-coder-1.5b-instruct", progress=False)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    return pull("all-minilm-l6-v2", progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir):
    from tokenmill.model.loader import load_model

    return load_model(tiny_model_dir, progress=False)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels() -> bool:
    """Build (or load) the C++ kernels before any test: a background build finishing in the middle
    of a test would switch its kernels between two steps."""
    from tokenmill.model import kernels

    return kernels.load()


@pytest.fixture(scope="module", autouse=True)
def no_graph_build_outlives_its_module() -> Iterator[None]:
    """Stop, and wait for, every decode-graph build a module's engines left running. An engine's
    shutdown only tells its build to stop, and the build ends once the compiler call it is in
    returns (a C++ compile can take seconds): meanwhile the next module's torch.compile would
    share inductor's process-wide state with it (its record of the kernels being compiled), which
    holds one compilation at a time."""
    yield
    from tokenmill.engine.stoppable_thread import stop_all

    running = stop_all(timeout=300)
    assert not running, f"{running} still running 300 s after they were told to stop"
