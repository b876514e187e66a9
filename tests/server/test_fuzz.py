"""Fuzzing the HTTP API: schemathesis over the server's own OpenAPI schema, then hypothesis over
the sampling parameters of the two generation routes.

Schemathesis cases come from `/openapi.json` (FastAPI's schema of the request models), in
positive mode (bodies the schema allows) and negative mode (bodies it forbids), and go to a live
server with the API key. Whatever comes in, the server must answer without a 5xx, every error
must have OpenAI's error shape, every 200 must be strict JSON, and the server must still serve
normally afterwards with nothing left running. Everything is derandomized and bounded: a
64-token context keeps even `n=16` without max_tokens short, and larger max_tokens are refused
with 400 at once.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
import requests  # schemathesis's transport
import schemathesis  # a test extra: missing, the module fails rather than skips
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup

from tests.server.conftest import API_KEY, MODEL_NAME, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_EXAMPLES = 20  # per operation and mode
ERROR_KEYS = {"message", "type", "param", "code"}


def _fuzz_settings(max_examples: int) -> settings:
    """Derandomized, bounded hypothesis runs: the same cases every time, no example database."""
    return settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )


EXPECTED_ROUTES = {
    ("GET", "/health"),
    ("GET", "/version"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("POST", "/api/show"),
    ("GET", "/api/tags"),
    ("GET", "/api/ps"),
    ("GET", "/api/version"),
    ("POST", "/v1/embeddings"),
}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def fuzz_server(tiny_loaded, one_torch_thread):
    running = RunningServer(
        LLMEngine(tiny_loaded, num_kv_blocks=96, max_model_len=64, max_num_seqs=32),
        ServerConfig(MODEL_NAME, api_key=API_KEY, max_body_bytes=1 << 20),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", timeout=30)


@pytest.fixture(scope="module")
def operations(schema):
    ops = []
    for result in schema.get_all_operations():
        ops.append(result.ok())  # an operation schemathesis cannot read is a failure too
    return ops


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity, which no JSON client can read."""
    return json.loads(
        text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"non-finite {c}"))
    )


def _header(response, name: str) -> str:
    for key, values in response.headers.items():
        if key.lower() == name:
            return values[0] if isinstance(values, list) else values
    return ""


def _problems(case, response) -> list[str]:
    """What is wrong with this response beyond schemathesis's own checks (empty when fine)."""
    status = response.status_code
    content_type = _header(response, "content-type")
    if status >= 400:
        try:
            body = response.json()
        except Exception:  # noqa: BLE001
            return [f"{status} without a JSON error body: {response.text[:300]!r}"]
        if not _is_error_body(case.path, body):
            return [f"{status} with a malformed error body: {response.text[:300]!r}"]
        if status >= 500 or status in (401,):
            return [f"unexpected {status}: {response.text[:300]!r}"]
        return []
    if status != 200:
        return [f"unexpected status {status}"]
    if case.path == "/metrics":
        return (
            [] if content_type.startswith("text/plain") else [f"/metrics served as {content_type}"]
        )
    if content_type.startswith("text/event-stream"):
        problems = []
        for line in response.text.splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                chunk = _strict_json(line[6:])
            except ValueError as exc:
                problems.append(f"stream chunk is not strict JSON ({exc}): {line[:300]!r}")
                continue
            if "error" in chunk or chunk.get("type") == "error":
                problems.append(f"in-band stream error: {line[:300]!r}")
        return problems
    if content_type.startswith("application/x-ndjson"):  # Ollama's streams
        lines = response.text.splitlines()
    else:
        lines = [response.text]
    for line in lines:
        try:
            body = _strict_json(line)
        except ValueError as exc:
            return [f"200 body is not strict JSON ({exc}): {line[:300]!r}"]
        if isinstance(body, dict) and "error" in body and case.path.startswith("/api/"):
            return [f"in-band stream error: {line[:300]!r}"]
    return []


