"""Paged attention against plain per-sequence attention; the compiled decode form against the eager
one."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model import kernels
from tokenmill.model.attention import (
    QUERY_BLOCK,
    AttentionBatch,
    KVCache,
    _fused_decode_attention,
    _matmul_decode_attention,
    kernel_attends_prompts,
    paged_attention,
    resolve_kv_cache_dtype,
)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 20.0)])
def test_fused_decode_attention_matches_batched_matmuls(
    window: int | None, softcap: float | None
) -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 6, 2, 8, 4
    cache = KVCache(
        num_layers=1, num_blocks=12, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim
    )
    cache.k[0][:-1].normal_()  # every slot but the zero pad slot
    cache.v[0][:-1].normal_()
    # contexts of different lengths (padded to the longest), blocks out of order
    context_lens, tables = [3, 11, 7], [[5], [2, 9, 0], [11, 4]]
    batch = AttentionBatch.build([1, 1, 1], context_lens, tables, block_size, cache.pad_slot)
    mask = batch.mask(window)
    q = torch.randn(3, heads, head_dim)
    args = (q, cache.k[0], cache.v[0], batch.context_slots, mask, 0.35, softcap)
    torch.testing.assert_close(
        _fused_decode_attention(*args), _matmul_decode_attention(*args), rtol=1e-5, atol=1e-5
    )


# Long prompt chunks after cached context and a short one: each block of query rows attends to a
# prefix of the keys only. Decodes beside a chunk and a fresh prompt: the step attends in three
# parts; a fresh prompt beside chunks, in two. Fresh prompts only: their own K/V, causal, in one
# padded grid.
STEPS = {
    "blocks": ([QUERY_BLOCK * 2 + 44, QUERY_BLOCK + 22, 5], [QUERY_BLOCK * 2 + 60, 400, 20]),
    "decodes and prompts": ([1, QUERY_BLOCK + 22, 1, 60], [37, 400, 150, 60]),
    "fresh and continued prompts": ([QUERY_BLOCK + 10, 30, 45], [QUERY_BLOCK + 10, 200, 45]),
    "fresh prompts": ([60, 45, 2], [60, 45, 2]),
}
PARTS = {
    "blocks": 0,
    "decodes and prompts": 3,
    "fresh and continued prompts": 2,
    "fresh prompts": 0,
}
# head_dim 32: the decode kernel takes the whole step where it serves (`kernel_attends_prompts`), in
# one call and no parts


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (50, None), (None, 20.0)])
@pytest.mark.parametrize("head_dim", [8, 32])
def test_prompt_attention_matches_per_sequence_attention(
    window: int | None, softcap: float | None, cache_dtype: torch.dtype, step: str, head_dim: int
) -> None:
    """None of the ways a step's prompts attend (`STEPS`) may change any result. A float16 cache
    holds the new keys rounded, and a float32 model reads them back widened."""
    torch.manual_seed(0)
    heads, kv_heads, block_size, scale = 4, 2, 16, 0.3
    query_lens, context_lens = STEPS[step]
    cache = KVCache(
        num_layers=1,
        num_blocks=80,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=cache_dtype,
    )
    cache.k[0][:-1].normal_()
    cache.v[0][:-1].normal_()
    order = torch.randperm(79).tolist()
    tables, used = [], 0
    for kv in context_lens:
        count = -(-kv // block_size)
        tables.append(order[used : used + count])
        used += count
    through_kernel = kernel_attends_prompts(torch.float32, cache_dtype, head_dim, "cpu")
    assert through_kernel == (head_dim == 32 and kernels.loaded() and not kernels.cpu_has_amx())
    batch = AttentionBatch.build(
        query_lens, context_lens, tables, block_size, cache.pad_slot, kernel_prompts=through_kernel
    )
    assert (batch.token_context_slots is not None) == through_kernel
    if step == "blocks":
        assert len(batch.query_blocks) == 3 and batch.query_blocks[0][2] < max(context_lens)
    assert len(batch.parts or ()) == (0 if through_kernel else PARTS[step])
    if step == "fresh and continued prompts" and not through_kernel:
        assert [part.fresh_prompts for part, _ in batch.parts] == [True, False]
    assert batch.fresh_prompts == (step == "fresh prompts")
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim)
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    out = paged_attention(
        q, k, v, cache.k[0], cache.v[0], batch, batch.mask(window), scale, softcap, window
    )
    assert out.dtype == torch.float32
    slot_of_token = batch.slot_mapping
    # float16: 11 bits
    torch.testing.assert_close(cache.k[0][slot_of_token].float(), k, rtol=1e-3, atol=1e-3)

    start = 0
    for q_len, kv_len, table in zip(query_lens, context_lens, tables):
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(kv_len)]
        )
        # (heads, kv, d)
        keys = cache.k[0][slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        values = (
            cache.v[0][slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        )
        scores = q[start : start + q_len].transpose(0, 1) @ keys.transpose(1, 2) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
        allowed = torch.arange(kv_len)[None, :] <= query_pos
        if window is not None:
            allowed &= query_pos - torch.arange(kv_len)[None, :] < window
        expected = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values).transpose(
            0, 1
        )
        torch.testing.assert_close(out[start : start + q_len], expected, rtol=1e-4, atol=1e-4)
        start += q_len


def test_kv_cache_dtype_follows_the_option() -> None:
    """auto: float16 for a float32 model on CPU (half the bytes a decode step reads), else the
    model's."""
    assert resolve_kv_cache_dtype("auto", torch.float32, "cpu") == torch.float16
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, "cuda") == torch.float32
    assert resolve_kv_cache_dtype("float32", torch.float32, "cpu") == torch.float32
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.float32, "cpu")


