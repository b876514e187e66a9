"""Paged attention against plain per-sequence attention; the compiled decode form against the eager
one."""

from __future__ import annotations

import pytest
import torch

from tests.paged_cache import block_tables, filled_cache
from tokenmill.model import attention, kernels
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


def _sinks(heads: int, on: bool) -> torch.Tensor | None:
    """Attention sinks (gpt-oss): a logit per head, large enough to take much of each softmax."""
    return torch.randn(heads, generator=torch.Generator().manual_seed(7)) * 2 + 1 if on else None


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dimension of (heads, queries, keys) scores, with each head's sink
    logit as one more key whose weight is dropped."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.view(-1, 1, 1).expand(*scores.shape[:2], 1)
    return torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]


@pytest.mark.parametrize(
    ("window", "softcap", "sinks"),
    [(None, None, False), (5, None, False), (None, 20.0, False), (5, None, True)],
)
def test_fused_decode_attention_matches_batched_matmuls(
    window: int | None, softcap: float | None, sinks: bool
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
    args = (
        q,
        cache.k[0],
        cache.v[0],
        batch.context_slots,
        mask,
        0.35,
        softcap,
        _sinks(heads, sinks),
    )
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
@pytest.mark.parametrize(
    ("window", "softcap", "sinks"),
    [(None, None, False), (50, None, False), (None, 20.0, False), (50, None, True)],
)
@pytest.mark.parametrize("head_dim", [8, 32])
def test_prompt_attention_matches_per_sequence_attention(
    window: int | None,
    softcap: float | None,
    sinks: bool,
    cache_dtype: torch.dtype,
    step: str,
    head_dim: int,
) -> None:
    """None of the ways a step's prompts attend (`STEPS`) may change any result. A float16 cache
    holds the new keys rounded, and a float32 model reads them back widened. Sinks take the paths
    of softcaps: the kernel's, or PyTorch's explicit softmax and decode matmuls."""
    torch.manual_seed(0)
    heads, kv_heads, block_size, scale = 4, 2, 16, 0.3
    query_lens, context_lens = STEPS[step]
    cache = filled_cache(block_size, 80, cache_dtype, kv_heads, head_dim)
    tables = block_tables(context_lens, block_size, 80)
    through_kernel = kernel_attends_prompts(torch.float32, cache_dtype, head_dim, "cpu")
    assert through_kernel == (head_dim == 32 and kernels.loaded())
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
    sink_logits = _sinks(heads, sinks)
    out = paged_attention(
        q,
        k,
        v,
        cache.k[0],
        cache.v[0],
        batch,
        batch.mask(window),
        scale,
        softcap,
        window,
        sink_logits,
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
        probs = _softmax(scores.masked_fill(~allowed, float("-inf")), sink_logits)
        expected = (probs @ values).transpose(0, 1)
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
    ("window", "softcap", "sinks", "whole"),
    [
        (None, None, False, True),
        (300, None, False, True),
        (100, None, False, False),
        (None, 20.0, False, False),
        (None, None, True, False),
    ],
)
def test_a_whole_prompt_attends_to_its_own_keys(
    window: int | None, softcap: float | None, sinks: bool, whole: bool, monkeypatch
) -> None:
    """One sequence's whole prompt takes SDPA's causal kernel on this step's K/V, rounded as the
    cache holds them, unless a window shorter than the prompt, a softcap or sinks need the mask
    (and, for the last two, an explicit softmax)."""
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
    sink_logits = _sinks(heads, sinks)
    out = paged_attention(
        q,
        k,
        v,
        cache.k[0],
        cache.v[0],
        batch,
        batch.mask(window),
        0.3,
        softcap,
        window,
        sink_logits,
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
    probs = _softmax(scores.masked_fill(~allowed, float("-inf")), sink_logits)
    torch.testing.assert_close(out, (probs @ values).transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_prompts_keep_sdpa_on_cpus_with_amx_unless_batch_invariant(monkeypatch) -> None:
    """Batch invariance (the default) takes prompt tokens through the decode kernel wherever it
    fits; without it, only where it was measured faster than SDPA: not on AMX."""
    monkeypatch.setattr(
        kernels, "cpu_flags", lambda: "flags\t: avx512f avx512_bf16 amx_bf16 amx_tile"
    )
    assert kernels.cpu_has_amx()
    assert not kernel_attends_prompts(
        torch.bfloat16, torch.bfloat16, 64, "cpu", batch_invariant=False
    )
    assert kernel_attends_prompts(torch.bfloat16, torch.bfloat16, 64, "cpu") == kernels.loaded()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t: avx512f avx512_bf16 avx512_vnni")
    for invariant in (True, False):
        assert (
            kernel_attends_prompts(
                torch.bfloat16, torch.bfloat16, 64, "cpu", batch_invariant=invariant
            )
            == kernels.loaded()
        )
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


# model dtype and KV cache dtype: float32 with its own or a half cache, bf16 with its own
DTYPES_AND_CACHE_DTYPES = [
    (torch.float32, torch.float32),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.bfloat16),
]


def _needs_kernel() -> None:
    # where the kernels should build and did not, test_kernels_build_and_load fails
    if not kernels.loaded():
        pytest.skip("tokenmill's decode kernel is not built on this CPU or without a C++ compiler")


@pytest.mark.parametrize("bound", [5000, 100])
@pytest.mark.parametrize(
    ("window", "softcap", "sinks"),
    [(None, None, False), (50, None, False), (None, 20.0, False), (50, None, True)],
)
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    DTYPES_AND_CACHE_DTYPES,
)
def test_a_step_past_the_pair_bound_attends_through_the_kernel_in_groups(
    bound: int,
    window: int | None,
    softcap: float | None,
    sinks: bool,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    monkeypatch,
) -> None:
    """A step whose slot table would pass `KERNEL_PROMPT_MAX_PAIRS` attends through the kernel in
    groups of consecutive tokens, each group's table and mask rows within the bound (a lone token's
    past it), and gives every token exactly the result of one call over the whole step."""
    _needs_kernel()
    torch.manual_seed(2)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 32, 16, 64
    # decodes, prompt chunks after cached context and a fresh prompt
    query_lens, context_lens = [1, 150, 1, 60, 40], [300, 250, 90, 60, 200]
    cache = filled_cache(block_size, num_blocks, cache_dtype, kv_heads, head_dim)
    tables = block_tables(context_lens, block_size, num_blocks)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    k, v = k.to(dtype), v.to(dtype)

    sink_logits = _sinks(heads, sinks)

    def attend(batch: AttentionBatch) -> torch.Tensor:
        mask = batch.mask(window)
        cache_k, cache_v = cache.k[0], cache.v[0]
        return paged_attention(
            q, k, v, cache_k, cache_v, batch, mask, 0.3, softcap, window, sink_logits
        )

    build_args = (query_lens, context_lens, tables, block_size, cache.pad_slot)
    whole = AttentionBatch.build(*build_args, kernel_prompts=True)
    assert whole.token_context_slots is not None and whole.kernel_groups is None
    expected = attend(whole)
    assert expected.dtype == dtype

    monkeypatch.setattr(attention, "KERNEL_PROMPT_MAX_PAIRS", bound)
    grouped = AttentionBatch.build(*build_args, kernel_prompts=True)
    assert grouped.parts is None and grouped.token_context_slots is None
    groups = grouped.kernel_groups
    assert len(groups) > 1 and groups[0][0] == 0 and groups[-1][1] == tokens
    assert all(end == after for (_, end, _), (after, _, _) in zip(groups, groups[1:]))
    assert all((end - first) * width <= bound or end - first == 1 for first, end, width in groups)
    if bound < max(context_lens):
        assert any((end - first) * width > bound for first, end, width in groups)
    assert grouped.mask(window) == ()
    whole_mask = whole.mask(window)
    for first, end, width in groups:
        slots, mask = grouped.kernel_group(first, end, width, window)
        assert torch.equal(slots, whole.token_context_slots[first:end, :width])
        assert torch.equal(mask, whole_mask[first:end, :width])
        assert not whole_mask[first:end, width:].any()  # past each token's sight
    assert torch.equal(attend(grouped), expected)


@pytest.mark.parametrize(
    ("window", "softcap", "sinks"),
    [(None, None, False), (40, None, False), (None, 20.0, False), (40, None, True)],
)
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    DTYPES_AND_CACHE_DTYPES,
)
def test_a_tokens_attention_does_not_depend_on_how_the_step_is_packed(
    window: int | None,
    softcap: float | None,
    sinks: bool,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    monkeypatch,
) -> None:
    """Batch invariance: a prompt attended in one chunk or in several (earlier chunks' K/V in the
    cache), alone or beside other sequences' decodes and prompts, within the pair bound or past it,
    gives its tokens bit-identical results; so does its next token decoded alone or beside prompts.
    Also on CPUs with AMX, where the kernel took no prompts before batch invariance."""
    _needs_kernel()
    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: True)
    torch.manual_seed(3)
    heads, kv_heads, head_dim, block_size, num_blocks, scale = 4, 2, 32, 16, 48, 0.3
    length = 150  # the prompt; then one decoded token
    # the prompt's sequence, and others: a decode, a fresh prompt, a chunk after cached context
    others_query, others_context = [1, 30, 50], [80, 30, 120]
    cache = filled_cache(block_size, num_blocks, cache_dtype, kv_heads, head_dim)
    table, *other_tables = block_tables([length + 1, *others_context], block_size, num_blocks)
    kernel_prompts = kernel_attends_prompts(dtype, cache_dtype, head_dim, "cpu")
    assert kernel_prompts

    def qkv(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.randn(count, heads, head_dim).to(dtype),
            torch.randn(count, kv_heads, head_dim).to(dtype),
            torch.randn(count, kv_heads, head_dim).to(dtype),
        )

    q, k, v = qkv(length + 1)
    others = qkv(sum(others_query))
    sink_logits = _sinks(heads, sinks)

    def attend(first: int, end: int, with_others: bool) -> torch.Tensor:
        """Tokens [first, end) of the sequence in one step, their outputs."""
        query_lens, context_lens, tables = [end - first], [end], [table]
        parts = [(q[first:end], k[first:end], v[first:end])]
        if with_others:
            query_lens, context_lens = query_lens + others_query, context_lens + others_context
            tables, parts = tables + other_tables, parts + [others]
        batch = AttentionBatch.build(
            query_lens,
            context_lens,
            tables,
            block_size,
            cache.pad_slot,
            kernel_prompts=kernel_prompts,
        )
        step_q, step_k, step_v = (torch.cat(t) for t in zip(*parts))
        out = paged_attention(
            step_q,
            step_k,
            step_v,
            cache.k[0],
            cache.v[0],
            batch,
            batch.mask(window),
            scale,
            softcap,
            window,
            sink_logits,
        )
        return out[: end - first]

    def prompt(cuts: list[int], with_others: bool) -> torch.Tensor:
        ends = [*cuts, length]
        return torch.cat([attend(a, b, with_others) for a, b in zip([0, *cuts], ends)])

    expected = prompt([], with_others=False)
    assert expected.dtype == dtype
    assert torch.equal(prompt([64, 100, 101], with_others=False), expected)
    assert torch.equal(prompt([], with_others=True), expected)
    assert torch.equal(prompt([37, 120], with_others=True), expected)
    monkeypatch.setattr(attention, "KERNEL_PROMPT_MAX_PAIRS", 3000)  # in groups of tokens
    assert torch.equal(prompt([], with_others=True), expected)
    assert torch.equal(prompt([90], with_others=False), expected)
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "cpu_has_amx", lambda: True)
    decoded = attend(length, length + 1, with_others=False)  # a decode step
    assert torch.equal(attend(length, length + 1, with_others=True), decoded)
