"""Several models in one server (`ModelRegistry`): models served side by side, loaded on demand
and unloaded after their keep_alive, loads that requests wait for, the memory budget's refusal,
LRU eviction under a most-loaded limit, and the memory an unload hands back."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, RunningServer
from tests.tiny_models import build_tiny_model
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import InvalidRequestError
from tokenmill.server.app import ServerConfig
from tokenmill.server.memory import parse_memory_size, release_freed_memory, resident_bytes
from tokenmill.server.model_registry import FOREVER, ModelRegistry, ModelSource, parse_keep_alive

MiB, GiB = 1 << 20, 1 << 30
PROMPT = "The quick brown fox"
BIG_KV = 512 * MiB  # the KV pool of the model whose unload must hand its memory back


class Models:
    """A `ModelFinder` over a fixed set of sources."""

    def __init__(self, sources: list[ModelSource]) -> None:
        self.sources = {s.name: s for s in sources}

    def find(self, name: str) -> ModelSource | None:
        return self.sources.get(name)

    def names(self) -> list[str]:
        return list(self.sources)


def source(
    name: str,
    path: Path,
    keep_alive: float = 60.0,
    memory: int = MiB,
    gate: threading.Event | None = None,
    kv_cache_memory: int | None = None,
) -> ModelSource:
    """A tiny model's source; its load waits for `gate` when there is one."""

    def build() -> AsyncLLMEngine:
        if gate is not None:
            assert gate.wait(60), "the test never opened the gate"
        kv = {"kv_cache_memory": kv_cache_memory} if kv_cache_memory else {"num_kv_blocks": 64}
        return AsyncLLMEngine(lambda: LLMEngine(path, compile=False, max_model_len=256, **kv))

    return ModelSource(name, path, memory, build, keep_alive)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    return (
        build_tiny_model(tmp_path_factory.mktemp("model-a"), seed=1),
        build_tiny_model(tmp_path_factory.mktemp("model-b"), seed=2),
    )


@pytest.fixture(scope="module")
def gates() -> dict[str, threading.Event]:
    return {"slow": threading.Event(), "slower": threading.Event()}


@pytest.fixture(scope="module")
def server(model_dirs, gates, one_torch_thread):
    a, b = model_dirs
    registry = ModelRegistry(
        Models(
            [
                source("tiny-b", b),
                source("slow", a, gate=gates["slow"]),
                source("slower", a, gate=gates["slower"]),
                source("big", b, memory=BIG_KV, kv_cache_memory=BIG_KV),
                source("huge", a, memory=64 * GiB),
            ]
        ),
        memory_budget=2 * GiB,
        load_timeout=30,
    )
    registry.load_now(source("tiny-a", a, keep_alive=FOREVER))
    running = RunningServer(registry, ServerConfig("tiny-a", api_key=API_KEY))
    yield running
    for gate in gates.values():
        gate.set()
    running.stop()


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture()
def http(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client


def complete(client: openai.OpenAI, model: str, **extra) -> str:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )
    assert out.model == model
    return out.choices[0].text


def statuses(http: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["status"] for m in http.get("/v1/models").json()["data"]}


def model_metrics(http: httpx.Client, model: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.labels.get("model") == model and sample.name.startswith("tokenmill:model"):
                out[sample.name] = sample.value
    return out


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(300, 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("90", 90.0), ("250ms", 0.25), (0, 0.0)],
)
def test_keep_alive_is_read_as_ollama_reads_it(value, seconds) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [-1, "-1m", "-5"])
def test_a_negative_keep_alive_keeps_the_model_loaded(value) -> None:
    assert parse_keep_alive(value) == FOREVER


def test_a_keep_alive_that_is_no_duration_says_what_is_accepted() -> None:
    with pytest.raises(InvalidRequestError, match="'5 minutes' is not a duration"):
        parse_keep_alive("5 minutes")


