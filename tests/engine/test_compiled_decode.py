"""The compiled decode graph computes what the eager model computes."""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch._inductor import loop_body
from torch._inductor.triton_bundler import TritonBundler

from tokenmill.engine import llm_engine, model_runner, stoppable_thread
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.stoppable_thread import ThreadStopped
from tokenmill.model import kernels, quant_linear
from tokenmill.model.dense_linear import DenseLinear
from tokenmill.model.loader import load_model
from tokenmill.sample import SamplingParams

PROMPTS = [[5, 9, 30, 71, 12, 44, 8], list(range(40, 60)), [3, 4, 5]]
TABLES = [[0, 1], [2, 3], [4, 5]]


@pytest.fixture(scope="module")
def runner(tiny_model_dir, tmp_path_factory):
    # int8 layers with dense copies from 2 tokens, so eager and compiled pick the same kernel kind
    # for every batch size; the tiny model's head (320 x 64) counts as a large int8 matrix, so it
    # takes the kernels of a real output head (chunks from 2 tokens, streamed at compiled batch 1;
    # the tile kernel where it serves, on AVX-512)
    patch = pytest.MonkeyPatch()
    patch.setattr(quant_linear, "LARGE_INT8_WEIGHTS", 320 * 64)
    patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    # no decode graphs cached yet
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    loaded = load_model(
        tiny_model_dir,
        progress=False,
        quantization="int8",
        dense_min_tokens=2,
        batch_invariant=False,
    )
    heads = {
        m.out_features
        for m in loaded.model.modules()
        if isinstance(m, quant_linear.QuantLinear)
        and quant_linear.is_large_int8(m.kind, m.out_features * m.in_features)
    }
    assert heads == {320}
    # inductor's placeholder module as torch defines it, not yet traced in this process
    traced = functools.cache(lambda: torch.fx.symbolic_trace(loop_body.identity))
    patch.setattr(loop_body.InterpreterShim, "_dummy_gm", staticmethod(traced))
    runner = ModelRunner(loaded, num_blocks=8, block_size=16, compile=True)
    assert runner.decode_mode in ("compiling", "compiled")
    runner.failed_module_calls, runner.early_steps = _serve_while_graphs_build(runner)
    assert runner.wait_compiled(timeout=900), f"compilation failed: {runner.compile_error!r}"
    yield runner
    patch.undo()


@pytest.fixture(autouse=True)
def graphs_serve_without_trial(monkeypatch) -> None:
    """The tests here check what a graph computes: their steps go to the graphs (the trial's
    own tests set a trial up)."""
    monkeypatch.setattr(model_runner, "GRAPH_TRIAL_STEPS", 0)


def _serve_while_graphs_build(runner: ModelRunner) -> tuple[list[str], dict[int, tuple] | None]:
    """While runner's graphs build, call a module on this thread as an eager step would; the
    first time the batch-1 graph is ready alone, also run a decode step of 1 and of 3 sequences.
    Returns the module calls' failures, and those steps' (logits, the eager path's logits, whether
    the step ran eagerly) by batch size (None if no such moment came)."""
    module, x, failures, steps = torch.nn.Identity(), torch.ones(1), [], None
    while runner._compile_thread.is_alive():
        try:
            module(x)
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            failures.append(repr(exc))
        if steps is None and list(runner._compiled_decode or ()) == [1]:
            steps = {size: _decode_step_while_building(runner, size) for size in (1, 3)}
        time.sleep(0.0002)
    return failures, steps


def _decode_step_while_building(runner: ModelRunner, batch_size: int) -> tuple:
    prompts, tables = PROMPTS[:batch_size], TABLES[:batch_size]
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)  # prefill: eager
    step = ([[7]] * batch_size, [len(p) + 1 for p in prompts], tables)
    eager_calls = []
    forward = runner._forward
    runner._forward = lambda *args: eager_calls.append(1) or forward(*args)
    try:
        logits = runner.last_token_logits(*step).clone()
    finally:
        del runner._forward
    return logits, runner.model.logits(runner.hidden_states(*step)), bool(eager_calls)


def test_modules_called_on_another_thread_while_graphs_build_work(runner) -> None:
    # torch.fx's symbolic tracing patches every module call in the process while it runs
    assert runner.failed_module_calls == []


