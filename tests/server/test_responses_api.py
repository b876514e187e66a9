"""OpenAI's Responses API (/v1/responses) through the official `openai` client: input items and
instructions, streaming events, `previous_response_id` continuing a stored conversation, GET of
a stored response, function calls and their outputs, errors. A response's text is the chat
completion's for the same conversation."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server import weather_tool
from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

INSTRUCTIONS = "Answer in one short sentence."
ASK = "Name a colour of the sky."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _chat(client: openai.OpenAI, messages: list[dict], max_tokens: int = 10) -> str:
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return resp.choices[0].message.content


def test_a_response_is_the_chat_completion_of_its_input(client) -> None:
    expected = _chat(
        client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}]
    )
    response = client.responses.create(
        model=MODEL_NAME,
        instructions=INSTRUCTIONS,
        input=[{"role": "user", "content": [{"type": "input_text", "text": ASK}]}],
        max_output_tokens=10,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete") and response.model == MODEL_NAME
    assert response.output_text == expected
    assert response.usage.output_tokens <= 10 and response.usage.input_tokens > 0
    assert client.responses.retrieve(response.id).output_text == expected


def test_a_stream_gives_the_same_response(client) -> None:
    common = dict(model=MODEL_NAME, input=ASK, max_output_tokens=10, temperature=0)
    whole = client.responses.create(**common)
    events = list(client.responses.create(stream=True, **common))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


def test_previous_response_id_continues_the_conversation(client) -> None:
    first = client.responses.create(
        model=MODEL_NAME, input=ASK, instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0
    )
    follow = "And at night?"
    second = client.responses.create(
        model=MODEL_NAME,
        input=follow,
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    # the earlier turn's input and output come first; its instructions do not carry over
    history = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": follow},
    ]
    assert second.output_text == _chat(client, history, 8)
    assert second.previous_response_id == first.id


def test_errors(client) -> None:
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL_NAME, input=ASK, previous_response_id="resp_nope")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=ASK)
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.responses.create(
            model=MODEL_NAME,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
        )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    with pytest.raises(openai.BadRequestError, match="tool_choice must be"):
        client.responses.create(
            model=MODEL_NAME, input=ASK, tool_choice={"type": "function"}, tools=[WEATHER]
        )


WEATHER = weather_tool.flat_tool(weather_tool.CITY_PARAMETERS)


@pytest.fixture(scope="module")
def qwen(qwen_coder_05b_gguf):
    running = RunningServer(
        LLMEngine(qwen_coder_05b_gguf, compile=False, num_kv_blocks=256, max_model_len=1024),
        ServerConfig("qwen"),
    )
    yield openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
    running.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_function_calls_and_their_outputs(qwen, stream: bool) -> None:
    common = dict(model="qwen", tools=[WEATHER], max_output_tokens=48, temperature=0)
    ask = weather_tool.ASK_WEATHER
    forced = {"type": "function", "name": "get_weather"}
    if stream:
        with qwen.responses.stream(input=ask, tool_choice=forced, **common) as s:
            response = s.get_final_response()
    else:
        response = qwen.responses.create(input=ask, tool_choice=forced, **common)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    answer = qwen.responses.create(
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        previous_response_id=response.id,
        tool_choice="none",
        **common,
    )
    assert answer.output_text.strip()
