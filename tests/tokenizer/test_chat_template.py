"""Chat templates render exactly as transformers' `apply_chat_template(..., tokenize=False)`."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from tokenmill.tokenizer import Tokenizer, TokenizerError
from tokenmill.tokenizer.chat_template import builtin_chat_template, render_chat_template

DATA = Path(__file__).parent.parent / "data" / "tokenizer-vectors"
# openai/gpt-oss-20b's chat_template.jinja (harmony), as TRL keeps it (chat_templates/gptoss.jinja)
HARMONY_TEMPLATE = (
    Path(__file__).parent.parent / "data" / "gpt-oss-chat-template.jinja"
).read_text()
GEMMA3_TEMPLATE = builtin_chat_template("gemma3")

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "  Hello  "},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "Café? 日本 🦙\nnew line"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two", "tool_calls": None},
        {"role": "user", "content": "three"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "five"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chatml_matches_transformers(
    smollm2_tokenizer: Tokenizer, smollm2_hf, messages: list[dict], add_generation_prompt: bool
) -> None:
    ours = smollm2_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt
    )
    theirs = smollm2_hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.startswith("<|im_start|>system\n")


@pytest.fixture(scope="module")
def gemma3_chat(gemma3_tokenizer: Tokenizer) -> Tokenizer:
    tokenizer = copy.copy(gemma3_tokenizer)  # shares the vocabulary, only the template differs
    tokenizer.chat_template = GEMMA3_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_gemma3_matches_transformers(gemma3_chat: Tokenizer, gemma3_hf, messages) -> None:
    ours = gemma3_chat.apply_chat_template(messages)
    theirs = gemma3_hf.apply_chat_template(
        messages, chat_template=GEMMA3_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert ours.startswith("<bos><start_of_turn>user\n") and ours.endswith("<start_of_turn>model\n")


def test_gemma3_prompt_encodes_to_control_tokens(gemma3_chat: Tokenizer) -> None:
    ids = gemma3_chat.encode(gemma3_chat.apply_chat_template(CONVERSATIONS[0]), add_bos=False)
    assert ids[:3] == [2, 105, 2364]  # <bos> <start_of_turn> user


FEATURES_TEMPLATE = """{%- set ns = namespace(count=0) -%}
{{ bos_token }}{% if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{%- for message in messages %}
    {%- if message.role == 'skip' %}{% continue %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    [{{ ns.count }}] {{ message.role }}: {{ message.content | tojson }}{{ eos_token }}
    {%- if message.reasoning_content is defined %} (thought: {{ message.reasoning_content }}){% endif %}
{% endfor %}
{%- if enable_thinking is defined %}thinking={{ enable_thinking }} {% endif %}
{{- dict(a=1) | tojson }} {{ strftime_now('%Y') | length }}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""  # noqa: E501


def test_template_features_match_transformers(smollm2_tokenizer: Tokenizer, smollm2_hf) -> None:
    """namespace, loop controls, tojson (non-ASCII, indent), tools, extra variables, reasoning
    fields."""
    tokenizer = copy.copy(smollm2_tokenizer)
    tokenizer.chat_template = FEATURES_TEMPLATE
    messages = [
        {"role": "user", "content": 'Héllo <b>"quoted"</b> 🦙'},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "ok", "reasoning": "because", "tool_calls": None},
    ]
    tools = [
        {"type": "function", "function": {"name": "f", "description": "ünïcode", "parameters": {}}}
    ]
    ours = tokenizer.apply_chat_template(messages, tools=tools, enable_thinking=False)
    theirs = smollm2_hf.apply_chat_template(
        messages, chat_template=FEATURES_TEMPLATE, tools=tools, tokenize=False,
        add_generation_prompt=True, enable_thinking=False,
    )  # fmt: skip
    assert ours == theirs
    assert (
        '"Héllo <b>\\"quoted\\"</b> 🦙"' in ours
        and "(thought: because)" in ours
        and "hidden" not in ours
    )


def test_template_errors_are_reported(gemma3_chat: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="roles must alternate"):
        gemma3_chat.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        )
    with pytest.raises(TokenizerError, match="empty conversation"):
        gemma3_chat.apply_chat_template([])


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
            },
            "required": ["city"],
        },
    },
}
HARMONY_CONVERSATIONS = [  # (messages, tools, chat_template_kwargs)
    ([{"role": "user", "content": "Hi!"}], None, {}),
    (
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "thinking": "Add them."},
            {"role": "user", "content": "And 3+3?"},
        ],
        None,
        {
            "reasoning_effort": "high",
            "builtin_tools": ["browser", "python"],
            "model_identity": "You are a test.",
        },
    ),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "thinking": "Call the tool.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "content": "sunny"},
        ],
        [WEATHER_TOOL],
        {},
    ),
]


@pytest.mark.parametrize("messages, tools, kwargs", HARMONY_CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gpt_oss_harmony_template_matches_transformers(
    messages, tools, kwargs, add_generation_prompt: bool
) -> None:
    """gpt-oss's template: its kwargs (reasoning effort, built-in tools, identity), the date from
    strftime_now, tools in TypeScript, reasoning as `thinking`."""
    ours = render_chat_template(
        HARMONY_TEMPLATE,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        special_tokens={},
        extra=kwargs,
    )
    theirs = render_jinja_template(
        conversations=[messages],
        chat_template=HARMONY_TEMPLATE,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )[0][0]
    assert ours == theirs
    assert ours.startswith("<|start|>system<|message|>")
    assert ours.endswith("<|start|>assistant") == add_generation_prompt
    assert ("Reasoning: high" in ours) == ("reasoning_effort" in kwargs)


def test_gpt_oss_takes_reasoning_content_as_thinking() -> None:
    """The OpenAI API's `reasoning_content` reaches harmony's analysis channel."""
    messages, tools, _ = HARMONY_CONVERSATIONS[2]
    as_thinking = render_chat_template(
        HARMONY_TEMPLATE,
        messages,
        add_generation_prompt=True,
        tools=tools,
        special_tokens={},
        extra={},
    )
    renamed = [
        {("reasoning_content" if k == "thinking" else k): v for k, v in m.items()} for m in messages
    ]
    ours = render_chat_template(
        HARMONY_TEMPLATE,
        renamed,
        add_generation_prompt=True,
        tools=tools,
        special_tokens={},
        extra={},
    )
    assert ours == as_thinking
    assert "<|channel|>analysis<|message|>Call the tool.<|end|>" in ours
