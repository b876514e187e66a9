"""`tokenmill::decoder_layer`: an eager step computes each pre-norm layer of plain attention in one
C++ call, with the same ops its Python forward calls; every row and cache entry comes out the same
bits either way, for every kind of linear layer it binds, and the layers it does not take keep
their Python forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.threads import torch_threads
from tests.tiny_models import build_tiny_model
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model import kernels, transformer
from tokenmill.model.attention import kernel_attends_prompts
from tokenmill.model.loader import load_model

pytestmark = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="tokenmill's kernels build only for x86 CPUs with AVX2 or AVX-512",
)

LOADS = [
    {"dtype": "float32"},  # DenseLinear through tokenmill::dense_linear
    {"dtype": "float32", "batch_invariant": False},  # nn.Linear through at::linear
    {"dtype": "bfloat16"},
    {"dtype": "float32", "quantization": "int4"},
    {"dtype": "float32", "quantization": "int8"},
    {"dtype": "bfloat16", "quantization": "int4"},
]
# three prompts of different lengths, then a decode step of all three
PROMPTS = [[5, 9, 14, 3, 7, 21, 30, 2, 11], [8, 1, 40, 6], list(range(50, 70))]
BLOCK = 16


class _CountedOps:
    """kernels' bindings, counting calls of `decoder_layer`."""

    def __init__(self, bindings) -> None:
        self.bindings, self.layer_calls = bindings, 0

    def __getattr__(self, name: str):
        if name != "decoder_layer":
            return getattr(self.bindings, name)

        def counted(*args):
            self.layer_calls += 1
            return self.bindings.decoder_layer(*args)

        return counted


def _steps(runner: ModelRunner, first_block: int) -> list[torch.Tensor]:
    """Hidden states of a prompt step and a decode step; sequence i from block first_block + 2i."""
    tables = [[first_block + 2 * i, first_block + 2 * i + 1] for i in range(len(PROMPTS))]
    lens = [len(p) for p in PROMPTS]
    prompt = runner.hidden_states(PROMPTS, lens, tables)
    decode = runner.hidden_states([[4]] * len(PROMPTS), [n + 1 for n in lens], tables)
    return [prompt, decode]


@pytest.fixture(scope="module", params=["llama", "llama-bias", "gemma3"])
def model_dir(request, tmp_path_factory) -> Path:
    """Tiny models with heads 32 wide (the fused rope and cache write take whole halves of 16):
    llama, llama with biases on every projection, Gemma 3 (sandwich norms, q/k norms per head,
    sliding windows, gelu)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma3":
        return build_tiny_model(path, arch="gemma3", layers=3, head_dim=32)
    bias = request.param == "llama-bias"
    return build_tiny_model(path, hidden_size=128, num_heads=4, num_kv_heads=2, bias=bias)


@pytest.mark.parametrize("options", LOADS, ids=lambda o: "-".join(map(str, o.values())))
def test_layers_in_one_call_give_the_python_layers_bits(model_dir, monkeypatch, options) -> None:
    loaded = load_model(model_dir, progress=False, **options)
    generator = torch.Generator().manual_seed(0)
    for module in loaded.model.modules():  # norms of their own (saved models' are all ones)
        if isinstance(module, transformer.RMSNorm):
            weight = torch.rand(module.weight.shape, generator=generator) + 0.5
            module.weight.data.copy_(weight)
    runner = ModelRunner(loaded, num_blocks=16, block_size=BLOCK, compile=False)
    layers = len(loaded.model.layers)
    counted = _CountedOps(kernels.ops())
    monkeypatch.setattr(kernels, "_bindings", counted)
    # every layer of the decode step, and of the prompt step where prompts attend through the
    # decode kernel (not with --no-batch-invariant on an AMX CPU, where SDPA takes them)
    cache = runner.cache.k[0]
    prompts_fused = kernel_attends_prompts(
        loaded.dtype,
        cache.dtype,
        cache.shape[-1],
        cache.device,
        batch_invariant=loaded.batch_invariant,
    )
    fused_calls = (2 if prompts_fused else 1) * layers
    # the fused layers share their work between three threads unevenly, the Python layers run on one
    with torch_threads(3):
        fused = _steps(runner, first_block=0)
    assert counted.layer_calls == fused_calls
    monkeypatch.setattr(transformer.Transformer, "_kernel_layer_calls", lambda *args: None)
    with torch_threads(1):
        python = _steps(runner, first_block=8)
    assert counted.layer_calls == fused_calls
    for step, (a, b) in enumerate(zip(fused, python)):
        assert torch.equal(a, b), f"step {step} differs"
    # the same K/V went into each run's slots: sequence i's positions from block 2i (fused) and
    # 8 + 2i (Python) on
    written = torch.cat([2 * i * BLOCK + torch.arange(len(p) + 1) for i, p in enumerate(PROMPTS)])
    for k, v in zip(runner.cache.k, runner.cache.v):
        for cache in (k, v):
            assert torch.equal(cache[written], cache[written + 8 * BLOCK])


def test_layers_it_does_not_take_keep_their_python_forward(tmp_path) -> None:
    """A step of Gemma 3 with heads 16 wide (the rope kernel's halves are whole vectors of 16) goes
    through the Python forward; so does a step of a model while an MLP has a forward hook, which
    then runs, and the next step after the hook is removed goes through `decoder_layer` again."""
    gemma = load_model(build_tiny_model(tmp_path / "gemma3", arch="gemma3"), progress=False)
    runner = ModelRunner(gemma, num_blocks=4, block_size=BLOCK, compile=False)
    h = torch.zeros(3, gemma.config.hidden_size)
    assert all(layer.kernel_weights(h) is not None for layer in gemma.model.layers)
    calls = []
    calls_of = transformer.Transformer._kernel_layer_calls
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            transformer.Transformer,
            "_kernel_layer_calls",
            lambda *args: calls.append(calls_of(*args)) or calls[-1],
        )
        runner.hidden_states([[3, 4, 5]], [3], [[0]])
    assert calls == [None]

    llama = load_model(
        build_tiny_model(tmp_path / "llama", hidden_size=128, num_heads=4, num_kv_heads=2),
        progress=False,
    )
    runner = ModelRunner(llama, num_blocks=4, block_size=BLOCK, compile=False)
    counted = _CountedOps(kernels.ops())
    seen = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "_bindings", counted)
        runner.hidden_states([[3, 4, 5]], [3], [[0]])  # through decoder_layer
        assert counted.layer_calls == len(llama.model.layers)
        mlp = llama.model.layers[0].mlp
        hook = mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        h = torch.zeros(3, llama.config.hidden_size)
        assert llama.model.layers[0].kernel_weights(h) is None
        runner.hidden_states([[3, 4, 5]], [3], [[1]])  # the Python forward, and the hook runs
        assert counted.layer_calls == len(llama.model.layers)
        hook.remove()
        runner.hidden_states([[3, 4, 5]], [3], [[2]])  # through decoder_layer again
        assert counted.layer_calls == 2 * len(llama.model.layers)
    assert seen == [torch.Size([3, llama.config.hidden_size])]
