"""The fair scheduling policy: tenants share the steps by virtual token counters, so one tenant
flooding the engine cannot hold another's request back; outputs stay those of plain runs."""

from __future__ import annotations

import pytest

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request import Sequence, SequenceStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.sample import SamplingParams

LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _steps_to_first_token(policy: str, tiny_loaded) -> tuple[int, dict[str, list[int]]]:
    """Tenant a keeps 8 long requests running (the sequence cap); after 3 steps tenant b sends
    one short request. Returns the steps b waited for its first token, and every output."""
    engine = LLMEngine(
        tiny_loaded, num_kv_blocks=256, max_model_len=256, max_num_seqs=8, policy=policy
    )
    for i in range(12):
        engine.add_request(f"a{i}", [1 + i, 2, 3, 4, 5], LONG, tenant="a")
    outputs: dict[str, list[int]] = {}
    waited = None
    for step in range(1000):
        if step == 3:
            engine.add_request("b", [7, 8, 9, 10], SHORT, tenant="b")
        for out in engine.step():
            if out.request_id == "b" and out.outputs[0].token_ids and waited is None:
                waited = step - 3
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    return waited, outputs


def test_a_flooding_tenant_does_not_hold_another_back(tiny_loaded) -> None:
    fcfs_wait, fcfs_outputs = _steps_to_first_token("fcfs", tiny_loaded)
    fair_wait, fair_outputs = _steps_to_first_token("fair", tiny_loaded)
    # b joins at a's counter, and takes the place of a's latest request as soon as a's next
    # step puts a's counter above it
    assert fair_wait <= 1
    assert fcfs_wait > 20  # behind a's first 8 requests' 40 tokens
    assert fair_outputs == fcfs_outputs  # the preempted requests recompute the same tokens


def _sequence(seq_id: str, tenant: str, arrival: float = 0.0) -> Sequence:
    return Sequence(
        seq_id=seq_id, prompt_token_ids=list(range(1, 9)), tenant=tenant, arrival_time=arrival
    )


def test_counters_weigh_prompt_and_output_tokens_and_lift_a_returning_tenant() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy="fair"),
        KVCacheManager(num_blocks=64, block_size=16),
    )
    scheduler.add_sequence(_sequence("a0", "a"))
    out = scheduler.schedule()
    assert out.num_new_tokens == [8] and scheduler.served == {"a": 8.0}
    seq = out.sequences[0]
    seq.num_computed_tokens = 8
    seq.append_output_token(5)
    scheduler.schedule()  # a decode: one output token, weighted 2
    assert scheduler.served == {"a": 10.0}
    scheduler.add_sequence(_sequence("c0", "c"))  # joins at the lowest active counter
    assert scheduler.served["c"] == 10.0


def _step(scheduler: Scheduler) -> list[str]:
    """Schedule a step and account for it as the engine would (a token out after the prompt)."""
    out = scheduler.schedule()
    for seq, num_new in zip(out.sequences, out.num_new_tokens):
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens >= seq.num_tokens:
            seq.append_output_token(1)
    return [seq.seq_id for seq in out.sequences]


def test_a_less_served_tenant_takes_the_place_of_the_most_served() -> None:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, policy="fair"),
        KVCacheManager(num_blocks=64, block_size=16),
    )
    for i in range(4):
        scheduler.add_sequence(_sequence(f"a{i}", "a", arrival=i))
    assert _step(scheduler) == ["a0", "a1"]  # 16 prompt tokens: a's counter is 16
    scheduler.add_sequence(_sequence("b0", "b", arrival=4))
    assert scheduler.served["b"] == 16.0  # lifted to a's
    # b's first step is its own: a1, a's latest, gives way, and a0 skips the step
    assert _step(scheduler) == ["b0"]
    assert scheduler.sequences["a1"].num_preemptions == 1
    assert scheduler.served == {"a": 16.0, "b": 24.0}
    # then b, served more than a, gives its place back to a's waiting a1 (with a's running a0
    # beside it: a has sequences running, so no step of its own)
    assert _step(scheduler) == ["a0", "a1"]
    assert scheduler.sequences["b0"].num_preemptions == 1


def test_a_tenant_at_its_running_limit_waits_while_others_are_admitted() -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, policy="fair", max_running_per_tenant=2
        ),
        KVCacheManager(num_blocks=64, block_size=16),
    )
    for i in range(4):
        scheduler.add_sequence(_sequence(f"a{i}", "a", arrival=i))
    scheduler.add_sequence(_sequence("b0", "b", arrival=4))
    # a's first two run; a2 and a3 wait although the cap, the budget and the pool have room
    assert sorted(_step(scheduler)) == ["a0", "a1", "b0"]
    assert sorted(_step(scheduler)) == ["a0", "a1", "b0"]
    scheduler.finish(scheduler.sequences["a0"], SequenceStatus.FINISHED_STOPPED)
    assert "a2" in _step(scheduler)  # a place of a's is free: its next one runs
    assert len([s for s in scheduler.running if s.tenant == "a"]) == 2


def test_a_running_limit_needs_the_fair_policy() -> None:
    with pytest.raises(ValueError, match="--scheduling-policy fair"):
        SchedulerConfig(policy="fcfs", max_running_per_tenant=2)
    with pytest.raises(ValueError, match="at least 1"):
        SchedulerConfig(policy="fair", max_running_per_tenant=0)


def test_an_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="fcfs, priority, fair"):
        SchedulerConfig(policy="lottery")


def test_the_server_names_tenants_by_key_then_user(tiny_loaded, monkeypatch) -> None:
    import httpx

    from tests.server.conftest import RunningServer
    from tokenmill.server.app import ServerConfig

    engine = LLMEngine(tiny_loaded, num_kv_blocks=128, max_model_len=256, policy="fair")
    seen: list[str] = []
    process = engine.input_processor.process

    def recording(*args, tenant: str = "", **kwargs):
        seen.append(tenant)
        return process(*args, tenant=tenant, **kwargs)

    monkeypatch.setattr(engine.input_processor, "process", recording)
    config = ServerConfig("tiny", api_key="owner", api_keys={"key-a": "team-a", "key-b": "team-b"})
    running = RunningServer(engine, config)
    try:
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        for key, user in (("key-a", None), ("key-b", "someone"), ("owner", "carol")):
            resp = httpx.post(
                f"{running.url}/v1/completions",
                json={**body, "user": user} if user else body,
                headers={"Authorization": f"Bearer {key}"},
            )
            assert resp.status_code == 200, resp.text
        refused = httpx.post(
            f"{running.url}/v1/completions", json=body, headers={"Authorization": "Bearer x"}
        )
        assert refused.status_code == 401
    finally:
        running.stop()
    assert seen == ["team-a", "team-b", "carol"]  # a key's tenant first, then the user field