@pytest.mark.parametrize(
    ("text", "size"),
    [("8GiB", 8 * GiB), ("512MiB", 512 * MiB), ("2GB", 2 * 10**9), ("0.5", 500), ("1024", 1024)],
)
def test_memory_sizes_are_bytes_or_a_fraction_of_the_system(text, size) -> None:
    assert parse_memory_size(text, total=1000) == size


def test_a_memory_size_without_a_known_unit_is_refused() -> None:
    with pytest.raises(ValueError, match="not a memory size"):
        parse_memory_size("8 gigs")


# ---------------------------------------------------------------------------- serving


def test_two_models_answer_alternating_requests_each_with_its_own_weights(client, http) -> None:
    texts: dict[str, set[str]] = {"tiny-a": set(), "tiny-b": set()}
    for _ in range(3):
        for model in texts:
            texts[model].add(complete(client, model))
    (a,), (b,) = texts.values()  # each model answers the same every time
    assert a != b  # and the two are not the same model
    listed = statuses(http)
    assert listed["tiny-a"] == listed["tiny-b"] == "loaded"
    assert listed["huge"] == "available"
    health = http.get("/health").json()
    assert health["models"]["tiny-a"]["status"] == health["models"]["tiny-b"]["status"] == "loaded"
    assert model_metrics(http, "tiny-b")["tokenmill:model_loaded"] == 1
    running = {m["name"] for m in http.get("/api/ps").json()["models"]}
    assert {"tiny-a", "tiny-b"} <= running


def test_a_model_unloads_after_its_keep_alive_and_reloads_on_the_next_request(client, http) -> None:
    first = complete(client, "tiny-b", keep_alive="30s")
    (row,) = [m for m in http.get("/api/ps").json()["models"] if m["name"] == "tiny-b"]
    expires = datetime.fromisoformat(row["expires_at"]) - datetime.now(timezone.utc)
    assert 20 < expires.total_seconds() <= 30
    before = model_metrics(http, "tiny-b")

    assert complete(client, "tiny-b", keep_alive=0.2) == first
    unloads = before["tokenmill:model_unloads_total"]

    def unloaded() -> bool:
        return model_metrics(http, "tiny-b")["tokenmill:model_unloads_total"] == unloads + 1

    wait_for(unloaded, "tiny-b to unload")
    assert statuses(http)["tiny-b"] == "available"
    assert "tiny-b" not in {m["name"] for m in http.get("/api/ps").json()["models"]}
    assert model_metrics(http, "tiny-b")["tokenmill:model_loaded"] == 0

    assert complete(client, "tiny-b") == first  # loaded again, the same model
    reloaded = model_metrics(http, "tiny-b")
    assert reloaded["tokenmill:model_loads_total"] == before["tokenmill:model_loads_total"] + 1
    assert statuses(http)["tiny-a"] == "loaded"  # kept loaded all along


def test_requests_for_a_loading_model_wait_for_one_load(client, http, gates) -> None:
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(complete, client, "slow") for _ in range(2)]
        wait_for(lambda: statuses(http)["slow"] == "loading", "slow to be loading")
        assert http.get("/health").json()["models"]["slow"] == {"status": "loading"}
        assert model_metrics(http, "slow")["tokenmill:model_loading"] == 1
        assert complete(client, "tiny-a")  # the other models go on serving meanwhile
        gates["slow"].set()
        first, second = (w.result(timeout=60) for w in waiting)
    assert first == second
    assert model_metrics(http, "slow")["tokenmill:model_loads_total"] == 1


def test_a_request_that_waits_too_long_for_a_load_is_asked_to_retry(server, client, gates) -> None:
    server.registry.load_timeout = 0.3
    try:
        with pytest.raises(openai.InternalServerError, match="still loading") as info:
            complete(client, "slower")
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"]
    finally:
        server.registry.load_timeout = 30
    gates["slower"].set()
    assert complete(client, "slower")  # the load went on: it serves once done


