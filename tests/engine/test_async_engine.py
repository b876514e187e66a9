"""The async engine streams per-request outputs to asyncio consumers and aborts on early exit."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import InvalidRequestError
from tokenmill.sample import SamplingParams


@pytest.fixture()
def async_engine(tiny_loaded):
    engine = AsyncLLMEngine(LLMEngine(tiny_loaded, num_kv_blocks=64))
    yield engine
    engine.shutdown()


def test_concurrent_streams_equal_offline_outputs(async_engine, tiny_loaded) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown", "Paris is", "def add(a, b):", "Once upon"]
    offline = LLMEngine(tiny_loaded, num_kv_blocks=64)
    expected = {}
    for i, p in enumerate(prompts):
        offline.add_request(str(i), p, params)
    while offline.has_unfinished_requests():
        expected |= {o.request_id: o.outputs[0].text for o in offline.step() if o.finished}

    async def consume(i: int, prompt: str) -> tuple[str, str]:
        text = ""
        async for out in async_engine.generate(prompt, params, request_id=str(i)):
            text += out.outputs[0].text_delta
        return str(i), text

    async def main():
        return dict(await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts))))

    assert asyncio.run(main()) == expected


def test_early_exit_aborts_and_frees_blocks(async_engine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main():
        async for out in async_engine.generate("Once upon a time", params, request_id="x"):
            if len(out.outputs[0].token_ids) >= 3:
                break
        for _ in range(100):
            stats = await async_engine.call(
                lambda e: (e.has_unfinished_requests(), e.kv.num_free_blocks)
            )
            if not stats[0]:
                return stats[1]
            await asyncio.sleep(0.01)

    assert asyncio.run(main()) == async_engine.engine.kv.num_total_blocks


def test_bad_request_raises_to_the_caller_only(async_engine) -> None:
    async def main():
        with pytest.raises(InvalidRequestError):
            async for _ in async_engine.generate("", SamplingParams(), request_id="bad"):
                pass
        outs = [
            o
            async for o in async_engine.generate(
                "Paris", SamplingParams(max_tokens=2), request_id="ok"
            )
        ]
        return outs[-1].finished

    assert asyncio.run(main())
    assert async_engine.is_healthy


def test_engine_built_by_a_factory_lives_on_the_engine_thread(tiny_loaded) -> None:
    import threading

    built_on = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine(tiny_loaded, num_kv_blocks=64)

    engine = AsyncLLMEngine(build)
    try:
        assert built_on == ["tokenmill-engine"] and isinstance(engine.engine, LLMEngine)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

        async def main():
            return [out async for out in engine.generate("Paris is", params, request_id="a")]

        assert asyncio.run(main())[-1].finished
    finally:
        engine.shutdown()


def test_factory_failure_is_raised_to_the_caller() -> None:
    def build() -> LLMEngine:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        AsyncLLMEngine(build)


def test_shutdown_waits_for_the_step_in_progress(tiny_loaded, monkeypatch) -> None:
    # The engine thread is a daemon: one still inside a step's kernels when the interpreter exits
    # would abort the process, so shutdown waits out a step longer than it once did (5 s)
    llm = LLMEngine(tiny_loaded, num_kv_blocks=64)
    stepping = threading.Event()
    step = llm.step

    def slow_step() -> list:
        stepping.set()
        time.sleep(6.0)
        return step()

    monkeypatch.setattr(llm, "step", slow_step)
    llm.add_request("slow", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    engine = AsyncLLMEngine(llm)
    assert stepping.wait(30)
    engine.shutdown()
    assert not engine._thread.is_alive()
