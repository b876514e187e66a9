"""Unknown request fields: ignored with a warning by default, as vLLM does (clients send vendor
fields such as llama.cpp's `cache_prompt`), refused with OpenAI's 400 under
`--strict-request-fields`."""

from __future__ import annotations

import logging

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig
from tokenmill.server.protocol import _warned_fields

VENDOR_FIELDS = {"cache_prompt": True, "n_probs": 0, "metadata": {"trace": "x"}}


@pytest.fixture(scope="module", params=[False, True], ids=["default", "strict"])
def served(request, tiny_loaded):
    strict = request.param
    running = RunningServer(
        LLMEngine(tiny_loaded, num_kv_blocks=128, max_model_len=256),
        ServerConfig(MODEL_NAME, strict_request_fields=strict),
    )
    with httpx.Client(base_url=running.url, timeout=60) as client:
        yield strict, client
    running.stop()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_vendor_fields_are_ignored_unless_strict(served, route, caplog) -> None:
    strict, http = served
    _warned_fields.clear()
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0}
    if route == "/v1/completions":
        body["prompt"] = "Hello there"
    else:
        body["messages"] = [{"role": "user", "content": "Hello there"}]
    plain = http.post(route, json=body)
    assert plain.status_code == 200, plain.text
    with caplog.at_level(logging.WARNING, logger="tokenmill.server"):
        resp = http.post(route, json={**body, **VENDOR_FIELDS})
        again = http.post(route, json={**body, **VENDOR_FIELDS})
    if strict:
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["message"] == (
            "Unrecognized request argument supplied: cache_prompt, metadata, n_probs"
        )
        assert error["param"] == "cache_prompt, metadata, n_probs"
        assert error["type"] == "invalid_request_error"
        return
    assert resp.status_code == again.status_code == 200, resp.text
    text = "text" if route == "/v1/completions" else "message"
    assert resp.json()["choices"][0][text] == plain.json()["choices"][0][text]
    warnings = [r.getMessage() for r in caplog.records if "unknown request fields" in r.message]
    assert len(warnings) == 1  # once per field name, not per request
    assert "cache_prompt, metadata, n_probs" in warnings[0]


def test_unknown_fields_of_nested_objects(served) -> None:
    strict, http = served
    body = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True, "bogus": 1},
    }
    resp = http.post("/v1/completions", json=body)
    if strict:
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "stream_options.bogus"
    else:
        assert resp.status_code == 200 and "data: [DONE]" in resp.text
        assert '"usage"' in resp.text  # the known field still counts


def test_a_misspelt_field_is_still_a_clear_400_of_its_own_kind(served) -> None:
    """Known fields keep their validation whatever the setting."""
    _, http = served
    resp = http.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": "many"}
    )
    assert resp.status_code == 400 and "max_tokens" in resp.json()["error"]["message"]
