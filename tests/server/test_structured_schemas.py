"""The acceptance set of structured outputs on a real model: varied JSON schemas, regular
expressions, choices and a GBNF grammar, through the official `openai` client against a live
server on SmolLM2 and Gemma 3 270M, streamed and not, greedy (temperature 0) and sampled
(temperature 1, seeded).

Every output must finish on its own (`finish_reason == "stop"`) and parse and validate:
`jsonschema.validate`, `re.fullmatch`, membership, or a small parser of the grammar. Every schema
is bounded (strings with maxLength, arrays with maxItems, no recursion), so that even a sampled
output ends well within max_tokens; and a streamed output is the same text as the whole one.
All of a model's requests go out at once, from one thread pool, so that the engine batches them:
constrained rows of many schemas share each step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from functools import partial

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, RunningServer
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

MAX_TOKENS = 400  # far above what any bounded schema below needs
WORKERS = 32  # requests in flight at once: the engine batches them
SEED = 7

# (name, prompt, schema)
SCHEMAS: list[tuple[str, str, dict]] = [
    (
        "person",
        "Extract the person: Maria Lopez is 34 and speaks Spanish and English.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "languages": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["name", "age", "languages"],
            "additionalProperties": False,
        },
    ),
    (
        "nested_address",
        "Give the shipping address of a customer in Boston as JSON.",
        {
            "type": "object",
            "properties": {
                "customer": {"type": "string", "maxLength": 20},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 24},
                        "city": {"type": "string", "maxLength": 16},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        "geo": {
                            "type": "object",
                            "properties": {
                                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                "lon": {"type": "integer", "minimum": -180, "maximum": 180},
                            },
                            "required": ["lat", "lon"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["street", "city", "zip", "geo"],
                    "additionalProperties": False,
                },
            },
            "required": ["customer", "address"],
            "additionalProperties": False,
        },
    ),
    (
        "tags_min_max_items",
        "Suggest between two and four tags for a blog post about baking sourdough bread.",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "minLength": 2, "maxLength": 14},
                    "minItems": 2,
                    "maxItems": 4,
                }
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
    ),
    (
        "weather_enum",
        "What is the weather like in Paris today? Answer as JSON.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy", "windy"]},
                "unit": {"enum": ["C", "F"]},
                "temperature": {"type": "integer", "minimum": -50, "maximum": 60},
            },
            "required": ["city", "condition", "unit", "temperature"],
            "additionalProperties": False,
        },
    ),
    (
        "event_const",
        "Log an event: the user alice signed in.",
        {
            "type": "object",
            "properties": {
                "version": {"const": "1.0"},
                "kind": {"const": "login"},
                "user": {"type": "string", "pattern": "^[a-z]{1,12}$"},
                "success": {"type": "boolean"},
                "attempts": {"const": 1},
            },
            "required": ["version", "kind", "user", "success", "attempts"],
            "additionalProperties": False,
        },
    ),
    (
        "shape_any_of",
        "Describe one geometric shape, a circle or a rectangle, as JSON.",
        {
            "type": "object",
            "properties": {
                "shape": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "circle"},
                                "radius": {"type": "integer", "minimum": 1, "maximum": 100},
                            },
                            "required": ["kind", "radius"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "kind": {"const": "rectangle"},
                                "width": {"type": "integer", "minimum": 1, "maximum": 100},
                                "height": {"type": "integer", "minimum": 1, "maximum": 100},
                            },
                            "required": ["kind", "width", "height"],
                            "additionalProperties": False,
                        },
                    ]
                }
            },
            "required": ["shape"],
            "additionalProperties": False,
        },
    ),
    (
        "order_refs",
        "Write an order of two items from a grocery store as JSON.",
        {
            "$defs": {
                "money": {"type": "integer", "minimum": 0, "maximum": 10000},
                "item": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                        "cents": {"$ref": "#/$defs/money"},
                    },
                    "required": ["sku", "quantity", "cents"],
                    "additionalProperties": False,
                },
            },
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "items": {
                    "type": "array",
                    "items": {"$ref": "#/$defs/item"},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "total": {"$ref": "#/$defs/money"},
            },
            "required": ["order_id", "items", "total"],
            "additionalProperties": False,
        },
    ),
    (
        "contact_patterns",
        "Extract the contact: call Bob on 555-123-4567, born 1990-04-12.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
                "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
                "birthday": {
                    "type": "string",
                    "pattern": "^(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$",
                },
            },
            "required": ["name", "phone", "birthday"],
            "additionalProperties": False,
        },
    ),
    (
        "integer_ranges",
        "Rate a movie you like: stars, a score and a rank, as JSON.",
        {
            "type": "object",
            "properties": {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
                "rank": {"type": "integer", "minimum": -10, "maximum": -1},
                "votes": {"type": "integer", "minimum": 1000, "maximum": 1000000},
                "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
            },
            "required": ["stars", "score", "rank", "votes", "step"],
            "additionalProperties": False,
        },
    ),
    (
        "nullable_fields",
        "Fill in a user profile; leave unknown fields null.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "maxLength": 16},
                "nickname": {"type": ["string", "null"], "maxLength": 16},
                "age": {
                    "anyOf": [{"type": "integer", "minimum": 0, "maximum": 130}, {"type": "null"}]
                },
                "manager": {"type": ["integer", "null"], "minimum": 1, "maximum": 999},
            },
            "required": ["username", "nickname", "age", "manager"],
            "additionalProperties": False,
        },
    ),
    (
        "optional_properties",
        "Describe a book: title, and optionally its author and year.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 30},
                "author": {"type": "string", "maxLength": 20},
                "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
            },
            "required": ["title"],
            "additionalProperties": False,
        },
    ),
    (
        "array_of_objects",
        "List two or three planets with their order from the sun.",
        {
            "type": "object",
            "properties": {
                "planets": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 10},
                            "position": {"type": "integer", "minimum": 1, "maximum": 8},
                            "has_rings": {"type": "boolean"},
                        },
                        "required": ["name", "position", "has_rings"],
                        "additionalProperties": False,
                    },
                    "minItems": 2,
                    "maxItems": 3,
                }
            },
            "required": ["planets"],
            "additionalProperties": False,
        },
    ),
    (
        "top_level_array",
        "Give three colors as a JSON array of short lowercase words.",
        {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{3,8}$"},
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "tuple_prefix_items",
        "Give a point as [x, y, label].",
        {
            "type": "array",
            "prefixItems": [
                {"type": "integer", "minimum": -100, "maximum": 100},
                {"type": "integer", "minimum": -100, "maximum": 100},
                {"type": "string", "maxLength": 8},
            ],
            "items": False,
            "minItems": 3,
        },
    ),
    (
        "all_of",
        "Describe an employee with an id and a department as JSON.",
        {
            "allOf": [
                {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}},
                    "required": ["id"],
                },
                {
                    "type": "object",
                    "properties": {"department": {"enum": ["sales", "engineering", "support"]}},
                    "required": ["department"],
                },
            ],
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "department": {"type": "string"},
            },
            "additionalProperties": False,
        },
    ),
    (
        "number_multiple_of",
        "Give the price and weight of a bag of apples as JSON.",
        {
            "type": "object",
            "properties": {
                "price": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.01},
                "weight_kg": {"type": "number", "minimum": 0.1, "maximum": 5, "multipleOf": 0.1},
                "organic": {"type": "boolean"},
            },
            "required": ["price", "weight_kg", "organic"],
            "additionalProperties": False,
        },
    ),
    (
        "mixed_enum",
        "Pick a priority and a status for a bug report.",
        {
            "type": "object",
            "properties": {
                "priority": {"enum": [1, 2, 3, "urgent", None]},
                "status": {"enum": ["open", "closed", "won't fix"]},
                "labels": {
                    "type": "array",
                    "items": {"enum": ["ui", "backend", "docs", "perf"]},
                    "maxItems": 3,
                },
            },
            "required": ["priority", "status", "labels"],
            "additionalProperties": False,
        },
    ),
    (
        "deep_nesting",
        "Describe a company with its CEO and the CEO's office as JSON.",
        {
            "type": "object",
            "properties": {
                "company": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 16},
                        "ceo": {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string", "maxLength": 16},
                                "office": {
                                    "type": "object",
                                    "properties": {
                                        "floor": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "room": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"},
                                    },
                                    "required": ["floor", "room"],
                                    "additionalProperties": False,
                                },
                            },
                            "required": ["name", "office"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "ceo"],
                    "additionalProperties": False,
                }
            },
            "required": ["company"],
            "additionalProperties": False,
        },
    ),
    (
        "one_of_payment",
        "How did the customer pay? Card or cash, as JSON.",
        {
            "type": "object",
            "properties": {
                "payment": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {
                                "method": {"const": "card"},
                                "last4": {"type": "string", "pattern": "^[0-9]{4}$"},
                            },
                            "required": ["method", "last4"],
                            "additionalProperties": False,
                        },
                        {
                            "type": "object",
                            "properties": {
                                "method": {"const": "cash"},
                                "change": {"type": "integer", "minimum": 0, "maximum": 100},
                            },
                            "required": ["method", "change"],
                            "additionalProperties": False,
                        },
                    ]
                }
            },
            "required": ["payment"],
            "additionalProperties": False,
        },
    ),
    (
        "string_lengths_and_escapes",
        'Write a short quote, with "quotes" and a backslash \\ in it, and its author.',
        {
            "type": "object",
            "properties": {
                "quote": {"type": "string", "minLength": 5, "maxLength": 40},
                "author": {"type": "string", "minLength": 2, "maxLength": 16},
                "initials": {"type": "string", "minLength": 2, "maxLength": 2},
            },
            "required": ["quote", "author", "initials"],
            "additionalProperties": False,
        },
    ),
    (
        "enum_array_and_bools",
        "Which features does this phone have? Answer as JSON flags.",
        {
            "type": "object",
            "properties": {
                "wifi": {"type": "boolean"},
                "nfc": {"type": "boolean"},
                "colors": {
                    "type": "array",
                    "items": {"enum": ["black", "white", "blue"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "storage_gb": {"enum": [64, 128, 256]},
            },
            "required": ["wifi", "nfc", "colors", "storage_gb"],
            "additionalProperties": False,
        },
    ),
    (
        "string_formats",
        "When and where is the meeting? Give a date, a time and an organiser e-mail.",
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "format": "date"},
                "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                "organiser": {
                    "type": "string",
                    "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$",
                },
            },
            "required": ["date", "time", "organiser"],
            "additionalProperties": False,
        },
    ),
]

# (name, pattern, prompt): regular expressions the whole output must match
REGEXES = [
    (
        "date",
        r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
        "When did the first moon landing happen? Answer with the date only.",
    ),
    ("phone", r"\(\d{3}\) \d{3}-\d{4}", "Give the phone number of a pizza place in New York."),
    (
        "email",
        r"[a-z]{1,10}(\.[a-z]{1,10})?@[a-z]{2,10}\.(com|org|net)",
        "Write the e-mail address of a support desk.",
    ),
]
CHOICES = ["positive", "negative", "neutral"]
# GBNF (llama.cpp's syntax): arithmetic over small numbers, parentheses one level deep
ARITHMETIC = r"""
root ::= expr
expr ::= term (ws op ws term){0,3}
term ::= number | "(" inner ")"
inner ::= number (ws op ws number){1,2}
number ::= [1-9] [0-9]{0,2}
op ::= [-+*/]
ws ::= " "?
"""


def _parse_arithmetic(text: str) -> list:
    """The parse tree of an ARITHMETIC sentence, by recursive descent over the grammar's rules;
    ValueError where the text is not in its language."""
    pos = 0

    def eat(pattern: str) -> str | None:
        nonlocal pos
        found = re.compile(pattern).match(text, pos)
        if found is None:
            return None
        pos = found.end()
        return found.group()

    def need(pattern: str, what: str) -> str:
        found = eat(pattern)
        if found is None:
            raise ValueError(f"expected {what} at {pos} in {text!r}")
        return found

    def number() -> int:
        return int(need(r"[1-9][0-9]{0,2}", "a number"))

    def sequence(first: Callable, most: int) -> list:  # first (ws op ws first){0,most}
        tree = [first()]
        while len(tree) < 2 * most + 1 and (op := eat(r" ?[-+*/] ?")) is not None:
            tree += [op.strip(), first()]
        return tree

    def term() -> int | list:
        if eat(r"\(") is None:
            return number()
        inner = sequence(number, 2)
        if len(inner) < 3:
            raise ValueError(f"a parenthesis holds one number in {text!r}")
        need(r"\)", "')'")
        return inner

    tree = sequence(term, 3)
    if pos != len(text):
        raise ValueError(f"trailing {text[pos:]!r} in {text!r}")
    return tree


@dataclass
class Answer:
    text: str
    finish_reason: str | None


def _schema_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat(client: openai.OpenAI, prompt: str, stream: bool, temperature: float, **kw) -> Answer:
    kwargs = dict(
        model="served",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        seed=SEED,
        **kw,
    )
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return Answer(choice.message.content, choice.finish_reason)
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return Answer("".join(pieces), finish)


def _complete(client: openai.OpenAI, prompt: str, stream: bool, temperature: float, **kw) -> Answer:
    kwargs = dict(
        model="served",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        seed=SEED,
        **kw,
    )
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        return Answer(choice.text, choice.finish_reason)
    pieces, finish = [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            pieces.append(choice.text or "")
            finish = choice.finish_reason or finish
    return Answer("".join(pieces), finish)


VARIANTS = [(stream, temperature) for stream in (False, True) for temperature in (0.0, 1.0)]


def _body(**fields) -> dict:
    return {"extra_body": fields}


def _jobs(client: openai.OpenAI, every_field: bool) -> dict[tuple, Callable]:
    """The requests for one model, by key: (kind, name, route or field, stream, temperature).
    every_field: also send schemas through the other fields and the completions route."""
    # (kind, name, route or field), how to ask, prompt, the constraint's arguments
    specs: list[tuple[tuple[str, str, str], Callable, str, dict]] = []
    for name, prompt, schema in SCHEMAS:
        constraint = {"response_format": _schema_format(name, schema)}
        specs.append((("json", name, "response_format"), _chat, prompt, constraint))
    for name, prompt, schema in SCHEMAS[:3] if every_field else ():
        specs += [
            (("json", name, "structured_outputs"), _chat, prompt,
             _body(structured_outputs={"json": schema})),
            (("json", name, "guided_json"), _chat, prompt, _body(guided_json=json.dumps(schema))),
            (("json", name, "completions"), _complete, f"{prompt}\nJSON:",
             _body(structured_outputs={"json": schema})),
        ]  # fmt: skip
    for name, pattern, prompt in REGEXES:
        specs.append((("regex", name, "chat"), _chat, prompt, _body(guided_regex=pattern)))
    date = "The date of the first moon landing:"
    review = "Is this review positive, negative or neutral? 'The food was cold.'"
    expression = "Write an arithmetic expression that equals 42."
    specs += [
        (("regex", "date", "completions"), _complete, date,
         _body(structured_outputs={"regex": REGEXES[0][1]})),
        (("choice", "sentiment", "chat"), _chat, review,
         _body(structured_outputs={"choice": CHOICES})),
        (("choice", "sentiment", "completions"), _complete, "Review: 'Great value!' Sentiment:",
         _body(guided_choice=CHOICES)),
        (("grammar", "arithmetic", "chat"), _chat, expression,
         _body(structured_outputs={"grammar": ARITHMETIC})),
        (("grammar", "arithmetic", "completions"), _complete, "An arithmetic expression:",
         _body(guided_grammar=ARITHMETIC)),
    ]  # fmt: skip
    return {
        (*key, stream, temperature): partial(ask, client, prompt, stream, temperature, **extra)
        for key, ask, prompt, extra in specs
        for stream, temperature in VARIANTS
    }


def _run_all(jobs: dict[tuple, Callable]) -> dict[tuple, Answer | Exception]:
    """Send every job at once; each key's answer, or the exception its request raised."""
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
    outcomes: dict[tuple, Answer | Exception] = {}
    for key, future in futures.items():
        try:
            outcomes[key] = future.result()
        except Exception as exc:  # noqa: BLE001 - reported by the test that owns the key
            outcomes[key] = exc
    return outcomes


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def outcomes(request) -> dict[tuple, Answer | Exception]:
    """Every request's outcome, on one real model; all sent at once, so batched. The fields and
    routes are the server's, the same for any model: they are sent to SmolLM2 only."""
    server = RunningServer(
        LLMEngine(
            request.getfixturevalue(f"{request.param}_gguf"), compile=False, num_kv_blocks=1024
        ),
        ServerConfig("served", api_key=API_KEY, max_body_bytes=1 << 20),
    )
    try:
        client = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300
        )
        yield _run_all(_jobs(client, every_field=request.param == "smollm2"))
    finally:
        server.stop()


