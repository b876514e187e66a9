"""Streamed JSON (server-sent events, Ollama's NDJSON lines) stays one line for every line reader:
JSON leaves U+0085, U+2028 and U+2029 as they are, and str.splitlines and httpx's `iter_lines`
(which the `ollama` client and many others read streams with) break lines at them."""

from __future__ import annotations

import json

import httpx

from tokenmill.server.formatting import sse, stream_json

TEXT = "one\u2028two\u2029three\x85four\nfive\r\u00e9\u4e2d"


def _lines_through_httpx(body: str) -> list[str]:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body.encode()))
    with httpx.Client(transport=transport) as client, client.stream("GET", "http://x/") as r:
        return list(r.iter_lines())


def test_an_event_reads_back_whole_through_httpx() -> None:
    payload = {"choices": [{"index": 0, "text": TEXT}]}
    lines = [line for line in _lines_through_httpx(sse(payload)) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :]) == payload


def test_an_ndjson_line_reads_back_whole_through_httpx() -> None:
    payloads = [{"response": TEXT, "done": False}, {"response": "", "done": True}]
    body = "".join(stream_json(p) + "\n" for p in payloads)
    assert [json.loads(line) for line in _lines_through_httpx(body)] == payloads


def test_json_text_is_escaped_the_same_way() -> None:
    text = json.dumps({"text": TEXT}, ensure_ascii=False)
    assert stream_json(text) == stream_json({"text": TEXT})
    assert stream_json(text).splitlines() == [stream_json(text)]
    assert "\u00e9\u4e2d" in stream_json(text)  # other characters stay as they are
