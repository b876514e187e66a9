"""Driving an engine through a list of requests, as the batch-invariance tests do."""

from __future__ import annotations

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import CompletionOutput
from tokenmill.sample import SamplingParams


def final_outputs(
    engine: LLMEngine, requests: list[tuple[str | list[int], SamplingParams]], per_step: int = 0
) -> list[CompletionOutput]:
    """Each request's finished output, in the order given; per_step > 0 adds that many requests
    before each step (arrivals at different steps), 0 all of them at once."""
    ids, pending, finals = [], list(requests), {}
    while pending or engine.has_unfinished_requests():
        take = len(pending) if per_step == 0 else per_step
        for prompt, params in pending[:take]:
            ids.append(engine.add_request(None, prompt, params))
        pending = pending[take:]
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    return [finals[i] for i in ids]
