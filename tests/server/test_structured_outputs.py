"""Structured outputs through the OpenAI API: `response_format`, vLLM's `structured_outputs` and
its older `guided_*` names, with the official client, streamed and not, on SmolLM2."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["en", "fr", "de"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    running = RunningServer(
        LLMEngine(smollm2_gguf, compile=False, num_kv_blocks=512),
        ServerConfig("smol", api_key=API_KEY, max_body_bytes=1 << 20),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_metrics_count_constrained_requests_and_compiles(client, server) -> None:
    def values() -> dict[str, float]:
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    before = values()
    for _ in range(2):  # the second finds the schema compiled
        client.chat.completions.create(
            model="smol", messages=MESSAGES, max_tokens=20, response_format=_schema_format(schema)
        )
    after = values()

    def moved(name: str) -> float:
        return after[f"tokenmill:{name}_total"] - before[f"tokenmill:{name}_total"]

    assert moved("structured_output_requests") == 2
    assert moved("grammar_compiles") == 1
    assert moved("grammar_compile_seconds") > 0


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_format_streamed_or_not(client, temperature: float) -> None:
    kwargs = dict(
        model="smol",
        messages=MESSAGES,
        max_tokens=120,
        temperature=temperature,
        seed=3,
        response_format=_schema_format(PERSON),
    )
    whole = client.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices
    ]
    assert "".join(pieces) == text  # seeded or greedy: the same tokens either way


def test_json_object_and_completions_endpoint(client) -> None:
    chat = client.chat.completions.create(
        model="smol",
        messages=MESSAGES,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert chat.choices[0].message.content.startswith("{")
    done = client.completions.create(
        model="smol",
        prompt="A person in JSON:",
        max_tokens=120,
        temperature=0,
        extra_body={"structured_outputs": {"json": PERSON}},
    )
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)


def test_regex_choice_grammar_and_guided_aliases(client) -> None:
    def ask(**extra) -> str:
        out = client.chat.completions.create(
            model="smol", messages=MESSAGES, max_tokens=40, temperature=0, extra_body=extra
        )
        return out.choices[0].message.content

    assert re.fullmatch(
        r"[a-z]{1,8}@[a-z]{1,8}\.com",
        ask(structured_outputs={"regex": r"[a-z]{1,8}@[a-z]{1,8}\.com"}),
    )
    assert ask(guided_choice=["alpha", "beta"]) in ("alpha", "beta")
    assert re.fullmatch(r"[0-9]{3}", ask(guided_regex="[0-9]{3}"))
    assert re.fullmatch(r"(yes|no)!", ask(guided_grammar='root ::= ("yes" | "no") "!"'))


ADD_TAG = {
    "structures": [
        {
            "begin": "<add>",
            "schema": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
            "end": "</add>",
        }
    ],
    "triggers": ["<add>"],
}


def test_structural_tag_as_response_format_or_structured_outputs(client) -> None:
    # free, SmolLM2 goes on counting past the schema's maximum: <add>{"a": 700}</add>. Four calls
    # make "<" its clear first pick (about 1 nat ahead): after two, "```" and "<" tie within 0.02,
    # and which one wins depends on the CPU's rounding.
    prompt = "Tool calls:\n" + "".join(f'<add>{{"a": {a}}}</add>\n' for a in (300, 400, 500, 600))
    chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=16,
        temperature=0,
        response_format={"type": "structural_tag", **ADD_TAG},
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    text = (
        client.completions.create(
            model="smol",
            prompt=prompt,
            max_tokens=30,
            temperature=0,
            extra_body={"structured_outputs": {"structural_tag": json.dumps(ADD_TAG)}},
        )
        .choices[0]
        .text
    )
    calls = [c.partition("</add>") for c in text.split("<add>")[1:]]
    assert [end for _, end, _ in calls].count("</add>") >= 1
    for body, end, _ in calls:
        if end:  # each whole call's JSON follows the schema
            jsonschema.validate(json.loads(body), ADD_TAG["structures"][0]["schema"])


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ({"response_format": _schema_format({"type": "objectx"})}, "cannot be compiled"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "not several"),
        (
            {"structured_outputs": {"structural_tag": {**ADD_TAG, "triggers": ["<sub>"]}}},
            "no trigger",
        ),
    ],
)
def test_bad_constraints_are_400_and_the_server_keeps_serving(client, extra, fragment) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
        client.chat.completions.create(
            model="smol", messages=MESSAGES, max_tokens=8, extra_body=extra
        )
    ok = client.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].finish_reason == "length"
