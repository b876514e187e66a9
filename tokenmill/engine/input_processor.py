"""InputProcessor: from what a front end sends to a `Request` the engine can queue.

It tokenizes (text prompts, and chat messages through the model's chat template: the one place
any front end tokenizes), validates the sampling parameters and the prompt against the model,
and fans a request with n > 1 out into its n sequences. It keeps no state of its own, so it runs
on whichever thread calls it: the server's event loop, or the thread of an offline caller. What
needs the engine's state (a request id already in use, a full queue) is checked by
`LLMEngine.enqueue`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from tokenmill.engine.request import Request, Sequence
from tokenmill.engine.structured_output import GrammarCompiler
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.sample import SamplingParams
from tokenmill.sample.params import MAX_SEED
from tokenmill.sample.sampler import request_generator
from tokenmill.tokenizer import IncrementalDetokenizer, Tokenizer


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        block_size: int,
        outputs_keyed_apart: bool = False,
    ) -> None:
        """outputs_keyed_apart: the sequences' `Sequence.outputs_keyed_apart`."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.outputs_keyed_apart = outputs_keyed_apart
        self.grammars = GrammarCompiler(tokenizer, vocab_size)

    def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a text prompt (BOS added where the model wants one, unless
        add_special_tokens is off), or of chat messages rendered with the chat template (which
        writes BOS itself, and the tools' descriptions where there are tools). Exactly one of
        prompt and messages; InvalidRequestError for input that cannot be tokenized."""
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give either prompt or messages")
        if messages is None:
            return self.tokenizer.encode(prompt, add_bos=None if add_special_tokens else False)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
        except TokenmillError:
            raise
        except Exception as exc:  # noqa: BLE001 - template errors come from user-supplied messages
            raise InvalidRequestError(
                f"the chat template could not render these messages: {exc}", param="messages"
            ) from exc
        return self.tokenizer.encode(text, add_bos=False)

    def process(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        extra_key: str | None = None,
        tenant: str = "",
    ) -> Request:
        """The request with its sequences, ready to queue; InvalidRequestError for anything the
        model cannot serve. A text prompt is tokenized; token ids are taken as they are."""
        params = params or SamplingParams()
        params.validate(vocab_size=self.vocab_size)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
            if any(not 0 <= t < self.vocab_size for t in token_ids):
                raise InvalidRequestError(
                    f"prompt token ids must be in [0, {self.vocab_size})", param="prompt"
                )
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            max_tokens=self._max_tokens(len(token_ids), params),
            stop_token_ids=frozenset(params.stop_token_ids)
            | (frozenset() if params.ignore_eos else self.tokenizer.stop_token_ids),
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(token_ids)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        # compiled here, on the caller's thread: a slow grammar never holds up the engine's steps
        spec = params.structured_outputs
        matcher = self.grammars.matcher(spec) if spec is not None else None
        for index in range(params.n):
            seq = self._sequence(request, index, arrival, priority, extra_key, tenant)
            if matcher is not None:  # each sequence advances its own
                seq.matcher = matcher if index == 0 else matcher.deep_copy()
            request.sequences.append(seq)
        return request

    def _max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The tokens a sequence may generate: max_tokens, or all the room the context leaves."""
        if not num_prompt_tokens:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {num_prompt_tokens} tokens; this model's context is "
                f"{self.max_model_len} tokens, leaving no room to generate",
                param="prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={max_tokens} plus the prompt's {num_prompt_tokens} tokens exceeds "
                f"the context of {self.max_model_len} tokens",
                param="max_tokens",
            )
        return max_tokens

    def _sequence(
        self,
        request: Request,
        index: int,
        arrival: float,
        priority: int,
        extra_key: str | None,
        tenant: str,
    ) -> Sequence:
        params = request.params
        if params.seed is not None and params.n > 1:  # distinct but reproducible sequences
            seed = (params.seed + index + MAX_SEED + 1) % (2 * (MAX_SEED + 1)) - MAX_SEED - 1
            params = replace(params, seed=seed)
        return Sequence(
            seq_id=f"{request.request_id}#{index}" if request.params.n > 1 else request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            params=params,
            arrival_time=arrival,
            priority=priority,
            extra_key=extra_key,
            tenant=tenant,
            block_size=self.block_size,
            outputs_keyed_apart=self.outputs_keyed_apart,
            request=request,
            index=index,
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            ),
            generator=request_generator(params),
            logprobs=[] if params.logprobs is not None else None,
        )
