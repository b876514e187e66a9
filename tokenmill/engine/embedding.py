"""EmbeddingEngine: batched embeddings from an encoder-only model (BERT, sentence-transformers).

An encoder has no KV cache and no decode steps: a batch of texts is one forward pass. Inputs are
tokenized and checked on the caller's thread (`prepare`, stateless), then embedded on the engine
thread (`embed`) in chunks of similar lengths, packed without padding (see `model.encoder`), so a
text's vector is the same whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.engine.llm_engine import EngineStats
from tokenmill.errors import InvalidRequestError
from tokenmill.model.encoder import EncoderConfig, load_encoder
from tokenmill.tokenizer import Tokenizer

DEFAULT_MAX_BATCH_TOKENS = 8192  # tokens per forward pass: bounds the attention and MLP buffers

EmbeddingInput = str | list[int]


class EmbeddingEngine:
    """An encoder model and its tokenizer; serves `embed` and nothing else."""

    def __init__(self, path: str | Path, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS) -> None:
        self.path = Path(path)
        self.encoder = load_encoder(self.path)
        self.config: EncoderConfig = self.encoder.config
        self.tokenizer = Tokenizer.from_hf_dir(self.path)
        self.max_batch_tokens = max(max_batch_tokens, self.config.max_seq_len)
        self.stats = EngineStats()

    @property
    def max_model_len(self) -> int:
        return self.config.max_seq_len

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    # ------------------------------------------------------------------ the engine loop's protocol
    # `AsyncLLMEngine` runs this engine's work as commands; it has no steps of its own.

    def has_unfinished_requests(self) -> bool:
        return False

    def shutdown(self, graceful: bool = True) -> None:
        """As `LLMEngine.shutdown`, which the async engine calls at its end: an encoder runs in
        this process alone, so there is nothing to stop."""

    def warm_kv_cache(self) -> bool:
        return False

    def adopt_reloaded_model(self) -> bool:
        return False  # an encoder loads once

    # ------------------------------------------------------------------ embedding

    def prepare(self, inputs: list[EmbeddingInput], truncate: int | None = None) -> list[list[int]]:
        """Token ids of each input, framed as the encoder expects (see `prepare_inputs`)."""
        return prepare_inputs(
            inputs,
            self.tokenizer.encode_framed,
            self.config.vocab_size,
            self.max_model_len,
            truncate,
        )

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """One float32 vector per sequence, in input order (num_seqs, dimensions). Sequences of
        similar lengths share a forward pass of at most `max_batch_tokens` tokens."""
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        out = torch.empty(len(token_ids), self.dimensions, dtype=torch.float32)
        chunk: list[int] = []
        tokens = 0
        for i in order:
            if chunk and tokens + len(token_ids[i]) > self.max_batch_tokens:
                out[chunk] = self.encoder.embed([token_ids[j] for j in chunk])
                chunk, tokens = [], 0
            chunk.append(i)
            tokens += len(token_ids[i])
        if chunk:
            out[chunk] = self.encoder.embed([token_ids[j] for j in chunk])
        self.stats.prompt_tokens += sum(len(t) for t in token_ids)
        self.stats.tokens_computed += sum(len(t) for t in token_ids)
        return out


def prepare_inputs(
    inputs: list[EmbeddingInput],
    tokenize: Callable[[str, int | None], list[int]],
    vocab_size: int,
    max_len: int,
    truncate: int | None = None,
) -> list[list[int]]:
    """Token ids of each input (a text, tokenized by `tokenize(text, cut)`, or token ids taken as
    they are), checked against the model: stateless, so it runs on any thread. `truncate` cuts
    each input to that many tokens (-1: `max_len`); without it, a longer input is refused."""
    if not inputs:
        raise InvalidRequestError("input must not be empty", param="input")
    if truncate is not None and truncate != -1 and not 1 <= truncate <= max_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be -1 or between 1 and {max_len}, got {truncate}",
            param="truncate_prompt_tokens",
        )
    cut = max_len if truncate == -1 else truncate
    prepared = []
    for index, item in enumerate(inputs):
        if isinstance(item, str):
            ids = tokenize(item, cut)
        else:
            if bad := [t for t in item if not 0 <= t < vocab_size]:
                raise InvalidRequestError(
                    f"input[{index}]: token id {bad[0]} is outside the vocabulary "
                    f"[0, {vocab_size})",
                    param="input",
                )
            ids = list(item[:cut]) if cut else list(item)
        if not ids:
            raise InvalidRequestError(f"input[{index}] has no tokens", param="input")
        if len(ids) > max_len:
            raise InvalidRequestError(
                f"input[{index}] has {len(ids)} tokens, more than this model's limit of "
                f"{max_len}; shorten it, or send truncate_prompt_tokens to cut it",
                param="input",
            )
        prepared.append(ids)
    return prepared
