"""Tensor parallelism (`tensor_parallel_size`): two ranks compute what one does, on tiny random
models with an uneven head split, a replicated KV head and packed GGUF weights; the workers leave
with the engine."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import psutil
import pytest
import torch
import transformers

from tests.engine_runs import final_outputs
from tests.model.test_gguf_model import HF_CONFIGS, _write_gguf
from tests.tiny_models import build_tiny_model
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.model.sharding import head_ranges, row_ranges
from tokenmill.sample import SamplingParams

Q = gguf.GGMLQuantizationType
NUM_BLOCKS, BLOCK = 64, 8


def _engine(path: Path, tp: int, quantization: str = "none", backend: str = "mp") -> LLMEngine:
    # float32 throughout, the KV cache too: an fp16 cache rounds each rank's keys at their own
    # last bit, which the 1e-4 bound would then measure
    return LLMEngine(
        str(path),
        dtype="fp32",
        quantization=quantization,
        kv_cache_dtype="float32",
        num_kv_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        compile=False,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
    )


def _prompts(vocab: int, count: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(3, vocab - 3, (int(n),), generator=g).tolist()
        for n in torch.randint(2, 14, (count,), generator=g)
    ]


def _logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt token's logits in one batched prefill, then two batched decode steps' of
    tokens chosen here, through blocks assigned by hand (two per sequence)."""
    tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
    lens = [len(p) for p in prompts]
    out = [engine.runner.all_logits(prompts, lens, tables)]
    for step in range(2):
        tokens = [[(7 * i + step) % 50 + 3] for i in range(len(prompts))]
        lens = [n + 1 for n in lens]
        out.append(engine.runner.all_logits(tokens, lens, tables))
    return out


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    return [o.token_ids for o in final_outputs(engine, [(p, params) for p in prompts])]


def _compare(
    path: Path, vocab: int, quantization: str, ranks: int = 2, backend: str = "mp"
) -> None:
    """Every logit and greedy token of `ranks` ranks equals one rank's, bit for bit."""
    prompts = _prompts(vocab, 16)
    results = {}
    for tp in (1, ranks):
        engine = _engine(path, tp, quantization, backend)
        try:
            results[tp] = (_logits(engine, prompts), _greedy(engine, prompts))
        finally:
            engine.shutdown()
    (logits1, greedy1), (logits2, greedy2) = results[1], results[ranks]
    for one, two in zip(logits1, logits2):
        assert torch.equal(two, one)
    assert greedy2 == greedy1


@pytest.fixture(scope="module")
def llama_3kv(tmp_path_factory) -> Path:
    # 6 heads of 16 over 3 KV heads: rank 0 holds 2 KV heads (4 query heads), rank 1 one (2)
    path = tmp_path_factory.mktemp("llama-3kv")
    return build_tiny_model(path, num_heads=6, num_kv_heads=3, hidden_size=96)


def test_llama_with_uneven_heads_equals_one_rank(llama_3kv: Path) -> None:
    _compare(llama_3kv, 320, "none")


def test_ray_actors_as_workers_equal_one_rank(llama_3kv: Path) -> None:
    """--distributed-executor-backend ray: the worker is a Ray actor (a local Ray instance)."""
    import ray

    try:
        _compare(llama_3kv, 320, "none", backend="ray")
    finally:
        ray.shutdown()


def test_llama_over_three_ranks_equals_one_rank(llama_3kv: Path) -> None:
    # one KV head each; the MLP's 128 rows split 48 + 48 + 32, the hidden 96 into 32 each
    _compare(llama_3kv, 320, "none", ranks=3)


def test_gemma3_with_a_replicated_kv_head_equals_one_rank(tmp_path: Path) -> None:
    # sandwich norms after the gathers; 1 KV head on both ranks, 2 query heads each
    path = build_tiny_model(tmp_path / "gemma3", arch="gemma3", num_kv_heads=1)
    _compare(path, 320, "none")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_packed_gguf_equals_one_rank(qtype: Q, tmp_path: Path) -> None:
    """Packed weights stay packed (each rank packs its rows of the file's blocks), and every
    output is one rank's whole sum: the packed kernels' results too equal one rank's exactly."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS["llama"], dtype=torch.float32)
    path = tmp_path / "model.gguf"
    _write_gguf(path, hf.eval(), "llama", qtype)
    _compare(path, 96, "none")
    _compare(path, 96, "gguf")


def test_workers_exit_on_shutdown_and_after_a_failed_step(llama_3kv: Path, monkeypatch) -> None:
    engine = _engine(llama_3kv, 2)
    pids = engine.executor.pids
    assert all(psutil.pid_exists(pid) for pid in pids)

    def fail(*args: object) -> None:
        raise RuntimeError("injected")

    # rank 0 fails after sending the step: the worker waits in its first gather
    monkeypatch.setattr(engine.runner, "_forward", fail)
    engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="out of step"):
        engine.step()
    assert engine.executor is None
    assert not any(psutil.pid_exists(pid) for pid in pids)

    engine = _engine(llama_3kv, 2)
    pids = engine.executor.pids
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_workers_exit_when_the_driver_raises(llama_3kv: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        from tokenmill.llm import LLM
        llm = LLM({str(llama_3kv)!r}, dtype="fp32", num_kv_blocks=16, tensor_parallel_size=2)
        print(*llm.engine.executor.pids, flush=True)
        raise SystemExit("the driver fails")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert "the driver fails" in run.stderr, run.stderr
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 1
    assert not any(psutil.pid_exists(pid) for pid in pids)


def test_workers_exit_when_the_driver_is_killed(llama_3kv: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from tokenmill.llm import LLM
        llm = LLM({str(llama_3kv)!r}, dtype="fp32", num_kv_blocks=16, tensor_parallel_size=2)
        print(*llm.engine.executor.pids, flush=True)
        time.sleep(300)
        """
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in driver.stdout.readline().split()]
    driver.kill()  # no atexit, no finalizers: the worker sees its group close
    driver.wait()
    workers = [psutil.Process(pid) for pid in pids]
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive


