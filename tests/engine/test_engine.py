"""Engine acceptance: batching, chunked prefill, preemption, prefix caching, aborts, sampling,
stops."""

from __future__ import annotations

import random

import pytest
import torch

from tests.model.test_kernels import needs_avx512
from tokenmill.engine.kv_memory import default_kv_budget
from tokenmill.engine.llm_engine import EngineConfig, LLMEngine
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.errors import InvalidRequestError
from tokenmill.model.loader import load_model
from tokenmill.sample import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts(
    n: int, seed: int = 0, lo: int = 5, hi: int = 120, vocab: int = 300
) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def _run(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    ids = [engine.add_request(None, p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i].outputs[0].token_ids for i in ids]


def test_greedy_alone_equals_inside_a_batch_of_32(tiny_loaded) -> None:
    target = _prompts(1, seed=99, lo=40, hi=41)[0]
    alone = _run(LLMEngine(tiny_loaded, num_kv_blocks=256), [target])[0]

    engine = LLMEngine(tiny_loaded, num_kv_blocks=256)
    others = _prompts(32, seed=1)
    waves = [others[:10], [target] + others[10:20], others[20:]]
    results, target_id = {}, None
    for wave in waves:
        for p in wave:
            rid = engine.add_request(None, p, GREEDY)
            if p is target:
                target_id = rid
        for _ in range(3):  # arrivals at different steps, mixing prefills with running decodes
            for out in engine.step():
                results[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = out
    assert results[target_id].outputs[0].token_ids == alone
    assert len(alone) == GREEDY.max_tokens


def test_kv_cache_dtype_sets_the_pool_and_how_many_blocks_a_budget_buys(tiny_loaded) -> None:
    """A float32 model on CPU keeps its cache in float16 unless told otherwise: twice the blocks
    for the same memory, and the same greedy tokens on this model."""
    budget = 1 << 20
    half = LLMEngine(tiny_loaded, kv_cache_memory=budget)
    full = LLMEngine(tiny_loaded, kv_cache_memory=budget, kv_cache_dtype="float32")
    assert (
        half.runner.cache.k[0].dtype == torch.float16
        and full.runner.cache.k[0].dtype == torch.float32
    )
    assert half.kv.num_total_blocks in (
        2 * full.kv.num_total_blocks,
        2 * full.kv.num_total_blocks + 1,
    )
    assert half.runner.cache.nbytes <= budget + half.runner.cache.nbytes // half.kv.num_total_blocks
    prompts = _prompts(4, seed=9, lo=20, hi=60)
    assert _run(half, prompts) == _run(full, prompts)
    with pytest.raises(ValueError, match="unknown KV cache dtype"):
        LLMEngine(tiny_loaded, kv_cache_memory=budget, kv_cache_dtype="int8")


def test_chunked_prefill_equals_whole_prompts(tiny_loaded) -> None:
    prompts = _prompts(8, seed=2, lo=30, hi=150)
    whole = _run(LLMEngine(tiny_loaded, num_kv_blocks=256, max_num_batched_tokens=4096), prompts)
    chunked_engine = LLMEngine(tiny_loaded, num_kv_blocks=256, max_num_batched_tokens=7)
    assert _run(chunked_engine, prompts) == whole


def test_preemption_completes_everything_with_same_outputs(tiny_loaded) -> None:
    prompts = _prompts(8, seed=3, lo=30, hi=60)
    ample = _run(LLMEngine(tiny_loaded, num_kv_blocks=256), prompts)
    tight = LLMEngine(tiny_loaded, num_kv_blocks=12, block_size=16)  # 192 slots for 8 x ~70 tokens
    assert _run(tight, prompts) == ample
    assert tight.stats.num_preemptions > 0
    assert tight.kv.num_free_blocks == tight.kv.num_total_blocks


def test_prefix_cache_reuses_a_200_token_prefix(tiny_loaded) -> None:
    shared = _prompts(1, seed=4, lo=200, hi=201)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10, 11, 12]
    engine = LLMEngine(tiny_loaded, num_kv_blocks=256)
    _run(engine, [first])
    hits_before, queries_before = engine.stats.prefix_cache_hits, engine.stats.prefix_cache_queries
    computed_before = _tokens_computed(engine)
    warm = _run(engine, [second])[0]
    # the 12 full blocks of the shared prefix
    assert engine.stats.prefix_cache_hits - hits_before == 192
    assert engine.stats.prefix_cache_queries - queries_before == len(second)
    # only the tokens after the cached blocks were run through the model (+ the decode steps)
    assert _tokens_computed(engine) - computed_before == len(second) - 192 + GREEDY.max_tokens - 1
    cold = _run(LLMEngine(tiny_loaded, num_kv_blocks=256, enable_prefix_caching=False), [second])[0]
    assert warm == cold


def _tokens_computed(engine: LLMEngine) -> int:
    return engine.stats.tokens_computed


def test_random_aborts_leak_no_blocks(tiny_loaded) -> None:
    rng = random.Random(5)
    engine = LLMEngine(tiny_loaded, num_kv_blocks=40, max_num_batched_tokens=64)
    live: list[str] = []
    for step in range(120):
        if step < 60 and rng.random() < 0.5:
            params = SamplingParams(
                temperature=rng.choice([0.0, 0.8]),
                max_tokens=rng.randrange(1, 30),
                n=rng.choice([1, 1, 2]),
                seed=rng.randrange(100),
            )
            live.append(engine.add_request(None, _prompts(1, seed=step, lo=2, hi=90)[0], params))
        if live and rng.random() < 0.2:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert not engine.scheduler.running and len(engine.scheduler.waiting) == 0


def test_seeded_sampling_is_independent_of_the_batch(tiny_loaded) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = _prompts(1, seed=6, lo=20, hi=21)[0]
    alone = _run(LLMEngine(tiny_loaded, num_kv_blocks=256), [prompt], params)[0]
    engine = LLMEngine(tiny_loaded, num_kv_blocks=256)
    noise = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    mixed = (
        [(p, noise) for p in _prompts(5, seed=7)]
        + [(prompt, params)]
        + [(p, noise) for p in _prompts(3, seed=8)]
    )
    ids = [engine.add_request(None, p, sp) for p, sp in mixed]
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done[ids[5]].outputs[0].token_ids == alone


def test_stop_string_across_two_tokens_is_trimmed(tiny_loaded) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=256)
    tok = engine.tokenizer
    prompt = _prompts(1, seed=9, lo=10, hi=11)[0]
    free_run = _run(engine, [prompt])[0]
    pieces = [tok.decode([t]) for t in free_run]
    full = tok.decode(free_run)
    # a stop string made of the last character of token k and the first of token k+1, first seen
    # there
    for k in range(2, len(pieces) - 1):
        stop = pieces[k][-1:] + pieces[k + 1][:1]
        boundary = len(tok.decode(free_run[: k + 1]))
        if len(stop) == 2 and full.find(stop) == boundary - 1:
            break
    else:
        pytest.fail("no token boundary to test in this output")
    expected = full[: boundary - 1]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    rid = engine.add_request(None, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    out = final.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == expected
    assert stop not in out.text


def test_stop_string_in_text_held_back_at_the_length_limit_stops(tiny_loaded) -> None:
    # a token whose text ends in an incomplete character ("a" then a lone UTF-8 lead byte) is
    # held back by the detokenizer until the end, where the stop string in it must still count
    engine = LLMEngine(tiny_loaded, num_kv_blocks=64)
    tok = engine.tokenizer
    held = next(
        i
        for i in range(tok.vocab_size)
        if (text := tok.decode([i])).endswith("\ufffd") and len(text) > 1 and text[-2] != "\ufffd"
    )
    stop = tok.decode([held])[-2]
    params = SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, stop=[stop], logit_bias={held: 100.0}
    )
    out = _run_outputs(engine, [5, 6, 7], params)
    assert out.token_ids == [held]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text