def test_the_batch_1_graph_serves_while_the_next_graph_builds(runner) -> None:
    assert runner.early_steps is not None, "the batch-1 graph was never ready on its own"
    for batch_size, (logits, eager, ran_eagerly) in runner.early_steps.items():
        assert ran_eagerly == (batch_size > 1)  # larger batches wait for their graph
        torch.testing.assert_close(logits, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_compiled_decode_matches_eager(runner, batch_size: int) -> None:
    prompts, tables = PROMPTS[:batch_size], TABLES[:batch_size]
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)  # prefill: eager
    step = ([[7]] * batch_size, [len(p) + 1 for p in prompts], tables)
    assert runner.decode_mode == "compiled"
    compiled = runner.last_token_logits(*step)
    assert runner.uncompiled_decode_steps == 0  # the warm-up compiled every graph decode needs
    eager = runner.model.logits(runner.hidden_states(*step))  # the eager path
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(compiled).all()


def test_a_few_tokens_per_sequence_run_as_rows_of_the_compiled_graph(runner) -> None:
    """A decode with its drafts (three tokens each): every token a row of the graph over its own
    context, as the eager path computes the chunk."""
    prompts, tables = PROMPTS, TABLES
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)
    step = ([[7, 8, 9]] * 3, [len(p) + 3 for p in prompts], tables)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "_forward", lambda *args: pytest.fail("the step ran eagerly"))
        rows = runner.token_logits(*step).clone()
        last = runner.last_token_logits(*step).clone()
    eager = runner.model.logits(runner.hidden_states(*step))
    assert rows.shape == eager.shape == (9, 320)
    torch.testing.assert_close(rows, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, eager[[2, 5, 8]], rtol=1e-4, atol=1e-4)


def test_compiled_steps_reuse_one_logits_buffer(runner) -> None:
    prompts, tables = PROMPTS, TABLES
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)
    first = runner.last_token_logits([[7]] * 3, [len(p) + 1 for p in prompts], tables)
    step = ([[9]] * 3, [len(p) + 2 for p in prompts], tables)
    second = runner.last_token_logits(*step)
    assert second.data_ptr() == first.data_ptr() and second.dtype == torch.float32
    eager = runner.model.logits(runner.hidden_states(*step))
    torch.testing.assert_close(second, eager, rtol=1e-4, atol=1e-4)
    smaller = runner.last_token_logits([[7]] * 2, [len(p) + 3 for p in prompts[:2]], tables[:2])
    assert smaller.shape == (2, second.shape[1]) and smaller.data_ptr() == first.data_ptr()


def test_argmax_only_steps_get_the_heads_products_as_they_are(runner) -> None:
    prompts, tables = PROMPTS, TABLES
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)
    step = ([[7]] * 3, [len(p) + 1 for p in prompts], tables)
    logits = runner.last_token_logits(*step).clone()
    raw = runner.last_token_logits(*step, argmax_only=True)
    assert raw.data_ptr() != runner._logits.data_ptr()  # not copied into the float32 buffer
    assert raw.dtype == runner.loaded.dtype
    torch.testing.assert_close(raw.float(), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("slower", ["graph", "eager"])
def test_each_batch_size_class_keeps_the_faster_of_its_graph_and_eager_steps(
    runner, monkeypatch, caplog, tmp_path, slower: str
) -> None:
    """The graph and the eager path take turns until each has GRAPH_TRIAL_STEPS timed steps of a
    class; the faster then serves the class alone, and the decision is saved. One path is slowed
    by 20 ms a step here."""
    trial_steps = 4
    monkeypatch.setattr(model_runner, "GRAPH_TRIAL_STEPS", trial_steps)
    record = tmp_path / "trials.json"
    monkeypatch.setattr(runner, "_trial_record", record)
    monkeypatch.setattr(runner, "_trial_decisions", {})
    paths: list[str] = []
    run_compiled, forward = runner._run_compiled, runner._forward

    def through_graph(*args):
        paths.append("graph")
        if slower == "graph":
            time.sleep(0.02)
        return run_compiled(*args)

    def eagerly(*args):
        paths.append("eager")
        if slower == "eager":
            time.sleep(0.02)
        return forward(*args)

    def eager_logits(token_ids, context_lens, tables) -> torch.Tensor:
        inputs = runner._inputs(token_ids, [1] * len(token_ids), context_lens, tables)
        return runner.model.logits(forward(*inputs))

    caplog.set_level(logging.INFO, logger="tokenmill.engine")
    for size in (1, 3):
        prompts, tables = PROMPTS[:size], TABLES[:size]
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(runner, "_trials", {})
            runner.last_token_logits(prompts, [len(p) for p in prompts], tables)  # prefill: eager
            # a first step through the graph checks its guards (a longer step, not timed)
            runner.last_token_logits([[7]] * size, [len(p) + 1 for p in prompts], tables)
            patch.setattr(runner, "_trials", {})
            patch.setattr(runner, "_run_compiled", through_graph)
            patch.setattr(runner, "_forward", eagerly)
            paths.clear()
            for i in range(2 * trial_steps + 3):
                step = ([[7 + i]] * size, [len(p) + 1 + i for p in prompts], tables)
                logits = runner.last_token_logits(*step).clone()
                torch.testing.assert_close(logits, eager_logits(*step), rtol=1e-4, atol=1e-4)
        faster = "eager" if slower == "graph" else "graph"
        assert paths == ["graph", "eager"] * trial_steps + [faster] * 3, (size, paths)
        serves = "through the compiled graph" if faster == "graph" else "eagerly"
        label = "1 sequence" if size == 1 else "2-3 sequences"
        assert f"decode steps of {label} run {serves}" in caplog.text
    assert json.loads(record.read_text()) == {"1": faster == "graph", "2": faster == "graph"}


@pytest.mark.parametrize(
    ("graph_ms", "graph_serves"), [(0.99, False), (0.975, False), (0.96, True), (0.5, True)]
)
def test_a_graph_serves_its_class_only_when_it_is_clearly_faster(
    monkeypatch, graph_ms: float, graph_serves: bool
) -> None:
    # within GRAPH_MIN_GAIN of the eager steps the two paths are the same speed: eager serves
    monkeypatch.setattr(model_runner, "GRAPH_TRIAL_STEPS", 3)
    trial = model_runner._PathTrial()
    decided = [
        trial.record(graph, (graph_ms if graph else 1.0) + noise)
        for noise in (0.0, 0.01, -0.01)
        for graph in (True, False)
    ]
    assert decided == [False] * 5 + [True]
    assert trial.graph_serves is graph_serves


def test_a_class_trial_counts_no_step_its_graph_did_not_serve(runner, monkeypatch) -> None:
    # no graph for batches of 2+ yet: their steps run eagerly and leave the trial to the graph
    monkeypatch.setattr(model_runner, "GRAPH_TRIAL_STEPS", 2)
    monkeypatch.setattr(runner, "_trials", {})
    monkeypatch.setattr(runner, "_compiled_decode", {1: runner._compiled_decode[1]})
    prompts, tables = PROMPTS, TABLES
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)
    for i in range(5):
        runner.last_token_logits([[7 + i]] * 3, [len(p) + 1 + i for p in prompts], tables)
    trial = runner._trials[2]
    assert trial.graph == trial.eager == [] and trial.graph_serves is None


