"""Runs the model over one step's batch: index tensors, forward pass, and the hidden states or
logits the caller asks for (`hidden_states`, `last_token_logits`, `all_logits`).

Decode steps (one new token per sequence) can run a `torch.compile`d graph of the whole model
instead of the eager forward pass, which calls each layer as one C++ call where the kernels serve.
Both call the same kernels and give the same bits; the graph spares the eager step's Python and
dispatch, and costs a few C++ ops of its own between the kernels. Which of the two is faster
depends on the CPU, the model and the batch size, so each batch-size class measures both on its
first decode steps and keeps the faster (`GRAPH_TRIAL_STEPS`). Compilation takes minutes the
first time (seconds once the graphs are saved), so it runs on a background thread while eager
steps serve. The trials' decisions are saved beside the graphs: where the graphs won nowhere, a
later start decodes eagerly without loading them (`GRAPH_MIN_GAIN`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenmill import model as model_package
from tokenmill.catalog import cache_root, mark_used, prune_cache, write_atomic
from tokenmill.engine.stoppable_thread import StoppableThread
from tokenmill.model import kernels
from tokenmill.model.attention import (
    AttentionBatch,
    KVCache,
    kernel_attends_prompts,
    resolve_kv_cache_dtype,
)
from tokenmill.model.loader import LoadedModel
from tokenmill.model.quant_linear import prompt_rows
from tokenmill.model.transformer import Transformer

if TYPE_CHECKING:  # dynamo is slow to import: the compile thread imports it, off the start's path
    from torch._dynamo.aot_compile import AOTCompiledFunction

log = logging.getLogger("tokenmill.engine")
# Inductor accumulates float sums longer than 4096 in chunks, and guards a graph traced with a
# shorter context on staying at or below it; longer contexts would need graphs of their own.
COMPILED_CONTEXT_MAX = 4096
# The most new tokens per sequence that `token_logits` runs as rows of the compiled decode graph
# (a decode with its drafts); longer (prompt chunks) run eagerly
COMPILED_ROWS_PER_SEQUENCE = 8
# Saved decode graphs kept (two per model and KV pool size), and saved trials (one each): a change
# of tokenmill's model code, of torch or of the KV pool's size leaves the old ones unused; more
# keeps more configurations ready to load, at the cost of disk space
KEEP_GRAPHS = 16

# The decode graphs by the batch sizes they serve: 1 (its size-1 dims specialized) and 2 for every
# larger batch (see `QuantLinear._kernel`), built in this order.
GRAPH_SIZES = (1, 2)
# Decode steps of each batch-size class (1, 2-3, 4-7, 8-15, ... sequences) that its graph, once
# ready, and the eager path take turns at before the faster of the two serves the class on: each
# path's median seconds per sequence over this many steps decide. Taking turns step by step sets
# both against the same load and the same drift of the machine's speed. On some CPUs the graphs
# are the faster path at every batch size, on others the eager one is (tuning log). 0: no trial,
# the graphs serve every batch they fit.
GRAPH_TRIAL_STEPS = 16
# How much faster (a fraction of the eager median) a class's graph must be to serve it. Within
# this the two paths are the same speed as far as the trial's steps tell, and the eager one serves:
# it holds no graph in memory, and where the graphs win no class, the saved trials spare later
# starts loading them (`_graphs_lose`), which slows the steps served meanwhile (tuning log).
GRAPH_MIN_GAIN = 0.03
# Saved trials spare a later start the graphs (`_graphs_lose`) only where they cover both one
# sequence and a batch of at least this many: where the graphs gain, they gain at one end or the
# other (the Python around a batch-1 step; on some CPUs, at large batches only: tuning log), so
# trials of small batches alone say nothing of large ones.
TRIALS_SPAN_BATCH = 16


@dataclass
class _PathTrial:
    """One batch-size class's decode steps timed through its graph and eagerly (seconds per
    sequence), until GRAPH_TRIAL_STEPS of each decide which path serves it (`graph_serves`)."""

    graph: list[float] = field(default_factory=list)
    eager: list[float] = field(default_factory=list)
    graph_serves: bool | None = None

    def graph_turn(self) -> bool:
        """Whether the class's next decode step goes to its graph."""
        if self.graph_serves is not None:
            return self.graph_serves
        return GRAPH_TRIAL_STEPS == 0 or len(self.graph) <= len(self.eager)

    def record(self, graph: bool, seconds_per_sequence: float) -> bool:
        """Add a step's time; True when this step's time decided the trial."""
        if self.graph_serves is not None or GRAPH_TRIAL_STEPS == 0:
            return False
        (self.graph if graph else self.eager).append(seconds_per_sequence)
        if min(len(self.graph), len(self.eager)) < GRAPH_TRIAL_STEPS:
            return False
        gain = 1 - statistics.median(self.graph) / statistics.median(self.eager)
        self.graph_serves = gain >= GRAPH_MIN_GAIN
        return True


