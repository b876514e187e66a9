"""Runs the model over one step's batch: index tensors, forward pass, logits of the tokens asked for."""

from __future__ import annotations

import torch

from tokenmill.model.attention import AttentionBatch, KVCache
from tokenmill.model.loader import LoadedModel


# Steps with fewer tokens run on one intra-op thread. A few-token step is bound by weight bytes
# and per-op overhead, which a second thread barely shortens (measured: 52 vs 50 tok/s batch-1
# decode), while its spinning OpenMP worker competes with the HTTP thread and the client for the
# cores: batch-1 serving fell from 43 to 30 tok/s with two threads on a 2-core machine.
MULTITHREAD_MIN_TOKENS = 8
# The process's configured intra-op threads, read before any runner switches to one thread:
# a runner created later must not mistake that switch for the configuration.
_CONFIGURED_THREADS: int | None = None


class ModelRunner:
    """Owns the model and its paged KV cache; block allocation is the caller's business."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16) -> None:
        global _CONFIGURED_THREADS
        if _CONFIGURED_THREADS is None:
            _CONFIGURED_THREADS = torch.get_num_threads()
        self.max_threads = _CONFIGURED_THREADS
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=loaded.dtype)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        all_logits: bool = False,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """Feed sequence i its new tokens token_ids[i], ending at context length context_lens[i].

        Returns float32 logits of each sequence's last new token (num_seqs, vocab), or of every new
        token (total_tokens, vocab) when all_logits is set; with hidden_only, the final hidden
        states instead of logits (for callers that need logits of only some tokens).
        """
        query_lens = [len(t) for t in token_ids]
        threads = self.max_threads if sum(query_lens) >= MULTITHREAD_MIN_TOKENS else 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        batch = AttentionBatch.build(query_lens, context_lens, block_tables, self.block_size, self.cache.pad_slot)
        flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
        hidden = self.model(flat, self.cache, batch)
        if hidden_only:
            return hidden
        if not all_logits:
            last = torch.tensor(query_lens).cumsum(0) - 1
            hidden = hidden[last]
        return self.model.compute_logits(hidden)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