@pytest.mark.parametrize(
    ("window", "softcap", "whole"),
    [(None, None, True), (300, None, True), (100, None, False), (None, 20.0, False)],
)
def test_a_whole_prompt_attends_to_its_own_keys(
    window: int | None, softcap: float | None, whole: bool, monkeypatch
) -> None:
    """One sequence's whole prompt takes SDPA's causal kernel on this step's K/V, rounded as the
    cache holds them, unless a window shorter than the prompt or a softcap needs the mask."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim, block_size, length = 4, 2, 8, 16, 200
    cache = KVCache(
        num_layers=1,
        num_blocks=16,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=torch.float16,
    )
    batch = AttentionBatch.build([length], [length], [list(range(13))], block_size, cache.pad_slot)
    assert batch.fresh_prompts
    assert not AttentionBatch.build(
        [length - 8], [length], [list(range(13))], block_size, cache.pad_slot
    ).fresh_prompts
    q, k, v = (
        torch.randn(length, heads, head_dim),
        torch.randn(length, kv_heads, head_dim),
        torch.randn(length, kv_heads, head_dim),
    )
    causal_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *args, **kwargs: (
            causal_calls.append(kwargs.get("is_causal", False)) or sdpa(*args, **kwargs)
        ),
    )
    out = paged_attention(
        q, k, v, cache.k[0], cache.v[0], batch, batch.mask(window), 0.3, softcap, window
    )
    assert any(causal_calls) == whole
    keys, values = (
        t.half().float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1) for t in (k, v)
    )
    scores = q.transpose(0, 1) @ keys.transpose(1, 2) * 0.3
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    positions = torch.arange(length)
    allowed = positions[None, :] <= positions[:, None]
    if window is not None:
        allowed &= positions[:, None] - positions[None, :] < window
    expected = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_prompts_keep_sdpa_on_cpus_with_amx(monkeypatch) -> None:
    """The decode kernel takes prompt tokens only where it was measured faster than SDPA: not on
    AMX."""
    monkeypatch.setattr(
        kernels, "cpu_flags", lambda: "flags\t: avx512f avx512_bf16 amx_bf16 amx_tile"
    )
    assert not kernel_attends_prompts(torch.bfloat16, torch.bfloat16, 64, "cpu")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t: avx512f avx512_bf16 avx512_vnni")
    assert kernel_attends_prompts(torch.bfloat16, torch.bfloat16, 64, "cpu") == kernels.loaded()
    # not whole vectors
    assert not kernel_attends_prompts(torch.bfloat16, torch.bfloat16, 72, "cpu")


def test_a_step_through_the_kernel_has_a_slot_table_and_a_mask_row_per_token() -> None:
    batch = AttentionBatch.build([5, 3, 1], [5, 7, 2], [[0], [1], [2]], 16, 48, kernel_prompts=True)
    assert batch.parts is None  # decodes and prompts together: one call
    assert batch.token_context_slots.tolist() == (
        [[0, 1, 2, 3, 4, 48, 48]] * 5
        + [[16, 17, 18, 19, 20, 21, 22]] * 3
        + [[32, 33, 48, 48, 48, 48, 48]]
    )
    mask = batch.mask(None)
    assert mask.shape == (9, 7)
    assert mask[:5].sum(-1).tolist() == [1, 2, 3, 4, 5] and mask[5:8].sum(-1).tolist() == [5, 6, 7]
    assert mask[8].tolist() == [True, True] + [False] * 5
    # a window of 2
    assert batch.mask(2)[4].tolist() == [False, False, False, True, True, False, False]
    assert (
        AttentionBatch.build(
            [1, 1], [5, 7], [[0], [1]], 16, 48, kernel_prompts=True
        ).token_context_slots
        is None
    )
