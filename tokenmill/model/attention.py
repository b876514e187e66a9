"""Paged attention: the KV cache lives in fixed-size blocks addressed through block tables.

A forward pass sees a flat list of new tokens from several sequences. Each token's key and value
are written to the cache slot given by `slot_mapping`; each sequence then attends to its whole
context, gathered through its block table. The index tensors are built once per step
(`AttentionBatch.build`) and shared by every layer, so the per-layer work is a scatter, a gather
and one batched SDPA call, with no Python loop over requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.model import kernels

# Compiled decode steps without tokenmill's kernel use `_fused_decode_attention` for heads up to
# this size: inductor's fused reductions beat batched matmuls on narrow heads (SmolLM2's 64) and
# lose on wide ones (Gemma 3's 256), which keep the batched matmuls.
FUSED_DECODE_MAX_HEAD_DIM = 128

# Prompts attend in blocks of this many query rows, each over only the keys its rows can see:
# PyTorch's CPU flash kernel computes a causal mask's upper triangle anyway. Smaller blocks skip
# more of the masked triangle but make more, smaller SDPA calls.
QUERY_BLOCK = 128

# A step with prompt tokens attends through the decode kernel where it serves
# (`kernel_attends_prompts`), every token a query of its own over the keys it may see, in one call
# with one slot table of up to this many (token, context slot) pairs (16 MB of int64). A larger step
# attends in groups of consecutive tokens, each group's table (at most this many pairs) made as it
# attends: a higher bound makes fewer, larger calls and holds larger tables.
KERNEL_PROMPT_MAX_PAIRS = 1 << 21


def kernel_attends_prompts(
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_dim: int,
    device: torch.device | str,
    *,
    batch_invariant: bool = True,
) -> bool:
    """Whether steps with prompt tokens attend through the decode kernel
    (`KERNEL_PROMPT_MAX_PAIRS`): where it takes the model's tensors (`kernel_fits`).

    The kernel computes each token on its own, so a token's result does not depend on how the step
    is packed (the other sequences in it, its size, where chunked prefill cut the prompt); SDPA's
    results depend on its query and key blocks. Without batch_invariant, not on CPUs with AMX,
    where SDPA's flash kernel multiplies bf16 on the matrix unit."""
    return kernel_fits(dtype, cache_dtype, head_dim, device) and (
        batch_invariant or not kernels.cpu_has_amx()
    )


KV_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """The KV cache's dtype for `--kv-cache-dtype`: float16, bfloat16, float32, or auto: float16 for
    a float32 model on CPU (as llama.cpp keeps it), else the model's dtype. A decode step of many
    sequences reads the whole cache, so half the bytes make its attention faster, and the pool holds
    twice the tokens in the same memory."""
    if name == "auto":
        return torch.float16 if model_dtype == torch.float32 and device == "cpu" else model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"unknown KV cache dtype {name!r} (choose auto, {', '.join(KV_CACHE_DTYPES)})"
        )
    return KV_CACHE_DTYPES[name]


