"""Perplexity computed the way llama.cpp's `llama-perplexity` does, so the two are comparable.

The text is tokenized once (with BOS when the model adds one), cut into non-overlapping chunks of
`ctx` tokens whose first token is replaced by BOS, and only the second half of each chunk is
scored, so every scored token has at least ctx/2 tokens of context.

With `decode`, each scored token's logits come from a one-token decode step over the cached
context, as in generation, instead of from one pass over the chunk: decode steps take other
kernels (the quantized GEMVs, which round activations to int8), whose quality this measures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tokenmill.engine.model_runner import ModelRunner, blocks_needed
from tokenmill.errors import InvalidRequestError
from tokenmill.model.loader import LoadedModel


@dataclass
class PerplexityResult:
    ppl: float
    ppl_error: float  # standard error of the estimate, as llama-perplexity prints after "+/-"
    num_chunks: int
    num_scored: int
    chunk_ppls: list[float] = field(default_factory=list)  # running estimate after each chunk


def perplexity(
    loaded: LoadedModel,
    token_ids: list[int],
    ctx: int = 512,
    max_chunks: int | None = None,
    on_chunk: Callable[[int, float], None] | None = None,
    decode: bool = False,
    kv_cache_dtype: str = "auto",
) -> PerplexityResult:
    if ctx < 4:
        raise InvalidRequestError("--ctx must be at least 4")
    num_chunks = len(token_ids) // ctx
    if max_chunks is not None:
        num_chunks = min(num_chunks, max_chunks)
    if len(token_ids) < 2 * ctx:
        raise InvalidRequestError(
            f"the text has {len(token_ids)} tokens; at least {2 * ctx} (2 x ctx) are needed"
        )
    tok = loaded.tokenizer
    bos = tok.bos_token_id if tok.add_bos else None
    runner = ModelRunner(loaded, num_blocks=blocks_needed(ctx, 16), kv_cache_dtype=kv_cache_dtype)
    table = list(range(runner.cache.num_blocks))
    first = ctx // 2
    nll_sum = nll2_sum = 0.0
    count = 0
    running = []
    for i in range(num_chunks):
        chunk = token_ids[i * ctx : (i + 1) * ctx]
        if bos is not None:
            chunk = [bos] + chunk[1:]
        nll = (
            _decoded_nll(runner, chunk, first, table)
            if decode
            else _prompt_nll(runner, chunk, first, table)
        ).double()
        nll_sum += float(nll.sum())
        nll2_sum += float((nll * nll).sum())
        count += len(nll)
        running.append(math.exp(nll_sum / count))
        if on_chunk:
            on_chunk(i, running[-1])
    mean = nll_sum / count
    variance = max(nll2_sum / count - mean * mean, 0.0)
    ppl = math.exp(mean)
    error = ppl * math.sqrt(variance / max(count - 1, 1))
    return PerplexityResult(
        ppl=ppl, ppl_error=error, num_chunks=num_chunks, num_scored=count, chunk_ppls=running
    )


def _prompt_nll(
    runner: ModelRunner, chunk: list[int], first: int, table: list[int]
) -> torch.Tensor:
    """Negative log-likelihoods of chunk[first + 1:], from one pass over the chunk as a prompt."""
    hidden = runner.hidden_states([chunk], [len(chunk)], [table], [len(chunk)])
    return _nll(runner.model.logits(hidden[first : len(chunk) - 1]), chunk[first + 1 :])


def _decoded_nll(
    runner: ModelRunner, chunk: list[int], first: int, table: list[int]
) -> torch.Tensor:
    """The same, from one decode step per token (as output tokens) after a pass over
    chunk[:first] (as a prompt)."""
    runner.hidden_states([chunk[:first]], [first], [table], [first])
    return torch.cat(
        [
            _nll(
                runner.last_token_logits([[chunk[pos]]], [pos + 1], [table]),
                chunk[pos + 1 : pos + 2],
            )
            for pos in range(first, len(chunk) - 1)
        ]
    )


def _nll(logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    return -torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(targets)[:, None]).squeeze(1)
