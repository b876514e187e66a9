"""Ollama's API (/api/*) through the official `ollama` client: listing, show, ps, chat and
generate, streamed as NDJSON and whole, options and format, errors in Ollama's shape. A chat's
output is the chat completion's for the same conversation, a raw generate's the completion's."""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest

from tests.server import weather_tool
from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer
from tokenmill import __version__
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

ASK = [{"role": "user", "content": "Name a colour of the sky."}]
GREEDY = {"temperature": 0, "num_predict": 10}


@pytest.fixture(scope="module")
def clients(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return (
        ollama.Client(host=server.url, headers=headers),
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0),
    )


def test_the_served_model_is_listed_shown_and_running(clients, server) -> None:
    client, _ = clients
    (listed,) = client.list().models
    assert listed.model == MODEL_NAME and listed.size > 0 and listed.details.family
    (running,) = client.ps().models
    assert running.model == MODEL_NAME and running.context_length == 512
    shown = client.show(MODEL_NAME)
    assert shown.template and "completion" in shown.capabilities
    version = httpx.get(f"{server.url}/api/version").json()
    assert version == {"version": __version__}


def test_chat_is_the_chat_completion_of_its_conversation(clients) -> None:
    client, chat = clients
    expected = chat.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=10, temperature=0
    )
    whole = client.chat(MODEL_NAME, messages=ASK, options=GREEDY, stream=False)
    assert whole.message.role == "assistant"
    assert whole.message.content == expected.choices[0].message.content
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.prompt_eval_count == expected.usage.prompt_tokens
    assert whole.eval_count == expected.usage.completion_tokens
    assert whole.total_duration >= whole.eval_duration > 0

    parts = list(client.chat(MODEL_NAME, messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    assert parts[-1].done_reason == whole.done_reason


def test_generate_runs_the_template_unless_raw(clients) -> None:
    client, chat = clients
    prompt = ASK[0]["content"]
    templated = client.generate(MODEL_NAME, prompt, options=GREEDY, stream=False)
    expected = chat.chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=10, temperature=0
    )
    assert templated.response == expected.choices[0].message.content
    parts = client.generate(MODEL_NAME, prompt, options=GREEDY, stream=True)
    streamed = "".join(p.response for p in parts)
    assert streamed == templated.response

    raw = client.generate(MODEL_NAME, prompt, raw=True, options=GREEDY, stream=False)
    completion = chat.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0
    )
    assert raw.response == completion.choices[0].text


def test_options_and_format(clients) -> None:
    client, _ = clients
    stop = client.generate(MODEL_NAME, "Hello", options={**GREEDY, "num_predict": 3}, stream=False)
    assert stop.eval_count == 3 and stop.done_reason == "length"
    schema = {"type": "string", "enum": ["red", "blue"]}
    formatted = client.chat(
        MODEL_NAME, messages=ASK, format=schema, options={"num_predict": 8}, stream=False
    )
    assert json.loads(formatted.message.content) in ("red", "blue")
    seeded = [
        client.generate(MODEL_NAME, "Hello", options={"seed": 7, "num_predict": 8}, stream=False)
        for _ in range(2)
    ]
    assert seeded[0].response == seeded[1].response


def test_an_empty_request_loads_the_model(clients) -> None:
    client, _ = clients
    loaded = client.generate(MODEL_NAME, "", stream=False)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_errors_have_ollamas_shape(clients, server) -> None:
    client, _ = clients
    with pytest.raises(ollama.ResponseError) as info:
        client.chat("no-such-model", messages=ASK, stream=False)
    assert info.value.status_code == 404 and "not found" in info.value.error
    resp = httpx.post(f"{server.url}/api/chat", json={"model": MODEL_NAME}, headers={})
    assert resp.status_code == 401 and set(resp.json()) == {"error"}
    resp = httpx.post(
        f"{server.url}/api/generate",
        json={"model": MODEL_NAME, "prompt": "x", "options": {"temperature": -1}},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert resp.status_code == 400 and "temperature" in resp.json()["error"]


WEATHER = weather_tool.chat_tool(weather_tool.CITY_PARAMETERS)


@pytest.fixture(scope="module")
def qwen(qwen_coder_05b_gguf):
    running = RunningServer(
        LLMEngine(qwen_coder_05b_gguf, compile=False, num_kv_blocks=256, max_model_len=1024),
        ServerConfig("qwen"),
    )
    yield ollama.Client(host=running.url)
    running.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_back_with_argument_objects(qwen, stream: bool) -> None:
    ask = [{"role": "user", "content": weather_tool.ASK_WEATHER}]
    options = {"temperature": 0, "num_predict": 48}
    if stream:
        parts = list(qwen.chat("qwen", messages=ask, tools=[WEATHER], options=options, stream=True))
        calls = [c for p in parts for c in p.message.tool_calls or []]
    else:
        calls = qwen.chat("qwen", messages=ask, tools=[WEATHER], options=options).message.tool_calls
    (call,) = calls
    assert (
        call.function.name == "get_weather" and "paris" in call.function.arguments["city"].lower()
    )
    history = ask + [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "18 C, sunny", "tool_name": "get_weather"},
    ]
    answer = qwen.chat("qwen", messages=history, options=options)
    assert answer.message.content.strip() and not answer.message.tool_calls


def test_embed_gives_the_openai_routes_vectors(minilm_dir) -> None:
    from tokenmill.engine.embedding import EmbeddingEngine

    running = RunningServer(EmbeddingEngine(minilm_dir), ServerConfig("minilm"))
    try:
        client = ollama.Client(host=running.url)
        texts = ["The sky is blue.", "Tokens stream to the client one by one, " * 3]
        result = client.embed("minilm", input=texts)
        expected = openai.OpenAI(base_url=f"{running.url}/v1", api_key="x").embeddings.create(
            model="minilm", input=texts
        )
        assert result.embeddings == [d.embedding for d in expected.data]
        assert result.prompt_eval_count == expected.usage.prompt_tokens
        assert client.embed("minilm", input=texts[0]).embeddings == result.embeddings[:1]
        assert client.show("minilm").capabilities == ["embedding"]
        with pytest.raises(ollama.ResponseError) as info:
            client.chat("minilm", messages=ASK, stream=False)
        assert info.value.status_code == 400 and "embeddings only" in info.value.error
    finally:
        running.stop()
