"""What the engine hands back each step, per request (vLLM's RequestOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


# For each generated (or prompt) token: its own logprob and the top alternatives, by token id.
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the n sequences of a request. Cumulative fields plus this step's delta, for
    streaming."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the request failed (finish_reason "error")
    error_is_input: bool = False  # the failure is the request's own (an output constraint that
    # cannot go on), not the engine's