def test_pad_slot_is_clean_after_warmup(runner) -> None:
    pad = runner.cache.pad_slot
    assert all(bool((t[pad] == 0).all()) for t in runner.cache.k + runner.cache.v)


def test_batch_without_a_graph_runs_eagerly(runner, monkeypatch, caplog) -> None:
    # a graph specialized to batch 2 (dynamo's eager backend: nothing to build) stands in for a
    # warm-up that missed a shape; its guards reject batch 3 and the step must not recompile
    static = torch.compile(model_runner.decode_step, fullgraph=True, dynamic=False, backend="eager")
    with torch.inference_mode():
        graph = static.aot_compile(((runner.model, runner.cache, *runner._warmup_inputs(2)), {}))
    monkeypatch.setattr(runner, "_compiled_decode", {1: graph, 2: graph})
    monkeypatch.setattr(runner, "_checked_graphs", set())
    prompts, tables = PROMPTS, TABLES
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)
    step = ([[7]] * 3, [len(p) + 1 for p in prompts], tables)
    before = runner.uncompiled_decode_steps
    logits = runner.last_token_logits(*step)
    assert runner.uncompiled_decode_steps == before + 1 and "runs eagerly" in caplog.text
    eager = runner.model.logits(runner.hidden_states(*step))
    torch.testing.assert_close(logits, eager)


