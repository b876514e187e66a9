"""End-to-end checks on the two real models (pulled from the catalog into the model cache)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tokenmill.cli.main import main
from tokenmill.llm import LLM
from tokenmill.sample import SamplingParams


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real_llm(request, smollm2_gguf, gemma3_gguf) -> Iterator[LLM]:
    # Default settings. Shut down after the module: it may be loading (or building) its decode
    # graphs on a background thread, which must not outlive the module (batches against requests
    # alone: tests/test_real_batch_invariance.py)
    with LLM(str(smollm2_gguf if request.param == "smollm2" else gemma3_gguf)) as llm:
        yield llm


def test_generate_with_no_model_uses_smollm2_and_says_paris(smollm2_gguf, capsys) -> None:
    assert main(["generate", "--max-tokens", "8", "The capital of France is"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_gemma_names_the_capital_of_france(gemma3_gguf, capsys) -> None:
    assert (
        main(
            [
                "generate",
                "--model",
                str(gemma3_gguf),
                "--max-tokens",
                "12",
                "The capital of France is the city of",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # llama-server's greedy answer: " Paris. It is the most visited city in the world." " Paris"
    # leads by over 2 nats in the dequantized and the packed model alike; after "The capital of
    # France is" the 270M model's next words hang on near-ties that any rounding can flip
    assert "Paris" in out, out


def test_chat_renders_the_template(real_llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    out = real_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    tok = real_llm.tokenizer
    assert out.prompt_token_ids == tok.encode(tok.apply_chat_template(messages), add_bos=False)
    if tok.bos_token_id is not None and tok.add_bos:  # the template writes BOS itself: exactly once
        assert out.prompt_token_ids.count(tok.bos_token_id) == 1
    if "im_start" in tok.chat_template:  # SmolLM2-Instruct answers; Gemma 3 270M is a base model
        assert "Paris" in out.outputs[0].text
