"""`tokenmill bench` against a fake OpenAI-compatible streaming server on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import jsonschema
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from tokenmill.bench.serving import (
    JSON_SCHEMAS,
    NEW_SCHEMA_TOKENS,
    RECORD_TOKENS,
    BenchConfig,
    BenchResult,
    RequestResult,
    compile_interference,
    format_comparison,
    format_report,
    format_summary,
    run_benchmark,
    structured_comparison,
    write_plot,
)
from tokenmill.cli.main import main
from tokenmill.errors import InvalidRequestError

CHUNK_DELAY = 0.002  # seconds between streamed tokens
HITS_PER_REQUEST = 4  # prompt tokens the fake server's prefix cache finds, per request


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
    # /metrics with prefix-cache counters per replica (as a data-parallel tokenmill serves them):
    # every prompt word looked up, HITS_PER_REQUEST found, alternating replicas
    prefix_cache: bool = False
    cache_queries: list[int] = field(default_factory=lambda: [0, 0])
    cache_hits: list[int] = field(default_factory=lambda: [0, 0])

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
            self.cache_queries[self.calls % 2] += prompt_tokens
            self.cache_hits[self.calls % 2] += HITS_PER_REQUEST

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

        async def metrics(_: Request) -> PlainTextResponse:
            if not self.prefix_cache:
                return PlainTextResponse("not found", status_code=404)
            lines = []
            for name, values in (("queries", self.cache_queries), ("hits", self.cache_hits)):
                lines.append(f"# TYPE tokenmill:prefix_cache_{name} counter")
                lines += [
                    f'tokenmill:prefix_cache_{name}_total{{replica="{i}"}} {v}'
                    for i, v in enumerate(values)
                ]
            return PlainTextResponse("\n".join(lines) + "\n")

        return Starlette(
            routes=[
                Route("/metrics", metrics),
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


def test_shared_prefixes_and_the_prefix_cache_hit_rate(fake) -> None:
    fake.tokenize = False
    fake.prefix_cache = True
    result = bench(fake, num_prompts=16, input_len=4, prefix_len=6, shared_prefixes=3)
    prompts = [b["prompt"].split() for b in fake.bodies]
    assert len({tuple(p[:6]) for p in prompts}) == 3  # three prefixes, each prompt starting so
    assert len({tuple(p[6:]) for p in prompts}) == 16  # then a turn of its own
    m = result.metrics()
    queries = sum(len(p) for p in prompts)
    assert m["prefix_cache_queries"] == queries and m["prefix_cache_hits"] == 16 * HITS_PER_REQUEST
    assert m["prefix_cache_hit_rate"] == pytest.approx(16 * HITS_PER_REQUEST / queries * 100)
    assert "Hit rate (%)" in format_report(result) and "Shared prefixes:" in format_report(result)
    assert "Hit rate (%)" in format_comparison({"a": result, "b": result})
    with pytest.raises(InvalidRequestError, match="shared_prefixes"):
        BenchConfig(shared_prefixes=0)


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


def schema_bodies(fake: FakeServer) -> list[dict]:
    return [
        b["response_format"]["json_schema"]["schema"] for b in fake.bodies if "response_format" in b
    ]


def test_json_schema_workloads(fake) -> None:
    result = bench(fake, num_prompts=16, warmup=1, structured_output="json")
    warm, *timed = fake.bodies
    assert all(b["response_format"]["type"] == "json_schema" for b in fake.bodies)
    schemas = schema_bodies(fake)
    assert len(schemas) == 17 and warm["response_format"]["json_schema"]["schema"] == schemas[1]
    distinct = {json.dumps(s, sort_keys=True) for s in schemas}
    assert len(distinct) == JSON_SCHEMAS  # taken in turn, repeats left to the server's cache
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["required"] == list(schema["properties"])
        records = list(schema["properties"].values())[-1]
        assert records["minItems"] * RECORD_TOKENS >= 6  # outlasts output_len
    assert "16 with a JSON schema (json)" in result.prompt_mode
    assert_sane(result)
    # the same seed gives the same schemas; json-unique a new one per request and per run
    fake.bodies.clear()
    bench(fake, num_prompts=16, warmup=1, structured_output="json")
    assert {json.dumps(s, sort_keys=True) for s in schema_bodies(fake)} == distinct
    unique: set[str] = set()
    for _ in range(2):
        fake.bodies.clear()
        bench(fake, num_prompts=8, warmup=1, structured_output="json-unique")
        unique |= {json.dumps(s, sort_keys=True) for s in schema_bodies(fake)}
    assert len(unique) == 18


def test_structured_output_ratio(fake) -> None:
    bench(fake, num_prompts=10, structured_output="json", structured_output_ratio=0.5)
    assert len(schema_bodies(fake)) == 5
    fake.bodies.clear()
    bench(fake, num_prompts=10, structured_output="json", structured_output_ratio=0.0)
    assert schema_bodies(fake) == []
    for bad in (
        {"structured_output": "yaml"},
        {"structured_output_ratio": 1.5},
        {"new_schemas": -1},
    ):
        with pytest.raises(InvalidRequestError):
            BenchConfig(**bad)


def test_new_schemas_arrive_mid_run_and_are_measured_apart(fake) -> None:
    result = bench(fake, num_prompts=6, max_concurrency=2, new_schemas=3, new_schemas_at=0.01)
    assert result.metrics()["completed"] == 6 and len(result.requests) == 6
    new = result.new_schema_requests
    assert len(new) == 3 and all(r.success and r.output_len == NEW_SCHEMA_TOKENS for r in new)
    assert all(r.start >= 0.01 for r in new)
    constrained = [b for b in fake.bodies if "response_format" in b]
    assert len(constrained) == 3 and all(b["max_tokens"] == NEW_SCHEMA_TOKENS for b in constrained)
    assert len({json.dumps(b["response_format"], sort_keys=True) for b in constrained}) == 3
    data = result.to_dict()
    assert len(data["new_schema_ttfts"]) == 3 and data["new_schema_errors"] == [""] * 3


def fixed_result(label: str, duration: float, itls: list[list[float]]) -> BenchResult:
    """A result of requests with the given inter-token gaps (seconds), 10 ms to the first token."""
    requests = [
        RequestResult(
            10, success=True, output_len=len(gaps) + 1, ttft=0.01, e2e=0.01 + sum(gaps), itl=gaps
        )
        for gaps in itls
    ]
    return BenchResult(BenchConfig(), "m", label, "fixed", duration, requests)


def test_structured_comparison_is_computed_from_both_runs() -> None:
    free = fixed_result("free", 2.0, [[0.01] * 9] * 4)  # 40 tokens in 2 s
    constrained = fixed_result("json", 2.5, [[0.0125] * 9] * 4)  # 40 tokens in 2.5 s
    summary = structured_comparison(free, constrained)
    assert summary["free_output_throughput"] == pytest.approx(20.0)
    assert summary["constrained_output_throughput"] == pytest.approx(16.0)
    assert summary["output_throughput_ratio"] == pytest.approx(0.8)
    assert summary["free_median_tpot_ms"] == pytest.approx(10.0)
    assert summary["median_tpot_ratio"] == pytest.approx(1.25)
    text = format_summary("Structured outputs", summary)
    assert "Constrained / free output throughput:    0.80x" in text


def test_compile_interference_is_computed_from_the_free_streams() -> None:
    # 100 gaps each: p99 is interpolated between the two largest
    without = fixed_result("free", 1.0, [[0.01] * 100])
    with_new = fixed_result("free + new schemas", 1.0, [[0.01] * 98 + [0.05, 0.09]])
    with_new.new_schema_requests = [
        RequestResult(10, success=True, output_len=16, ttft=t, e2e=1.0) for t in (0.1, 0.3)
    ] + [RequestResult(10, error="HTTP 400")]
    summary = compile_interference(without, with_new)
    assert summary["p99_itl_ms_without"] == pytest.approx(10.0)
    assert summary["p99_itl_ms_with"] == pytest.approx(50.0 + 0.01 * 40.0)
    assert summary["p99_itl_ratio"] == pytest.approx(5.04)
    assert summary["max_itl_ms_without"] == pytest.approx(10.0)
    assert summary["max_itl_ms_with"] == pytest.approx(90.0)
    assert (summary["new_schema_completed"], summary["new_schema_failed"]) == (2, 1)
    assert summary["new_schema_median_ttft_ms"] == pytest.approx(200.0)
    assert "P99 ITL with / without:                  5.04x" in format_summary("x", summary)


def test_cli_structured_output(fake, tmp_path, capsys) -> None:
    args = ["bench", "--base-url", fake.url, "--num-prompts", "4", "--output-len", "4"]
    out_json = tmp_path / "r.json"
    assert main([*args, "--structured-output", "json", "--result-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "Structured outputs" in out and "Constrained / free output throughput:" in out
    data = json.loads(out_json.read_text())
    assert list(data["runs"]) == ["free", "json"] and data["runs"]["json"]["completed"] == 4
    assert 0 < data["summary"]["output_throughput_ratio"]
    # the constrained run's prompts are drawn with the next seed: no prefix shared with the free
    free_prompts = {b["prompt"] for b in fake.bodies if "response_format" not in b}
    json_prompts = {b["prompt"] for b in fake.bodies if "response_format" in b}
    assert len(json_prompts) == 5 and not free_prompts & json_prompts
    fake.bodies.clear()
    code = main([*args, "--structured-output", "compile-interference", "--new-schemas", "2"])
    assert code == 0
    out = capsys.readouterr().out
    assert "Compile interference" in out and "P99 ITL with / without:" in out
    assert "New-schema requests completed:           2" in out
    assert len(schema_bodies(fake)) == 2