def test_context_past_the_graphs_runs_eagerly_without_fallback(runner) -> None:
    # the graphs are specialized to contexts up to COMPILED_CONTEXT_MAX; a longer one goes to the
    # eager path directly instead of failing the graphs' guards
    context = model_runner.COMPILED_CONTEXT_MAX + 5
    runner.last_token_logits([list(range(32))], [32], [[0, 1]])  # fill blocks 0 and 1
    # a long context of repeated blocks: only its shape matters
    table = [[0, 1] * (context // 32 + 1)]
    step = ([[7]], [context], table)
    before = runner.uncompiled_decode_steps
    logits = runner.last_token_logits(*step)
    assert runner.uncompiled_decode_steps == before
    eager = runner.model.logits(runner.hidden_states(*step))
    torch.testing.assert_close(logits, eager)


def test_a_second_runner_loads_the_graphs_and_a_damaged_entry_is_compiled_again(
    runner, monkeypatch
) -> None:
    # the module's runner compiled the graphs and cached them (XDG_CACHE_HOME is still its folder)
    entries = sorted((model_runner.cache_root() / "decode-graphs").glob("*.bin"))
    assert [p.name.split("-")[-1] for p in entries] == ["batch1.bin", "batch2.bin"]
    # graphs fit a runner of the same model and KV pool only
    assert ModelRunner(runner.loaded, num_blocks=8, block_size=16).graphs_cached()
    assert not ModelRunner(runner.loaded, num_blocks=9, block_size=16).graphs_cached()

    def no_tracing(self, start: float):
        raise AssertionError("traced again instead of loading the cached graphs")

    with monkeypatch.context() as patch:
        patch.setattr(ModelRunner, "_trace_graphs", no_tracing)
        second = ModelRunner(runner.loaded, num_blocks=8, block_size=16, compile=True)
        assert second.wait_compiled(timeout=900), f"loading failed: {second.compile_error!r}"
    prompts, tables = PROMPTS, TABLES
    second.last_token_logits(prompts, [len(p) for p in prompts], tables)
    for size in (1, 3):
        step = ([[7]] * size, [len(p) + 1 for p in prompts[:size]], tables[:size])
        compiled = second.last_token_logits(*step)
        eager = second.model.logits(second.hidden_states(*step))
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert second.uncompiled_decode_steps == 0

    entries[1].write_bytes(entries[1].read_bytes()[:1000])  # damaged: traced and saved again
    third = ModelRunner(runner.loaded, num_blocks=8, block_size=16, compile=True)
    assert third.wait_compiled(timeout=900), f"compilation failed: {third.compile_error!r}"
    assert entries[1].stat().st_size > 1000


def _compiled_runner(model_dir, tmp_path_factory, name: str, **load_options):
    """A runner of the model loaded with these options, its decode graphs compiled into fresh
    caches named after `name`; yields it, for a module-scoped fixture."""
    patch = pytest.MonkeyPatch()
    patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp(f"inductor-{name}")))
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp(f"cache-{name}")))
    loaded = load_model(model_dir, progress=False, **load_options)
    runner = ModelRunner(loaded, num_blocks=8, block_size=16, compile=True)
    assert runner.wait_compiled(timeout=900), f"compilation failed: {runner.compile_error!r}"
    yield runner
    patch.undo()


