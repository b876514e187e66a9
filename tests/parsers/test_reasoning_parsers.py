"""Reasoning parsers: whole outputs split into reasoning and content as expected, and streamed in
every way of cutting them into pieces to the same parts."""

from __future__ import annotations

import pytest

from tests.parsers.chunking import splits
from tokenmill.parsers import REASONING_PARSERS, ReasoningParser
from tokenmill.parsers.reasoning import HarmonyReasoningParser

CASES = [  # (prompt opens the reasoning, output, reasoning, content)
    (False, "<think>\nLet me think.\n</think>\n\nParis.", "Let me think.\n", "Paris."),
    (False, "  \n<think>a < b </thi c</think>Paris.", "a < b </thi c", "Paris."),
    (False, "Paris.", None, "Paris."),
    (False, "\n\nParis <think>no</think>", None, "Paris <think>no</think>"),
    (False, "<thin", None, "<thin"),
    (False, "<think>Still thinking", "Still thinking", None),
    (False, "<think>\n\n</think>\n\n", None, None),
    (False, "", None, None),
    (True, "\nLet me think.</think>\n\nParis.", "Let me think.", "Paris."),
    (True, "<think>x</think>y", "<think>x", "y"),
    (True, "Still thinking </think", "Still thinking </think", None),
    (True, "</think>Paris.", None, "Paris."),
]


@pytest.mark.parametrize("parser_name", [n for n in REASONING_PARSERS if n != "gpt-oss"])
@pytest.mark.parametrize("opened, text, reasoning, content", CASES)
def test_parse(parser_name: str, opened: bool, text: str, reasoning, content) -> None:
    parser = REASONING_PARSERS[parser_name](prompt_opens_reasoning=opened)
    assert parser.parse(text) == (reasoning, content)


@pytest.mark.parametrize("opened, text, reasoning, content", CASES)
def test_streaming_matches_parse(opened: bool, text: str, reasoning, content) -> None:
    for chunks in splits(text):
        parser = ReasoningParser(prompt_opens_reasoning=opened)
        pieces = [*map(parser.feed, chunks), parser.finish()]
        assert "".join(r for r, _ in pieces) == (reasoning or ""), chunks
        assert "".join(c for _, c in pieces) == (content or ""), chunks


def test_holds_back_only_a_possible_marker() -> None:
    parser = ReasoningParser()
    assert parser.feed(" <thi") == ("", "")
    assert parser.feed("nk>\nI see") == ("I see", "")
    assert not parser.reasoning_ended
    assert parser.feed(" it</th") == (" it", "")
    assert parser.feed("ink>\n\nYes") == ("", "Yes")
    assert parser.reasoning_ended
    assert parser.finish() == ("", "")


def test_output_without_reasoning_ends_it_at_once() -> None:
    parser = ReasoningParser()
    assert parser.feed("Hello") == ("", "Hello")
    assert parser.reasoning_ended


@pytest.mark.parametrize(
    "prompt, opens",
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<think>\nold\n</think>\nanswer<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
    ],
)
def test_opens_reasoning(prompt: str, opens: bool) -> None:
    assert ReasoningParser.opens_reasoning(prompt) == opens


# gpt-oss's harmony output after the prompt's `<|start|>assistant`: (output, reasoning, content)
HARMONY = [
    (
        "<|channel|>analysis<|message|>User greets.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
        "User greets.",
        "Hello!",
    ),
    ("<|channel|>final<|message|>Hi.", None, "Hi."),  # no reasoning; the stop token left out
    ("<|channel|>analysis<|message|>Still <|en", "Still <|en", None),
    (
        "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>"
        "b<|end|><|start|>assistant<|channel|>final<|message|>c<|end|>",
        "ab",
        "c",
    ),
    (  # a tool call stays content as written, for a tool parser
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>',
        "Need weather.",
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>',
    ),
    ("Plain answer.", None, "Plain answer."),
    ("<|chan", None, "<|chan"),
    ("", None, None),
]


@pytest.mark.parametrize("text, reasoning, content", HARMONY)
def test_harmony_channels_split_and_stream_alike(text: str, reasoning, content) -> None:
    assert HarmonyReasoningParser().parse(text) == (reasoning, content)
    for chunks in splits(text):
        parser = HarmonyReasoningParser()
        pieces = [*map(parser.feed, chunks), parser.finish()]
        assert "".join(r for r, _ in pieces) == (reasoning or ""), chunks
        assert "".join(c for _, c in pieces) == (content or ""), chunks


def test_harmony_parser_keeps_special_tokens_and_holds_back_markers() -> None:
    assert REASONING_PARSERS["gpt-oss"].special_markers
    assert not REASONING_PARSERS["qwen3"].special_markers
    parser = HarmonyReasoningParser()
    assert parser.feed("<|channel|>analysis<|mess") == ("", "")
    assert parser.feed("age|>Think<|e") == ("Think", "")
    assert not parser.reasoning_ended
    assert parser.feed("nd|><|start|>assistant<|channel|>final<|message|>Done") == ("", "Done")
    assert parser.reasoning_ended