def _is_error_body(path: str, body) -> bool:
    """Whether body is an error in the shape of the API that serves path."""
    if not isinstance(body, dict):
        return False
    if path.startswith("/v1/messages"):  # Anthropic's
        error = body.get("error")
        return (
            body.get("type") == "error"
            and isinstance(error, dict)
            and set(error) == {"type", "message"}
            and isinstance(error["message"], str)
        )
    if path.startswith("/api/"):  # Ollama's
        return set(body) == {"error"} and isinstance(body["error"], str)
    error = body.get("error")
    return (
        isinstance(error, dict) and set(error) == ERROR_KEYS and isinstance(error["message"], str)
    )


def _fuzz(operations, url: str, mode) -> list[str]:
    failures: list[str] = []
    calls = 0
    statuses: Counter = Counter()
    with requests.Session() as session:
        for op in operations:
            strategy = st.tuples(
                op.as_strategy(generation_mode=mode), st.sampled_from(["keep", "ours", "none"])
            )

            @_fuzz_settings(MAX_EXAMPLES)
            @given(strategy)
            def run(drawn) -> None:
                nonlocal calls
                case, model = drawn
                # Most random model names are refused with 404 before any work; steer a share of the
                # valid bodies to the served model so that generation itself gets fuzzed.
                if isinstance(case.body, dict) and model != "keep":
                    if model == "ours":
                        case.body["model"] = MODEL_NAME
                    else:
                        case.body.pop("model", None)
                label = f"{case.method} {case.path}"
                calls += 1
                try:
                    response = case.call(base_url=url, session=session, headers=AUTH, timeout=60)
                except requests.RequestException as exc:
                    failures.append(
                        f"{label}: no answer ({exc!r})\n    {case.as_curl_command(headers=AUTH)}"
                    )
                    return
                statuses[label, response.status_code] += 1
                try:
                    case.validate_response(response, checks=[not_a_server_error], headers=AUTH)
                except FailureGroup as exc:
                    failures.append(f"{label}: {str(exc).strip()[:1500]}")
                    return
                for problem in _problems(case, response):
                    failures.append(f"{label}: {problem}\n    {case.as_curl_command(headers=AUTH)}")

            try:
                run()
            except Unsatisfiable:
                # negative mode: a route without inputs cannot be sent invalid ones
                if op.method.upper() != "GET":
                    raise
    print(
        f"{mode.value}: {calls} cases;",
        ", ".join(f"{k[0]} {k[1]}: {v}" for k, v in sorted(statuses.items())),
    )
    assert calls >= len(operations) * 5, f"only {calls} cases were generated"
    return failures


def _quiesce(url: str) -> None:
    """One more round trip before asserting: by then the server has finished logging whatever the
    last request raised. (On CPython 3.11 a traceback formatted in a server thread while pytest
    formats a failure can crash pytest: both parse source with ast, whose state is shared.)"""
    try:
        httpx.get(f"{url}/health", timeout=30)
    except httpx.HTTPError:
        pass


def _assert_healthy(url: str) -> None:
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        assert http.get("/health").status_code == 200
        resp = http.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": "Once upon a time",
                "max_tokens": 5,
                "ignore_eos": True,
                "temperature": 0,
            },
        )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert (
            body["choices"][0]["finish_reason"] == "length"
            and body["usage"]["completion_tokens"] == 5
        )
        # Nothing the fuzzer sent left a request behind or a KV block taken.
        deadline = time.monotonic() + 10
        while True:
            values = {}
            for line in http.get("/metrics").text.splitlines():
                if line.startswith("tokenmill:") and " " in line:
                    name, _, value = line.rpartition(" ")
                    values[name.split("{")[0]] = float(value)
            settled = (
                values.get("tokenmill:num_requests_running") == 0
                and values.get("tokenmill:num_requests_waiting") == 0
                and values.get("tokenmill:kv_cache_free_blocks")
                == values.get("tokenmill:kv_cache_total_blocks")
            )
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert settled, values


