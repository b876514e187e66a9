"""`serve --data-parallel-size 2`: two engine replicas as Ray actors behind one endpoint.

The OpenAI-client tests of test_openai_api run here too, against the replicas; then streams
closed early, per-replica metrics and health, and a replica killed under load. One local Ray
instance serves the module.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import ray  # a test extra: missing, the module fails rather than skips
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer
from tests.server.test_openai_api import (  # noqa: F401 - collected and run against the replicas
    PROMPT,
    client,
    offline,
    test_cached_tokens_reported,
    test_chat_equals_offline_streaming_or_not,
    test_completion_equals_offline,
    test_echo_and_token_id_prompts,
    test_errors_have_openai_shape,
    test_models_tokenize_detokenize_health_version,
    test_n_and_seed,
    test_stop_and_stop_reason,
    test_streamed_completion_equals_non_streamed,
)
from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.engine.data_parallel import DataParallelEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.errors import InvalidRequestError
from tokenmill.sample import SamplingParams
from tokenmill.server.app import ServerConfig

# the offline reference's settings (see test_openai_api.offline), in every replica
REPLICA_OPTIONS = dict(num_kv_blocks=256, max_model_len=512, dtype="fp32", compile=False)


@pytest.fixture(scope="module")
def ray_instance():
    """One small local Ray for the module: no dashboard, a small object store, and four logical
    CPUs (the server's two replicas, and the disaggregated engine's two, of one thread each)."""
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=100 << 20,
        logging_level="warning",
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def server(ray_instance, tiny_model_dir):
    engine = DataParallelEngine(tiny_model_dir, 2, REPLICA_OPTIONS, router="prefix", num_threads=1)
    running = RunningServer(
        engine, ServerConfig(MODEL_NAME, api_key=API_KEY, max_body_bytes=1 << 20)
    )
    yield running
    running.stop()


def _metrics(http: httpx.Client) -> dict[tuple[str, str | None], float]:
    """(sample name, replica label) -> value."""
    out: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("replica"))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _wait_for(condition, timeout: float = 20.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _settled_metrics(http: httpx.Client) -> dict[tuple[str, str | None], float]:
    """/metrics once the replicas' polled counters stop moving (earlier requests' included)."""
    last = _metrics(http)
    while True:
        time.sleep(0.3)
        now = _metrics(http)
        if all(now[k] == v for k, v in last.items() if k[1] is not None):
            return now
        last = now


def test_metrics_have_a_replica_label_and_health_lists_replicas(client, http) -> None:  # noqa: F811
    before = _settled_metrics(http)
    client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )

    def generated() -> float:
        after = _metrics(http)
        return sum(
            after.get(("tokenmill:generation_tokens_total", r), 0)
            - before.get(("tokenmill:generation_tokens_total", r), 0)
            for r in ("0", "1")
        )

    _wait_for(lambda: generated() == 4, what="the replicas' counters")
    after = _metrics(http)
    assert ("tokenmill:kv_cache_usage_perc", "0") in after
    assert ("tokenmill:kv_cache_usage_perc", "1") in after
    assert ("tokenmill:prefix_cache_hits_total", None) not in after  # per replica only
    # the endpoint's own histograms count every request once, with no replica label
    e2e = "tokenmill:e2e_request_latency_seconds_count"
    assert after[(e2e, None)] == before[(e2e, None)] + 1
    health = http.get("/health").json()
    assert health["status"] == "ok"
    assert [r["status"] for r in health["replicas"]] == ["ok", "ok"]


def test_embeddings_come_from_a_replica(http, tiny_loaded) -> None:
    resp = http.post("/v1/embeddings", json={"model": MODEL_NAME, "input": [PROMPT, "Paris is"]})
    assert resp.status_code == 200, resp.text
    got = [item["embedding"] for item in resp.json()["data"]]
    engine = LLMEngine(tiny_loaded, num_kv_blocks=256, max_model_len=512)
    ids = [engine.tokenizer.encode(text) for text in (PROMPT, "Paris is")]
    assert torch.allclose(torch.tensor(got), engine.embed(ids), atol=1e-5)


def test_shared_prefix_requests_go_to_one_replica(client, server) -> None:  # noqa: F811
    prefix = "Paris is the capital of France; Berlin is the capital of Germany. " * 4
    for i in range(4):
        client.completions.create(
            model=MODEL_NAME, prompt=prefix + f"Question {i}:", max_tokens=2, temperature=0
        )
    held = [
        v.cached_prefix(
            server.async_engine.input_processor.process("x", prefix + "Q").sequences[0].block_hashes
        )
        for v in server.async_engine.router.replicas
    ]
    assert max(held) >= 2 and min(held) == 0


def test_closed_streams_free_their_replica(http, server) -> None:
    for _ in range(3):
        with http.stream(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": PROMPT,
                "max_tokens": 400,
                "stream": True,
                "ignore_eos": True,
            },
        ) as resp:
            assert resp.status_code == 200
            next(line for line in resp.iter_lines() if line.startswith("data: "))
    # the client hung up: the replicas stop generating for it
    _wait_for(
        lambda: (
            all(s.num_running == 0 for s in server.async_engine.replica_stats())
            and all(v.requests == 0 for v in server.async_engine.router.replicas)
        ),
        what="the aborted requests to leave the replicas",
    )


def test_pd_disaggregation_matches_a_single_engine(ray_instance, tiny_model_dir, offline) -> None:  # noqa: F811
    engine = DataParallelEngine(
        tiny_model_dir, 2, REPLICA_OPTIONS, num_threads=1, pd_disaggregation=True
    )
    prompts = ["The quick brown fox jumps over the lazy dog. " * 5, PROMPT + " and then " * 20]

    async def run() -> list[RequestOutput]:
        finals = []
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=12)
            async for out in engine.generate(prompt, params, f"pd-{i}"):
                final = out
            finals.append(final)
        return finals

    try:
        finals = asyncio.run(asyncio.wait_for(run(), 60))
        for prompt, final in zip(prompts, finals):
            ids = engine.tokenize(prompt)
            ref = offline(ids, SamplingParams(temperature=0, max_tokens=12))
            assert final.outputs[0].token_ids == ref.outputs[0].token_ids
            # the decode replica found the prefill replica's blocks in its prefix cache
            assert final.num_cached_tokens == (len(ids) - 1) // 16 * 16 > 0
        assert engine.replica_stats()[1].prefix_cache_hits == sum(
            f.num_cached_tokens for f in finals
        )
        prompt_tokens = sum(len(engine.tokenize(p)) for p in prompts)
        _wait_for(  # the prefill replica's counters come with its next poll
            lambda: engine.replica_stats()[0].prompt_tokens == prompt_tokens,
            what="the prefill replica to count the prompts",
        )
    finally:
        engine.shutdown()


def test_requests_without_output_move_when_their_replica_dies(ray_instance, tiny_model_dir) -> None:
    """One sequence at a time per replica: the requests queued behind it have no output yet, so
    they go to the other replica when theirs dies; only the running one fails."""
    options = REPLICA_OPTIONS | {"max_num_seqs": 1}
    engine = DataParallelEngine(tiny_model_dir, 2, options, router="round-robin", num_threads=1)
    pid = engine.replica_pid(0)

    started = asyncio.Event()  # the first token arrived: replica 0 has a running request

    async def one(i: int) -> str:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        try:
            async for out in engine.generate(f"{i} {PROMPT}", params, f"q{i}"):
                started.set()
                final = out
        except EngineDeadError:
            return "failed"
        return "done" if final.outputs[0].finish_reason == "length" else "cut"

    async def run() -> list[str]:
        tasks = [asyncio.create_task(one(i)) for i in range(6)]  # three on each replica
        await started.wait()
        os.kill(pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    try:
        outcomes = asyncio.run(asyncio.wait_for(run(), 90))
    finally:
        engine.shutdown()
    assert outcomes.count("failed") <= 1 and outcomes.count("done") >= 5, outcomes


def test_too_few_cluster_cpus_is_an_error_not_a_wait(ray_instance, tiny_model_dir) -> None:
    with pytest.raises(InvalidRequestError, match="has 4 CPUs.*need 6"):
        DataParallelEngine(tiny_model_dir, 2, REPLICA_OPTIONS, num_threads=3)


async def _stream_one(url: str, i: int) -> str:
    """'done', or how the request failed; the timeout turns a hang into a failure."""
    body = {
        "model": MODEL_NAME,
        "prompt": f"{i} " + PROMPT,
        "max_tokens": 480,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                error = json.loads(await r.aread())["error"]
                assert r.status_code >= 500 and set(error) == {"message", "type", "param", "code"}
                return f"http {r.status_code}"
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    assert set(event["error"]) == {"message", "type", "param", "code"}
                    return "in-band error"
            return "done"


def test_killed_replica_fails_its_requests_fast_and_comes_back(server, http, client) -> None:  # noqa: F811
    engine = server.async_engine
    pid = engine.replica_pid(0)

    async def run() -> list[str]:
        tasks = [asyncio.create_task(_stream_one(server.url, i)) for i in range(8)]
        # kill replica 0 once both replicas have requests and replica 0 is generating
        generated = engine.replica_stats()[0].generation_tokens
        deadline = time.monotonic() + 30
        while not (
            all(v.requests for v in engine.router.replicas)
            and engine.replica_stats()[0].generation_tokens > generated
        ):
            assert time.monotonic() < deadline, "the requests never reached both replicas"
            await asyncio.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=90)

    outcomes = asyncio.run(run())
    # none hung; replica 1's requests finish; replica 0's fail in OpenAI's shape (in the stream,
    # or before it, with a 5xx), or finish on replica 1 where they had sent nothing yet
    assert len(outcomes) == 8 and outcomes.count("done") >= 1
    assert set(outcomes) <= {"done", "in-band error", "http 503"}, outcomes
    _wait_for(
        lambda: http.get("/health").json()["replicas"][0]["restarts"] >= 1,
        timeout=60,
        what="replica 0 to come back",
    )
    assert engine.replica_pid(0) != pid
    # both replicas serve again
    engine.router.policy = "round-robin"
    try:
        for _ in range(2):
            resp = client.completions.create(
                model=MODEL_NAME, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert resp.choices[0].finish_reason == "length"
    finally:
        engine.router.policy = "prefix"
