"""Tool-call parsers: whole outputs parsed as expected, and streamed in every way of cutting them
into pieces to the same content and calls; their grammars checked with llguidance."""

from __future__ import annotations

import json
from collections.abc import Callable

import llguidance
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.parsers.chunking import splits
from tokenmill.parsers import TOOL_PARSERS, ToolParser, tool_parser_for_template

ARGS = {
    "q": 'a}b"c\\d{[',
    "nested": [1, {"x": [2.5, None, True]}, []],
    "unicode": "héllo ✓ 🌍",
    "tag": "</tool_call> <tool_call> [TOOL_CALLS] ]} <|python_tag|>",
}
ARGS_TEXT = json.dumps(ARGS, ensure_ascii=False)
ESCAPED = '{"s": "\\u00e9\\n\\"", "n": -1.5e3}'  # kept as written, not re-serialized


def hermes(name: str, arguments: str, key: str = "arguments") -> str:
    return f'<tool_call>\n{{"name": "{name}", "{key}": {arguments}}}\n</tool_call>'


CASES = {
    "hermes": [
        ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
        ("\n\n  Hello <b> a < b <tool", "Hello <b> a < b <tool", []),
        ("Use the <tool_call> tag.", "Use the <tool_call> tag.", []),
        (hermes("get_weather", '{"city": "Paris"}'), None, [("get_weather", '{"city": "Paris"}')]),
        (
            hermes("a", "{}") + "\n" + hermes("b", '{"x": 1}', key="parameters") + "\n",
            None,
            [("a", "{}"), ("b", '{"x": 1}')],
        ),
        (
            "Let me check.\n\n" + hermes("f", "{}") + "\n\nDone.",
            "Let me check.\n\nDone.",
            [("f", "{}")],
        ),
        (hermes("f", ARGS_TEXT), None, [("f", ARGS_TEXT)]),
        (hermes("f", ESCAPED), None, [("f", ESCAPED)]),
        (hermes("f", '"{\\"a\\": \\"}\\"}"'), None, [("f", '{"a": "}"}')]),
        (
            '<tool_call>{"arguments": [1, {"a": "}"}], "name": "f"}</tool_call>',
            None,
            [("f", '[1, {"a": "}"}]')],
        ),
        ('<tool_call>\n{"type": "function", "name": "f"}\n</tool_call>', None, [("f", "{}")]),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"nam": "f"}</tool_call>', '<tool_call>{"nam": "f"}</tool_call>', []),
        (
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>x',
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>x',
            [],
        ),
        (
            '<tool_call>{"arguments": {"a": tru}, "name": "f"}',
            '<tool_call>{"arguments": {"a": tru}, "name": "f"}',
            [],
        ),
        (
            "<tool_call>oops</tool_call>\n" + hermes("f", "{}"),
            "<tool_call>oops</tool_call>\n",
            [("f", "{}")],
        ),
        # bare calls, as Qwen2.5-Coder writes them: where they open the output or follow a call
        ('{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
        (
            '{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {}}\nDone.',
            "Done.",
            [("a", "{}"), ("b", "{}")],
        ),
        (hermes("a", "{}") + '\n{"name": "b", "arguments": {}}', None, [("a", "{}"), ("b", "{}")]),
        ('Here: {"name": "a", "arguments": {}}', 'Here: {"name": "a", "arguments": {}}', []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    "llama3_json": [
        ("It is sunny.", "It is sunny.", []),
        ('Here: {"name": "a", "parameters": {}}', 'Here: {"name": "a", "parameters": {}}', []),
        (
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            [("get_weather", '{"city": "Paris"}')],
        ),
        ('  <|python_tag|>{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
        (
            '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, 2]}}',
            None,
            [("a", "{}"), ("b", '{"x": [1, 2]}')],
        ),
        ('{"name": "a", "parameters": {}}\n\nDone.', "Done.", [("a", "{}")]),
        ('{"name": "a", "parameters": {}}; oops', "; oops", [("a", "{}")]),
        (f'{{"name": "f", "parameters": {ARGS_TEXT}}}', None, [("f", ARGS_TEXT)]),
        ('{"name": "f", "parameters": "{\\"a\\": 1}"}', None, [("f", '{"a": 1}')]),
        ('{"parameters": {"a": "}"}, "name": "f"}', None, [("f", '{"a": "}"}')]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("{not json}", "{not json}", []),
        (
            '<|python_tag|>brave_search.call(query="x")',
            '<|python_tag|>brave_search.call(query="x")',
            [],
        ),
        ("<|python", "<|python", []),
    ],
    "mistral": [
        ("It is sunny.", "It is sunny.", []),
        ("a [TOOL b", "a [TOOL b", []),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            None,
            [("get_weather", '{"city": "Paris"}')],
        ),
        (
            '[TOOL_CALLS] [{"name": "a", "arguments": {"x": "]}"}}, '
            '{"parameters": 1, "name": "b"}]',
            None,
            [("a", '{"x": "]}"}'), ("b", "1")],
        ),
        ('Sure. [TOOL_CALLS][{"name": "f", "arguments": {}}]', "Sure. ", [("f", "{}")]),
        (f'[TOOL_CALLS][{{"name": "f", "arguments": {ARGS_TEXT}}}]', None, [("f", ARGS_TEXT)]),
        ('[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": 1}"}]', None, [("f", '{"a": 1}')]),
        ("[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
        ('[TOOL_CALLS][{"foo": 1}]', '[TOOL_CALLS][{"foo": 1}]', []),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}, oops]', ", oops]", [("f", "{}")]),
    ],
}
ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


def stream(parser: ToolParser, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Streams chunks through the parser: (content, [(name, arguments)]), checking the deltas'
    shape: each call's first delta alone has its id and name, indices in order."""
    content, calls = [], []
    for text, deltas in [*map(parser.feed, chunks), parser.finish()]:
        content.append(text)
        for delta in deltas:
            if delta.index == len(calls):
                assert delta.id.startswith("call_") and len(delta.id) == 29
                assert delta.name
                calls.append([delta.name, delta.arguments])
            else:
                assert delta.index == len(calls) - 1, "deltas come in call order"
                assert delta.id is None and delta.name is None
                calls[-1][1] += delta.arguments
    assert parser.called == bool(calls)
    return "".join(content), [tuple(call) for call in calls]


@pytest.mark.parametrize("parser_name, text, content, calls", ALL_CASES)
def test_parse(parser_name: str, text: str, content: str | None, calls: list) -> None:
    parsed_content, parsed_calls = TOOL_PARSERS[parser_name]().parse(text)
    assert parsed_content == content
    assert [(call.name, call.arguments) for call in parsed_calls] == calls
    assert len({call.id for call in parsed_calls}) == len(calls)
    assert all(call.id.startswith("call_") and len(call.id) == 29 for call in parsed_calls)


@pytest.mark.parametrize("parser_name, text, content, calls", ALL_CASES)
def test_streaming_matches_parse(parser_name: str, text: str, content: str | None, calls: list):
    parser_class = TOOL_PARSERS[parser_name]
    for chunks in splits(text):
        assert stream(parser_class(), chunks) == (content or "", calls), chunks


NAMED_CASES = [
    ('{"name": "John", "age": 3}', '{"name": "John", "age": 3}', []),
    (hermes("nope", "{}") + "\n" + hermes("f", "{}"), hermes("nope", "{}") + "\n", [("f", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", NAMED_CASES)
def test_a_call_to_a_function_there_is_not_is_content(text: str, content: str, calls: list):
    parser = TOOL_PARSERS["hermes"](names={"f"})
    parsed_content, parsed_calls = parser.parse(text)
    assert (parsed_content, [(c.name, c.arguments) for c in parsed_calls]) == (content, calls)
    for chunks in splits(text):
        assert stream(TOOL_PARSERS["hermes"](names={"f"}), chunks) == (content, calls), chunks


@pytest.mark.parametrize(
    "parser_name, text, name",
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, "x', "f"),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}', "f"),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arg', "g"),
    ],
)
def test_truncated_call_is_the_one_difference(parser_name: str, text: str, name: str) -> None:
    """A call cut off after its name: streaming has sent it, parse keeps its text as content."""
    parser = TOOL_PARSERS[parser_name]()
    content, calls = parser.parse(text)
    assert name not in [call.name for call in calls] and text.endswith(content[-5:])
    _, streamed = stream(TOOL_PARSERS[parser_name](), [text])
    assert streamed[-1][0] == name


def test_parse_does_not_depend_on_feed() -> None:
    parser = TOOL_PARSERS["hermes"]()
    assert parser.feed("Hello <tool_call>\n{") == ("Hello ", [])
    assert parser.parse("plain") == ("plain", [])
    assert parser.finish() == ("<tool_call>\n{", [])


def test_name_then_arguments_stream_as_they_come() -> None:
    parser = TOOL_PARSERS["hermes"]()
    assert parser.feed('<tool_call>\n{"name": "get_') == ("", [])
    content, deltas = parser.feed('weather", "arguments": {"city": "Pa')
    assert content == "" and len(deltas) == 1
    assert (deltas[0].index, deltas[0].name, deltas[0].arguments) == (
        0,
        "get_weather",
        '{"city": "Pa',
    )
    _, deltas = parser.feed('ris"}}\n</tool_call>')
    assert [(d.index, d.id, d.name, d.arguments) for d in deltas] == [(0, None, None, 'ris"}')]
    assert parser.called


@pytest.mark.parametrize(
    "template, name",
    [
        ("{%- if tools %}<tools></tools> ... <tool_call>{{ tool_call }}</tool_call>", "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }} ... {{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ('Respond in the format {"name": function name, "parameters": dictionary}', "llama3_json"),
        ("{% for message in messages %}{{ message.content }}{% endfor %}", None),
    ],
)
def test_tool_parser_for_template(template: str, name: str | None) -> None:
    assert tool_parser_for_template(template) == name


# Grammars, against a byte-level tokenizer whose added tokens are the markers

MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"$ref": "#/$defs/Unit"},
                },
                "required": ["city"],
                "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]
WEATHER = '{"city": "Paris", "unit": "celsius"}'
CALLS = {  # two calls in each format, then what goes wrong
    "hermes": (
        hermes("get_weather", WEATHER) + "\n" + hermes("get_time", '{"tz": "CET"}'),
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    "llama3_json": (
        f'{{"name": "get_weather", "parameters": {WEATHER}}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ),
    "mistral": (
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ),
}
SEPARATOR = {
    "hermes": ("</tool_call>\n<", "</tool_call><"),
    "llama3_json": ("; {", ";{"),
    "mistral": ("}}, {", "}},{"),
}


def byte_level_tokenizer(added: list[str]) -> tuple[llguidance.LLTokenizer, dict[str, int]]:
    """An llguidance tokenizer of one token a byte plus the added tokens (and "<eos>"), with the
    added tokens' ids."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([*added, "<eos>"])
    ids = {token: tokenizer.token_to_id(token) for token in added}
    eos = tokenizer.token_to_id("<eos>")
    return llguidance.LLTokenizer(tokenizer.to_str(), eos_token=eos), ids


@pytest.fixture(scope="module", params=["special tokens", "literals"])
def vocab(request) -> tuple[llguidance.LLTokenizer, Callable[[str], str]]:
    """A tokenizer, and how the grammar renders markers for it: as references to its special
    tokens (`<[id]>` where the marker has no angle brackets), or as string literals where the
    vocabulary has no such tokens."""
    if request.param == "literals":
        return byte_level_tokenizer([])[0], json.dumps
    tokenizer, ids = byte_level_tokenizer(MARKERS)
    return tokenizer, lambda marker: marker if marker[0] == "<" else f"<[{ids[marker]}]>"


def accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    tokens = tokenizer.tokenize_str(text, parse_special=True)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("parser_name", list(CALLS))
def test_grammar(vocab, parser_name: str) -> None:
    tokenizer, token = vocab
    parser = TOOL_PARSERS[parser_name]()
    two, one = CALLS[parser_name]
    single = parser.grammar(TOOLS, parallel=False, token=token)
    parallel = parser.grammar(TOOLS, parallel=True, token=token)
    for grammar in (single, parallel):
        assert llguidance.LLMatcher.validate_grammar(grammar, tokenizer) == ""
        assert accepts(tokenizer, grammar, one)
        for wrong in (
            one.replace("get_weather", "get_weathr"),  # no such function
            one.replace('"Paris"', "3"),  # city is a string
            one.replace('"city": "Paris"', '"town": "Paris"'),  # city is required
            one.replace("{", "{ ", 1),  # compact JSON
        ):
            assert not accepts(tokenizer, grammar, wrong), wrong
    assert accepts(tokenizer, parallel, two)
    assert not accepts(tokenizer, single, two)
    assert not accepts(tokenizer, parallel, two.replace("celsius", "kelvin"))
    assert not accepts(tokenizer, parallel, two.replace(*SEPARATOR[parser_name]))
    content, calls = parser.parse(two)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", WEATHER),
        ("get_time", '{"tz": "CET"}'),
    ]