def test_schema_lists_every_route(operations) -> None:
    assert {(op.method.upper(), op.path) for op in operations} >= EXPECTED_ROUTES


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_every_route(operations, fuzz_server, mode) -> None:
    failures = _fuzz(operations, fuzz_server.url, schemathesis.GenerationMode(mode))
    _quiesce(fuzz_server.url)
    assert not failures, f"{len(failures)} bad responses:\n\n" + "\n\n".join(failures[:60])
    _assert_healthy(fuzz_server.url)


# ---------------------------------------------------------------------------- sampling parameters
# The schema says little about the values the engine accepts, so the fuzzer above mostly hits the
# validators. Here every body is well formed and every value spans its whole documented range,
# extremes included: the server must answer 200 (a complete, consistent result) or 400.


def _finite(lo: float, hi: float, extremes: tuple = ()) -> st.SearchStrategy:
    return st.one_of(st.floats(lo, hi, allow_nan=False), st.sampled_from((lo, hi) + extremes))


SAMPLING = {
    "temperature": _finite(0.0, 2.0, (1e-30, 1e-6)),
    "top_p": _finite(1e-9, 1.0),
    "top_k": st.one_of(st.integers(-1, 400), st.just(2**40)),
    "min_p": _finite(0.0, 1.0),
    "repetition_penalty": _finite(1e-3, 1e3, (1e-30, 1e30)),
    "presence_penalty": _finite(-2.0, 2.0),
    "frequency_penalty": _finite(-2.0, 2.0),
    "logit_bias": st.dictionaries(st.integers(0, 319).map(str), _finite(-100.0, 100.0), max_size=4),
    "seed": st.one_of(
        st.integers(-(2**63), 2**63 - 1), st.sampled_from([0, -1, 2**63 - 1, -(2**63)])
    ),
    "stop": st.one_of(
        st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)
    ),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3),
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "priority": st.integers(-100, 100),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
COMPLETION = {
    **SAMPLING,
    "logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(0, 5),
}
CHAT = {
    **SAMPLING,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 20),
    "max_completion_tokens": st.integers(1, 8),
    "add_generation_prompt": st.booleans(),
}
PROMPTS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(0, 319), min_size=1, max_size=20),
    st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=2),
)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}
    ),
    min_size=1,
    max_size=3,
)


