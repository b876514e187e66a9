"""`--reasoning-parser`: a `<think>` model's reasoning comes back as `reasoning_content`, streamed
and not, and an output constraint holds from the end of the reasoning. The model is a tiny random
one whose tokenizer has `<think>` and `</think>` tokens and whose chat template opens the
reasoning in the generation prompt, as DeepSeek-R1's does."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import API_KEY, RunningServer
from tests.tiny_models import CHATML, build_tiny_model
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server.app import ServerConfig

OPENS_REASONING = CHATML.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'")
MESSAGES = [{"role": "user", "content": "Is Paris the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, one_torch_thread):
    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny-r1"),
        added_tokens=["<think>", "</think>"],
        chat_template=OPENS_REASONING,
    )
    running = RunningServer(
        LLMEngine(path, num_kv_blocks=128, max_model_len=256),
        ServerConfig("tiny", api_key=API_KEY, reasoning_parser="deepseek_r1"),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def end_of_thinking(server) -> str:
    """The token id of </think>, for a logit_bias that makes the random model close its
    reasoning within a few dozen tokens."""
    return str(server.async_engine.tokenizer.added_token_id("</think>"))


def _streamed(client, **kwargs) -> tuple[str, str, str | None]:
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("constrained", [False, True], ids=["free", "choice"])
def test_reasoning_is_split_off_and_the_constraint_follows_it(
    client, end_of_thinking, constrained: bool
) -> None:
    extra = {"guided_choice": ["yes", "no"]} if constrained else {}
    closed = 0
    for seed in range(6):
        kwargs = dict(
            messages=MESSAGES,
            max_tokens=48,
            seed=seed,
            logit_bias={end_of_thinking: 5.0},
            extra_body=extra,
        )
        choice = client.chat.completions.create(model="tiny", **kwargs).choices[0]
        reasoning = getattr(choice.message, "reasoning_content", None)
        content = choice.message.content
        assert "</think>" not in (reasoning or "")
        if constrained and choice.finish_reason == "stop":  # the answer follows the reasoning
            assert content in ("yes", "no")
        closed += content is not None
        assert _streamed(client, **kwargs) == (reasoning or "", content or "", choice.finish_reason)
    assert closed >= 3


def test_reasoning_that_never_closes_is_all_reasoning(client) -> None:
    choice = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0
    ).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and choice.message.reasoning_content


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory, one_torch_thread):
    """A server with gpt-oss's reasoning parser, over the tiny model (its `<|im_start|>` stands
    for harmony's special marker tokens)."""
    path = build_tiny_model(tmp_path_factory.mktemp("tiny-harmony"))
    running = RunningServer(
        LLMEngine(path, num_kv_blocks=64, max_model_len=256),
        ServerConfig("tiny", api_key=API_KEY, reasoning_parser="gpt-oss"),
    )
    yield openai.OpenAI(base_url=f"{running.url}/v1", api_key=API_KEY, max_retries=0), running
    running.stop()


def test_harmony_keeps_special_tokens_and_refuses_constraints(harmony_client) -> None:
    """The harmony parser reads channel markers, which are special tokens: the output keeps them
    (here, output that opens no channel is all content). An output constraint could not allow
    the final channel's header: refused, saying so."""
    client, running = harmony_client
    marker = str(running.async_engine.tokenizer.added_token_id("<|im_start|>"))
    choice = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, logit_bias={marker: 100}
    ).choices[0]
    assert choice.message.content == "<|im_start|>" * 3
    assert getattr(choice.message, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError, match="reasoning-parser gpt-oss"):
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=3, extra_body={"guided_choice": ["a"]}
        )
