"""Soak: hundreds of random requests at concurrency 32, a third of them streamed and dropped
mid-way.

Nothing may fail with a 5xx, every answer that is read to its end must be complete and
consistent, and once the load stops the engine must be idle with every KV block back in the
pool, and this process (which runs the server) must not have grown.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import random
import string
import time

import httpx
import psutil
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONCURRENCY = 32
WARMUP = 50
REQUESTS = 500
ERROR_KEYS = {"message", "type", "param", "code"}
WORDS = [
    "Once",
    "upon",
    "a",
    "time",
    "there",
    "was",
    "the",
    "king",
    "of",
    "Paris",
    "river",
    "and",
    "quick",
    "fox",
]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def soak_server(tiny_loaded, one_torch_thread):
    # 128 blocks of 16 tokens hold fewer tokens than 32 sequences of n=2 can want: preemption is
    # exercised too.
    running = RunningServer(
        LLMEngine(tiny_loaded, num_kv_blocks=128, max_num_seqs=32, max_model_len=256),
        ServerConfig(MODEL_NAME, api_key=API_KEY),
    )
    yield running
    running.stop()


def _strict_json(text: str):
    return json.loads(
        text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"non-finite {c}"))
    )


def _random_request(rng: random.Random, i: int) -> dict:
    """One request: route, body, and when streamed, after how many chunks to hang up (None: read it
    all)."""
    chat = rng.random() < 0.5
    body: dict = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 40), "n": rng.choice([1, 1, 2])}
    if chat:
        body["messages"] = [
            {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))}
        ]
        if rng.random() < 0.3:
            body["messages"].insert(0, {"role": "system", "content": "Be brief."})
    else:
        body["prompt"] = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
    if rng.random() < 0.5:
        body["temperature"] = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])
    if rng.random() < 0.3:
        body["top_p"] = rng.choice([0.1, 0.5, 0.9, 1.0])
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([0, 1, 5, 40])
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.3:
        body["stop"] = [
            "".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 2)))
            for _ in range(rng.randint(1, 3))
        ]
    if rng.random() < 0.4:
        body["ignore_eos"] = True
    if rng.random() < 0.4:
        if chat:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    hangup = None
    if rng.random() < 0.5:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.8:
            # hung up on: a third of all requests (some end before the hang-up point)
            hangup = rng.randint(0, 6)
    return {
        "id": i,
        "route": "/v1/chat/completions" if chat else "/v1/completions",
        "body": body,
        "hangup": hangup,
    }


def _token_counts(route: str, choice: dict) -> int | None:
    """Tokens of one choice (or streamed delta) as its logprobs tell, None without logprobs."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    return len(lp["content"]) if route == "/v1/chat/completions" else len(lp["tokens"])


def _check_final(
    req: dict, texts: dict, finish: dict, counts: dict, usage: dict | None
) -> list[str]:
    body, _route = req["body"], req["route"]
    n, limit, problems = body["n"], body["max_tokens"], []
    if sorted(finish) != list(range(n)):
        return [f"finish reasons for choices {sorted(finish)}, expected {n}"]
    for index, reason in finish.items():
        if reason not in ("stop", "length"):
            problems.append(f"choice {index} finished with {reason!r}")
        if counts.get(index) is not None:
            if counts[index] > limit or (reason == "length" and counts[index] != limit):
                problems.append(
                    f"choice {index}: {counts[index]} tokens, finish {reason}, max_tokens {limit}"
                )
        if reason == "length" and body.get("stop") and any(s in texts[index] for s in body["stop"]):
            problems.append(
                f"choice {index} ran to length though its text holds a stop string: "
                f"{texts[index]!r}"
            )
        if body.get("ignore_eos") and not body.get("stop") and reason != "length":
            problems.append(
                f"choice {index}: ignore_eos without stop strings finished with {reason!r}"
            )
    if usage is None:
        return problems + ["no usage"]
    if (
        usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]
        or usage["prompt_tokens"] < 1
    ):
        problems.append(f"inconsistent usage {usage}")
    if not usage["completion_tokens"] <= n * limit:
        problems.append(f"usage {usage['completion_tokens']} tokens > n * max_tokens")
    if (
        len(counts) == n
        and all(c is not None for c in counts.values())
        and sum(counts.values()) != usage["completion_tokens"]
    ):
        problems.append(
            f"usage says {usage['completion_tokens']} tokens, logprobs hold {sum(counts.values())}"
        )
    return problems


