"""The offline API: `LLM(model=...).generate(prompts, SamplingParams)` and `.chat(messages)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tokenmill.engine.llm_engine import EngineConfig, LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sample import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Runs batches of prompts through one engine; outputs come back in the order given."""

    def __init__(
        self, model: str | Path | None = None, dtype: str = "auto", **engine_options
    ) -> None:
        self.engine = LLMEngine(model, EngineConfig(dtype=dtype), progress=True, **engine_options)
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's graph build and tensor-parallel workers, if any (see
        `LLMEngine.shutdown`)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self.engine.add_request(None, prompt, p))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            self.engine.step()  # let the aborts release their blocks
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation (and the tools the model may call, as OpenAI describes
        them) with the model's chat template, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.engine.tokenize(
                messages=conv, add_generation_prompt=add_generation_prompt, tools=tools
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