def _check(outcomes: dict, kind: str, name: str, verify: Callable[[str], object]) -> None:
    """Every answer of (kind, name) stopped on its own and passes verify; streamed, it is the
    same text as whole (greedy or seeded: the same tokens, whatever the batch)."""
    keys = [key for key in outcomes if key[:2] == (kind, name)]
    assert len(keys) >= len(VARIANTS)
    problems = []
    for key in keys:
        answer = outcomes[key]
        label = "/".join(map(str, key[2:]))
        if isinstance(answer, Exception):
            problems.append(f"{label}: {answer!r}")
            continue
        if answer.finish_reason != "stop":
            problems.append(f"{label}: finish_reason {answer.finish_reason}: {answer.text!r}")
            continue
        try:
            verify(answer.text)
        except Exception as exc:  # noqa: BLE001 - collected, then reported together
            problems.append(f"{label}: {type(exc).__name__}: {exc}: {answer.text!r}")
        whole = outcomes[(*key[:3], False, key[4])]
        if key[3] and isinstance(whole, Answer) and whole.text != answer.text:
            problems.append(f"{label}: streamed {answer.text!r}, whole {whole.text!r}")
    assert not problems, "\n".join(problems)


def _validator(schema: dict) -> Callable[[str], None]:
    """Validation of an output against the schema, with the format checks. Numbers with a fraction
    are read as decimals, as JSON writes them: as floats, 1.2 is not a multiple of 0.1."""
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    return lambda text: jsonschema.validate(
        json.loads(text, parse_float=Decimal), exact, format_checker=checker
    )


def test_schemas_are_many_and_valid() -> None:
    assert len(SCHEMAS) >= 20
    assert len({name for name, _, _ in SCHEMAS}) == len(SCHEMAS)
    for _, _, schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("name", [name for name, _, _ in SCHEMAS])
def test_json_schema(outcomes, name: str) -> None:
    schema = next(schema for n, _, schema in SCHEMAS if n == name)
    _check(outcomes, "json", name, _validator(schema))


@pytest.mark.parametrize("name", [name for name, _, _ in REGEXES])
def test_regex(outcomes, name: str) -> None:
    pattern = next(pattern for n, pattern, _ in REGEXES if n == name)

    def matches(text: str) -> None:
        assert re.fullmatch(pattern, text), f"does not match {pattern}"

    _check(outcomes, "regex", name, matches)


def test_choice(outcomes) -> None:
    def member(text: str) -> None:
        assert text in CHOICES

    _check(outcomes, "choice", "sentiment", member)


def test_gbnf_grammar(outcomes) -> None:
    _check(outcomes, "grammar", "arithmetic", _parse_arithmetic)
