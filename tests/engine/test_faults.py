"""Fault isolation: one request's failure ends that request only; the engine keeps serving."""

from __future__ import annotations

import torch

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sample import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _finish_all(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return done


def test_nan_logits_fail_only_that_request(tiny_loaded, monkeypatch) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=64)
    original = engine._sample

    def poisoned(logits, seqs, batch, touched):
        logits = logits.clone()
        for i, seq in enumerate(seqs):
            if seq.seq_id == "poison" and seq.num_output_tokens == 3:
                logits[i, 5] = float("nan")
        return original(logits, seqs, batch, touched)

    monkeypatch.setattr(engine, "_sample", poisoned)
    for rid in ("a", "poison", "b"):
        engine.add_request(rid, [5, 6, 7, 8], PARAMS)
    done = _finish_all(engine)
    assert done["poison"].outputs[0].finish_reason == "error"
    assert "non-finite" in done["poison"].error and len(done["poison"].outputs[0].token_ids) == 3
    assert [len(done[r].outputs[0].token_ids) for r in "ab"] == [8, 8]
    assert done["a"].outputs[0].token_ids == done["b"].outputs[0].token_ids
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_tokenizer_failure_fails_only_that_request(tiny_loaded) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=64)
    for rid in ("a", "broken"):
        engine.add_request(rid, [5, 6, 7], PARAMS)

    def explode(token_id: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated tokenizer failure")

    engine._requests["broken"].sequences[0].detokenizer.push = explode
    done = _finish_all(engine)
    assert (
        done["broken"].outputs[0].finish_reason == "error" and "simulated" in done["broken"].error
    )
    assert done["a"].outputs[0].finish_reason == "length" and done["a"].error is None


def test_failed_step_fails_its_batch_and_the_engine_goes_on(tiny_loaded, monkeypatch) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=64)
    real_forward = engine.runner._forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated kernel failure")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "_forward", flaky)
    engine.add_request("victim", [5, 6, 7], PARAMS)
    done = _finish_all(engine)
    assert (
        done["victim"].outputs[0].finish_reason == "error"
        and "simulated kernel failure" in done["victim"].error
    )
    engine.add_request("after", [5, 6, 7], PARAMS)
    assert _finish_all(engine)["after"].outputs[0].finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert all(torch.isfinite(k[engine.runner.cache.pad_slot]).all() for k in engine.runner.cache.k)


def test_failed_step_leaves_no_unwritten_blocks_in_the_prefix_cache(
    tiny_loaded, monkeypatch
) -> None:
    engine = LLMEngine(tiny_loaded, num_kv_blocks=64)
    prompt = list(range(5, 70))  # four full blocks, published to the prefix cache when scheduled
    real_forward = engine.runner._forward
    monkeypatch.setattr(
        engine.runner, "_forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    engine.add_request("failed", prompt, PARAMS)
    assert _finish_all(engine)["failed"].outputs[0].finish_reason == "error"
    monkeypatch.setattr(engine.runner, "_forward", real_forward)
    hits = engine.stats.prefix_cache_hits
    engine.add_request("retry", prompt, PARAMS)
    retry = _finish_all(engine)["retry"]
    assert engine.stats.prefix_cache_hits == hits  # nothing reused from the failed step
    cold = LLMEngine(tiny_loaded, num_kv_blocks=64, enable_prefix_caching=False)
    cold.add_request("cold", prompt, PARAMS)
    assert retry.outputs[0].token_ids == _finish_all(cold)["cold"].outputs[0].token_ids