def _check_generation(route: str, body: dict, resp: httpx.Response) -> str | None:
    """None when the response is a complete, consistent answer to body (or a proper 400)."""
    if resp.status_code == 400:
        error = resp.json().get("error", {})
        return None if set(error) == ERROR_KEYS else f"malformed 400 body {resp.text[:300]!r}"
    if resp.status_code != 200:
        return f"status {resp.status_code}: {resp.text[:300]!r}"
    prompts = 1
    if (
        route == "/v1/completions"
        and isinstance(body["prompt"], list)
        and isinstance(body["prompt"][0], str)
    ):
        prompts = len(body["prompt"])
    expected = prompts * body.get("n", 1)
    limit = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if (
        route == "/v1/chat/completions"
        and "max_completion_tokens" not in body
        and "max_tokens" not in body
    ):
        limit = 64
    try:
        if body.get("stream"):
            lines = [ln for ln in resp.text.splitlines() if ln.startswith("data: ")]
            if not lines or lines[-1] != "data: [DONE]":
                return f"stream does not end with [DONE]: {resp.text[-300:]!r}"
            chunks = [_strict_json(ln[6:]) for ln in lines[:-1]]
            errors = [c["error"] for c in chunks if "error" in c]
            if errors:
                return f"in-band error after {len(chunks) - 1} chunks: {errors[0]}"
            finish = {}
            for c in chunks:
                for choice in c["choices"]:
                    if choice.get("finish_reason") is not None:
                        finish[choice["index"]] = choice["finish_reason"]
            usage = [c["usage"] for c in chunks if c.get("usage")]
            if body.get("stream_options", {}).get("include_usage") and len(usage) != 1:
                return f"{len(usage)} usage chunks"
        else:
            data = _strict_json(resp.text)
            finish = {c["index"]: c["finish_reason"] for c in data["choices"]}
            usage = [data["usage"]]
            if len(data["choices"]) != expected:
                return f"{len(data['choices'])} choices, expected {expected}"
            counts = []
            for c in data["choices"]:
                lp = c.get("logprobs")
                if route == "/v1/completions" and lp and not body.get("echo"):
                    counts.append(len(lp["tokens"]))
                elif route == "/v1/chat/completions" and lp:
                    counts.append(len(lp["content"]))
            if len(counts) == expected and sum(counts) != usage[0]["completion_tokens"]:
                return (
                    f"usage says {usage[0]['completion_tokens']} tokens, "
                    f"logprobs hold {sum(counts)}"
                )
    except (ValueError, KeyError, TypeError) as exc:
        return f"bad body ({exc!r}): {resp.text[:500]!r}"
    if sorted(finish) != list(range(expected)) or not set(finish.values()) <= {"stop", "length"}:
        return f"finish reasons {finish}, expected {expected} of stop/length"
    for u in usage:
        if (
            not 0 <= u["completion_tokens"] <= expected * limit
            or u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"]
        ):
            return f"inconsistent usage {u} for {expected} choices of at most {limit} tokens"
    return None


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_sampling_parameters(fuzz_server, route) -> None:
    fields = COMPLETION if route == "/v1/completions" else CHAT
    required = {"prompt": PROMPTS} if route == "/v1/completions" else {"messages": MESSAGES}
    failures: list[str] = []
    statuses: Counter = Counter()
    with httpx.Client(base_url=fuzz_server.url, headers=AUTH, timeout=60) as http:

        @_fuzz_settings(40)
        @given(st.fixed_dictionaries(required, optional=fields))
        def run(body) -> None:
            if body.get("echo") and body.get("stream"):
                body.pop("echo")
            try:
                resp = http.post(route, json=body)
            except httpx.HTTPError as exc:
                failures.append(f"no answer ({exc!r}) to {json.dumps(body)}")
                return
            statuses[resp.status_code] += 1
            problem = _check_generation(route, body, resp)
            if problem:
                failures.append(f"{problem}\n    body: {json.dumps(body)}")

        run()
    print(route, dict(statuses))
    _quiesce(fuzz_server.url)
    assert not failures, f"{len(failures)} bad responses:\n\n" + "\n\n".join(failures[:20])
    assert statuses[200] >= 20, statuses  # the generation paths were reached, not only validators
    _assert_healthy(fuzz_server.url)


# Regressions the fuzzer's value ranges are unlikely to reach on their own (found by probing the
# same surface): any out-of-range input must be a 400, never a 500 or non-JSON output.