def test_unsupported_combinations_are_refused(llama_3kv: Path, tiny_loaded) -> None:
    with pytest.raises(ValueError, match="rather than a loaded model"):
        LLMEngine(tiny_loaded, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="at least 1"):
        LLMEngine(str(llama_3kv), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="--distributed-executor-backend mp"):
        LLMEngine(str(llama_3kv), tensor_parallel_size=2, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="draft model"):
        LLMEngine(
            str(llama_3kv),
            tensor_parallel_size=2,
            speculative_config={"model": str(llama_3kv), "num_speculative_tokens": 2},
        )


def test_head_and_row_splits() -> None:
    # SmolLM2: 9 query heads over 3 KV heads
    assert head_ranges(9, 3, 2) == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    # Gemma 3 270M: one KV head, replicated; its 4 query heads split
    assert head_ranges(4, 1, 2) == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]
    assert head_ranges(8, 2, 4) == [
        (range(0, 2), range(0, 1)),
        (range(2, 4), range(0, 1)),
        (range(4, 6), range(1, 2)),
        (range(6, 8), range(1, 2)),
    ]
    with pytest.raises(ValueError, match="tensor-parallel-size"):
        head_ranges(4, 1, 3)
    # the intermediate and hidden sizes split in whole tiles of 16 rows where they are made of them
    assert row_ranges(96, 2, "rows") == [range(0, 48), range(48, 96)]
    assert row_ranges(128, 3, "rows") == [range(0, 48), range(48, 96), range(96, 128)]
    assert row_ranges(10, 3, "rows") == [range(0, 4), range(4, 7), range(7, 10)]
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        row_ranges(3, 4, "hidden dimensions")


def test_whole_projection_qk_norms_are_refused() -> None:
    """OLMo 2 normalizes q and k over all heads at once: no rank holds them all."""
    from tokenmill.model.config import ModelConfig
    from tokenmill.model.sharding import Shard, layout

    cfg = ModelConfig("olmo2", 96, 64, 96, 2, 4, 2, 16, qk_norm=True, qk_norm_whole=True)
    assert layout(cfg, Shard(0, 1)).q_heads == range(0, 4)
    with pytest.raises(ValueError, match="--tensor-parallel-size 1"):
        layout(cfg, Shard(0, 2))


def test_generate_command_with_two_ranks(llama_3kv: Path, capsys) -> None:
    from tokenmill.cli.main import main

    outputs = []
    for tp in ("1", "2"):
        argv = ["generate", "-m", str(llama_3kv), "--dtype", "fp32", "--no-compile", "-n", "6"]
        assert main([*argv, "--tensor-parallel-size", tp, "def add(a, b):"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[1] == outputs[0]


def test_async_engine_serves_and_stops_its_workers(llama_3kv: Path) -> None:
    """As `serve` runs it: the engine built on the engine thread, its workers stopped when the
    engine loop ends."""
    import asyncio

    from tokenmill.engine.async_engine import AsyncLLMEngine

    async_engine = AsyncLLMEngine(lambda: _engine(llama_3kv, 2))
    pids = async_engine.engine.executor.pids
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def run() -> list[int]:
        outs = [out async for out in async_engine.generate([5, 6, 7], params, "r")]
        return outs[-1].outputs[0].token_ids

    tokens = asyncio.run(run())
    async_engine.shutdown(timeout=30)
    assert not any(psutil.pid_exists(pid) for pid in pids)
    engine = _engine(llama_3kv, 1)
    assert tokens == _greedy_one(engine, [5, 6, 7], params)


def _greedy_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    return final_outputs(engine, [(prompt, params)])[0].token_ids


def test_any_head_split_of_packed_weights_equals_one_rank(tmp_path: Path) -> None:
    """4 KV heads of 16 over 3 ranks: 2 + 1 + 1, so rank 1's attention output is columns 32..48,
    inside a Q4_0 block of o_proj's input; o_proj takes every rank's columns, whole blocks."""
    import copy

    config = copy.deepcopy(HF_CONFIGS["llama"])
    config.num_key_value_heads = 4
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path / "model.gguf"
    _write_gguf(path, hf.eval(), "llama", Q.Q4_0)
    _compare(path, 96, "gguf", ranks=3)
