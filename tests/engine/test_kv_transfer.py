"""A prompt's KV blocks moved from one engine's prefix cache to another's (prefill/decode
disaggregation): the receiving engine hits them and generates what it would alone."""

from __future__ import annotations

from tokenmill.engine.kv_transfer import export_prefix, import_prefix
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request import Sequence
from tokenmill.sample import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. " * 5


def _run(engine: LLMEngine, prompt: str | list[int], max_tokens: int):
    rid = engine.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    return final


def test_moved_blocks_are_hit_and_outputs_match(tiny_loaded) -> None:
    alone = LLMEngine(tiny_loaded, num_kv_blocks=64, max_model_len=512)
    expected = _run(alone, PROMPT, 12)
    prefill = LLMEngine(tiny_loaded, num_kv_blocks=64, max_model_len=512)
    decode = LLMEngine(tiny_loaded, num_kv_blocks=64, max_model_len=512)
    ids = prefill.tokenize(PROMPT)
    _run(prefill, ids, 1)
    hashes = Sequence("p", ids, block_size=16).block_hashes
    kv = export_prefix(prefill, hashes)
    assert kv.block_hashes == hashes and len(hashes) >= 2
    assert kv.k.shape[:2] == (tiny_loaded.config.num_layers, len(hashes) * 16)
    assert import_prefix(decode, kv) == len(hashes)
    assert import_prefix(decode, kv) == len(hashes)  # again: nothing new, nothing lost
    out = _run(decode, ids, 12)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.num_cached_tokens == min(len(hashes), (len(ids) - 1) // 16) * 16
    assert decode.kv.num_free_blocks == decode.kv.num_total_blocks  # all free again, and cached


def test_import_stops_when_the_pool_is_full(tiny_loaded) -> None:
    prefill = LLMEngine(tiny_loaded, num_kv_blocks=64, max_model_len=512)
    ids = prefill.tokenize(PROMPT)
    _run(prefill, ids, 1)
    kv = export_prefix(prefill, Sequence("p", ids, block_size=16).block_hashes)
    small = LLMEngine(tiny_loaded, num_kv_blocks=2, max_model_len=32)
    assert import_prefix(small, kv) == 2
    # a prefix the pool lacks from its first block on exports nothing
    assert export_prefix(small, [b"\1" * 32]).block_hashes == []
