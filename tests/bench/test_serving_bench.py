"""`tokenmill bench` against a fake OpenAI-compatible streaming server on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tokenmill.bench.serving import (
    BenchConfig,
    BenchResult,
    format_comparison,
    format_report,
    run_benchmark,
    write_plot,
)
from tokenmill.cli.main import main
from tokenmill.errors import InvalidRequestError

CHUNK_DELAY = 0.002  # seconds between streamed tokens


@dataclass
class FakeServer:
    """Streams one token per chunk with a usage chunk; counts a whitespace-separated word as one
    token."""

    url: str = ""
    tokenize: bool = True
    fail_every: int = 0  # answer every n-th generation request with HTTP 500
    calls: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    bodies: list[dict] = field(default_factory=list)
    client_ports: list[int] = field(default_factory=list)  # of each generation request's connection

    def app(self) -> Starlette:
        async def models(_: Request) -> JSONResponse:
            return JSONResponse(
                {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
            )

        async def tokenize(request: Request) -> JSONResponse:
            body = await request.json()
            if not self.tokenize or "prompt" not in body:
                return JSONResponse({"error": "not found"}, status_code=404)
            tokens = list(range(100, 100 + len(body["prompt"].split())))
            return JSONResponse({"tokens": tokens, "count": len(tokens)})

        async def generate(request: Request) -> StreamingResponse | JSONResponse:
            body = await request.json()
            self.bodies.append(body)
            self.client_ports.append(request.client.port)
            self.calls += 1
            if self.fail_every and self.calls % self.fail_every == 0:
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            chat = "messages" in body
            prompt = body["messages"][0]["content"] if chat else body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            n = body["max_tokens"]

            async def events():
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    if chat:
                        yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    for i in range(n):
                        await asyncio.sleep(CHUNK_DELAY)
                        text = f" w{i}"
                        choice = (
                            {"index": 0, "delta": {"content": text}}
                            if chat
                            else {"index": 0, "text": text}
                        )
                        yield _sse({"choices": [choice]})
                    yield _sse(
                        {
                            "choices": [],
                            "usage": {
                                "prompt_tokens": prompt_tokens,
                                "completion_tokens": n,
                                "total_tokens": prompt_tokens + n,
                            },
                        }
                    )
                    yield "data: [DONE]\n\n"
                finally:
                    self.in_flight -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/tokenize", tokenize, methods=["POST"]),
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/v1/chat/completions", generate, methods=["POST"]),
            ]
        )


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


@pytest.fixture(scope="module")
def server_thread():
    """One uvicorn server for the module; each test puts a fresh FakeServer app behind it."""
    holder: dict[str, Starlette] = {}

    async def app(scope, receive, send):
        await holder["app"](scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    yield holder, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def fake(server_thread) -> FakeServer:
    holder, url = server_thread
    state = FakeServer(url=url)
    holder["app"] = state.app()
    return state


def bench(fake: FakeServer, **kwargs) -> BenchResult:
    settings = {
        "num_prompts": 8,
        "input_len": 12,
        "output_len": 6,
        "warmup": 0,
        "timeout": 30.0,
    } | kwargs
    return asyncio.run(run_benchmark(BenchConfig(base_url=fake.url, **settings)))


def assert_sane(result: BenchResult) -> None:
    m = result.metrics()
    ok = [r for r in result.requests if r.success]
    for r in ok:
        assert 0 < r.ttft < r.e2e
        assert r.tpot > 0
        assert len(r.itl) == r.output_len - 1
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < m[f"median_{name}_ms"] <= m[f"p90_{name}_ms"] <= m[f"p99_{name}_ms"]
    assert m["mean_ttft_ms"] < m["mean_e2el_ms"]
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert m["total_token_throughput"] > m["output_throughput"]


def test_fixed_lengths_are_measured_and_reported(fake) -> None:
    result = bench(fake, warmup=1)
    m = result.metrics()
    assert (m["completed"], m["failed"]) == (8, 0)
    assert fake.calls == 9  # the warm-up is sent but not counted
    # /tokenize calibrated: one token per word
    assert [r.input_len for r in result.requests] == [12] * 8
    assert m["total_output_tokens"] == 8 * 6
    assert result.model == result.label == "fake-model"
    assert "measured with the server's /tokenize" in result.prompt_mode
    assert all(
        b["stream"]
        and b["stream_options"] == {"include_usage": True}
        and b["temperature"] == 0
        and "ignore_eos" not in b
        for b in fake.bodies
    )
    assert_sane(result)
    report = format_report(result)
    assert (
        "Serving Benchmark Result" in report
        and "Successful requests:" in report
        and "P99 TPOT (ms):" in report
    )


def test_random_lengths_prefix_and_ignore_eos(fake) -> None:
    fake.tokenize = False
    result = bench(
        fake,
        num_prompts=12,
        input_len=20,
        output_len=8,
        random_range_ratio=0.5,
        prefix_len=5,
        ignore_eos=True,
    )
    assert "assumed" in result.prompt_mode
    inputs = [r.input_len for r in result.requests]
    outputs = [r.output_len for r in result.requests]
    assert all(5 + 10 <= n <= 5 + 30 for n in inputs) and len(set(inputs)) > 1
    assert all(4 <= n <= 12 for n in outputs) and len(set(outputs)) > 1
    prompts = [b["prompt"].split() for b in fake.bodies]
    assert all(p[:5] == prompts[0][:5] for p in prompts)
    assert all(b["ignore_eos"] is True for b in fake.bodies)
    assert_sane(result)


def test_token_id_prompts_and_chat(fake) -> None:
    result = bench(fake, token_ids=True, num_prompts=4)
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 12 for b in fake.bodies)
    # ids the server's tokenizer gave
    assert all(100 <= t < 100 + 1000 for b in fake.bodies for t in b["prompt"])
    assert result.metrics()["completed"] == 4
    fake.bodies.clear()
    chat = bench(fake, endpoint="/v1/chat/completions", num_prompts=4)
    assert all(b["messages"][0]["role"] == "user" for b in fake.bodies)
    assert chat.metrics()["completed"] == 4
    assert_sane(chat)
    with pytest.raises(InvalidRequestError):
        BenchConfig(token_ids=True, endpoint="/v1/chat/completions")


def test_request_rate_and_concurrency_limits(fake) -> None:
    paced = bench(fake, num_prompts=10, request_rate=100.0)
    starts = [r.start for r in paced.requests]
    assert starts == sorted(starts) and starts[-1] > 0.02  # arrivals are spread out, in order
    assert paced.metrics()["completed"] == 10
    fake.max_in_flight = 0
    capped = bench(fake, num_prompts=10, max_concurrency=2)
    assert fake.max_in_flight == 2
    assert capped.metrics()["completed"] == 10
    assert_sane(capped)
    # each request on a connection of its own: a kept-alive one that the server closes as it is
    # reused fails the request (llama-server's did, 4-5 of 64 at concurrency 32)
    assert len(set(fake.client_ports)) == len(fake.client_ports) == 20


def test_failures_are_counted_with_their_errors(fake) -> None:
    fake.fail_every = 3
    result = bench(fake, num_prompts=9, max_concurrency=3)
    m = result.metrics()
    assert (m["completed"], m["failed"]) == (6, 3)
    failed = [r for r in result.requests if not r.success]
    assert all(r.error.startswith("HTTP 500") and "boom" in r.error for r in failed)
    assert_sane(result)
    assert "First error (3 failed): HTTP 500" in format_report(result)


def test_json_plot_and_comparison(fake, tmp_path) -> None:
    first = bench(fake, label="one")
    second = bench(fake, label="two", max_concurrency=1)
    path = tmp_path / "result.json"
    first.write_json(str(path))
    data = json.loads(path.read_text())
    assert data["completed"] == 8 and data["settings"]["request_rate"] == "inf"
    assert "api_key" not in data["settings"]
    assert len(data["ttfts"]) == len(data["itls"]) == len(data["errors"]) == 8
    png = tmp_path / "plot.png"
    write_plot({"one": first, "two": second}, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_comparison({"one": first, "two": second})
    assert "one" in table and "two" in table
    assert "8 (1.00x)" in table  # both completed all requests
    assert "Mean TTFT (ms)" in table


def test_cli(fake, tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(
        [
            "bench",
            "--base-url",
            fake.url,
            "--num-prompts",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--max-concurrency",
            "2",
            "--result-json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "fake-model" in out
    assert json.loads(out_json.read_text())["completed"] == 4
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    fake.fail_every = 1  # the warm-up fails: a one-line error, exit code 1
    assert main(["bench", "--base-url", fake.url, "--num-prompts", "2"]) == 1
    assert "warm-up request" in capsys.readouterr().err
    assert main(["bench", "--base-url", fake.url, "--input-len", "0"]) == 1