@pytest.mark.parametrize(("seed", "n"), [(2**64, 1), (-(2**63) - 1, 1), (2**64 - 1, 2)])
def test_out_of_range_seed_is_a_client_error(fuzz_server, seed, n) -> None:
    """A seed torch cannot take (n > 1 derives seed + 1, seed + 2, ... for the other choices) must
    be refused with 400 or served, never a 500."""
    with httpx.Client(base_url=fuzz_server.url, headers=AUTH, timeout=60) as http:
        responses = [
            http.post(route, json={**body, "max_tokens": 2, "seed": seed, "n": n})
            for route, body in (
                ("/v1/completions", {"prompt": "hi"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            )
        ]
    _quiesce(fuzz_server.url)
    for resp in responses:
        assert resp.status_code in (200, 400), resp.text
        if resp.status_code == 400:
            assert set(resp.json()["error"]) == ERROR_KEYS
        else:
            assert len(resp.json()["choices"]) == n
    _assert_healthy(fuzz_server.url)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_tiny_repetition_penalty_never_yields_non_json(fuzz_server, route, stream) -> None:
    """A repetition_penalty small enough to underflow must be refused or give finite numbers:
    NaN or Infinity is not JSON (a 500 from the JSON encoder, or an unreadable stream event)."""
    body = (
        {"prompt": "hi", "logprobs": 1}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    )
    body |= {"max_tokens": 2, "repetition_penalty": 1e-300, "stream": stream}
    with httpx.Client(base_url=fuzz_server.url, headers=AUTH, timeout=60) as http:
        resp = http.post(route, json=body)
    _quiesce(fuzz_server.url)
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 200:  # then every number in it must be finite: strict JSON
        payloads = (
            [line[6:] for line in resp.text.splitlines() if line.startswith("data: {")]
            if stream
            else [resp.text]
        )
        for payload in payloads:
            try:
                _strict_json(payload)
            except ValueError as exc:
                pytest.fail(f"{exc} in {payload[:300]}")
    _assert_healthy(fuzz_server.url)


# ---------------------------------------------------------------------------- structured outputs
# The request schema types the output constraints loosely (any dict, any string), and schemathesis
# seldom gets one compiled: a random model name, or two constraints at once, is refused first.
# Here the bodies are valid and carry random JSON schemas, regular expressions, choices and
# grammars, well formed or not, through every field that takes one; now and then a value of the
# wrong type, or two fields at once. The server must follow the constraint (200) or refuse it
# (400), never answer 5xx, and serve on afterwards.

JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 5),
        st.floats(-10, 10, allow_nan=False),
        st.text(max_size=4),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=5,
)
REGEXES = st.one_of(
    st.text(alphabet="ab09.*+?|()[]{}^$\\-,dwsp:L", min_size=1, max_size=16),
    st.sampled_from(
        [
            r"[a-z]{1,5}",
            r"\d{3}-\d{4}",
            r"(yes|no)!?",
            r"a*b?",
            r"\p{L}{1,3}",
            r"(?i)abc",
            r"x{0}",  # only the empty output
            r"[^\s\S]",  # no output at all
            r"a{2,1}",
            r"(a",
            r"a{100000}",
            " ",
        ]
    ),
)
GRAMMAR_PIECES = st.sampled_from(
    ['"a"', '"b"', '""', "root", "x", "[a-z]", "[^\\n]", "(", ")", "|", "*", "+", "?", "{1,3}"]
    + [" ", "\n", "::=", '"', "start", ":", "/a+/", "%ignore", "\nx ::= ", "%json {}", "\\"]
)
GRAMMARS = st.one_of(
    st.lists(GRAMMAR_PIECES, max_size=8).map(lambda pieces: "root ::= " + "".join(pieces)),
    st.lists(GRAMMAR_PIECES, max_size=8).map(lambda pieces: "start: " + "".join(pieces)),
    st.text(min_size=1, max_size=30),
    st.sampled_from(
        [
            'root ::= ("yes" | "no") "!"',
            'root ::= [0-9]+ ("," [0-9]+){0,3}',
            'root ::= item+\nitem ::= [a-c] " "',
            'root ::= root "a" | "a"',  # left recursion
            "root ::= root",  # no output at all
            'root ::= "a" missing',
            'start: "a"+ | /[0-9]{2}/',
            "start: %json {}",
            'start: %json {"type": "integer"}',
        ]
    ),
)
LEAF_SCHEMAS = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "type": st.one_of(
                st.sampled_from(["string", "integer", "number", "boolean", "null", "objectx"]),
                st.lists(st.sampled_from(["string", "integer", "null"]), max_size=3),
            ),
            "minLength": st.integers(-1, 4),
            "maxLength": st.integers(-1, 6),
            "pattern": REGEXES,
            "format": st.sampled_from(["date", "date-time", "email", "uuid", "ipv4", "bogus"]),
            "minimum": st.integers(-5, 5) | st.floats(-5, 5),
            "maximum": st.integers(-5, 5) | st.floats(-5, 5),
            "exclusiveMinimum": st.integers(-5, 5),
            "multipleOf": st.sampled_from([0, -1, 0.5, 3, 1e-9]),
            "enum": st.lists(JSON_VALUES, max_size=3),
            "const": JSON_VALUES,
        },
    ),
    st.sampled_from(
        [
            {"$ref": "#/$defs/leaf"},
            {"$ref": "#/$defs/missing"},
            {"$ref": "http://example.com/schema"},
            {"not": {}},
            {"uniqueItems": True},
        ]
    ),
)
# Bounded trees: a schema that refers to itself where an instance needs it has no finite instance,
# which llguidance finds out only while generating (see the regression test below).
SCHEMAS = st.recursive(
    LEAF_SCHEMAS,
    lambda inner: st.one_of(
        st.fixed_dictionaries(
            {"type": st.just("object")},
            optional={
                "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3),
                "required": st.lists(st.text(max_size=4), max_size=2),
                "additionalProperties": st.one_of(st.booleans(), inner),
                "minProperties": st.integers(0, 2),
            },
        ),
        st.fixed_dictionaries(
            {"type": st.just("array")},
            optional={
                "items": st.one_of(inner, st.booleans()),
                "prefixItems": st.lists(inner, max_size=2),
                "minItems": st.integers(-1, 2),
                "maxItems": st.integers(-1, 3),
            },
        ),
        st.builds(
            lambda key, schemas: {key: schemas},
            st.sampled_from(["anyOf", "oneOf", "allOf"]),
            st.lists(inner, max_size=3),
        ),
    ),
    max_leaves=6,
).map(lambda schema: {"$defs": {"leaf": {"type": "integer", "minimum": 0}}, **schema})
SCHEMA_OR_TEXT = st.one_of(SCHEMAS, SCHEMAS.map(json.dumps), st.text(max_size=20))
# mostly valid; an empty list or an empty string now and then
CHOICES = st.one_of(
    st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=4),
    st.lists(st.text(max_size=6), max_size=4),
)
STRUCTURED_OUTPUTS = {
    "json": SCHEMA_OR_TEXT,
    "json_object": st.booleans(),
    "regex": REGEXES,
    "choice": CHOICES,
    "grammar": GRAMMARS,
}
CONSTRAINTS = {
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "json_schema", "yaml"])},
        optional={
            "json_schema": st.fixed_dictionaries(
                {"name": st.text(max_size=8)},
                optional={"schema": SCHEMAS, "strict": st.booleans(), "description": st.text()},
            )
        },
    ),
    "structured_outputs": st.one_of(
        *(st.fixed_dictionaries({key: values}) for key, values in STRUCTURED_OUTPUTS.items()),
        st.fixed_dictionaries({}, optional=STRUCTURED_OUTPUTS),  # none, or several
    ),
    "guided_json": SCHEMA_OR_TEXT,
    "guided_regex": REGEXES,
    "guided_choice": CHOICES,
    "guided_grammar": GRAMMARS,
}
# min_tokens stays out: see test_min_tokens_past_a_finished_grammar_is_no_server_error
CONSTRAINED = {
    "max_tokens": st.integers(1, 8),
    "temperature": _finite(0.0, 2.0),
    "seed": st.integers(0, 2**31),
    "n": st.integers(1, 2),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 319).map(str), _finite(-100.0, 100.0), max_size=4),
    "stop": st.lists(st.text(min_size=1, max_size=2), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=2),
    "top_k": st.integers(-1, 8),
}