def _compiled_and_eager_step(
    runner: ModelRunner, batch_size: int, kernels: set[str]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A decode step of batch_size sequences after their prompts: its logits from the compiled
    graph and from the eager model, and how many calls the compiled step made to these ops."""
    prompts, tables = PROMPTS[:batch_size], TABLES[:batch_size]
    runner.last_token_logits(prompts, [len(p) for p in prompts], tables)
    step = ([[7]] * batch_size, [len(p) + 1 for p in prompts], tables)
    with torch.profiler.profile() as profile:
        compiled = runner.last_token_logits(*step)
    assert runner.uncompiled_decode_steps == 0
    calls = sum(e.count for e in profile.key_averages() if e.key in kernels)
    return compiled, runner.model.logits(runner.hidden_states(*step)), calls


@pytest.fixture(scope="module")
def bf16_runner(tiny_model_dir, tmp_path_factory, cpu_kernels):
    # bf16 int8 layers: the dtype tokenmill's int8 kernel takes, inside the batch-1 graph
    assert cpu_kernels, "the C++ kernels did not build"
    yield from _compiled_runner(
        tiny_model_dir,
        tmp_path_factory,
        "bf16",
        dtype="bf16",
        quantization="int8",
        dense_min_tokens=2,
        batch_invariant=False,
    )


@pytest.mark.parametrize("batch_size", [1, 3])
def test_compiled_bf16_decode_with_the_int8_kernels_matches_eager(
    bf16_runner, batch_size: int
) -> None:
    # int8 weights take the tile kernel on AVX-512, the int8 GEMV elsewhere
    kernels = {"tokenmill::int8_linear", "tokenmill::quant_tiles_linear"}
    compiled, eager, calls = _compiled_and_eager_step(bf16_runner, batch_size, kernels)
    modules = bf16_runner.model.modules()
    assert calls == sum(isinstance(m, quant_linear.QuantLinear) for m in modules)
    # inductor keeps fused intermediates in fp32 where eager rounds each op to bf16: on this
    # deliberately chaotic model that moves the logits by ~2% (as much as bf16 vs fp32 eager does)
    error = ((compiled.float() - eager.float()).norm() / eager.float().norm()).item()
    assert error < 0.05


def test_deferred_compile_starts_on_request(tiny_loaded, monkeypatch) -> None:
    # `serve` defers the compilation until it listens; /health says "compiling" meanwhile, so
    # that clients (and the benchmarks) wait for the compiled graphs rather than time eager steps
    calls: list[bool] = []
    monkeypatch.setattr(ModelRunner, "_compile_decode", lambda self: calls.append(True))
    runner = ModelRunner(tiny_loaded, num_blocks=8, block_size=16, compile=True, defer_compile=True)
    assert runner.decode_mode == "compiling" and calls == []
    runner.start_compile()
    runner.start_compile()  # once only
    assert not runner.wait_compiled(timeout=30)
    assert calls == [True] and runner.decode_mode == "eager"  # the stand-in compiled nothing
    assert ModelRunner(tiny_loaded, num_blocks=8, block_size=16).decode_mode == "eager"


def test_gil_slices_are_short_while_graphs_build_and_restored_after(
    tiny_loaded, monkeypatch
) -> None:
    # the compile thread's Python would otherwise hold the GIL for whole default slices between the
    # ops of the eager steps served meanwhile; a target and its draft may build at once
    before = sys.getswitchinterval()
    both_inside = threading.Barrier(2, timeout=30)
    seen: list[float] = []

    def build(self) -> None:
        both_inside.wait()
        seen.append(sys.getswitchinterval())
        both_inside.wait()  # neither leaves before both have looked

    monkeypatch.setattr(ModelRunner, "_build_or_load_graphs", build)
    runners = [
        ModelRunner(tiny_loaded, num_blocks=8, block_size=16, compile=True) for _ in range(2)
    ]
    for runner in runners:
        runner.wait_compiled(timeout=60)
    assert seen == [pytest.approx(model_runner.COMPILE_SWITCH_INTERVAL_S)] * 2
    assert sys.getswitchinterval() == pytest.approx(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_graphs_build_at_the_lowest_priority_and_the_serving_threads_keep_theirs(
    tiny_loaded, monkeypatch
) -> None:
    # the compile thread, and the compilers it starts, yield the cores to the eager steps
    seen: list[int] = []
    monkeypatch.setattr(
        ModelRunner,
        "_build_or_load_graphs",
        lambda self: seen.append(os.getpriority(os.PRIO_PROCESS, 0)),
    )
    before = os.getpriority(os.PRIO_PROCESS, 0)
    runner = ModelRunner(tiny_loaded, num_blocks=8, block_size=16, compile=True)
    runner.wait_compiled(timeout=60)
    assert seen == [kernels.COMPILE_NICE]
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # this thread (the engine's) as it was


HELD_GRAPHS = {1: "graph for 1", 2: "graph for 2+"}


@pytest.fixture
def held_traces(monkeypatch, tmp_path) -> tuple[list[ModelRunner], threading.Event]:
    """Graph traces that record their runner and end, returning `HELD_GRAPHS`, once the returned
    event is set; the graph cache in tmp_path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    traced: list[ModelRunner] = []
    release = threading.Event()

    def trace(self, start: float) -> dict[int, str]:
        traced.append(self)
        assert release.wait(30)
        return dict(HELD_GRAPHS)

    monkeypatch.setattr(ModelRunner, "_trace_graphs", trace)
    return traced, release


def _runner_tracing(model, traced: list[ModelRunner], num_blocks: int) -> ModelRunner:
    """A compiling runner, once its trace has begun."""
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=16, compile=True)
    deadline = time.monotonic() + 30
    while runner not in traced and time.monotonic() < deadline:
        time.sleep(0.01)
    return runner


def test_a_runner_loads_the_graphs_another_runner_is_building_rather_than_tracing_them(
    tiny_loaded, monkeypatch, held_traces
) -> None:
    traced, release = held_traces
    saved: dict[object, str] = {}

    def load(self, paths) -> dict[int, str] | None:
        return {size: saved[path] for size, path in paths.items()} if saved else None

    monkeypatch.setattr(ModelRunner, "_load_graphs", load)
    monkeypatch.setattr(
        model_runner, "_save_graph", lambda graph, path: saved.update({path: graph})
    )
    first = _runner_tracing(tiny_loaded, traced, num_blocks=8)
    second = ModelRunner(tiny_loaded, num_blocks=8, block_size=16, compile=True)
    time.sleep(0.3)
    assert traced == [first] and second.decode_mode == "compiling"
    release.set()
    assert first.wait_compiled(timeout=30) and second.wait_compiled(timeout=30)
    assert traced == [first]
    assert second._compiled_decode == HELD_GRAPHS