class KVCache:
    """One pool of cache slots per layer: `k[layer]` has shape (num_slots + 1, kv_heads, head_dim).
    A model whose layers differ (`ModelConfig.kv_cache_shapes`) gives each tensor's shape instead;
    layers that share another layer's cache have no tensor of their own (`ModelConfig.kv_source`).

    Slot s belongs to block s // block_size; blocks are handed out by the engine's block pool.
    The pool is left uninitialized (zeroing gigabytes would cost seconds at start-up and commit
    all the memory at once): every slot a sequence reads was written first. The one extra slot,
    `pad_slot`, is zero and never written; padded context positions point at it, so garbage
    (possibly NaN) can never leak into attention through a masked position.

    shared_kv: the values are the keys, `v[layer] is k[layer]` (multi-head latent attention caches
    one latent per token that serves as both, see model/mla.py): half the memory.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shared_kv: bool = False,
        shapes: list[tuple[int, int]] | None = None,
    ) -> None:
        """shared_kv: the values are the keys (one tensor per layer: latent attention); shapes:
        (KV heads, head width) of each tensor, in place of num_layers tensors of num_kv_heads x
        head_dim."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_slot = num_blocks * block_size
        shapes = shapes or [(num_kv_heads, head_dim)] * num_layers
        # One tensor per layer, not views of one big tensor: a compiled step mutates each layer's
        # cache in place, which it can only do without copying for a tensor that is not a view.
        shape = (self.pad_slot + 1,)
        self.k = [torch.empty((*shape, *s), dtype=dtype, device=device) for s in shapes]
        self.v = (
            self.k
            if shared_kv
            else [torch.empty((*shape, *s), dtype=dtype, device=device) for s in shapes]
        )
        self.zero_pad_slot()

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool once: the keys and the values, or the keys alone where the
        values are the keys."""
        return self.k if self.v is self.k else self.k + self.v

    def zero_pad_slot(self) -> None:
        """(Re)zero the pad slot, e.g. after a warm-up step that wrote its K/V there."""
        for t in self.tensors:
            t[self.pad_slot].zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def zero_blocks(self, tensor: torch.Tensor, first_block: int, end_block: int) -> None:
        """Zero blocks [first_block, end_block) of one of the pool's tensors (`k[i]` or `v[i]`)."""
        tensor[first_block * self.block_size : end_block * self.block_size].zero_()

    @staticmethod
    def bytes_per_block(
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        shared_kv: bool = False,
        shapes: list[tuple[int, int]] | None = None,
    ) -> int:
        """The bytes of one block over every tensor (shared_kv, shapes: as for the
        constructor)."""
        shapes = shapes or [(num_kv_heads, head_dim)] * num_layers
        elements = sum(heads * width for heads, width in shapes)
        per_tensor = block_size * elements * torch.finfo(dtype).bits // 8
        return per_tensor if shared_kv else 2 * per_tensor


