"""Tensor parallelism on the two real models (pulled from the catalog into the model cache): two
ranks give one rank's greedy outputs with packed weights, and its float32 logits, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_real_batch_invariance import PROMPTS
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.llm import LLM
from tokenmill.sample import SamplingParams


@pytest.fixture(params=["smollm2", "gemma3"])
def real_gguf(request, smollm2_gguf, gemma3_gguf) -> Path:
    # SmolLM2-135M Q4_1: 9 heads over 3 KV heads, split 6 + 3 over 2 KV heads + 1;
    # Gemma 3 270M Q4_K_M: 4 heads over 1 KV head, replicated, and sandwich norms
    return smollm2_gguf if request.param == "smollm2" else gemma3_gguf


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:32], params, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_32_prompts_greedy_with_two_ranks_equal_one(real_gguf: Path, dtype: str) -> None:
    """Default settings (packed weights): one rank computes o_proj and down_proj in the parts two
    ranks hold (model/sharding.py's PartedLinear), so two ranks repeat its arithmetic."""
    with LLM(str(real_gguf), dtype=dtype, tensor_parallel_size=2) as llm:
        two = _greedy(llm)
    with LLM(str(real_gguf), dtype=dtype) as llm:
        one = _greedy(llm)
    assert two == one


def _fp32_logits(path: Path, tp: int) -> torch.Tensor:
    prompts = [list(range(100, 100 + n)) for n in (3, 17, 9, 30)]
    tables = [[2 * i, 2 * i + 1] for i in range(len(prompts))]
    engine = LLMEngine(
        str(path),
        dtype="float32",
        quantization="none",
        kv_cache_dtype="float32",
        num_kv_blocks=16,
        block_size=16,
        compile=False,
        tensor_parallel_size=tp,
    )
    try:
        return engine.runner.all_logits(prompts, [len(p) for p in prompts], tables)
    finally:
        engine.shutdown()


def test_float32_logits_with_two_ranks_equal_one(real_gguf: Path) -> None:
    one, two = _fp32_logits(real_gguf, 1), _fp32_logits(real_gguf, 2)
    assert torch.equal(two, one)