def _run_outputs(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(None, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.request_id == rid and o.finished), final)
    return final.outputs[0]


def test_streamed_deltas_add_up_to_the_text(tiny_loaded) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=256)
    engine.add_request(
        None, "The quick brown", SamplingParams(temperature=0.0, max_tokens=20, stop=["zz"])
    )
    deltas, tokens, final = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text_delta)
            tokens.extend(out.outputs[0].token_ids_delta)
            final = out
    assert "".join(deltas) == final.outputs[0].text
    assert tokens == final.outputs[0].token_ids


def test_n_children_share_the_prompt_and_differ(tiny_loaded) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=256)
    prompt = _prompts(1, seed=10, lo=64, hi=65)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    rid = engine.add_request(None, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert [c.index for c in final.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in final.outputs}) == 3
    assert engine.stats.prefix_cache_hits >= 2 * 48  # children 1 and 2 reuse 3 full blocks each
    assert final.request_id == rid


def test_logprobs_and_prompt_logprobs_match_the_model(tiny_loaded) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=256)
    prompt = _prompts(1, seed=11, lo=12, hi=13)[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    engine.add_request(None, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    out = final.outputs[0]
    seq = prompt + out.token_ids
    runner = ModelRunner(tiny_loaded, num_blocks=8, block_size=16)
    ref = runner.all_logits([seq], [len(seq)], [list(range(8))]).log_softmax(-1)
    assert final.prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry = final.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(
            float(ref[pos - 1, prompt[pos]]), abs=1e-4
        )
        assert len(entry) in (2, 3)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry[token].rank == 1 and entry[token].logprob == pytest.approx(
            float(row.max()), abs=1e-4
        )
        assert sorted(entry) == sorted(row.topk(3).indices.tolist())


def test_eager_steps_leave_their_logits_in_one_buffer(tiny_loaded) -> None:
    """A prompt step's and decode steps' last-token logits land in one float32 buffer, reused
    from call to call (a new tensor of a large vocabulary's logits at 32 sequences is mapped and
    faulted in every step); argmax_only steps return the head's products in the model's dtype."""
    runner = ModelRunner(tiny_loaded, num_blocks=8, block_size=16)
    prompts = [[5, 9, 3], [7, 1], [4, 4, 4, 4]]
    tables = [[0], [1], [2]]
    prefill = runner.last_token_logits(prompts, [len(p) for p in prompts], tables)
    expected_prefill = prefill.clone()
    step = ([[8]] * 3, [len(p) + 1 for p in prompts], tables)
    decoded = runner.last_token_logits(*step)
    assert decoded.data_ptr() == prefill.data_ptr() and decoded.dtype == torch.float32
    # the same step again, its logits as a new tensor
    reference = runner.model.logits(runner.hidden_states(*step))
    assert torch.equal(decoded, reference)
    fresh = ModelRunner(tiny_loaded, num_blocks=8, block_size=16)
    again = fresh.last_token_logits(prompts, [len(p) for p in prompts], tables)
    assert torch.equal(again, expected_prefill)
    raw = fresh.last_token_logits(*step, argmax_only=True)
    assert raw.dtype == tiny_loaded.dtype and raw.data_ptr() != fresh._logits.data_ptr()
    assert torch.equal(raw.float().argmax(-1), decoded.argmax(-1))


@needs_avx512  # a head writes into a reused tensor through the tile kernel only
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eager_steps_leave_the_head_products_in_one_buffer(tiny_model_dir, dtype: str) -> None:
    """A packed output head writes each eager step's products into one reused tensor (a new one
    for a large vocabulary at a wide batch is mapped and faulted in every step), which for a
    float32 model is the logits buffer itself; the logits are those of a new tensor."""
    loaded = load_model(tiny_model_dir, dtype=dtype, quantization="int8", progress=False)
    assert loaded.model.lm_head.tiles
    runner = ModelRunner(loaded, num_blocks=8, block_size=16)
    prompts = [[5, 9, 3], [7, 1], [4, 4, 4, 4]]
    tables = [[0], [1], [2]]
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)
    steps = [([[t]] * 3, [len(p) + 1 + i for p in prompts], tables) for i, t in enumerate((8, 2))]
    raw = [runner.last_token_logits(*step, argmax_only=True) for step in steps]
    assert raw[0].data_ptr() == raw[1].data_ptr() and raw[0].dtype == loaded.dtype
    logits = runner.last_token_logits(*steps[1])
    assert logits.dtype == torch.float32
    assert (logits.data_ptr() == raw[0].data_ptr()) == (loaded.dtype == torch.float32)
    reference = runner.model.logits(runner.hidden_states(*steps[1]))
    assert torch.equal(logits, reference)


def test_bad_requests_are_refused_and_leave_nothing(tiny_loaded) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=16, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request(None, [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request(None, list(range(3, 70)), SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request(None, [5, 6], SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="top_p"):
        engine.add_request(None, [5, 6], SamplingParams(top_p=2.0))
    assert not engine.has_unfinished_requests()


def test_overrides_leave_the_callers_config_alone(tiny_loaded) -> None:
    config = EngineConfig(max_num_seqs=4)
    engine = LLMEngine(tiny_loaded, config, num_kv_blocks=16, max_model_len=64)
    assert (engine.config.num_kv_blocks, engine.config.max_num_seqs) == (16, 4)
    assert config == EngineConfig(max_num_seqs=4)
    with pytest.raises(TypeError, match="unknown engine option 'num_blocks'"):
        LLMEngine(tiny_loaded, config, num_blocks=16)


@pytest.mark.parametrize(
    "free_gib, budget_gib", [(40, 4), (16, 4), (11, 2), (10, 2), (9, 2), (5, 1), (3, 0.5)]
)
def test_default_kv_budget_is_a_power_of_two_of_a_quarter_of_free_ram(free_gib, budget_gib) -> None:
    """Small changes in free memory must not change the pool size: compiled graphs depend on it."""
    assert default_kv_budget(int(free_gib * 2**30)) == int(budget_gib * 2**30)


def test_warming_the_kv_pool_writes_only_unheld_blocks_up_to_the_limit(
    tiny_loaded, monkeypatch
) -> None:
    from tokenmill.engine import kv_memory

    engine = LLMEngine(tiny_loaded, num_kv_blocks=64, block_size=16)
    cache, pool = engine.runner.cache, engine.kv.block_pool
    per_block = cache.k[0][:16].nbytes
    monkeypatch.setattr(kv_memory, "KV_WARM_BYTES", 3 * per_block)  # units of 3 blocks
    # 20 blocks past the used
    monkeypatch.setattr(kv_memory, "KV_WARM_AHEAD", 20 * 2 * len(cache.k) * per_block)
    for t in cache.k + cache.v:
        t[: cache.pad_slot].fill_(7.0)
    held = [b.block_id for b in pool.get_new_blocks(2)]  # blocks 0 and 1, in use
    cached_block = pool.get_new_blocks(1)[0]  # block 2: full, cached, then freed
    pool.cached[("h",)] = cached_block
    cached_block.block_hash = ("h",)
    pool.free_blocks([cached_block])

    units = 0
    while engine.warm_kv_cache():
        units += 1
    # blocks 0-23 (to 3 + 20, in whole units of 3), every tensor
    assert units == 8 * 2 * len(cache.k)

    def block(t: torch.Tensor, i: int) -> torch.Tensor:
        return t[i * 16 : (i + 1) * 16]

    for t in cache.k + cache.v:
        for i in held + [cached_block.block_id]:
            assert bool((block(t, i) == 7.0).all()), f"block {i} was written"
        for i in range(3, 24):
            assert bool((block(t, i) == 0).all()), f"block {i} was not warmed"
        assert bool((t[24 * 16 : cache.pad_slot] == 7.0).all()), "warmed past the limit"

    pool.get_new_blocks(10)  # blocks 3..12 taken: the limit moves to 33
    assert engine.warm_kv_cache()
    while engine.warm_kv_cache():
        pass
    assert bool((cache.k[0][24 * 16 : 33 * 16] == 0).all())