def _decide_trials(runner: ModelRunner, graph_ms: dict[int, float]) -> None:
    """Decide runner's trials of these batch sizes, the graph's steps taking graph_ms and the
    eager ones 1 ms."""
    for num_seqs, ms in graph_ms.items():
        trial = model_runner._PathTrial()
        for _ in range(model_runner.GRAPH_TRIAL_STEPS):
            runner._record_trial(trial, True, ms / 1e3, num_seqs)
            runner._record_trial(trial, False, 1e-3, num_seqs)
        assert trial.graph_serves is not None


def test_graphs_that_won_no_trial_are_not_loaded_again(
    tiny_loaded, monkeypatch, held_traces, caplog
) -> None:
    # a later start of the same model and KV pool finds the saved trials: the eager path kept
    # every class from 1 sequence to 16 or more, so it decodes eagerly without the graphs
    monkeypatch.setattr(model_runner, "GRAPH_TRIAL_STEPS", 2)
    traced, release = held_traces
    release.set()
    first = ModelRunner(tiny_loaded, num_blocks=8, block_size=16, compile=True)
    assert first.wait_compiled(timeout=30) and traced == [first]
    _decide_trials(first, {1: 0.99, 3: 0.98, 16: 1.0})
    records = list((model_runner.cache_root() / "decode-graphs").glob("*-trials.json"))
    assert [json.loads(r.read_text()) for r in records] == [{"1": False, "2": False, "5": False}]
    caplog.set_level(logging.INFO, logger="tokenmill.engine")
    second = ModelRunner(tiny_loaded, num_blocks=8, block_size=16, compile=True)
    assert not second.wait_compiled(timeout=30)
    assert traced == [first] and second._compiled_decode is None
    assert second.decode_mode == "eager" and second.compile_error is None
    assert "delete it to try the graphs again" in caplog.text
    # another KV pool is another graph key: no saved trials, so its graphs build
    other = ModelRunner(tiny_loaded, num_blocks=9, block_size=16, compile=True)
    assert other.wait_compiled(timeout=30) and traced == [first, other]


@pytest.mark.parametrize(
    "decisions", [{1: 0.99, 32: 0.99, 64: 0.5}, {3: 0.99, 32: 0.99}, {1: 0.99, 15: 0.99}]
)
def test_graphs_load_where_saved_trials_chose_them_or_span_too_few_batch_sizes(
    tiny_loaded, monkeypatch, held_traces, decisions: dict[int, float]
) -> None:
    monkeypatch.setattr(model_runner, "GRAPH_TRIAL_STEPS", 2)
    traced, release = held_traces
    release.set()
    first = ModelRunner(tiny_loaded, num_blocks=8, block_size=16, compile=True)
    assert first.wait_compiled(timeout=30)
    _decide_trials(first, decisions)
    second = ModelRunner(tiny_loaded, num_blocks=8, block_size=16, compile=True)
    assert second.wait_compiled(timeout=30)
    assert traced == [first, second]  # the graphs could not be saved: traced again


def test_runners_of_other_graphs_never_trace_at_the_same_time(
    tiny_loaded, monkeypatch, held_traces
) -> None:
    # torch.fx's tracers share one process-wide patcher of `nn.Module.__call__`: two graphs traced
    # at once (here other KV pools, so other cache entries) would undo each other's patches
    traced, release = held_traces
    monkeypatch.setattr(ModelRunner, "_load_graphs", lambda self, paths: None)
    monkeypatch.setattr(model_runner, "_save_graph", lambda graph, path: None)
    first = _runner_tracing(tiny_loaded, traced, num_blocks=8)
    second = ModelRunner(tiny_loaded, num_blocks=16, block_size=16, compile=True)
    assert second._graph_paths() != first._graph_paths()
    time.sleep(0.3)
    assert traced == [first] and second.decode_mode == "compiling"
    release.set()
    assert first.wait_compiled(timeout=30) and second.wait_compiled(timeout=30)
    assert traced == [first, second]


@pytest.mark.parametrize("cached", [True, False])
def test_engine_left_to_itself_compiles_at_once_only_where_graphs_are_cached(
    tiny_loaded, monkeypatch, cached: bool
) -> None:
    # LLM() and `generate` (compile None): cached graphs load at once; else a job compiles once it
    # has been busy COMPILE_AFTER_BUSY_S, so that a short one never pays for a compile
    calls: list[int] = []
    monkeypatch.setattr(ModelRunner, "graphs_cached", lambda self: cached)
    monkeypatch.setattr(ModelRunner, "compile_in_background", lambda self: calls.append(1))
    monkeypatch.setattr(llm_engine, "COMPILE_AFTER_BUSY_S", 0.05)
    engine = LLMEngine(tiny_loaded, num_kv_blocks=64)
    assert calls == ([1] if cached else [])
    engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
    start = time.perf_counter()
    while time.perf_counter() - start < 0.2:  # idle time does not count
        pass
    assert calls == ([1] if cached else [])
    busy = 0.0  # the steps' time, as the engine counts it or a little more
    while engine.has_unfinished_requests() and not (busy and calls):
        start = time.perf_counter()
        engine.step()
        busy += time.perf_counter() - start
    assert calls == [1]
    assert cached or busy >= llm_engine.COMPILE_AFTER_BUSY_S, "compiled before the busy time"


