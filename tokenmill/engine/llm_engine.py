"""LLMEngine: add requests, call `step()`, get outputs. The synchronous core of every front end.

A request comes in through the `InputProcessor` (tokenized, validated, fanned out into its
sequences) and is queued. One step = schedule -> build the flat batch -> forward -> sample
(batched) -> the `OutputProcessor` appends the tokens, detokenizes and finds the sequences that
are done -> free what finished -> one `RequestOutput` per request the step touched.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from tokenmill.engine.input_processor import InputProcessor
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.kv_memory import KVWarmer, blocks_for_budget
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import FINISHED_STATUS, Request, Sequence
from tokenmill.engine.scheduler import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tokenmill.engine.speculative import (
    DRAFT_MIN_CONFIDENCE,
    SPECULATION_MAX_BATCH,
    SPECULATION_MAX_PAUSE,
    SpeculativeConfig,
    accepted_drafts,
)
from tokenmill.engine.step_batch import StepBatch
from tokenmill.engine.structured_output import allows_only
from tokenmill.engine.tp_executor import TPExecutor, check_backend
from tokenmill.errors import InvalidRequestError, QueueFullError
from tokenmill.model import kernels
from tokenmill.model.encoder import pool
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.model.quant_linear import prompts_apart
from tokenmill.model.sharding import Shard
from tokenmill.sample import Sampler, SamplingBatch, SamplingParams
from tokenmill.sample.sampler import SamplerOutput

log = logging.getLogger("tokenmill.engine")

# With compile left to the engine (EngineConfig.compile None) and no decode graphs cached, the
# seconds of steps after which it starts compiling them in the background: a job this long is
# likely to run long enough to repay the compile, a shorter one never pays for it.
COMPILE_AFTER_BUSY_S = 60.0


@dataclass
class EngineConfig:
    dtype: str = "auto"  # bf16 where the CPU multiplies it natively, else fp32 (load_model)
    quantization: str = "auto"  # see load_model: GGUF weights stay packed by default
    dense_min_tokens: int | None = None
    # a request's output does not depend on its batch (see load_model); off: faster kernels where
    # the batch size decides them
    batch_invariant: bool = True
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # see attention.resolve_kv_cache_dtype
    kv_cache_memory: int | None = None  # bytes for the KV pool; default: see default_kv_budget
    num_kv_blocks: int | None = None  # exact pool size (overrides kv_cache_memory; tests use it)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    max_running_per_tenant: int | None = None  # fair policy: running sequences per tenant
    models_dir: str | None = None
    max_queue_len: int | None = None  # waiting sequences beyond this are refused (QueueFullError)
    # decode through compiled graphs (see ModelRunner), built or loaded in the background: True
    # from the start, False never; None: at once where an earlier run cached them, else once
    # the engine has been busy COMPILE_AFTER_BUSY_S
    compile: bool | None = None
    defer_compile: bool = False  # ... from `runner.start_compile()` on, when the caller is ready
    # where tokenmill's CPU kernels are not built yet (a first start), serve at once on PyTorch's
    # kernels while they build, then reload the model onto them between two steps; off: wait for
    # the build before loading. Outputs before the swap can differ from those after it and are not
    # batch invariant. Without tensor parallelism or a draft model only (those wait).
    serve_while_building: bool = False
    # speculative decoding (see engine/speculative.py): vLLM's --speculative-config, as JSON text,
    # a dict or a SpeculativeConfig; None: off
    speculative_config: str | dict | SpeculativeConfig | None = None
    # /v1/embeddings from a decoder: its final hidden states pooled by "last" token or "mean"
    embedding_pooling: str = "last"
    # ranks the model is split over (see engine/tp_executor.py): this process and N-1 workers,
    # each with max(1, threads // N) threads; steps run eagerly (compile is off) when N > 1
    tensor_parallel_size: int = 1
    # how the workers run: "mp", local processes; "ray", Ray actors (see engine/tp_executor.py)
    distributed_executor_backend: str = "mp"


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prompt_tokens: int = 0  # prompt tokens of all requests added
    generation_tokens: int = 0
    tokens_computed: int = 0  # tokens run through the model (prefill chunks and decodes)
    structured_requests: int = 0  # requests with an output constraint (structured outputs)
    grammar_compiles: int = 0  # distinct grammars converted and checked (the cache's misses)
    grammar_compile_seconds: float = 0.0  # time those took, on the requests' threads
    spec_num_drafts: int = 0  # speculative steps of a sequence: drafts verified
    spec_num_draft_tokens: int = 0  # tokens drafted and verified
    spec_num_accepted_tokens: int = 0  # drafted tokens the target accepted
    # the fair policy's virtual token counters of the tenants with requests in the engine
    tenant_served_tokens: dict[str, float] = field(default_factory=dict)


def _with_overrides(config: EngineConfig, overrides: dict[str, Any]) -> EngineConfig:
    known = {f.name for f in fields(EngineConfig)}
    if unknown := [key for key in overrides if key not in known]:
        raise TypeError(f"unknown engine option {unknown[0]!r}")
    return replace(config, **overrides)


def _resolve(model: str | Path | None, cfg: EngineConfig, progress: bool) -> Path:
    from tokenmill.catalog import resolve_model

    return resolve_model(model, models_dir=cfg.models_dir, progress=progress)


def _load_options(cfg: EngineConfig) -> dict[str, Any]:
    return {
        "dtype": cfg.dtype,
        "quantization": cfg.quantization,
        "dense_min_tokens": cfg.dense_min_tokens,
        "batch_invariant": cfg.batch_invariant,
    }


def _load(
    model: str | Path | None,
    cfg: EngineConfig,
    progress: bool,
    shard: Shard | None = None,
    head_rows: list[int] | None = None,
    while_kernels_build: bool = False,
) -> LoadedModel:
    path = _resolve(model, cfg, progress)
    return load_model(
        path,
        progress=progress,
        shard=shard,
        head_rows=head_rows,
        while_kernels_build=while_kernels_build,
        **_load_options(cfg),
    )


class LLMEngine:
    """The model, its KV cache and the scheduler, driven one `step` at a time by one thread."""

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        config: EngineConfig | None = None,
        progress: bool = False,
        **overrides: Any,
    ) -> None:
        """model: a catalog name, a path or a loaded model. config: the engine's settings, with
        overrides of any of its fields (the caller's config is left as it is)."""
        self.config = cfg = _with_overrides(config or EngineConfig(), overrides)
        self.speculative = SpeculativeConfig.parse(cfg.speculative_config)
        self.executor: TPExecutor | None = None
        if cfg.tensor_parallel_size != 1:
            self.executor = self._start_workers(model, progress)
        try:
            self._build_runner(model, progress)
        except BaseException:
            self.shutdown(graceful=False)
            raise
        cfg, mc, num_blocks = self.config, self.loaded.config, self.runner.cache.num_blocks
        # busy seconds left before compiling (compile None, no graphs cached), else None;
        # tensor-parallel steps run eagerly
        self._busy_before_compile: float | None = None
        if cfg.compile is None and self.executor is None:
            if self.runner.graphs_cached():
                self.runner.compile_in_background()
            else:
                self._busy_before_compile = COMPILE_AFTER_BUSY_S
        limit = min(mc.max_position_embeddings, num_blocks * cfg.block_size)
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        self.kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        # the draft model: its own KV pool, addressed by the target's block tables
        self.drafter: ModelRunner | None = None
        self.draft_vocab: torch.Tensor | None = None  # see _draft_runner
        if self.speculative is not None and self.speculative.model is not None:
            self.drafter = self._draft_runner(self.speculative.model, num_blocks, progress)
        self.scheduler = Scheduler(
            SchedulerConfig(
                cfg.max_num_seqs,
                cfg.max_num_batched_tokens,
                cfg.policy,
                cfg.max_running_per_tenant,
            ),
            self.kv,
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            mc.vocab_size,
            self.max_model_len,
            cfg.block_size,
            outputs_keyed_apart=prompts_apart(self.loaded.dtype, self.loaded.batch_invariant),
        )
        self.output_processor = OutputProcessor(self.tokenizer, self.max_model_len)
        self.sampler = Sampler()
        self.stats = EngineStats(num_total_blocks=num_blocks)
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._aborted: list[Request] = []  # aborted since the last step, which reports them
        self._ids = itertools.count()
        self._kv_warmer = KVWarmer(self.runner.cache, self.kv.block_pool)

    def _start_workers(self, model: str | Path | LoadedModel | None, progress: bool) -> TPExecutor:
        """Check that tensor parallelism serves this configuration and start its workers."""
        cfg = self.config
        check_backend(cfg.distributed_executor_backend)
        if cfg.tensor_parallel_size < 1:
            raise InvalidRequestError(
                f"tensor_parallel_size must be at least 1, got {cfg.tensor_parallel_size}"
            )
        if isinstance(model, LoadedModel):
            raise InvalidRequestError(
                "tensor parallelism loads each rank's shard itself: pass the model's name or "
                "path rather than a loaded model"
            )
        if self.speculative is not None and self.speculative.model is not None:
            raise InvalidRequestError(
                "a draft model is not supported with tensor parallelism: drop the model from "
                "--speculative-config (n-gram drafts work) or use --tensor-parallel-size 1"
            )
        if cfg.compile:
            log.warning("tensor-parallel steps run eagerly: compiled decode graphs stay off")
        path = _resolve(model, cfg, progress)
        return TPExecutor(
            cfg.tensor_parallel_size,
            str(path),
            _load_options(cfg),
            cfg.block_size,
            cfg.kv_cache_dtype,
            cfg.distributed_executor_backend,
        )

    def _build_runner(self, model: str | Path | LoadedModel | None, progress: bool) -> None:
        """Load the model (this rank's shard under tensor parallelism) and build its runner."""
        cfg, executor = self.config, self.executor
        reload = None
        if isinstance(model, LoadedModel):
            self.loaded = model
        elif self._loads_while_building():
            self.loaded = _load(model, cfg, progress, while_kernels_build=True)
            reload = functools.partial(
                load_model, self.loaded.path, progress=False, **_load_options(cfg)
            )
        else:
            shard = None if executor is None else Shard(0, executor.size)
            self.loaded = _load(model, cfg, progress, shard)
        if self.loaded.tokenizer is None:
            raise InvalidRequestError(f"{self.loaded.path}: the model has no tokenizer")
        self.tokenizer = self.loaded.tokenizer
        num_blocks = cfg.num_kv_blocks or blocks_for_budget(
            cfg.kv_cache_memory, self.loaded, cfg.block_size, cfg.kv_cache_dtype
        )
        self.runner = ModelRunner(
            self.loaded,
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            compile=bool(cfg.compile) and executor is None,
            defer_compile=cfg.defer_compile,
            kv_cache_dtype=cfg.kv_cache_dtype,
            on_step=None if executor is None else executor.send_step,
            reload=reload,
        )
        if executor is not None:
            executor.connect(num_blocks, self.loaded.model.device)

    def _loads_while_building(self) -> bool:
        """Whether to load the model on PyTorch's layouts now, the kernels building meanwhile
        (`EngineConfig.serve_while_building`; starts their build)."""
        return (
            self.config.serve_while_building
            and self.executor is None
            and (self.speculative is None or self.speculative.model is None)
            and kernels.build_in_background() is not None
        )

    def adopt_reloaded_model(self) -> bool:
        """Between steps: swap in the model reloaded onto the kernels if it is ready (see
        `EngineConfig.serve_while_building`); whether it did."""
        reloaded = self.runner.adopt_reloaded_model()
        if reloaded is None:
            return False
        self.loaded = reloaded
        return True

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the decode graphs' build and the tensor-parallel workers, if any (idempotent).
        The build is told to stop, not waited for: it ends at its next bytecode, and the
        interpreter's exit waits for it (see engine/stoppable_thread.py). graceful False:
        terminate the workers, as after a failed step, when the ranks are out of step."""
        for runner in (getattr(self, "runner", None), getattr(self, "drafter", None)):
            if runner is not None:  # a start that failed has neither
                runner.stop_compile(timeout=0)
        if self.executor is not None:
            self.executor.shutdown(graceful)
            self.executor = None

    # ------------------------------------------------------------------ requests

    def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of a text prompt or of chat messages (see `InputProcessor.tokenize`)."""
        return self.input_processor.tokenize(
            prompt, messages, add_special_tokens, add_generation_prompt, chat_template_kwargs, tools
        )

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        extra_key: str | None = None,
        tenant: str = "",
    ) -> str:
        """Process and queue a request; returns its id (one is made up for None). Raises
        InvalidRequestError for anything unservable, QueueFullError when the queue is full.
        tenant: who sent it, for the fair scheduling policy."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        self.enqueue(
            self.input_processor.process(
                request_id, prompt, params, priority, arrival_time, extra_key, tenant
            )
        )
        return request_id

    def enqueue(self, request: Request) -> None:
        """Queue a request the `InputProcessor` made, whole or not at all."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        limit, waiting = self.config.max_queue_len, len(self.scheduler.waiting)
        if limit is not None and waiting + len(request.sequences) > limit:
            raise QueueFullError(
                f"the server is at capacity ({waiting} requests waiting); retry shortly"
            )
        for seq in request.sequences:
            self.scheduler.add_sequence(seq)
        self._requests[request.request_id] = request
        self.stats.prompt_tokens += len(request.prompt_token_ids)

    def embed(self, token_ids: list[list[int]]) -> torch.Tensor:
        """L2-normalized float32 embeddings of each sequence (num_seqs, hidden): its final hidden
        states pooled as `EngineConfig.embedding_pooling` says. Runs between steps, one sequence
        per forward pass, in KV blocks borrowed from the pool and given back at once; raises
        QueueFullError when running requests hold too many blocks for a sequence."""
        pooling = self.config.embedding_pooling
        if pooling not in ("last", "mean"):
            raise ValueError(f"embedding_pooling must be 'last' or 'mean', got {pooling!r}")
        mode = "lasttoken" if pooling == "last" else "mean"  # `pool`'s names
        rows = []
        for ids in token_ids:
            need = -(-len(ids) // self.kv.block_size)
            if need > self.kv.num_free_blocks:
                raise QueueFullError(
                    f"the KV cache has {self.kv.num_free_blocks} free blocks, {need} needed to "
                    "embed this input; retry when running requests finish"
                )
            blocks = self.kv.block_pool.get_new_blocks(need)
            try:
                table = [b.block_id for b in blocks]
                hidden = self.runner.hidden_states([ids], [len(ids)], [table], [len(ids)])
            finally:
                self.kv.block_pool.free_blocks(reversed(blocks))
            rows.append(pool(hidden, [len(ids)], mode, normalize=True))
            self.stats.tokens_computed += len(ids)
        self.stats.prompt_tokens += sum(len(t) for t in token_ids)
        return torch.cat(rows)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool. Unknown ids are ignored."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.sequences:
            if seq.finish_reason is None:
                self.output_processor.finish(seq, "abort")
        self._free_finished()
        self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def warm_kv_cache(self) -> bool:
        """Fault in a little more of the KV pool while idle (see `KVWarmer`); False once done."""
        return self._kv_warmer.warm()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the output of every request it touched (a new token, prompt
        logprobs, finished or failed) and of every request aborted since the last step."""
        self.adopt_reloaded_model()
        touched: dict[str, Request] = {r.request_id: r for r in self._aborted}
        self._aborted.clear()
        sched = self.scheduler.schedule()
        if sched.sequences:
            start = time.perf_counter()
            try:
                self._run(sched, touched)
            except Exception as exc:  # noqa: BLE001 - fail this batch only, keep the engine serving
                if self.executor is not None:
                    self.shutdown(graceful=False)
                    raise RuntimeError(
                        "a tensor-parallel step failed and left the ranks out of step; the "
                        "workers are stopped: start a new engine"
                    ) from exc
                log.exception(
                    "step failed; failing the %d sequences of its batch", len(sched.sequences)
                )
                self._fail_batch(sched.sequences, exc, touched)
            self._count_busy(time.perf_counter() - start)
        outputs = [self.output_processor.make_output(r) for r in touched.values()]
        for request in touched.values():
            if request.finished:
                del self._requests[request.request_id]
        self._update_stats()
        return outputs

    def _count_busy(self, seconds: float) -> None:
        """Start compiling the decode graphs once the engine has been busy long enough (see
        COMPILE_AFTER_BUSY_S)."""
        if self._busy_before_compile is None:
            return
        self._busy_before_compile -= seconds
        if self._busy_before_compile <= 0:
            self._busy_before_compile = None
            log.info("compiling the decode graphs in the background for this long job")
            self.runner.compile_in_background()
            if self.drafter is not None:
                self.drafter.compile_in_background()

    def _draft_runner(self, model: str, num_blocks: int, progress: bool) -> ModelRunner:
        cfg = self.config
        tokenizer = self.tokenizer
        vocab = self.speculative.draft_vocab(
            self.loaded.config.vocab_size,
            set(tokenizer.stop_token_ids) | set(tokenizer.added_token_ids()),
        )
        # the draft's head computes these ids' logits only; drafts map back through it
        self.draft_vocab = None if vocab is None else torch.tensor(vocab)
        draft = _load(model, cfg, progress, head_rows=vocab)
        probe = "def f(x):\n    return x + 1  # héllo, 世界"
        if draft.config.vocab_size != self.loaded.config.vocab_size or (
            draft.tokenizer is None or draft.tokenizer.encode(probe) != self.tokenizer.encode(probe)
        ):
            raise InvalidRequestError(
                f"the draft model {model} does not share the target's vocabulary: speculative "
                "decoding needs a draft of the same family (e.g. Qwen2.5-Coder 0.5B for 1.5B)"
            )
        runner = ModelRunner(
            draft,
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            compile=bool(cfg.compile),
            defer_compile=cfg.defer_compile,
            kv_cache_dtype=cfg.kv_cache_dtype,
        )
        if cfg.compile is None and runner.graphs_cached():  # as the target's (see __init__)
            runner.compile_in_background()
        return runner

    def _draft_with_model(self, sched: SchedulerOutput) -> None:
        """The draft model's greedy drafts for the sequences scheduled with room for them (their
        drafts are placeholders until now): it reads what it has not read of each sequence, up to
        and with its last token, then drafts one token at a time, all sequences at once. A
        sequence stops drafting after a draft the draft model gives less than
        DRAFT_MIN_CONFIDENCE probability, and its step computes only the drafts it has."""
        scheduled = [i for i, s in enumerate(sched.sequences) if s.draft_token_ids]
        if not scheduled:
            return
        seqs = [sched.sequences[i] for i in scheduled]
        tables = [self.kv.get_block_ids(s.seq_id) for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        going = list(range(len(seqs)))
        while going:  # the first pass reads each sequence's unread tokens, the others a draft
            logits = self.drafter.last_token_logits(
                [drafts[i][-1:] or seqs[i].all_token_ids[seqs[i].draft_computed :] for i in going],
                [seqs[i].num_tokens + len(drafts[i]) for i in going],
                [tables[i] for i in going],
            )
            tokens, confident = self._draft_ids(logits)
            for i, token in zip(going, tokens):
                drafts[i].append(token)
            going = [
                i
                for i, sure in zip(going, confident)
                if sure and len(drafts[i]) < len(seqs[i].draft_token_ids)
            ]
        for index, seq, tokens in zip(scheduled, seqs, drafts):
            sched.num_new_tokens[index] -= len(seq.draft_token_ids) - len(tokens)
            seq.draft_token_ids = tokens
            seq.draft_computed = seq.num_tokens + len(tokens) - 1

    def _draft_ids(self, logits: torch.Tensor) -> tuple[list[int], list[bool]]:
        """The draft model's greedy tokens from its head's logits, and whether it gives each at
        least DRAFT_MIN_CONFIDENCE probability."""
        top = logits.softmax(-1).max(-1)
        ids = top.indices if self.draft_vocab is None else self.draft_vocab[top.indices]
        return ids.tolist(), (top.values >= DRAFT_MIN_CONFIDENCE).tolist()

    def _run(self, sched: SchedulerOutput, touched: dict[str, Request]) -> None:
        if self.drafter is not None:
            self._draft_with_model(sched)
        batch = StepBatch.build(sched, self.kv)
        seqs = batch.sampling_seqs
        sampling = self._sampling_batch(seqs) if seqs else None
        inputs = (batch.token_ids, batch.context_lens, batch.block_tables)
        prompts = batch.prompt_tokens
        if last_only := batch.needs_last_token_logits_only:
            out = self.runner.last_token_logits(
                *inputs, argmax_only=sampling.argmax_only, prompt_tokens=prompts
            )
        elif last_only := batch.samples_every_token:
            out = self.runner.token_logits(
                *inputs, argmax_only=sampling.argmax_only, prompt_tokens=prompts
            )
        else:
            out = self.runner.hidden_states(*inputs, prompt_tokens=prompts)
        self.stats.tokens_computed += batch.num_tokens
        for seq, n in zip(sched.sequences, sched.num_new_tokens):
            seq.num_computed_tokens += n
        for row, start, n, seq in batch.prompt_logprob_rows:
            self._prompt_logprobs(out[row : row + n], start, seq)
            touched[seq.request.request_id] = seq.request
        if sampling is not None:
            logits = out if last_only else self.runner.model.logits(out[batch.sample_rows])
            self._sample(logits, seqs, sampling, touched)

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The sampling rows of the step: one per sequence, and one more per draft, whose
        penalties and min_tokens see the drafts before it."""
        rows = [(s, j) for s in seqs for j in range(len(s.draft_token_ids) + 1)]
        outputs = [
            s.output_token_ids + s.draft_token_ids[:j] if j else s.output_token_ids for s, j in rows
        ]
        constrained = [r for r, (s, _) in enumerate(rows) if s.matcher is not None]
        bits = None
        if constrained:
            matched = [s for s in seqs if s.matcher is not None]
            bits = self.input_processor.grammars.allowed_tokens(
                [s.matcher for s in matched], [s.draft_token_ids for s in matched]
            )
        stops_for_min_tokens = [s.request.stop_token_ids for s, _ in rows]
        for bits_row, r in enumerate(constrained):
            seq, j = rows[r]
            short = seq.num_output_tokens + j < seq.params.min_tokens
            if short and allows_only(bits[bits_row], stops_for_min_tokens[r]):
                stops_for_min_tokens[r] = frozenset()  # a finished constraint ends the output
        batch = SamplingBatch.build(
            [s.params for s, _ in rows],
            [s.prompt_token_ids for s, _ in rows],
            outputs,
            [s.generator for s, _ in rows],
            self.loaded.config.vocab_size,
            stops_for_min_tokens,
        )
        if constrained:
            batch.allowed_bits = bits
            batch.allowed_rows = torch.tensor(constrained, dtype=torch.int64)
        return batch

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        batch: SamplingBatch,
        touched: dict[str, Request],
    ) -> None:
        for seq in seqs:
            touched[seq.request.request_id] = seq.request
        sampled = self.sampler(logits, batch)
        if logits.shape[0] == len(seqs):
            if batch.allowed_rows is not None:
                token_ids = sampled.token_ids.tolist()
                for row in batch.allowed_rows.tolist():
                    self._advance_matcher(seqs[row], token_ids[row : row + 1])
            self.output_processor.process_sampled(seqs, sampled, logits)
        else:
            self._accept_drafts(seqs, sampled, logits)
        if self.speculative is not None:
            self._draft(seqs)
        self._free_finished()

    def _accept_drafts(
        self, seqs: list[Sequence], sampled: SamplerOutput, logits: torch.Tensor
    ) -> None:
        """Each sequence's accepted drafts, then the target's token after them (see
        engine/speculative.py), appended one round at a time: round j appends every sequence's
        j-th new token, from its row of the step's sampling rows."""
        tokens = sampled.token_ids.tolist()
        rounds: list[list[tuple[Sequence, int, int]]] = []  # (sequence, row, token)
        row = 0
        for seq in seqs:
            drafts = seq.draft_token_ids
            accepted = accepted_drafts(drafts, tokens[row : row + len(drafts) + 1])
            new = drafts[:accepted] + [tokens[row + accepted]]
            if seq.matcher is not None:
                self._advance_matcher(seq, new)
            for j, token in enumerate(new):
                if j == len(rounds):
                    rounds.append([])
                rounds[j].append((seq, row + j, token))
            if drafts:
                self.stats.spec_num_drafts += 1
                self.stats.spec_num_draft_tokens += len(drafts)
                self.stats.spec_num_accepted_tokens += accepted
                if self.drafter is None:  # prompt lookup: fewer drafts while few are accepted
                    seq.max_drafts = accepted + 1
                seq.draft_misses = 0 if accepted else seq.draft_misses + 1
                if seq.draft_misses:  # and fewer steps with drafts while none are
                    seq.draft_pause = min(2 ** (seq.draft_misses - 1), SPECULATION_MAX_PAUSE)
                # the step computed every draft; the rejected ones' KV is written over later
                seq.num_computed_tokens -= len(drafts) - accepted
                # the draft model's KV holds up to the last accepted draft
                seq.draft_computed = min(seq.draft_computed, seq.num_computed_tokens)
                seq.draft_token_ids = []
            row += len(drafts) + 1
        for appended in rounds:
            index = torch.tensor([r for _, r, _ in appended])
            chosen = sampled.select(index)
            chosen.token_ids = torch.tensor([t for _, _, t in appended])
            self.output_processor.process_sampled(
                [s for s, _, _ in appended], chosen, logits[index]
            )

    def _advance_matcher(self, seq: Sequence, tokens: list[int]) -> None:
        """The sequence's matcher takes its new tokens, up to the end of its constraint; a
        matcher in error (its mask allowed nothing) fails the request with the reason."""
        if seq.matcher.is_error():
            error = seq.matcher.get_error()
            self.output_processor.fail(
                seq, f"the output constraint cannot go on: {error}", is_input=True
            )
            return
        for token in tokens:
            if seq.matcher.is_stopped():
                break
            seq.matcher.consume_token(token)

    def _draft(self, seqs: list[Sequence]) -> None:
        """Drafts for the next step of each sequence that goes on, while few enough
        run for verifying them to pay (SPECULATION_MAX_BATCH), and none for a while after drafts
        that all missed (SPECULATION_MAX_PAUSE), so a sequence whose drafts miss spends little on
        them. Prompt lookup proposes at most one more than its last drafts had accepted: a copied
        passage that parted from the text tends to part again. A draft model gets K placeholders
        each time, however many of its last drafts were accepted (its drafts follow the verified
        text); it fills them up to its first unsure draft (`_draft_with_model`)."""
        if len(self.scheduler.running) > SPECULATION_MAX_BATCH:
            return
        for seq in seqs:
            if seq.finish_reason is not None:
                continue
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            room = min(
                seq.request.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens
            )
            limit = room - 1 if seq.max_drafts is None else min(room - 1, seq.max_drafts)
            if self.drafter is not None:  # placeholders, drafted once scheduled
                seq.draft_token_ids = [-1] * min(limit, self.speculative.num_speculative_tokens)
            else:
                drafts = self.speculative.propose(seq.all_token_ids, limit)
                if seq.matcher is not None:  # drafts its constraint refuses would be rejected
                    drafts = drafts[: seq.matcher.validate_tokens(drafts)]
                seq.draft_token_ids = drafts

    def _prompt_logprobs(self, hidden: torch.Tensor, start: int, seq: Sequence) -> None:
        positions = self.output_processor.prompt_logprob_positions(seq, start, hidden.shape[0])
        if positions:
            logprobs = self.runner.model.logits(hidden[: len(positions)]).log_softmax(-1)
            self.output_processor.record_prompt_logprobs(seq, positions, logprobs)

    def _fail_batch(
        self, seqs: list[Sequence], exc: Exception, touched: dict[str, Request]
    ) -> None:
        """Fail the batch's unfinished sequences after a failed step. Their blocks leave the
        prefix cache: they were published for the step, but perhaps never written."""
        for seq in seqs:
            if seq.finish_reason is None:
                self.output_processor.fail(seq, f"internal error while running the model: {exc!r}")
        for seq in self._free_finished(uncache=True):
            touched[seq.request.request_id] = seq.request

    def _free_finished(self, uncache: bool = False) -> list[Sequence]:
        """Release what the sequences finished since the last call held; returns them."""
        finished = self.output_processor.take_finished()
        for seq in finished:
            self.scheduler.finish(seq, FINISHED_STATUS[seq.finish_reason], uncache=uncache)
        return finished

    def _update_stats(self) -> None:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.tenant_served_tokens = dict(self.scheduler.served)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = self.kv.prefix_cache_queries
        s.prefix_cache_hits = self.kv.prefix_cache_hits
        s.kv_usage = self.kv.usage
        s.num_free_blocks = self.kv.num_free_blocks
        s.generation_tokens = self.output_processor.num_generation_tokens
        grammars = self.input_processor.grammars
        s.structured_requests = grammars.num_matchers
        s.grammar_compiles = grammars.num_compiles
        s.grammar_compile_seconds = grammars.compile_seconds