# Inductor's C++ wrapper checks every input's and op output's sizes, strides and alignment on each
# call (hundreds of checks a step): the graphs' inputs are the model's own fixed tensors and the
# batch tensors built for them, so the checks are left out, which cuts the graph's own time
# outside the ops it calls (see the tuning log). Intermediates are rounded to the model's dtype
# where eager PyTorch rounds them ("emulate_precision_casts"), and the graphs call the same
# kernels as eager steps, so a decode token's result is the same bits whether it runs in a graph
# (of either batch size) or eagerly beside a prompt chunk. The C++ wrapper (thousands of lines of
# op calls, one function) is compiled apart from the graph's own kernels and with light
# optimization ("cpp_wrapper_build_separate"; the kernels keep inductor's full flags): compiled
# with them at -O3, it was most of a cold build's time, for no faster steps.
GRAPH_OPTIONS = {
    "emulate_precision_casts": True,
    "cpp_wrapper": True,
    "cpp_wrapper_build_separate": True,
    "size_asserts": False,
    "alignment_asserts": False,
    "scalar_asserts": False,
}

# Inductor warns, in the middle of a server's log, when one of its fused kernels mixes bf16 and
# float16 values: a bf16 model's embedding rows dequantized from GGUF blocks, whose scales are
# float16. The graphs round each value to its dtype where the eager step does
# (`emulate_precision_casts`), so the warning tells a user nothing to act on.
warnings.filterwarnings(
    "ignore", message="bf16 and fp16 are mixed in the scheduler node", module="torch._inductor"
)

# The interpreter's GIL switch interval while decode graphs are built or loaded. The compile
# thread then runs Python (dynamo's tracing, loading) for seconds, and every op an eager step
# calls releases the GIL and may wait out a whole default switch interval to get it back: the
# steps served meanwhile, a first start's first answers among them, took many times longer.
# Shorter slices keep them near their speed (see the tuning log).
COMPILE_SWITCH_INTERVAL_S = 1e-4