def test_engine_told_to_compile_or_not_never_waits_for_a_job(tiny_loaded, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(ModelRunner, "graphs_cached", lambda self: True)
    monkeypatch.setattr(ModelRunner, "compile_in_background", lambda self: calls.append(1))
    monkeypatch.setattr(llm_engine, "COMPILE_AFTER_BUSY_S", 0.0)
    engine = LLMEngine(tiny_loaded, num_kv_blocks=64, compile=False)
    engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert calls == [] and engine.runner.decode_mode == "eager"


def _building_runner(loaded, monkeypatch, tmp_path, trace) -> ModelRunner:
    """A runner with no graphs cached whose build runs trace(runner, start) in place of
    `_trace_graphs`, returned once trace has begun."""
    monkeypatch.setattr(model_runner, "cache_root", lambda: tmp_path)
    tracing = threading.Event()

    def traced(self, start: float) -> dict:
        tracing.set()
        return trace(self, start)

    monkeypatch.setattr(ModelRunner, "_trace_graphs", traced)
    runner = ModelRunner(loaded, num_blocks=8, block_size=16, compile=True)
    assert tracing.wait(120)
    return runner


def _trace_until_stopped(runner: ModelRunner, start: float) -> dict:
    while True:
        time.sleep(0.01)


def test_a_build_stopped_while_it_traces_ends_and_leaves_eager_steps(
    tiny_loaded, monkeypatch, tmp_path
) -> None:
    # An engine's shutdown stops its graphs' build wherever it is: dynamo and inductor have no
    # way to cancel one, so the thread gets an exception raised inside it (again soon, if
    # CPython drops it: see test_a_stop_dropped_on_the_way_is_raised_again)
    runner = _building_runner(tiny_loaded, monkeypatch, tmp_path, ModelRunner._trace_graphs)
    time.sleep(1.0)  # well inside the first graph's trace, which takes seconds
    assert runner.decode_mode == "compiling" and runner._compiled_decode is None
    assert runner.stop_compile(timeout=60)
    assert runner.decode_mode == "eager" and runner.compile_error is None
    assert not list(tmp_path.rglob("*.bin"))  # nothing saved
    eager = ModelRunner(tiny_loaded, num_blocks=8, block_size=16)
    for each in (runner, eager):
        each.last_token_logits(PROMPTS, [len(p) for p in PROMPTS], TABLES)
    step = ([[7]] * len(PROMPTS), [len(p) + 1 for p in PROMPTS], TABLES)
    assert torch.equal(runner.last_token_logits(*step), eager.last_token_logits(*step))


def test_a_stop_the_compilers_turn_into_an_error_is_no_failure(
    tiny_loaded, monkeypatch, tmp_path, caplog
) -> None:
    # dynamo sometimes meets the raised stop in its own cleanup and raises an AssertionError
    # instead: the build still counts as stopped, and nothing warns of a failed compilation
    def trace(runner: ModelRunner, start: float) -> dict:
        try:
            return _trace_until_stopped(runner, start)
        except ThreadStopped:
            raise AssertionError() from None

    runner = _building_runner(tiny_loaded, monkeypatch, tmp_path, trace)
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        assert runner.stop_compile(timeout=60)
    assert runner.decode_mode == "eager" and runner.compile_error is None
    assert "compiling the decode step stopped (AssertionError())" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_stop_dropped_on_the_way_is_raised_again(tiny_loaded, monkeypatch, tmp_path) -> None:
    # CPython prints and drops an exception that lands in a weakref callback or a __del__, and
    # the build runs on: the stop raises it again until the thread ends (here within 0.2 s: the
    # trace is no compiler's, whose unwinding a raise that soon could cut short)
    monkeypatch.setattr(stoppable_thread, "RAISE_AGAIN_AFTER_S", 0.2)
    dropped = threading.Event()

    def trace(runner: ModelRunner, start: float) -> dict:
        try:
            _trace_until_stopped(runner, start)
        except ThreadStopped:
            dropped.set()
        return _trace_until_stopped(runner, start)

    runner = _building_runner(tiny_loaded, monkeypatch, tmp_path, trace)
    assert runner.stop_compile(timeout=30)
    assert dropped.is_set() and runner.decode_mode == "eager" and runner.compile_error is None


def test_a_build_stopped_inside_inductor_leaves_later_compilations_working(
    tiny_loaded, monkeypatch, tmp_path
) -> None:
    # a stop landing between inductor's opening of its record of kernels and the `try` that
    # closes it would leave it open, and the next compilation that misses the cache would fail
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing cached

    def trace(runner: ModelRunner, start: float) -> dict:
        TritonBundler.begin_compile()  # where a stop can land before the `try`
        return _trace_until_stopped(runner, start)

    runner = _building_runner(tiny_loaded, monkeypatch, tmp_path, trace)
    assert runner.stop_compile(timeout=60)
    compiled = torch.compile(lambda x: torch.sin(x) * 3 + 1, fullgraph=True)
    x = torch.randn(37)
    assert torch.allclose(compiled(x), torch.sin(x) * 3 + 1)


def test_the_interpreter_stops_a_running_build_before_it_exits(tiny_model_dir) -> None:
    # A daemon thread still in a PyTorch op when the interpreter finalizes aborts the process
    # (exit status 134; see engine/stoppable_thread.py): the exit stops the build first. The
    # check is registered before tokenmill is imported, so it runs after tokenmill's handler.
    script = f"""
import atexit, threading
atexit.register(lambda: print("alive at exit:", [
    t.name for t in threading.enumerate() if t.name == "tokenmill-compile"]))
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.model.loader import load_model
building = threading.Event()
def build(self):
    building.set()
    while True:
        sum(range(1000))  # Python, as dynamo's tracing is
ModelRunner._build_or_load_graphs = build
loaded = load_model({str(tiny_model_dir)!r}, progress=False)
runner = ModelRunner(loaded, num_blocks=8, block_size=16, compile=True)
assert building.wait(60)
"""
    env = dict(os.environ)
    if kernels.loaded():  # the kernels this process loaded: a fixture may point the cache elsewhere
        env["XDG_CACHE_HOME"] = str(Path(kernels._bindings.__file__).parents[3])
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "alive at exit: []"


def test_an_engine_shut_down_stops_its_build(tiny_loaded, monkeypatch) -> None:
    building = threading.Event()

    def build(self) -> None:
        building.set()
        while True:
            time.sleep(0.01)

    monkeypatch.setattr(ModelRunner, "_build_or_load_graphs", build)
    engine = LLMEngine(tiny_loaded, num_kv_blocks=64, compile=True)
    assert building.wait(60)
    engine.shutdown()
    engine.runner.wait_compiled(timeout=30)
    assert engine.runner.decode_mode == "eager"
    assert not engine.runner._compile_thread.is_alive()


@pytest.fixture(scope="module")
def fp32_dense_runner(tiny_model_dir, tmp_path_factory, cpu_kernels):
    # a batch-invariant fp32 model with dense layers: they multiply through tokenmill's kernel
    assert cpu_kernels, "the C++ kernels did not build"
    yield from _compiled_runner(
        tiny_model_dir, tmp_path_factory, "fp32", dtype="fp32", quantization="none"
    )


@pytest.mark.parametrize("batch_size", [1, 3])
def test_compiled_fp32_decode_calls_the_dense_kernel_and_equals_eager(
    fp32_dense_runner, batch_size: int
) -> None:
    compiled, eager, calls = _compiled_and_eager_step(
        fp32_dense_runner, batch_size, {"tokenmill::dense_linear"}
    )
    assert calls == sum(isinstance(m, DenseLinear) for m in fp32_dense_runner.model.modules())
    # the same bits: a decode token's logits must not depend on whether its step ran compiled or
    # eagerly beside a prompt (in fp32 nothing rounds away a difference, e.g. in the rope tables)
    assert torch.equal(compiled, eager)


def test_inductors_warning_on_mixed_bf16_and_float16_stays_out_of_the_log() -> None:
    # raised while a bf16 model's graphs build (its GGUF embedding's float16 scales): noise in a
    # server's log; inductor's other warnings still show. In a process of its own, as a server is:
    # pytest sets up each test's warning filters anew.
    code = (
        "import warnings\n"
        "import tokenmill.engine.model_runner\n"
        "for message in ('bf16 and fp16 are mixed in the scheduler node.', 'another'):\n"
        "    warnings.warn_explicit(message, UserWarning, 'cpp.py', 1,\n"
        "                           module='torch._inductor.codegen.cpp')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "UserWarning: another" in done.stderr and "mixed" not in done.stderr
