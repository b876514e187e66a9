"""Batch invariance on the real models with default settings, and on SmolLM2 dense in fp32 (`-q none
--dtype fp32`): a request's tokens do not depend on what else the engine runs (neighbours, arrival
step, chunk boundaries, eager or compiled decode).

The references are each prompt run alone on an engine as `LLM()` builds it (with those options).
For the default settings it is told to build its decode graphs in the background at once, so that
the compiled test finds them ready or waits for them rather than building them again; its steps
decode eagerly until then, and through the graphs after. The dense configuration runs eagerly
only: its compiled graphs give an eager step's bits (tests/engine/test_compiled_decode.py), and
building them would add minutes to a cold test run. Greedy requests are then run 64 at a time,
arriving over several steps, under a small token budget that cuts the long prompts into chunks,
on an engine that decodes eagerly throughout; seeded sampled requests in batches of 7 and 32; both
again with the compiled decode graphs (default settings); and through `tokenmill serve` with no
other flags, concurrently (default settings: the server adds no arithmetic of its own).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from tests.engine_runs import final_outputs
from tests.server.conftest import free_port
from tokenmill.engine import model_runner
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sample import SamplingParams

SUBJECTS = [
    "France",
    "the ocean",
    "music",
    "a small town",
    "computers",
    "the moon",
    "winter",
    "tea",
]
TEMPLATES = [
    "The capital of {} is",
    "Here is a short story about {}:",
    "Three facts about {}:",
    "Q: What do you know about {}?\nA:",
]
SENTENCE = "Write down everything you know about {}, with dates, places and names. "
# 64 prompts from 5 to ~200 tokens; the long ones take several chunks of BUDGET tokens
PROMPTS = [t.format(s) for t in TEMPLATES for s in SUBJECTS]
PROMPTS += [
    SENTENCE.format(s) * (4 + i % 9) + t.format(s)
    for t in TEMPLATES
    for i, s in enumerate(SUBJECTS)
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SAMPLED = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=16) for i in range(32)]
BUDGET = 64  # tokens per step for the batched runs
ARRIVALS_PER_STEP = 8

pytestmark = pytest.mark.timeout(1500)


class Subject(NamedTuple):
    path: Path
    options: dict  # LLMEngine's
    compiled: bool  # whether its runs alone build the decode graphs (see the module docstring)


DEFAULT_SETTINGS = ["smollm2", "gemma3", "qwen-coder-1.5b"]


@pytest.fixture(scope="module", params=[*DEFAULT_SETTINGS, "smollm2-dense-fp32"])
def model(request) -> Subject:
    if request.param == "smollm2-dense-fp32":  # dense layers through tokenmill's fp32 matmul
        options = {"quantization": "none", "dtype": "fp32"}
        return Subject(request.getfixturevalue("smollm2_gguf"), options, compiled=False)
    fixtures = {
        "smollm2": "smollm2_gguf",
        "gemma3": "gemma3_gguf",
        "qwen-coder-1.5b": "qwen_coder_15b_gguf",
    }
    path = request.getfixturevalue(fixtures[request.param])
    return Subject(path, {}, compiled=True)


@pytest.fixture(scope="module")
def alone(model) -> dict[str, list[list[int]]]:
    """Each request run by itself (see the module docstring); its token ids and its text."""
    engine = LLMEngine(model.path, compile=model.compiled, **model.options)
    greedy = [_run(engine, [(p, GREEDY)], text=True)[0] for p in PROMPTS]
    sampled = [_run(engine, [(p, s)], text=True)[0] for p, s in zip(PROMPTS, SAMPLED)]
    return {
        "greedy": [ids for ids, _ in greedy],
        "sampled": [ids for ids, _ in sampled],
        "texts": [text for _, text in (*sampled, *greedy[:32])],
    }


def _run(
    engine: LLMEngine,
    requests: list[tuple[str, SamplingParams]],
    per_step: int = 0,
    text: bool = False,
) -> list:
    """Token ids of each request (with text: (token ids, text)); per_step: see `final_outputs`."""
    outputs = final_outputs(engine, requests, per_step)
    return [(o.token_ids, o.text) if text else o.token_ids for o in outputs]


def _check_batches(engine: LLMEngine, alone: dict[str, list[list[int]]]) -> None:
    greedy = _run(engine, [(p, GREEDY) for p in PROMPTS], per_step=ARRIVALS_PER_STEP)
    differ = [i for i, (a, b) in enumerate(zip(greedy, alone["greedy"])) if a != b]
    assert not differ, f"greedy prompts {differ} differ from their runs alone"
    for size in (7, 32):
        sampled = _run(engine, list(zip(PROMPTS[:size], SAMPLED[:size])))
        differ = [i for i, (a, b) in enumerate(zip(sampled, alone["sampled"])) if a != b]
        assert not differ, f"seeded requests {differ} differ inside a batch of {size}"


def test_eager_batches_equal_requests_alone(model, alone) -> None:
    engine = LLMEngine(model.path, max_num_batched_tokens=BUDGET, compile=False, **model.options)
    _check_batches(engine, alone)
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks  # every request's blocks back


@pytest.mark.parametrize("model", DEFAULT_SETTINGS, indirect=True)
def test_compiled_batches_equal_requests_alone(model, alone, monkeypatch) -> None:
    # The graphs come from the user's cache (built once, minutes on a cold one), but trials saved
    # there by an earlier run (`tokenmill serve` of the same model and code) may have found them
    # no faster than eager steps on this machine, and a start then skips them: this test is about
    # what the graphs compute, so it reads no saved trials.
    monkeypatch.setattr(model_runner, "_read_trials", lambda path: {})
    engine = LLMEngine(model.path, max_num_batched_tokens=BUDGET, compile=True, **model.options)
    assert engine.runner.wait_compiled(timeout=1200), repr(engine.runner.compile_error)
    _check_batches(engine, alone)
    assert engine.runner.uncompiled_decode_steps == 0


@pytest.mark.parametrize("model", DEFAULT_SETTINGS, indirect=True)
def test_served_requests_equal_requests_alone(model, alone, tmp_path) -> None:
    """`tokenmill serve MODEL` with no other flags: 32 seeded and 32 greedy requests at once."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TOKENMILL_API_KEY"}
    log = (tmp_path / "serve.log").open("w")
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", str(model.path)]
    cmd += ["--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc)
        texts = asyncio.run(_served(url))
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    differ = [i for i, (a, b) in enumerate(zip(texts, alone["texts"])) if a != b]
    assert not differ, f"served requests {differ} differ from their runs alone"


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "tokenmill serve exited"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("tokenmill serve did not come up in 120 s")


async def _served(url: str) -> list[str]:
    """The texts of 32 seeded and 32 greedy completions sent at once."""

    async def complete(client: httpx.AsyncClient, prompt: str, params: SamplingParams) -> str:
        body = {
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "ignore_eos": params.ignore_eos,
        }
        response = await client.post(f"{url}/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    async with httpx.AsyncClient() as client:
        requests = [*zip(PROMPTS[:32], SAMPLED), *((p, GREEDY) for p in PROMPTS[:32])]
        return list(await asyncio.gather(*(complete(client, p, s) for p, s in requests)))