class _ShortGilSlices:
    """`sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S)` while any runner builds or loads its
    graphs (a target and its draft model may at once); the interval from before after the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._before = sys.getswitchinterval()

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._before = sys.getswitchinterval()
                sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S)
            self._active += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                sys.setswitchinterval(self._before)


_short_gil_slices = _ShortGilSlices()

# One build or load of decode graphs at a time in a process. torch.fx's tracers (which inductor
# runs while it lowers a graph) patch `torch.nn.Module.__call__` through one process-wide patcher,
# so two threads tracing at once undo each other's patches: dynamo then traces the model through the
# other thread's patched `__call__`, or fails ("CURRENT_PATCHER is None"). A runner that wants
# graphs another runner is building (two engines of one model, a model loaded again while its
# first instance compiles, a stopped build still in a compiler call) waits, then loads them.
_graph_build_lock = threading.Lock()


# The compile thread waits for a lock or another thread in slices of this many seconds: a wait
# in one C call would hold off `stop_compile`'s exception until it ends.
WAIT_SLICE_S = 0.1


@contextlib.contextmanager
def _holding(lock: threading.Lock) -> Iterator[None]:
    """Hold lock, waiting for it in `WAIT_SLICE_S` slices."""
    while not lock.acquire(timeout=WAIT_SLICE_S):
        pass
    try:
        yield
    finally:
        lock.release()


class ModelRunner:
    """Owns the model and its paged KV cache; block allocation is the caller's business."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int = 16,
        compile: bool = False,
        defer_compile: bool = False,
        kv_cache_dtype: str = "auto",
        on_step: Callable[[list[list[int]], list[int], list[list[int]], list[int] | None], None]
        | None = None,
        reload: Callable[[], LoadedModel] | None = None,
    ) -> None:
        """compile: build (or load) the compiled decode graphs on a background thread, from now on
        or, with defer_compile, from `start_compile`. kv_cache_dtype: see
        `attention.resolve_kv_cache_dtype`. on_step: called with each step's token ids, context
        lengths, block tables and prompt token counts before its forward pass (tensor
        parallelism's driver sends them to the other ranks there; see engine/tp_executor.py,
        which runs without compile).
        reload: for a model loaded while the kernels build (`kernels.deferred`), loads it again
        once they are built, on a background thread; `adopt_reloaded_model` then swaps it in."""
        self.on_step = on_step
        # as configured on the thread that builds the runner
        self.max_threads = torch.get_num_threads()
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        device = loaded.model.device
        self.cache = KVCache(
            cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype=resolve_kv_cache_dtype(kv_cache_dtype, loaded.dtype, device.type),
            device=device,
            shared_kv=cfg.latent_kv,
            shapes=cfg.kv_cache_shapes(),
        )
        # the cache's head widths (Gemma 4's layers have two)
        self._head_dims = sorted({t.shape[-1] for t in self.cache.k})
        # the decode graphs ready so far, by `GRAPH_SIZES` (None before the first): a graph serves
        # its batches as soon as it is built, while the next one builds
        self._compiled_decode: dict[int, AOTCompiledFunction] | None = None
        # keys of the graphs whose guards held on a real step
        self._checked_graphs: set[int] = set()
        # by batch-size class (`num_seqs.bit_length()`): its graph against its eager steps; on a
        # GPU, whose steps the host's clock does not time, the graphs serve without a trial
        self._trials: dict[int, _PathTrial] = {}
        self._trial_graphs = device.type == "cpu"
        # the classes' decisions, an earlier run's and then this run's, and where they are saved
        # (beside the graphs: the compile thread reads both before any graph serves)
        self._trial_decisions: dict[int, bool] = {}
        self._trial_record: Path | None = None
        self.compile_error: BaseException | None = None
        self.compile_seconds: float | None = None
        # a mixture of experts picks its experts' kernels by the step's routing, which one traced
        # graph cannot hold: such models decode eagerly
        self.compiles = loaded.config.moe is None
        self.compile_requested = compile and self.compiles
        if compile and not self.compiles:
            log.info("mixture-of-experts model: decode steps stay eager (no compiled graph)")
        self._compile_thread: StoppableThread | None = None
        self.uncompiled_decode_steps = 0  # decode steps no compiled graph fitted (run eagerly)
        self._logits: torch.Tensor | None = None  # see _logits_buffer
        self._products: torch.Tensor | None = None  # see _eager_products
        self._kernel_build = (
            kernels.build_in_background() if self.cache.k[0].device.type == "cpu" else None
        )
        # the model as `reload` loads it onto the kernels, until `adopt_reloaded_model` takes it
        self._reloaded: LoadedModel | None = None
        # set once the model is the one the runner keeps: graphs are traced from that one
        self._model_final = threading.Event()
        if reload is not None and self._kernel_build is not None:
            threading.Thread(
                target=self._reload_when_built, args=(reload,), name="tokenmill-reload", daemon=True
            ).start()
        else:
            self._model_final.set()
        if compile and not defer_compile:
            self.start_compile()

    @property
    def reload_pending(self) -> bool:
        """Whether the model still runs on PyTorch's layouts, to be reloaded onto the kernels."""
        return not self._model_final.is_set()

    def adopt_reloaded_model(self) -> LoadedModel | None:
        """Swap in the model reloaded onto the kernels, if it is ready (else None); the caller
        runs no step meanwhile and drops its references to the old model."""
        reloaded = self._reloaded
        if reloaded is None:
            return None
        self._reloaded = None
        self.loaded, self.model = reloaded, reloaded.model
        self._model_final.set()
        log.info("the model now runs on tokenmill's kernels")
        return reloaded

    def _reload_when_built(self, reload: Callable[[], LoadedModel]) -> None:
        """Wait for the kernels' build, then load the model again onto them. Where the build or
        the load fails, the model loaded first serves on. At the lowest priority, as the build:
        the steps serving meanwhile come first."""
        kernels.lower_thread_priority()
        self._kernel_build.join()
        if kernels.loaded():
            start = time.perf_counter()
            try:
                self._reloaded = reload()
                seconds = time.perf_counter() - start
                log.info("reloaded the model onto the kernels in %.1f s", seconds)
                return
            except Exception:  # noqa: BLE001 - the model loaded first keeps serving
                log.exception("reloading the model onto the kernels failed; it stays as it is")
        self._model_final.set()

    def compile_in_background(self) -> None:
        """Request the compiled decode graphs and start building (or loading) them now."""
        self.compile_requested = self.compiles
        self.start_compile()

    def graphs_cached(self) -> bool:
        """Whether an earlier run left decode graphs for this runner in the cache."""
        return all(path.is_file() for path in self._graph_paths().values())

    def start_compile(self) -> None:
        """Start the requested compilation, once. Tracing holds the GIL for seconds at a time, and
        loading saved graphs too delays a server's start, so a server starts it once it listens."""
        if self.compile_requested and self._compile_thread is None:
            self._compile_thread = StoppableThread(self._compile_decode, "tokenmill-compile")
            self._compile_thread.start()

    def stop_compile(self, timeout: float | None = None) -> bool:
        """Stop building or loading the decode graphs, wherever that has got to, and wait up to
        timeout seconds for it to end (True if it has). A graph ready by then keeps serving its
        batches; the others run eagerly."""
        self.compile_requested = False
        return self._compile_thread is None or self._compile_thread.stop(timeout)

    @property
    def decode_mode(self) -> str:
        """'compiled', 'compiling' (eager until ready, or until the compilation starts) or
        'eager'."""
        if self._compiled_decode is not None and len(self._compiled_decode) == len(GRAPH_SIZES):
            return "compiled"
        pending = self.compile_requested and (
            self._compile_thread is None or self._compile_thread.is_alive()
        )
        return "compiling" if pending else "eager"

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compilation ends (True if every compiled graph is in use)."""
        if self._compile_thread is not None:
            self._compile_thread.join(timeout)
        return self.decode_mode == "compiled"

    @torch.inference_mode()
    def hidden_states(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        prompt_tokens: list[int] | None = None,
    ) -> torch.Tensor:
        """Feed sequence i its new tokens token_ids[i], ending at context length context_lens[i],
        its KV in the blocks block_tables[i]; returns the final hidden states of every new token
        (total_tokens, hidden), for callers that need the logits of only some of them.

        prompt_tokens: how many of each sequence's new tokens are prompt tokens, all of them or
        none, the sequences with prompt tokens after those without (None: none are). Where the
        layers compute prompt and output tokens with different products (`prompt_rows`), a token
        computes alike whatever its batch only if the caller says which it is."""
        query_lens = [len(t) for t in token_ids]
        flat, batch = self._inputs(token_ids, query_lens, context_lens, block_tables, prompt_tokens)
        return self._forward(flat, batch, first_prompt_row(token_ids, prompt_tokens))

    @torch.inference_mode()
    def last_token_logits(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        argmax_only: bool = False,
        prompt_tokens: list[int] | None = None,
    ) -> torch.Tensor:
        """As `hidden_states`, but returns the float32 logits of each sequence's last new token
        (num_seqs, vocab). A decode step runs the compiled graph where one is ready (never a
        step with prompt tokens). The logits are overwritten by the next call's (see
        `_logits_buffer`) and, with argmax_only (the caller only takes their argmaxes), may stay
        in the model's dtype (see `Transformer.logits`)."""
        query_lens = [len(t) for t in token_ids]
        first_prompt = first_prompt_row(token_ids, prompt_tokens)
        compiled = self._compiled_decode is not None and first_prompt == sum(query_lens)
        if compiled and 1 < max(query_lens) <= COMPILED_ROWS_PER_SEQUENCE:
            # a few tokens each (e.g. a draft model reading its accepted drafts): as rows
            logits = self.token_logits(token_ids, context_lens, block_tables, argmax_only)
            return logits[torch.tensor(query_lens).cumsum(0) - 1]
        flat, batch = self._inputs(token_ids, query_lens, context_lens, block_tables, prompt_tokens)
        if compiled and self._is_decode(query_lens, context_lens):
            return self._decode_logits(flat, batch, argmax_only)
        hidden = self._forward(flat, batch, first_prompt)
        last = torch.tensor(query_lens).cumsum(0) - 1
        return self._finish_logits(self._eager_products(hidden[last]), argmax_only)

    @torch.inference_mode()
    def token_logits(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        argmax_only: bool = False,
        prompt_tokens: list[int] | None = None,
    ) -> torch.Tensor:
        """As `all_logits` (the logits of every new token), through the compiled graph where one
        is ready and each sequence computes at most COMPILED_ROWS_PER_SEQUENCE output tokens (a
        decode with its drafts): each token is then a row of its own over its context, the rows
        of one sequence sharing its block table. A step writes every row's K/V before any row
        attends, so a row sees the tokens before it, as a prompt chunk's tokens do, and its
        result is the same either way (batch invariance). argmax_only: as for
        `last_token_logits`."""
        if (
            self._compiled_decode is None
            or max(map(len, token_ids)) > COMPILED_ROWS_PER_SEQUENCE
            or (prompt_tokens is not None and any(prompt_tokens))
        ):
            return self.all_logits(token_ids, context_lens, block_tables, prompt_tokens)
        rows = [[token] for ids in token_ids for token in ids]
        lens = [
            end - len(ids) + 1 + i
            for ids, end in zip(token_ids, context_lens)
            for i in range(len(ids))
        ]
        tables = [table for ids, table in zip(token_ids, block_tables) for _ in ids]
        return self.last_token_logits(rows, lens, tables, argmax_only=argmax_only)

    @torch.inference_mode()
    def all_logits(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        prompt_tokens: list[int] | None = None,
    ) -> torch.Tensor:
        """As `hidden_states`, but returns the float32 logits of every new token (total_tokens,
        vocab)."""
        hidden = self.hidden_states(token_ids, context_lens, block_tables, prompt_tokens)
        return self.model.logits(hidden)

    def _inputs(
        self,
        token_ids: list[list[int]],
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        prompt_tokens: list[int] | None = None,
    ) -> tuple[torch.Tensor, AttentionBatch]:
        """The flat token tensor and the attention batch of a step; sets this thread's OpenMP
        threads to what the compiled kernels were built for."""
        if self.on_step is not None:
            self.on_step(token_ids, context_lens, block_tables, prompt_tokens)
        cache = self.cache.k[0]
        kernel_prompts = all(
            kernel_attends_prompts(
                self.loaded.dtype,
                cache.dtype,
                head_dim,
                cache.device,
                batch_invariant=self.loaded.batch_invariant,
            )
            for head_dim in self._head_dims
        )
        batch = AttentionBatch.build(
            query_lens,
            context_lens,
            block_tables,
            self.block_size,
            self.cache.pad_slot,
            kernel_prompts=kernel_prompts,
        )
        flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
        # while the kernels build for the reload, half the cores serve and the build (at the
        # lowest priority) has the rest: with every core, the build would wait for the steps
        self._set_threads(
            max(1, self.max_threads // 2) if self.reload_pending else self.max_threads
        )
        return flat, batch

    def _decode_logits(
        self, flat: torch.Tensor, batch: AttentionBatch, argmax_only: bool
    ) -> torch.Tensor:
        """A decode step's logits (`last_token_logits`) through its batch's graph or eagerly, as
        its batch-size class's trial has it (`GRAPH_TRIAL_STEPS`), timing the step for the trial
        while it runs. A step whose graph is not ready, or checks its guards first, is not timed."""
        num_seqs = batch.num_seqs
        trial = self._trials.setdefault(
            num_seqs.bit_length(), _PathTrial(graph_serves=None if self._trial_graphs else True)
        )
        start = time.perf_counter()
        if trial.graph_turn():
            checked = min(num_seqs, GRAPH_SIZES[-1]) in self._checked_graphs
            products = self._run_compiled(flat, batch)
            if products is None:  # no graph for this batch yet
                products = self._eager_products(self._forward(flat, batch))
                return self._finish_logits(products, argmax_only)
            logits = self._finish_logits(products, argmax_only)
            if checked:
                self._record_trial(trial, True, (time.perf_counter() - start) / num_seqs, num_seqs)
            return logits
        logits = self._finish_logits(self._eager_products(self._forward(flat, batch)), argmax_only)
        self._record_trial(trial, False, (time.perf_counter() - start) / num_seqs, num_seqs)
        return logits

    def _record_trial(self, trial: _PathTrial, graph: bool, seconds: float, num_seqs: int) -> None:
        """Add a timed step of num_seqs sequences to its class's trial; log and save the
        decision."""
        if trial.record(graph, seconds):
            self._save_trial(num_seqs.bit_length(), bool(trial.graph_serves))
            low = 1 << (num_seqs.bit_length() - 1)
            log.info(
                "decode steps of %s run %s: %.3f ms a sequence through the compiled graph, "
                "%.3f ms eagerly (medians of %d steps each)",
                "1 sequence" if low == 1 else f"{low}-{2 * low - 1} sequences",
                "through the compiled graph" if trial.graph_serves else "eagerly",
                statistics.median(trial.graph) * 1e3,
                statistics.median(trial.eager) * 1e3,
                GRAPH_TRIAL_STEPS,
            )

    def _save_trial(self, size_class: int, graph_serves: bool) -> None:
        """Add a class's decision to the saved trials; one that cannot be saved only costs a later
        start the graphs' loading."""
        self._trial_decisions[size_class] = graph_serves
        if self._trial_record is None:
            return
        decisions = {str(c): serves for c, serves in sorted(self._trial_decisions.items())}
        try:
            write_atomic(self._trial_record, json.dumps(decisions))
        except OSError as exc:
            log.info("could not save the decode path trials at %s (%r)", self._trial_record, exc)

    def _forward(
        self, flat: torch.Tensor, batch: AttentionBatch, first_prompt: int | None = None
    ) -> torch.Tensor:
        """The eager forward pass: final hidden states; rows from first_prompt on are prompt
        tokens (None: none are)."""
        rows = flat.shape[0]
        if first_prompt is None or first_prompt >= rows:
            return self.model(flat, self.cache, batch)
        with prompt_rows(first_prompt, rows):
            return self.model(flat, self.cache, batch)

    def _finish_logits(self, products: torch.Tensor, argmax_only: bool) -> torch.Tensor:
        """`last_token_logits`' logits of the output head's products, compiled or eager, in
        `_logits_buffer` (or the products themselves, with argmax_only: `Transformer.logits`)."""
        return self.model.logits(
            products=products, out=self._logits_buffer(products.shape), argmax_only=argmax_only
        )

    def _eager_products(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's products of an eager step's final hidden states, written into a
        tensor reused from call to call where the head's kernel takes one (`head_products`), as
        the logits are (`_logits_buffer`): for a float32 model that same tensor, so that
        `_finish_logits` copies nothing. The first products of a size become the buffer."""
        rows = hidden.shape[0]
        buffer = self._logits if hidden.dtype == torch.float32 else self._products
        if buffer is not None and buffer.shape[0] >= rows:
            return self.model.head_products(hidden, out=buffer)
        products = self.model.head_products(hidden)
        if products.dtype == torch.float32:
            self._logits = products
        else:
            self._products = products
        return products

    def _logits_buffer(self, shape: torch.Size) -> torch.Tensor:
        """Where `last_token_logits` leaves its float32 logits, reused from call to call (at
        least shape's rows): a new tensor of a large vocabulary's logits for a batch, above what
        glibc's heap serves (32 MB), would be mapped and faulted in afresh every step."""
        rows, vocab = shape
        if self._logits is None or self._logits.shape[0] < rows:
            self._logits = torch.empty(
                rows, vocab, dtype=torch.float32, device=self.cache.k[0].device
            )
        return self._logits

    def _run_compiled(self, flat: torch.Tensor, batch: AttentionBatch) -> torch.Tensor | None:
        """The compiled step's head products (`decode_step`), or None for a batch whose graph is
        not built yet or whose graph's guards reject it.

        Dynamo's guards (thousands of checks per graph: every weight's shape, dtype and identity,
        the cache, the input shapes) are a noticeable part of a small model's step when checked on
        every call (see the tuning log). What varies between steps is the batch size, which picks
        the graph here, and the context length, which `_is_decode` keeps within the graphs'
        range; the rest is fixed once the model is loaded. So each graph's guards are checked in
        full on its first real step only. A graph that fails them (it should not happen; logged
        once) leaves its steps to the eager path: compiling a new graph here would stall every
        request for minutes.
        """
        key = min(batch.num_seqs, GRAPH_SIZES[-1])
        graphs = self._compiled_decode  # read once: the compile thread may replace it
        graph = None if graphs is None else graphs.get(key)
        if graph is None:  # not built yet: the eager step serves
            return None
        args = (self.model, self.cache, flat, batch)
        if key in self._checked_graphs:
            return graph(*args)[0]
        try:
            products = graph(*args)[0]  # guards checked before anything runs
        except RuntimeError as exc:
            if "GuardManager check failed" not in str(exc):
                raise
            self.uncompiled_decode_steps += 1
            if self.uncompiled_decode_steps == 1:
                log.warning(
                    "a decode batch of %d runs eagerly: its compiled graph does not fit it (%s)",
                    batch.num_seqs,
                    exc,
                )
            return None
        graph.disable_guard_check()
        self._checked_graphs.add(key)
        return products

    @staticmethod
    def _is_decode(query_lens: list[int], context_lens: list[int]) -> bool:
        # A 1-token context would hit shapes the graphs were not compiled for (size-1 dims are
        # specialized); such a step is a first token, which the eager path serves. Contexts past
        # COMPILED_CONTEXT_MAX run eagerly too: the graphs' softmax sums are specialized to it.
        return (
            max(query_lens) == 1
            and 1 < min(context_lens)
            and max(context_lens) <= COMPILED_CONTEXT_MAX
        )

    @staticmethod
    def _set_threads(threads: int) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _compile_decode(self) -> None:
        """Compile the decode graphs (`GRAPH_SIZES`), or load them from the cache of an earlier
        run; each serves its batches from when it is ready. Neither where an earlier run's trials
        found them no faster (`_graphs_lose`).

        `aot_compile`d graphs run without dynamo's per-call guards (see `_run_compiled`), but
        inductor's caches do not serve them (their key holds a random name), so they are saved
        whole, keyed by everything that shapes them: the sources they are traced from, torch,
        the CPU, the threads, the model's structure and the KV cache's size. Their guards are
        checked on the warm-up step after loading as after compiling. The thread runs at the
        lowest priority (`kernels.COMPILE_NICE`).
        """
        kernels.lower_thread_priority()
        with _short_gil_slices:
            self._build_or_load_graphs()

    def _build_or_load_graphs(self) -> None:
        start = time.perf_counter()
        # graphs traced before the kernels load would not use them, nor would a model's graphs
        # serve the model reloaded onto the kernels
        if self._kernel_build is not None:
            while self._kernel_build.is_alive():
                self._kernel_build.join(WAIT_SLICE_S)
        while not self._model_final.wait(WAIT_SLICE_S):
            pass
        # inductor builds its kernels for the current thread count
        self._set_threads(self.max_threads)
        key = self._graph_key()
        paths = self._graph_paths(key)
        folder = paths[1].parent
        record = folder / f"{key}-trials.json"
        self._trial_decisions = _read_trials(record)
        self._trial_record = record
        mark_used(record)
        prune_cache(folder, "*-trials.json", KEEP_GRAPHS)
        if _graphs_lose(self._trial_decisions):
            log.info(
                "decode steps run eagerly: an earlier run timed this model's compiled graphs no "
                "faster than eager steps at any batch size it tried (%s: delete it to try the "
                "graphs again)",
                record,
            )
            return
        # Dynamo first, before any of inductor: a custom op's first call, in another thread,
        # imports dynamo too, and two threads each importing a module the other's import needs
        # deadlock. Not before the saved trials are read: a start that skips the graphs spares
        # the import's seconds and memory.
        import torch._dynamo  # noqa: F401

        try:
            with _holding(_graph_build_lock):
                try:
                    graphs = self._load_graphs(paths)
                    if graphs is None:
                        graphs = self._trace_graphs(start)
                        for size, graph in graphs.items():
                            _save_graph(graph, paths[size])
                        prune_cache(folder, "*.bin", KEEP_GRAPHS)
                finally:
                    if self._compile_thread is not None and self._compile_thread.stop_requested:
                        _close_stopped_compilation()
        except Exception as exc:  # noqa: BLE001 - eager steps keep serving; say why once
            self._compiled_decode = None  # a graph built before the failure too
            if self._compile_thread is not None and self._compile_thread.stop_requested:
                # the compilers sometimes turn the stop raised inside them into an error of their
                # own (an AssertionError from dynamo) on the way out: a stop, not a failure
                log.info("compiling the decode step stopped (%r)", exc)
                return
            self.compile_error = exc
            log.warning("compiling the decode step failed; decoding stays eager: %r", exc)
            return
        finally:
            self.cache.zero_pad_slot()  # the warm-ups wrote their K/V there
        self.compile_seconds = time.perf_counter() - start
        log.info("compiled decode step ready after %.1f s", self.compile_seconds)
        self._compiled_decode = graphs

    def _trace_graphs(self, start: float) -> dict[int, AOTCompiledFunction]:
        """Build the decode graphs, each serving from when it is ready (start: when the
        compilation began, for the log)."""
        _keep_module_calls_untraced()
        # The KV pool never changes size: as symbols, its tensors' lengths (one per layer and K/V)
        # would be graph arguments boxed into tensors on every call, each with guards of its own.
        for tensor in self.cache.k + self.cache.v:
            torch._dynamo.mark_static(tensor, 0)
        compiled = torch.compile(decode_step, fullgraph=True, dynamic=True, options=GRAPH_OPTIONS)
        # no "duck sizing": a warm-up batch size equal to some other size (say, the KV heads)
        # would otherwise be assumed equal to it, and the first real batch would recompile.
        # Specialized floats: the layers' constants (norm eps, softmax scale) would otherwise
        # be graph inputs, boxed into tensors on every call (see the tuning log).
        from torch.fx.experimental import _config as shape_config

        graphs = {}
        with (
            torch.inference_mode(),
            shape_config.patch(use_duck_shape=False),
            torch._dynamo.config.patch(specialize_float=True),
        ):
            for size in GRAPH_SIZES:
                args = (self.model, self.cache, *self._warmup_inputs(size))
                graphs[size] = compiled.aot_compile((args, {}))
                graphs[size](*args)  # a first run, guards checked
                self._compiled_decode = dict(graphs)  # serving while the next one builds
                log.info(
                    "compiled decode graph for %s ready after %.1f s",
                    f"batches of {size}+" if size == GRAPH_SIZES[-1] else f"batch {size}",
                    time.perf_counter() - start,
                )
        return graphs

    def _load_graphs(self, paths: dict[int, Path]) -> dict[int, AOTCompiledFunction] | None:
        """The cached graphs, each run once with its guards checked; None if any is missing or
        unfit."""
        if not all(path.is_file() for path in paths.values()):
            return None
        graphs = {}
        try:
            with torch.inference_mode():  # the guards expect inference tensors, as when traced
                for size, path in paths.items():
                    with path.open("rb") as f:
                        graphs[size] = torch.compiler.load_compiled_function(f)
                    graphs[size](self.model, self.cache, *self._warmup_inputs(size))
                    mark_used(path)
        except Exception as exc:  # noqa: BLE001 - a stale or damaged entry: compile afresh
            log.info("cached decode graphs unusable (%r); compiling them again", exc)
            return None
        return graphs

    def _graph_paths(self, key: str | None = None) -> dict[int, Path]:
        """Where the decode graphs for batch 1 and for larger batches are cached (key: the
        runner's `_graph_key`, computed here if not given)."""
        folder = cache_root() / "decode-graphs"
        key = key or self._graph_key()
        return {size: folder / f"{key}-batch{size}.bin" for size in GRAPH_SIZES}

    def _graph_key(self) -> str:
        key = hashlib.sha256()
        for source in _traced_sources():
            key.update(source.read_bytes())
        shapes = [
            f"{name}{tuple(t.shape)}{t.dtype}"
            for name, t in self.model.state_dict(keep_vars=True).items()
        ]
        for part in (
            torch.__version__,
            kernels.build_directory().name,
            str(self.max_threads),
            repr(self.loaded.config),
            repr(self.model),
            *shapes,
            f"{len(self.cache.k)}x{tuple(self.cache.k[0].shape)}{self.cache.k[0].dtype}",
        ):
            key.update(part.encode())
        return key.hexdigest()[:24]

    def _warmup_inputs(self, batch_size: int) -> tuple[torch.Tensor, AttentionBatch]:
        """A decode batch whose K/V writes land in the pad slot (zeroed again afterwards), so the
        warm-up touches no block the engine may be using meanwhile."""
        pad = self.cache.pad_slot
        context = batch_size + 2  # 1 would be specialized
        batch = AttentionBatch.build(
            [1] * batch_size, [context] * batch_size, [[0]] * batch_size, self.block_size, pad
        )
        batch.slot_mapping.fill_(pad)
        batch.context_slots.fill_(pad)
        return torch.zeros(batch_size, dtype=torch.int64), batch


def _read_trials(path: Path) -> dict[int, bool]:
    """The decisions that an earlier run's trials saved at path (`ModelRunner._save_trial`): by
    batch-size class, whether its graph served it; empty where there is no readable record."""
    try:
        return {int(c): bool(serves) for c, serves in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def _graphs_lose(decisions: dict[int, bool]) -> bool:
    """Whether saved trials make the graphs not worth loading: they decided the class of one
    sequence and one of `TRIALS_SPAN_BATCH` or more, and the eager path kept every class."""
    spans = 1 in decisions and max(decisions) >= TRIALS_SPAN_BATCH.bit_length()
    return spans and not any(decisions.values())


def _keep_module_calls_untraced() -> None:
    """Give inductor its placeholder graph module built by hand rather than by `torch.fx`'s
    symbolic tracing, which it otherwise runs once per process while it lowers a graph.

    Symbolic tracing swaps `torch.nn.Module.__call__` for the tracer's own for as long as it runs,
    in every thread: an eager step on another thread then fails its batch ("module is not installed
    as a submodule"). Dynamo's and AOTAutograd's tracers leave such calls to the module itself.
    """
    from torch._inductor import loop_body

    graph = torch.fx.Graph()
    graph.output(graph.placeholder("x"))
    placeholder = torch.fx.GraphModule(torch.nn.Module(), graph)  # what tracing `identity` gives
    loop_body.InterpreterShim._dummy_gm = staticmethod(lambda: placeholder)


def _close_stopped_compilation() -> None:
    """Close what a compilation stopped midway may have left open for the whole process.

    Inductor records the kernels of the graph it compiles in a class attribute, opened before a
    `try` and closed in its `finally`: a stop landing between the two (or in the `finally`)
    leaves it open, and the process's next compilation that misses inductor's cache fails an
    assertion on entry."""
    try:
        from torch._inductor.triton_bundler import TritonBundler
    except ImportError:  # a torch before the bundler keeps no such record
        return
    TritonBundler.end_compile()


def _traced_sources() -> list[Path]:
    """The sources a decode graph is traced from: the model package and this module (the server,
    CLI and scheduler can change without costing the next start a compile)."""
    return sorted(Path(model_package.__file__).parent.rglob("*.py")) + [Path(__file__)]


def _save_graph(graph: AOTCompiledFunction, path: Path) -> None:
    """Cache a compiled graph; one that cannot be saved only costs the next start a compile."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        graph.save_compiled_function(str(path))  # written to a temporary file, then renamed
    except Exception as exc:  # noqa: BLE001 - pickling can fail in many ways
        log.info("could not cache the decode graph at %s (%r)", path, exc)


def decode_step(
    model: Transformer, cache: KVCache, flat: torch.Tensor, batch: AttentionBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the model, the function the decode graphs are compiled from: the
    output head's products (`Transformer.head_products`, which `Transformer.logits` finishes),
    and the final hidden states as a second output: an output is stored once, where inductor
    would otherwise recompute the last norms inside the output head's fused reduction for every
    one of its rows. A function of its arguments only, as `aot_compile` needs: it pickles what
    the guards look at."""
    hidden = model(flat, cache, batch)
    return model.head_products(hidden), hidden


def first_prompt_row(token_ids: list[list[int]], prompt_tokens: list[int] | None) -> int:
    """The first row of a step's flat tokens that holds a prompt token (the step's token count
    where none does), for `ModelRunner.hidden_states`' prompt_tokens."""
    rows = sum(map(len, token_ids))
    if prompt_tokens is None:
        return rows
    if len(prompt_tokens) != len(token_ids):
        raise ValueError(f"{len(prompt_tokens)} prompt token counts for {len(token_ids)} sequences")
    first = rows - sum(prompt_tokens)
    row = 0
    for ids, prompts in zip(token_ids, prompt_tokens):
        if prompts not in (0, len(ids)) or (row < first) != (prompts == 0):
            raise ValueError(
                "each sequence's new tokens must be all prompt tokens or none, and the sequences "
                f"with prompt tokens must come last; got prompt token counts {prompt_tokens} for "
                f"{[len(ids) for ids in token_ids]} new tokens"
            )
        row += len(ids)
    return first


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