def test_a_model_beyond_the_memory_budget_is_refused_saying_why(client, http) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, "huge")
    message = info.value.message
    assert "`huge` does not fit" in message and "64.0 GiB" in message
    assert "the memory budget is 2.0 GiB" in message and "--memory-budget" in message
    assert statuses(http)["huge"] == "available"


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "message"),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, ""),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}, None),
    ],
)
def test_an_unknown_model_is_a_404_in_each_apis_shape(http, path, body, error) -> None:
    resp = http.post(path, json={"model": "no-such-model", **body})
    assert resp.status_code == 404
    payload = resp.json()
    if error is None:  # Ollama's: {"error": "..."}
        assert "no-such-model" in payload["error"]
    elif error == "":  # Anthropic's
        assert payload["type"] == "error" and payload["error"]["type"] == "not_found_error"
    else:  # OpenAI's
        assert payload["error"]["code"] == "model_not_found"


def test_unloading_hands_the_models_memory_back(server, client, http) -> None:
    release_freed_memory()
    before = resident_bytes()
    complete(client, "big", keep_alive=-1)
    # the KV pool is written while the engine idles (see KVWarmer): wait until it is resident
    wait_for(lambda: resident_bytes() - before > 0.8 * BIG_KV, "the KV pool to be resident")
    loaded = resident_bytes()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    done = ollama.Client(host=server.url, headers=headers).generate("big", keep_alive=0)
    assert done.done_reason == "unload"
    assert statuses(http)["big"] == "available"
    release_freed_memory()
    after = resident_bytes()
    figures = f"before {before / MiB:.0f}, loaded {loaded / MiB:.0f}, after {after / MiB:.0f}"
    print(f"resident MiB: {figures}")
    assert abs(after - before) <= 0.1 * before


# ---------------------------------------------------------------------------- a most-loaded limit


@pytest.fixture(scope="module")
def two_at_most(model_dirs, one_torch_thread):
    a, b = model_dirs
    finder = Models([source("b", b), source("c", a), source("kept", b, keep_alive=FOREVER)])
    registry = ModelRegistry(finder, max_loaded=2)
    registry.load_now(source("a", a, keep_alive=FOREVER))
    running = RunningServer(registry, ServerConfig("a", api_key=API_KEY))
    yield running
    running.stop()


def test_loading_past_the_limit_unloads_the_least_recently_used_idle_model(two_at_most) -> None:
    client = openai.OpenAI(base_url=f"{two_at_most.url}/v1", api_key=API_KEY, max_retries=0)
    http = httpx.Client(base_url=two_at_most.url, headers={"Authorization": f"Bearer {API_KEY}"})
    complete(client, "b")
    complete(client, "c")  # a is kept loaded: b makes room
    listed = statuses(http)
    assert (listed["a"], listed["b"], listed["c"]) == ("loaded", "available", "loaded")
    complete(client, "b")
    listed = statuses(http)
    assert (listed["a"], listed["b"], listed["c"]) == ("loaded", "loaded", "available")
    complete(client, "kept")  # b goes; kept stays loaded from now on
    with pytest.raises(openai.BadRequestError, match="at most 2 models load at once"):
        complete(client, "c")  # a and kept are both kept loaded: c can never fit


def test_a_running_engine_handed_to_the_server_never_unloads(model_dirs, one_torch_thread) -> None:
    """`build_app(engine, ...)` serves an engine it cannot build again: a request's keep_alive 0
    leaves it loaded, and it goes on answering."""
    a, _ = model_dirs
    engine = LLMEngine(a, compile=False, max_model_len=256, num_kv_blocks=64)
    running = RunningServer(engine, ServerConfig("solo", api_key=API_KEY))
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        ollama.Client(host=running.url, headers=headers).generate("solo", keep_alive=0)
        client = openai.OpenAI(
            base_url=f"{running.url}/v1", api_key=API_KEY, max_retries=0, timeout=30
        )
        assert complete(client, "solo", keep_alive=0)
        with httpx.Client(base_url=running.url, headers=headers, timeout=60) as http:
            assert statuses(http) == {"solo": "loaded"}
    finally:
        running.stop()