async def _run_one(client: httpx.AsyncClient, req: dict) -> tuple[str, list[str]]:
    """Outcome ('ok', 'hung-up') and problems of one request."""
    route, body = req["route"], req["body"]
    if not body.get("stream"):
        resp = await client.post(route, json=body)
        if resp.status_code != 200:
            return "ok", [f"status {resp.status_code}: {resp.text[:300]}"]
        try:
            data = _strict_json(resp.text)
            texts = {
                c["index"]: c["message"]["content"] if "message" in c else c["text"]
                for c in data["choices"]
            }
            finish = {c["index"]: c["finish_reason"] for c in data["choices"]}
            counts = {c["index"]: _token_counts(route, c) for c in data["choices"]}
            if len(data["choices"]) != body["n"]:
                return "ok", [f"{len(data['choices'])} choices for n={body['n']}"]
            return "ok", _check_final(req, texts, finish, counts, data.get("usage"))
        except (ValueError, KeyError, TypeError) as exc:
            return "ok", [f"bad body ({exc!r}): {resp.text[:300]}"]

    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    counts: dict[int, int | None] = {}
    usage = None
    chunks = 0
    done = False
    async with client.stream("POST", route, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return "ok", [f"status {resp.status_code}: {resp.text[:300]}"]
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            try:
                chunk = _strict_json(line[6:])
            except ValueError as exc:
                return "ok", [f"stream chunk not strict JSON ({exc}): {line[:300]}"]
            if "error" in chunk:
                return "ok", [f"in-band error: {line[:300]}"]
            chunks += 1
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                i = c["index"]
                texts[i] = texts.get(i, "") + (
                    (c.get("delta") or {}).get("content") or c.get("text") or ""
                )
                counts[i] = counts.get(i, 0) + (_token_counts(route, c) or 0)
                if c.get("finish_reason") is not None:
                    finish[i] = c["finish_reason"]
            if req["hangup"] is not None and chunks >= req["hangup"]:
                return "hung-up", []  # leaving the block closes the connection mid-stream
    if not done:
        return "ok", ["stream ended without [DONE]"]
    if body.get("logprobs") in (None, False):
        # 0 is a request for logprobs (of the chosen token only)
        counts = {}
    return "ok", _check_final(req, texts, finish, counts, usage)


async def _run_all(url: str, requests: list[dict]) -> tuple[list[str], dict]:
    problems: list[str] = []
    outcomes: dict[str, int] = {}
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=url, headers=AUTH, timeout=httpx.Timeout(120), limits=limits
    ) as client:

        async def guarded(req: dict) -> None:
            async with gate:
                try:
                    outcome, found = await _run_one(client, req)
                except httpx.HTTPError as exc:
                    outcome, found = "transport-error", [f"{exc!r}"]
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            problems.extend(
                f"request {req['id']} {req['route']} {json.dumps(req['body'])}: {p}" for p in found
            )

        await asyncio.gather(*(guarded(r) for r in requests))
    return problems, outcomes


def _metrics(http: httpx.Client) -> dict[str, float]:
    values: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("tokenmill:"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return values


def _settled(http: httpx.Client, timeout: float = 10.0) -> tuple[bool, dict]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(http)
        idle = (
            m.get("tokenmill:num_requests_running") == 0
            and m.get("tokenmill:num_requests_waiting") == 0
            and m.get("tokenmill:kv_cache_free_blocks") == m.get("tokenmill:kv_cache_total_blocks")
        )
        if idle or time.monotonic() > deadline:
            return idle, m
        time.sleep(0.2)


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def test_soak(soak_server, caplog) -> None:
    caplog.set_level(logging.ERROR, logger="tokenmill")
    rng = random.Random(1234)
    requests = [_random_request(rng, i) for i in range(WARMUP + REQUESTS)]
    assert sum(r["hangup"] is not None for r in requests[WARMUP:]) >= REQUESTS // 4

    started = time.monotonic()
    warm_problems, _ = asyncio.run(_run_all(soak_server.url, requests[:WARMUP]))
    with httpx.Client(base_url=soak_server.url, headers=AUTH, timeout=30) as http:
        _settled(http)
    rss_before = _rss()
    problems, outcomes = asyncio.run(_run_all(soak_server.url, requests[WARMUP:]))
    elapsed = time.monotonic() - started

    with httpx.Client(base_url=soak_server.url, headers=AUTH, timeout=30) as http:
        idle, metrics = _settled(http)
        rss_after = _rss()
        assert http.get("/health").status_code == 200
        after = http.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": "Once upon a time",
                "max_tokens": 4,
                "ignore_eos": True,
            },
        )
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4, (
            after.text
        )

    print(
        f"soak: {WARMUP}+{REQUESTS} requests in {elapsed:.1f} s, outcomes {outcomes}, "
        f"rss {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB, "
        f"preemptions {metrics.get('tokenmill:num_preemptions_total')}"
    )
    report = []
    problems = warm_problems + problems
    if problems:
        report.append(
            f"{len(problems)} bad responses, e.g.:\n  "
            + "\n  ".join(p[:600] for p in problems[:15])
        )
    if not idle:
        state = {k: v for k, v in metrics.items() if "kv_cache" in k or "num_requests" in k}
        report.append(f"engine not idle 10 s after the load: {state}")
    if rss_after > rss_before * 1.10:
        report.append(
            f"resident memory grew {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
        )
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name.startswith("tokenmill")
    ]
    if errors:
        report.append(f"{len(errors)} errors logged by the server, e.g. {errors[:3]}")
    assert not report, "\n\n".join(report)
    assert outcomes.get("hung-up", 0) >= REQUESTS // 4 and outcomes.get("ok", 0) >= REQUESTS // 2, (
        outcomes
    )
