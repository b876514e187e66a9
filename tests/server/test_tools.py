"""Tool calling through the OpenAI API on Qwen2.5-Coder-0.5B-Instruct (Hermes-style
`<tool_call>` format, picked from its chat template): `tool_choice` none, auto, required and a
named function, streamed and not, a multi-turn conversation through a tool's result, and bad
tool requests refused with 400 while the server keeps serving."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.server import weather_tool
from tests.server.conftest import API_KEY, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

WEATHER = weather_tool.chat_tool()
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current local time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
BAD_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": "{not json"},
}


@pytest.fixture(scope="module")
def server(qwen_coder_05b_gguf):
    running = RunningServer(
        LLMEngine(qwen_coder_05b_gguf, compile=False, num_kv_blocks=512),
        ServerConfig("qwen", api_key=API_KEY, max_body_bytes=1 << 20),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _check_calls(calls, names: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(client, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """(content, calls by index as {"id", "name", "arguments"}, finish_reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="qwen", stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
                if piece.id is not None:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"], call["name"] = piece.id, piece.function.name
                else:
                    assert call["id"] is not None, "a call's id and name come first"
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
    ids=["required", "named"],
)
def test_forced_calls_are_valid_streamed_or_not(client, tool_choice) -> None:
    names = {"get_time"} if isinstance(tool_choice, dict) else set(SCHEMAS)
    kwargs = dict(messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=96)
    whole = client.chat.completions.create(model="qwen", temperature=0, **kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, names)
    content, calls, finish = _streamed(client, temperature=0, **kwargs)
    assert finish == "tool_calls"
    assert content == (choice.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]

    def sampled(seed: int):
        return client.chat.completions.create(
            model="qwen", temperature=1, seed=seed, parallel_tool_calls=False, **kwargs
        ).choices[0]

    with ThreadPoolExecutor(8) as pool:
        for choice in pool.map(sampled, range(8)):
            assert choice.finish_reason == "tool_calls"
            assert len(choice.message.tool_calls) == 1
            _check_calls(choice.message.tool_calls, names)


def test_auto_lets_the_model_call_and_streams_the_same_call(client) -> None:
    kwargs = dict(messages=ASK, tools=TOOLS, max_tokens=96, temperature=0)
    whole = client.chat.completions.create(model="qwen", **kwargs).choices[0]
    # greedy, Qwen2.5-Coder-0.5B calls get_weather for Paris
    assert whole.finish_reason == "tool_calls"
    _check_calls(whole.message.tool_calls, {"get_weather"})
    assert json.loads(whole.message.tool_calls[0].function.arguments)["city"] == "Paris"
    content, calls, finish = _streamed(client, **kwargs)
    assert finish == "tool_calls" and content == (whole.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]


def test_none_gives_text(client) -> None:
    choice = client.chat.completions.create(
        model="qwen", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0
    ).choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("temperature", [31, 17])
def test_a_tool_result_leads_to_an_answer(server, client, temperature: int) -> None:
    first = client.chat.completions.create(
        model="qwen",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=96,
        temperature=0,
    ).choices[0]
    (call,) = first.message.tool_calls
    messages = [
        *ASK,
        first.message.model_dump(exclude_none=True),  # arguments as JSON text, as OpenAI sends
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"celsius": temperature})},
    ]
    rendered = httpx.post(
        f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
        json={"messages": messages, "tools": TOOLS},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()["tokens"]
    prompt = server.async_engine.tokenizer.decode(rendered)
    # the template writes the call's arguments as an object, and the result as the tool's response
    assert f'"arguments": {call.function.arguments}' in prompt
    assert f'<tool_response>\n{{"celsius": {temperature}}}\n</tool_response>' in prompt
    # Left free, the 0.5B model calls the tool again; the answer's shape is held, its number
    # comes from the tool's result
    answer = client.chat.completions.create(
        model="qwen",
        messages=messages,
        tools=TOOLS,
        max_tokens=32,
        temperature=0,
        extra_body={"guided_regex": r"It is [0-9]{1,3} degrees in Paris\."},
    ).choices[0]
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert answer.message.content == f"It is {temperature} degrees in Paris."


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice needs tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools.0.function.name",
        ),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "objectx"}},
                    }
                ],
            },
            "cannot be compiled",
        ),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "leaves no"),
        (
            {"messages": [*ASK, {"role": "assistant", "tool_calls": [BAD_CALL]}]},
            "arguments must be JSON",
        ),
    ],
)
def test_bad_tool_requests_are_400_and_the_server_keeps_serving(client, extra, fragment) -> None:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 8, **extra}
    with pytest.raises(openai.BadRequestError, match=fragment):
        client.chat.completions.create(model="qwen", **body)
    ok = client.chat.completions.create(model="qwen", messages=ASK, max_tokens=4)
    assert ok.choices[0].finish_reason == "length"
