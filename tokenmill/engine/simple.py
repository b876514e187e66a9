"""Single-sequence generation: the first end-to-end path, before the batching engine exists."""

from __future__ import annotations

from typing import Iterator

import torch

from tokenmill.errors import InvalidRequestError

from tokenmill.engine.model_runner import ModelRunner, blocks_needed
from tokenmill.model.loader import LoadedModel


def generate_tokens(
    loaded: LoadedModel,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    seed: int | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Iterator[int]:
    """Yield up to max_tokens new token ids (greedy when temperature is 0), stopping at stop_ids."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty: give at least one token")
    total = len(prompt_ids) + max_tokens
    limit = loaded.config.max_position_embeddings
    if total > limit:
        raise InvalidRequestError(f"prompt ({len(prompt_ids)} tokens) + max tokens ({max_tokens}) exceeds the "
                         f"model's context of {limit} tokens")
    runner = ModelRunner(loaded, num_blocks=blocks_needed(total, 16))
    table = list(range(runner.cache.num_blocks))
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    new_ids, context = list(prompt_ids), 0
    for _ in range(max_tokens):
        context += len(new_ids)
        logits = runner.forward([new_ids], [context], [table])[0]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(logits.argmax())
        yield token
        if token in stop_ids:
            return
        new_ids = [token]
