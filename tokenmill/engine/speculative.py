"""Speculative decoding: draft a few tokens cheaply, verify them all in one target forward.

A decoding sequence with drafts computes its last token and its k drafts in one step; the target
samples a token at each of the k + 1 positions, as it would have one position at a time (each
position's penalties see the drafts before it, a seeded request draws from its own generator in
order). Drafts are accepted while they equal the target's own token; the first that does not is
replaced by it, and where all are accepted the last position's token comes on top. Drafts here are
deterministic (a point mass), for which this rule is the standard accept / resample-from-the-
residual rule: the draft d is accepted with probability p(d), and the target's token given that it
is not d follows the residual p(x) / (1 - p(d)), x != d. So the output's distribution is the
target's, and a greedy output is the one plain decoding gives.

Drafting by prompt lookup ("ngram"): the longest n-gram ending the sequence (prompt_lookup_max
tokens down to prompt_lookup_min) that occurred earlier in its tokens proposes the tokens that
followed its latest earlier occurrence. Drafting by a draft model ("draft_model"): a smaller model
with the target's vocabulary proposes its greedy tokens, at the start of the step that verifies
them (see `LLMEngine._draft_with_model`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.errors import InvalidRequestError

# Running sequences above which no sequence drafts: a step of that many rows is bound by compute,
# not by reading the weights, and verifying drafts no longer comes for free
SPECULATION_MAX_BATCH = 8
# Longest pause, in steps, of a sequence whose drafts keep missing: it pauses 1, 2, 4, ... steps
# after each verification in a row that accepted nothing, since a step that verifies drafts runs
# eagerly while plain decode steps run through the compiled graphs
SPECULATION_MAX_PAUSE = 16
# Token ids a draft model's output head computes by default, below the special tokens, which it
# always computes: byte-level BPE vocabularies number their tokens in merge order, roughly by
# frequency, so the first ids cover most of what a target writes while the head reads a fraction
# of a large vocabulary's rows (EAGLE-3's and FR-Spec's reduced draft vocabulary); a token the
# draft cannot propose is one draft rejected, never a different output
DRAFT_VOCAB_SIZE = 32768
# A draft model's probability for its own draft below which it drafts no further in that step:
# the target rejects an unsure draft often, so drafts after it seldom pay for their draft steps
# and verification rows (HF transformers' assistant_confidence_threshold)
DRAFT_MIN_CONFIDENCE = 0.6


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`: {"method": "ngram", "num_speculative_tokens": K,
    "prompt_lookup_min": 1, "prompt_lookup_max": 4}, or {"model": "<alias or path>",
    "num_speculative_tokens": K, "draft_vocab_size": V} (method "draft_model"; the draft's head
    computes the first V token ids and the special tokens, null: every token)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model
    draft_vocab_size: int | None = DRAFT_VOCAB_SIZE

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """The config from its JSON text or dict (None: no speculation); InvalidRequestError
        saying what is wrong with it."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"the speculative config is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise InvalidRequestError("the speculative config must be a JSON object")
        if "model" in value:
            value = {"method": "draft_model", **value}
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
        known |= {"model", "draft_vocab_size"}
        if unknown := sorted(set(value) - known):
            raise InvalidRequestError(
                f"unknown speculative config key {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        config = cls(**value)
        if config.method not in ("ngram", "draft_model"):
            raise InvalidRequestError(
                f'unknown speculative method {config.method!r}; tokenmill drafts with "ngram" '
                'or a draft model ({"model": ...})'
            )
        if (config.method == "draft_model") != (config.model is not None):
            raise InvalidRequestError('method "draft_model" goes with a "model", and only it')
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise InvalidRequestError(
                "the speculative config needs 1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        if config.num_speculative_tokens < 1:
            raise InvalidRequestError("num_speculative_tokens must be at least 1")
        if config.draft_vocab_size is not None and config.draft_vocab_size < 1:
            raise InvalidRequestError(
                "draft_vocab_size must be at least 1 (or null for the whole vocabulary)"
            )
        return config

    def draft_vocab(self, vocab_size: int, special_ids: set[int]) -> list[int] | None:
        """The token ids a draft model's head computes, in order: the first draft_vocab_size
        ids, then the special tokens past them; None for the whole vocabulary."""
        if self.draft_vocab_size is None or self.draft_vocab_size >= vocab_size:
            return None
        first = self.draft_vocab_size
        return list(range(first)) + sorted(i for i in special_ids if first <= i < vocab_size)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to min(num_speculative_tokens, limit) drafts to follow token_ids."""
        return propose_ngram(
            token_ids,
            min(self.num_speculative_tokens, limit),
            self.prompt_lookup_min,
            self.prompt_lookup_max,
        )


def accepted_drafts(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts the target accepts, sampled[j] being its token at draft j's position: those
    up to the first it did not sample itself (the rule for deterministic drafts, see above)."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The k tokens (or fewer) after the latest earlier occurrence of the longest n-gram, n from
    n_max down to n_min, that ends token_ids; [] where none occurred before."""
    if k <= 0 or len(token_ids) <= n_min:
        return []
    tokens = np.asarray(token_ids)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        # windows starting before the suffix itself, each with at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            after = int(starts[-1]) + n
            return tokens[after : after + k].tolist()
    return []
