"""The server driven by the official `openai` client: results equal the offline engine's."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, MODEL_NAME
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sample import SamplingParams

PROMPT = "Once upon a time there was"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a capital."},
]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_loaded):
    engine = LLMEngine(tiny_loaded, num_kv_blocks=256, max_model_len=512)

    def run(prompt, params: SamplingParams):
        rid = engine.add_request(None, prompt, params)
        final = None
        while engine.has_unfinished_requests():
            final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
        return final

    return run


def _chat_ids(server) -> list[int]:
    tok = server.async_engine.tokenizer
    return tok.encode(tok.apply_chat_template(MESSAGES), add_bos=False)


def test_completion_equals_offline(client, offline) -> None:
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    ref = offline(PROMPT, SamplingParams(temperature=0, max_tokens=12))
    assert resp.choices[0].text == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_streamed_completion_equals_non_streamed(client) -> None:
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )


def test_chat_equals_offline_streaming_or_not(client, offline, server) -> None:
    ref = offline(_chat_ids(server), SamplingParams(temperature=0, max_tokens=10))
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0
    )
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            max_completion_tokens=10,
            temperature=0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_n_and_seed(client, offline) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=42, n=2)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in first.choices) == [0, 1]
    ref = offline(PROMPT, SamplingParams(temperature=1.0, max_tokens=8, seed=42, n=2))
    assert [c.text for c in first.choices] == [c.text for c in ref.outputs]
    streamed = list(client.completions.create(**kwargs, stream=True))
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in first.choices]


def test_stop_and_stop_reason(client) -> None:
    free = (
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == free[: free.find(stop)]


def test_completion_logprobs(client) -> None:
    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for _, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and logprob == pytest.approx(max(top.values()))  # greedy: the best one


def test_chat_logprobs(client) -> None:
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(
        len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        for c in content
    )


def test_echo_and_token_id_prompts(client, server) -> None:
    ids = server.async_engine.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert by_text.choices[0].text == PROMPT + by_ids.choices[0].text
    batch = client.completions.create(
        model=MODEL_NAME, prompt=[PROMPT, "Paris is"], max_tokens=4, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1]


def test_cached_tokens_reported(client) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens


def test_models_tokenize_detokenize_health_version(http, server) -> None:
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    tok = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}).json()
    assert tok["tokens"] == server.async_engine.tokenizer.encode(PROMPT) and tok["count"] == len(
        tok["tokens"]
    )
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": PROMPT}
    chat_tok = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat_tok["tokens"] == _chat_ids(server)
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]


def test_metrics_parse_and_move(client, http) -> None:
    def values() -> dict[str, float]:
        out = {}
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0) + sample.value
        return out

    before = values()
    client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = values()
    assert (
        after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"]
        == 4
    )
    assert after["tokenmill:prompt_tokens_total"] > before["tokenmill:prompt_tokens_total"]
    assert (
        after["tokenmill:e2e_request_latency_seconds_count"]
        == before["tokenmill:e2e_request_latency_seconds_count"] + 1
    )
    assert (
        after["tokenmill:time_to_first_token_seconds_count"]
        > before["tokenmill:time_to_first_token_seconds_count"]
    )
    assert (
        after["tokenmill:inter_token_latency_seconds_count"]
        - before["tokenmill:inter_token_latency_seconds_count"]
        == 3
    )
    for name in (
        "tokenmill:num_requests_running",
        "tokenmill:num_requests_waiting",
        "tokenmill:kv_cache_usage_perc",
        "tokenmill:num_preemptions_total",
        "tokenmill:prefix_cache_queries_total",
        "tokenmill:prefix_cache_hits_total",
    ):
        assert name in after


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "prompt": PROMPT, "temperature": -1}, 400, "temperature"),
        ({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL_NAME, "prompt": "word " * 600}, 400, "context"),
        ({"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 100000}, 400, "max_tokens"),
        ({"model": "no-such-model", "prompt": PROMPT}, 404, "does not exist"),
        ({"model": MODEL_NAME, "prompt": PROMPT, "suffix": "x"}, 400, "suffix"),
        ({"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {"99999": 5}}, 400, "logit_bias"),
        ({"model": MODEL_NAME, "prompt": ""}, 400, "empty"),
        ({"model": MODEL_NAME, "prompt": PROMPT, "n": 17}, 400, "n must be between 1 and 16"),
        (
            {"model": MODEL_NAME, "prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(301)}},
            400,
            "at most 300 entries",
        ),
        ({"model": MODEL_NAME, "prompt": PROMPT, "seed": 2**64}, 400, "seed"),
        (
            {"model": MODEL_NAME, "prompt": PROMPT, "repetition_penalty": 1e-300},
            400,
            "repetition_penalty",
        ),
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "body"),  # not UTF-8
    ],
)
def test_errors_have_openai_shape(http, body, status, fragment) -> None:
    if isinstance(body, bytes):
        resp = http.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    else:
        resp = http.post("/v1/completions", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"]
    assert http.get("/health").status_code == 200  # still serving


def test_unknown_route_and_method_have_openai_shape(http) -> None:
    for resp, status in ((http.get("/v1/nothing-here"), 404), (http.get("/v1/completions"), 405)):
        assert resp.status_code == status and set(resp.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }


def test_request_timeout_ends_long_requests(tiny_loaded) -> None:
    from tests.server.conftest import RunningServer
    from tokenmill.server.app import ServerConfig

    running = RunningServer(
        LLMEngine(tiny_loaded, num_kv_blocks=64, max_model_len=512),
        ServerConfig(MODEL_NAME, request_timeout=0.2),
    )
    try:
        with httpx.Client(base_url=running.url, timeout=30) as anon:
            body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
            resp = anon.post("/v1/completions", json=body)
            assert resp.status_code == 504 and "timed out" in resp.json()["error"]["message"]
            with anon.stream("POST", "/v1/completions", json=body | {"stream": True}) as stream:
                lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
            assert "timed out" in lines[-2] and lines[-1] == "data: [DONE]"
            assert anon.post("/v1/completions", json=body | {"max_tokens": 2}).status_code == 200
    finally:
        running.stop()


def test_auth_and_body_limit(server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for route in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
            resp = anon.request("GET" if route == "/v1/models" else "POST", route, json={})
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        wrong = anon.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert anon.get("/health").status_code == 200
        big = anon.post(
            "/v1/completions",
            content=b"x" * (2 << 20),
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        assert big.status_code == 413


def test_openai_client_raises_typed_errors(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=5)
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_stream_error_is_reported_in_band(http) -> None:
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "stream": True,
            "max_tokens": 3,
        },
    ) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all("choices" in json.loads(line[6:]) for line in lines[:-1])