@st.composite
def _constrained_bodies(draw, route: str) -> dict:
    prompt = st.text(min_size=1, max_size=12)  # short: the context is 64 tokens
    required = (
        {"prompt": prompt}
        if route == "/v1/completions"
        else {"messages": st.tuples(prompt.map(lambda text: {"role": "user", "content": text}))}
    )
    body = draw(st.fixed_dictionaries(required, optional=CONSTRAINED))
    fields = draw(st.lists(st.sampled_from(sorted(CONSTRAINTS)), min_size=1, max_size=2))
    for name in fields[: 1 + (draw(st.integers(0, 9)) == 0)]:  # two fields in a tenth
        wrong_type = draw(st.integers(0, 9)) == 0
        body[name] = draw(JSON_VALUES if wrong_type else CONSTRAINTS[name])
    return body


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_fuzz_structured_outputs(fuzz_server, route) -> None:
    failures: list[str] = []
    statuses: Counter = Counter()
    with httpx.Client(base_url=fuzz_server.url, headers=AUTH, timeout=60) as http:

        @_fuzz_settings(200)
        @given(_constrained_bodies(route))
        def run(body) -> None:
            try:
                resp = http.post(route, json=body)
            except httpx.HTTPError as exc:
                failures.append(f"no answer ({exc!r}) to {json.dumps(body)}")
                return
            statuses[resp.status_code] += 1
            problem = _check_generation(route, body, resp)
            if problem:
                failures.append(f"{problem}\n    body: {json.dumps(body)}")

        run()
    print(route, dict(statuses))
    _quiesce(fuzz_server.url)
    assert not failures, f"{len(failures)} bad responses:\n\n" + "\n\n".join(failures[:20])
    assert statuses[200] >= 20 and statuses[400] >= 10, statuses  # compiled and refused ones
    _assert_healthy(fuzz_server.url)


