"""Anthropic's Messages API (/v1/messages) through the official `anthropic` SDK: text, system
prompts, stop sequences, streaming events, tool use and tool results, errors in Anthropic's
shape. A message's output is the chat completion's for the same conversation."""

from __future__ import annotations

import anthropic
import jsonschema
import openai
import pytest

from tests.server import weather_tool
from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

SYSTEM = "Answer in one short sentence."
ASK = "Name a colour of the sky."
# the SDK no longer takes sampling parameters as arguments; the API still reads them
GREEDY = {"temperature": 0}
WEATHER = weather_tool.anthropic_tool()


@pytest.fixture(scope="module")
def clients(server):
    return (
        anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0),
        openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0),
    )


def _chat_text(client: openai.OpenAI, max_tokens: int, **extra) -> tuple[str, int]:
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
        max_tokens=max_tokens,
        temperature=0,
        **extra,
    )
    return resp.choices[0].message.content, resp.usage.prompt_tokens


def test_a_message_is_the_chat_completion_of_its_conversation(clients) -> None:
    messages, chat = clients
    expected, prompt_tokens = _chat_text(chat, 12)
    message = messages.messages.create(
        model=MODEL_NAME,
        max_tokens=12,
        extra_body=GREEDY,
        system=SYSTEM,
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}],
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL_NAME
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.input_tokens == prompt_tokens
    assert 0 < message.usage.output_tokens <= 12


def test_a_stream_gives_the_same_message(clients) -> None:
    messages, _ = clients
    common = dict(model=MODEL_NAME, max_tokens=12, extra_body=GREEDY, system=SYSTEM)
    whole = messages.messages.create(messages=[{"role": "user", "content": ASK}], **common)
    with messages.messages.stream(messages=[{"role": "user", "content": ASK}], **common) as s:
        events = [event.type for event in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events and "message_delta" in events
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_is_reported(clients) -> None:
    messages, chat = clients
    text, _ = _chat_text(chat, 12)
    stop = text.strip()[3:6]  # inside the greedy answer
    message = messages.messages.create(
        model=MODEL_NAME,
        max_tokens=12,
        extra_body=GREEDY,
        system=SYSTEM,
        stop_sequences=[stop],
        messages=[{"role": "user", "content": ASK}],
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"model": "no-such-model", "max_tokens": 4}, 404, "not_found_error"),
        ({"model": MODEL_NAME}, 400, "invalid_request_error"),  # no max_tokens
        (
            {
                "model": MODEL_NAME,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "invalid_request_error",
        ),
    ],
)
def test_errors_have_anthropics_shape(server, body, status, kind) -> None:
    import httpx

    body = {"messages": [{"role": "user", "content": ASK}], **body}
    resp = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY})
    assert resp.status_code == status, resp.text
    error = resp.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert error["error"]["message"]


def test_a_wrong_key_is_an_authentication_error(server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": ASK}]
        )


@pytest.fixture(scope="module")
def qwen_client(qwen_coder_05b_gguf):
    running = RunningServer(
        LLMEngine(qwen_coder_05b_gguf, compile=False, num_kv_blocks=256, max_model_len=1024),
        ServerConfig("qwen", api_key=API_KEY),
    )
    yield anthropic.Anthropic(base_url=running.url, api_key=API_KEY, max_retries=0)
    running.stop()


def test_tool_use_and_tool_results(qwen_client) -> None:
    """A forced tool call comes back as a tool_use block whose input follows the tool's schema,
    streamed or not; its result sent back gets a text answer."""
    ask = [{"role": "user", "content": weather_tool.ASK_WEATHER}]
    common = dict(model="qwen", max_tokens=64, extra_body=GREEDY, tools=[WEATHER])
    forced = {"type": "tool", "name": "get_weather"}
    message = qwen_client.messages.create(messages=ask, tool_choice=forced, **common)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with qwen_client.messages.stream(messages=ask, tool_choice=forced, **common) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.input == use.input and streamed.stop_reason == "tool_use"

    history = ask + [
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}],
        },
    ]
    answer = qwen_client.messages.create(messages=history, tool_choice={"type": "none"}, **common)
    assert answer.content[0].type == "text" and answer.content[0].text.strip()
