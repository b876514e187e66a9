"""Overload: with a waiting queue of 2 and one sequence at a time, a burst of 16 requests is
partly refused with 503 + Retry-After, and every accepted request still runs to its end."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BURST = 16
MAX_TOKENS = 20
QUEUE = 2

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def overload_server(tiny_loaded, one_torch_thread):
    running = RunningServer(
        LLMEngine(
            tiny_loaded, num_kv_blocks=64, max_model_len=256, max_queue_len=QUEUE, max_num_seqs=1
        ),
        ServerConfig(MODEL_NAME, api_key=API_KEY),
    )
    yield running
    running.stop()


def _metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tokenmill:"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return values


def _body(i: int) -> tuple[str, dict]:
    common = {
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": i,
    }
    if i % 4 == 1:  # some streamed: a refusal must come as a status, before any event
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if i % 2:
        return "/v1/chat/completions", {
            **common,
            "messages": [{"role": "user", "content": f"Story number {i}"}],
        }
    return "/v1/completions", {**common, "prompt": f"Once upon a time, story {i} began"}


async def _one(client: httpx.AsyncClient, i: int) -> dict:
    route, body = _body(i)
    if not body.get("stream"):
        resp = await client.post(route, json=body)
        return {
            "i": i,
            "status": resp.status_code,
            "headers": resp.headers,
            "text": resp.text,
            "route": route,
            "stream": False,
        }
    async with client.stream("POST", route, json=body) as resp:
        await resp.aread()
        return {
            "i": i,
            "status": resp.status_code,
            "headers": resp.headers,
            "text": resp.text,
            "route": route,
            "stream": True,
        }


async def _burst(url: str) -> tuple[list[dict], list[dict]]:
    samples: list[dict] = []
    limits = httpx.Limits(max_connections=BURST + 4)
    async with httpx.AsyncClient(
        base_url=url, headers=AUTH, timeout=httpx.Timeout(120), limits=limits
    ) as client:
        stop = asyncio.Event()

        async def watch() -> None:  # the queue must never grow past its limit
            while not stop.is_set():
                samples.append(_metrics((await client.get("/metrics")).text))
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(_one(client, i) for i in range(BURST)))
        stop.set()
        await watcher
    return results, samples


def _check_completed(result: dict) -> list[str]:
    problems = []
    text = result["text"]
    if result["stream"]:
        lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        if not lines or lines[-1] != "[DONE]":
            return ["stream without [DONE]"]
        chunks = [json.loads(ln) for ln in lines[:-1]]
        if any("error" in c for c in chunks):
            return [f"in-band error {text[:300]!r}"]
        reasons = [
            ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")
        ]
        usage = [c["usage"] for c in chunks if c.get("usage")]
    else:
        data = json.loads(text)
        reasons = [ch["finish_reason"] for ch in data["choices"]]
        usage = [data["usage"]]
    if reasons != ["length"]:
        problems.append(f"finish reasons {reasons}, expected ['length']")
    if len(usage) != 1 or usage[0]["completion_tokens"] != MAX_TOKENS:
        problems.append(f"usage {usage}, expected {MAX_TOKENS} completion tokens")
    return problems


def test_burst_is_partly_refused_and_the_rest_completes(overload_server) -> None:
    results, samples = asyncio.run(_burst(overload_server.url))
    statuses = sorted(r["status"] for r in results)
    print(
        f"burst of {BURST}: statuses {statuses}; waiting peaked at "
        f"{max((s['tokenmill:num_requests_waiting'] for s in samples), default=None)}"
    )
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 503]
    assert len(accepted) + len(refused) == BURST, statuses
    assert refused, f"no request was refused: {statuses}"
    assert len(accepted) >= QUEUE, statuses  # the first ones always find room in the queue

    for r in refused:
        retry_after = r["headers"].get("retry-after")
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, r[
            "headers"
        ]
        assert r["headers"]["content-type"].startswith("application/json"), r["headers"]
        error = json.loads(r["text"])["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "server_overloaded" and error["code"] == "queue_full", error
    problems = [
        f"request {r['i']} ({r['route']}, stream={r['stream']}): {p}"
        for r in accepted
        for p in _check_completed(r)
    ]
    assert not problems, "\n".join(problems)

    assert samples, "no /metrics sample taken during the burst"
    assert max(s["tokenmill:num_requests_waiting"] for s in samples) <= QUEUE, samples
    assert max(s["tokenmill:num_requests_running"] for s in samples) <= 1, samples

    with httpx.Client(base_url=overload_server.url, headers=AUTH, timeout=60) as http:
        assert http.get("/health").status_code == 200
        deadline = time.monotonic() + 10
        while True:
            m = _metrics(http.get("/metrics").text)
            idle = (
                m["tokenmill:num_requests_running"] == 0
                and m["tokenmill:num_requests_waiting"] == 0
                and m["tokenmill:kv_cache_free_blocks"] == m["tokenmill:kv_cache_total_blocks"]
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert idle, m
        resp = http.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": "Once upon a time",
                "max_tokens": 5,
                "ignore_eos": True,
            },
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5, resp.text


def test_refused_requests_succeed_when_retried_after_the_hint(overload_server) -> None:
    """Clients that honour Retry-After all get through once the queue drains."""

    async def run() -> list[tuple[int, int]]:
        async with httpx.AsyncClient(
            base_url=overload_server.url, headers=AUTH, timeout=60
        ) as client:

            async def patient(i: int) -> tuple[int, int]:
                route, body = _body(i)
                body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")} | {
                    "max_tokens": 4
                }
                for attempt in range(1, 40):
                    resp = await client.post(route, json=body)
                    if resp.status_code != 503:
                        return resp.status_code, attempt
                    await asyncio.sleep(min(float(resp.headers["retry-after"]), 1.0))
                return 503, attempt

            return await asyncio.gather(*(patient(i) for i in range(8)))

    outcomes = asyncio.run(run())
    print("patient clients (status, attempts):", outcomes)
    assert all(status == 200 for status, _ in outcomes), outcomes
    assert any(attempts > 1 for _, attempts in outcomes), outcomes  # the queue limit did bite