def _post_both_ways(url: str, route: str, extra: dict) -> list[httpx.Response]:
    body = (
        {"prompt": "hi"}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as http:
        return [
            http.post(route, json={**body, "max_tokens": 8, "stream": stream, **extra})
            for stream in (False, True)
        ]


@pytest.mark.parametrize(
    "extra",
    [
        {"guided_regex": r"[^\s\S]"},
        {"guided_json": {"$ref": "#"}},
        {"guided_grammar": "root ::= root"},
        {"structured_outputs": {"grammar": 'start: start "a"'}},
    ],
    ids=["empty-class", "self-ref-schema", "gbnf-only-recursion", "lark-only-recursion"],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_constraint_no_output_satisfies_is_a_400(fuzz_server, route, extra) -> None:
    """llguidance accepts these grammars, whose language is empty; their matcher fails at the first
    token. They are refused when compiled, streamed or not, not failed while generating (500)."""
    responses = _post_both_ways(fuzz_server.url, route, extra)
    _quiesce(fuzz_server.url)
    for resp in responses:
        assert resp.status_code == 400, resp.text[:300]
        assert "no output can satisfy it" in resp.json()["error"]["message"]
    _assert_healthy(fuzz_server.url)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_min_tokens_past_a_finished_grammar_ends_the_output(fuzz_server, route) -> None:
    """The grammar allows only the end before min_tokens: the constraint wins, no 500."""
    extra = {"guided_choice": ["a", "b"], "min_tokens": 3}
    responses = _post_both_ways(fuzz_server.url, route, extra)
    _quiesce(fuzz_server.url)
    for resp in responses:
        assert resp.status_code == 200 and '"error"' not in resp.text, resp.text[:300]
    choice = responses[0].json()["choices"][0]
    assert choice.get("text", choice.get("message", {}).get("content")) in ("a", "b")


def test_a_schema_without_a_finite_instance_is_a_400(fuzz_server) -> None:
    """llguidance finds out a token in that it cannot go on: the request's own failure."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    (resp, _) = _post_both_ways(fuzz_server.url, "/v1/completions", {"guided_json": schema})
    _quiesce(fuzz_server.url)
    assert resp.status_code == 400, resp.text[:300]
    assert "the output constraint cannot go on" in resp.json()["error"]["message"]
    _assert_healthy(fuzz_server.url)