@dataclass
class AttentionBatch:
    """Where a step's tokens go in the cache and what each of them may attend to."""

    positions: torch.Tensor  # (T,) position of each new token in its sequence
    slot_mapping: torch.Tensor  # (T,) cache slot receiving each new token's K/V
    token_index: torch.Tensor  # (T,) index of each new token in the padded (B * max_q) query grid
    # (B, max_kv) cache slot of every context position (pad slot where padding)
    context_slots: torch.Tensor
    key_positions: torch.Tensor  # (B, max_kv) position of each context slot, large where padding
    query_positions: torch.Tensor  # (B, max_q) position of each padded query, -1 where padding
    num_seqs: int
    max_q: int
    query_blocks: tuple[tuple[int, int, int], ...]  # (first row, end row, keys any of them sees)
    # prompts only, all of their context new in this step (no cached prefix)
    fresh_prompts: bool = False
    # (T, max_kv) context slots of each new token's sequence where the whole step attends through
    # the decode kernel in one call (`build`'s kernel_prompts); None otherwise, and for decode steps
    token_context_slots: torch.Tensor | None = None
    # A step through the kernel beyond `KERNEL_PROMPT_MAX_PAIRS` attends in groups of consecutive
    # tokens instead: (first token, end token, context columns its tokens see) (see `kernel_group`)
    kernel_groups: tuple[tuple[int, int, int], ...] | None = None
    # Otherwise a step mixing decodes (one new token), fresh prompts and prompt chunks after cached
    # context attends in parts, each a batch of its own with the indices of its tokens in this one:
    # one padded grid would make every decode row as long as the longest chunk (see `_parts`).
    parts: tuple[tuple[AttentionBatch, torch.Tensor], ...] | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        pad_slot: int,
        device: torch.device | str = "cpu",
        kernel_prompts: bool = False,
    ) -> AttentionBatch:
        """Describe a step: sequence i adds query_lens[i] tokens ending at context length
        context_lens[i].

        pad_slot is the cache's never-written zero slot (`KVCache.pad_slot`). kernel_prompts: a step
        with prompt tokens attends through the decode kernel (`kernel_attends_prompts`), all of its
        tokens in one call within `KERNEL_PROMPT_MAX_PAIRS`, else in groups of tokens.
        """
        # numpy: a decode step builds these every step, and on tiny arrays a numpy op costs a
        # fraction of a torch op's dispatch
        num_seqs = len(query_lens)
        max_q, max_kv = max(query_lens), max(context_lens)
        q_lens = np.array(query_lens, dtype=np.int64)
        kv_lens = np.array(context_lens, dtype=np.int64)
        width = max(len(t) for t in block_tables)
        tables = np.zeros((num_seqs, width), dtype=np.int64)
        for row, table in zip(tables, block_tables):
            row[: len(table)] = table

        kv_pos = np.arange(max_kv)
        kv_valid = kv_pos < kv_lens[:, None]
        blocks = tables[:, np.minimum(kv_pos // block_size, width - 1)]
        context_slots = np.where(kv_valid, blocks * block_size + kv_pos % block_size, pad_slot)
        key_positions = np.where(kv_valid, kv_pos, np.iinfo(np.int64).max)

        q_offsets = np.arange(max_q)
        q_valid = q_offsets < q_lens[:, None]
        query_positions = np.where(q_valid, kv_lens[:, None] - q_lens[:, None] + q_offsets, -1)
        token_index = np.flatnonzero(q_valid)
        positions = query_positions.reshape(-1)[token_index]
        slot_mapping = context_slots[token_index // max_q, positions]

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        through_kernel = kernel_prompts and max_q > 1
        one_call = through_kernel and len(token_index) * max_kv <= KERNEL_PROMPT_MAX_PAIRS
        return cls(
            token_context_slots=tensor(context_slots[token_index // max_q]) if one_call else None,
            kernel_groups=_kernel_groups(positions) if through_kernel and not one_call else None,
            positions=tensor(positions),
            slot_mapping=tensor(slot_mapping),
            token_index=tensor(token_index),
            context_slots=tensor(context_slots),
            key_positions=tensor(key_positions),
            query_positions=tensor(query_positions),
            num_seqs=num_seqs,
            max_q=max_q,
            query_blocks=_query_blocks(query_lens, context_lens),
            fresh_prompts=max_q > 1 and bool((q_lens == kv_lens).all()),
            parts=None
            if through_kernel
            else cls._parts(query_lens, context_lens, block_tables, block_size, pad_slot, device),
        )

    @classmethod
    def _parts(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        pad_slot: int,
        device: torch.device | str,
    ) -> tuple[tuple[AttentionBatch, torch.Tensor], ...] | None:
        """The step's sequences by how they attend, where it has more than one kind: decodes (one
        new token), fresh prompts (no cached context: causal attention to their own K/V) and prompt
        chunks after cached context (a server's step often ends one prompt's chunk and starts
        others: together they would all gather their context from the cache)."""
        kinds = [0 if q == 1 else 1 if q == kv else 2 for q, kv in zip(query_lens, context_lens)]
        present = sorted(set(kinds))
        if len(present) == 1:
            return None
        token_kinds = np.repeat(kinds, query_lens)
        parts = []
        for wanted in present:
            seqs = [i for i, kind in enumerate(kinds) if kind == wanted]
            part = cls.build(
                [query_lens[i] for i in seqs],
                [context_lens[i] for i in seqs],
                [block_tables[i] for i in seqs],
                block_size,
                pad_slot,
                device,
            )
            parts.append((part, torch.from_numpy(np.flatnonzero(token_kinds == wanted)).to(device)))
        return tuple(parts)

    def mask(self, window: int | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Boolean (B, 1, max_q, max_kv) mask: causal, within the sliding window when given; for a
        batch in parts, one per part; for a step through the decode kernel, (T, max_kv), a row per
        token; for one through the kernel in groups, none (`kernel_group` makes each group's)."""
        if self.parts is not None:
            return tuple(part.mask(window) for part, _ in self.parts)
        if self.kernel_groups is not None:
            return ()
        q = self.query_positions[:, :, None]
        k = self.key_positions[:, None, :]
        allowed = k <= q
        if window is not None:
            allowed &= q - k < window
        # Padded query rows would be all-masked (NaN in SDPA); let them see slot 0 instead.
        allowed[:, :, 0] |= (q < 0)[:, :, 0]
        if self.token_context_slots is not None:
            return allowed.reshape(-1, allowed.shape[-1]).index_select(0, self.token_index)
        return allowed[:, None]

    def kernel_group(
        self, first: int, end: int, width: int, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot table and mask rows, (end - first, width) each, of tokens [first, end) of a step
        through the kernel in groups (`kernel_groups`): their rows of a whole-step table and mask
        cut to the first width columns, past which each of them is masked."""
        seqs = self.token_index[first:end] // self.max_q
        slots = self.context_slots[:, :width].index_select(0, seqs)
        # Column j is key position j; a sequence's padded columns lie past all of its tokens.
        query = self.positions[first:end, None]
        key = torch.arange(width, device=query.device)
        allowed = key <= query
        if window is not None:
            allowed &= query - key < window
        return slots, allowed


def _kernel_groups(positions: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Consecutive tokens (at positions `positions`) in groups of up to `KERNEL_PROMPT_MAX_PAIRS`
    (token, context column) pairs (a group of one token past it), each with the columns its tokens
    see: keys up to the group's last position. The decode kernel skips masked keys and splits the
    context at the same columns in any table, so the narrower tables change no token's result."""
    groups = []
    first = 0
    while first < len(positions):
        widths = np.maximum.accumulate(positions[first:] + 1)
        pairs = widths * np.arange(1, len(widths) + 1)  # increasing
        count = max(1, int(np.searchsorted(pairs, KERNEL_PROMPT_MAX_PAIRS, side="right")))
        groups.append((first, first + count, int(widths[count - 1])))
        first += count
    return tuple(groups)


def _query_blocks(
    query_lens: list[int], context_lens: list[int]
) -> tuple[tuple[int, int, int], ...]:
    """Split the padded query rows into `QUERY_BLOCK`s, each with the number of leading keys that
    any of its rows may attend to (row j of sequence i is at position context - query + j)."""
    max_q, max_kv = max(query_lens), max(context_lens)
    if max_q <= QUERY_BLOCK:
        return ((0, max_q, max_kv),)
    blocks = []
    for first in range(0, max_q, QUERY_BLOCK):
        end = min(max_q, first + QUERY_BLOCK)
        seen = max(min(kv, kv - q + end) for q, kv in zip(query_lens, context_lens))
        blocks.append((first, end, max(seen, 1)))  # padded rows see key 0 (see `mask`)
    return tuple(blocks)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    mask: torch.Tensor | tuple[torch.Tensor, ...],
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each sequence's cached context.

    q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim), or None where this step's K/V are in
    the cache already (written by `tokenmill::rotary_write_kv`, or by the layer whose cache this
    one shares); returns (T, heads, head_dim); mask: `batch.mask(window)`; window: the sliding
    window, if any; sinks: (heads,) float32 logits that join each head's softmax denominator and
    weigh no value (gpt-oss's attention sinks).
    """
    if k is not None:
        k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # as the cache holds them
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
    if batch.token_context_slots is not None:
        # every token of the step as a query of the decode kernel
        return kernels.ops().decode_attention(
            q, k_cache, v_cache, batch.token_context_slots, mask, scale, softcap, sinks
        )
    if batch.kernel_groups is not None:
        out = torch.empty_like(q)
        for first, end, width in batch.kernel_groups:
            slots, group_mask = batch.kernel_group(first, end, width, window)
            out[first:end] = kernels.ops().decode_attention(
                q[first:end], k_cache, v_cache, slots, group_mask, scale, softcap, sinks
            )
        return out
    if batch.parts is None:
        return _attend_cached(q, k, v, k_cache, v_cache, batch, mask, scale, softcap, window, sinks)
    out = torch.empty_like(q)
    for (part, tokens), part_mask in zip(batch.parts, mask):
        # each after the whole step's K/V are in the cache
        out[tokens] = _attend_cached(
            q[tokens],
            None if k is None else k[tokens],
            None if v is None else v[tokens],
            k_cache,
            v_cache,
            part,
            part_mask,
            scale,
            softcap,
            window,
            sinks,
        )
    return out


def _attend_cached(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` once this step's K/V (k, v, in the cache's dtype, or None: read back from
    the cache where needed) are in the cache, for a batch not in parts."""
    if batch.max_q == 1:  # pure decode: one token per sequence, tokens already in batch order
        return _decode_attention(
            q, k_cache, v_cache, batch.context_slots, mask, scale, softcap, sinks
        )
    num_heads, head_dim = q.shape[1:]
    plain = softcap is None and sinks is None  # what SDPA computes
    if batch.fresh_prompts and plain and (window is None or batch.max_q <= window):
        # Prompts without cached context attend to their own K/V in causal order: no gather from
        # the cache, no mask tensor, and SDPA's causal kernel skips the masked half (faster than
        # masked blocks of `QUERY_BLOCK` queries). The K/V are rounded as the cache holds them, so
        # that later steps see what the prompt saw. Padded rows come after each sequence's own, out
        # of its rows' causal sight.
        if k is None:
            k, v = k_cache[batch.slot_mapping], v_cache[batch.slot_mapping]
        grids = []
        for t in (q, k.to(q.dtype), v.to(q.dtype)):
            if batch.num_seqs > 1:
                t = t.new_zeros(batch.num_seqs * batch.max_q, *t.shape[1:]).index_copy_(
                    0, batch.token_index, t
                )
            grids.append(t.view(batch.num_seqs, batch.max_q, *t.shape[1:]).transpose(1, 2))
        out = F.scaled_dot_product_attention(*grids, is_causal=True, scale=scale, enable_gqa=True)
        out = out.transpose(1, 2).reshape(batch.num_seqs * batch.max_q, num_heads, head_dim)
        return out if batch.num_seqs == 1 else out.index_select(0, batch.token_index)
    # (B, kv_heads, max_kv, head_dim)
    keys = k_cache[batch.context_slots].to(q.dtype).transpose(1, 2)
    values = v_cache[batch.context_slots].to(q.dtype).transpose(1, 2)
    padded = q.new_zeros(batch.num_seqs * batch.max_q, num_heads, head_dim)
    padded.index_copy_(0, batch.token_index, q)
    padded = padded.view(batch.num_seqs, batch.max_q, num_heads, head_dim).transpose(1, 2)
    parts = [
        _attend(
            padded[:, :, first:end],
            keys[:, :, :seen],
            values[:, :, :seen],
            mask[:, :, first:end, :seen],
            scale,
            softcap,
            sinks,
        )
        for first, end, seen in batch.query_blocks
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    out = out.transpose(1, 2).reshape(batch.num_seqs * batch.max_q, num_heads, head_dim)
    return out.index_select(0, batch.token_index)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, in the fastest form where it runs: tokenmill's kernel where
    it is built (`decode_attention_fits`), else `FUSED_DECODE_MAX_HEAD_DIM` decides.

    q: (B, heads, head_dim); caches: (slots, kv_heads, head_dim); slots: (B, max_kv);
    mask: (B, 1, 1, max_kv).
    """
    if decode_attention_fits(q, k_cache):
        return kernels.ops().decode_attention(
            q, k_cache, v_cache, slots, mask, scale, softcap, sinks
        )
    fused = torch.compiler.is_compiling() and q.shape[-1] <= FUSED_DECODE_MAX_HEAD_DIM
    attend = _fused_decode_attention if fused else _matmul_decode_attention
    return attend(q, k_cache, v_cache, slots, mask, scale, softcap, sinks)


def decode_attention_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `tokenmill::decode_attention` (kernels/attention.cpp) takes these tensors."""
    return q.is_cpu and _kernel_takes(q.dtype, k_cache.dtype, q.shape[-1])


def kernel_fits(
    dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, device: torch.device | str
) -> bool:
    """Whether `tokenmill::decode_attention` takes queries of this dtype and head size over this
    cache."""
    return torch.device(device).type == "cpu" and _kernel_takes(dtype, cache_dtype, head_dim)


def _kernel_takes(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """`kernel_fits` on CPU."""
    return (
        kernels.loaded()
        and dtype in (torch.float32, torch.bfloat16)
        and cache_dtype in KV_CACHE_DTYPES.values()
        and head_dim % 16 == 0
        and head_dim <= 512
    )


def _matmul_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention as two batched matmuls over the gathered context, grouping query heads by
    their KV head. For a single query row, SDPA's flash kernel costs far more in setup than the
    arithmetic."""
    b, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    k = k_cache[slots].transpose(1, 2)  # (B, kv_heads, max_kv, head_dim)
    v = v_cache[slots].transpose(1, 2)
    # float32 throughout: for these tiny matmuls it is both faster than bf16 on CPU and exact
    qg = q.float().view(b, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # (B, kv_heads, group, max_kv)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sinks = sinks.view(1, kv_heads, num_heads // kv_heads, 1)
    out = torch.matmul(_softmax(scores, -1, sinks), v.float())
    return out.to(q.dtype).view(b, num_heads, head_dim)


def _fused_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention written as broadcast products and sums, for a compiled graph.

    Inductor fuses each sum with the gather of the cache rows it reads, so no gathered copy of the
    context is made, and no batch of tiny matmuls is dispatched: on narrow heads, faster than
    `_matmul_decode_attention` compiled (`FUSED_DECODE_MAX_HEAD_DIM`). Eagerly it would materialize
    the (batch, context, heads, head_dim) products.
    """
    b, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[slots].float()[:, :, :, None, :]  # (B, max_kv, kv_heads, 1, head_dim)
    values = v_cache[slots].float()[:, :, :, None, :]
    qg = q.float().view(b, 1, kv_heads, num_heads // kv_heads, head_dim)
    scores = (qg * keys).sum(-1) * scale  # (B, max_kv, kv_heads, group)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.view(b, -1, 1, 1), float("-inf"))
    if sinks is not None:
        sinks = sinks.view(1, 1, kv_heads, num_heads // kv_heads)
    # (B, kv_heads, group, head_dim)
    out = (_softmax(scores, 1, sinks)[..., None] * values).sum(1)
    return out.to(q.dtype).view(b, num_heads, head_dim)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return _explicit_attention(q, k, v, mask, scale, softcap, sinks)


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with tanh-capped scores (Gemma 2) or sinks (gpt-oss), which SDPA cannot
    express."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sinks = sinks.view(1, -1, 1, 1)
    return torch.matmul(_softmax(scores.float(), -1, sinks).to(q.dtype), v)


def _softmax(scores: torch.Tensor, dim: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax of scores along dim; with sinks (shaped to broadcast against scores, one along
    dim), each row's sink logit joins the denominator as one more score whose weight is dropped:
    the one place the Python paths take attention sinks (the kernel's is `merge_chunks`)."""
    if sinks is None:
        return torch.softmax(scores, dim=dim)
    shape = list(scores.shape)
    shape[dim] = 1
    combined = torch.cat((scores, sinks.to(scores.dtype).expand(shape)), dim=dim)
    return torch.softmax(combined, dim=dim).narrow(dim, 0, scores.shape[dim])
