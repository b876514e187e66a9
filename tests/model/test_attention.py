"""The decode attention of compiled graphs computes what the batched-matmul formulation computes."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.attention import AttentionBatch, KVCache, _fused_decode_attention, _matmul_decode_attention


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 20.0)])
def test_fused_decode_attention_matches_batched_matmuls(window: int | None, softcap: float | None) -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_dim, block_size = 6, 2, 8, 4
    cache = KVCache(num_layers=1, num_blocks=12, block_size=block_size, num_kv_heads=kv_heads, head_dim=head_dim)
    cache.k[0][:-1].normal_()  # every slot but the zero pad slot
    cache.v[0][:-1].normal_()
    # contexts of different lengths (padded to the longest), blocks out of order
    context_lens, tables = [3, 11, 7], [[5], [2, 9, 0], [11, 4]]
    batch = AttentionBatch.build([1, 1, 1], context_lens, tables, block_size, cache.pad_slot)
    mask = batch.mask(window)
    q = torch.randn(3, heads, head_dim)
    args = (q, cache.k[0], cache.v[0], batch.context_slots, mask, 0.35, softcap)
    torch.testing.assert_close(_fused_decode_attention(*args), _matmul_decode_attention(*args), rtol=1e-5, atol=1e-5)
