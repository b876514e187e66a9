"""LLMEngine: add requests, call `step()`, get outputs. The synchronous core of every front end.

One step = schedule -> build the flat batch -> forward -> sample (batched) -> update requests
(append tokens, detokenize, check stops) -> free what finished. A request with n > 1 becomes n
child sequences that share its prompt's KV blocks through the prefix cache.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil
import torch

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.outputs import CompletionOutput, Logprob, RequestOutput, TokenLogprobs
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig
from tokenmill.errors import InvalidRequestError, QueueFullError
from tokenmill.model.attention import KVCache, resolve_kv_cache_dtype
from tokenmill.model.loader import LoadedModel, load_model
from tokenmill.sample import Sampler, SamplingBatch, SamplingParams
from tokenmill.sample.params import MAX_SEED
from tokenmill.sample.sampler import request_generator
from tokenmill.tokenizer import IncrementalDetokenizer

GiB = 1 << 30
log = logging.getLogger("tokenmill.engine")
# `warm_kv_cache` writes this much of one of the KV pool's tensors a call (~3-5 ms): the delay it
# can add to a request that arrives meanwhile
KV_WARM_BYTES = 2 << 20
# ... and keeps this much of the pool warm past the blocks used so far (SmolLM2: ~2,900 blocks of 16
# tokens), not all of it: the process stays as large as its use
KV_WARM_AHEAD = 1 * GiB


def _default_kv_budget(available: int) -> int:
    """A quarter of the free RAM, at most 4 GiB, rounded down to a power of two: the compiled decode
    graphs are specialized to the pool's size, and a size that followed the free memory exactly
    would need a new graph (minutes of compilation) on almost every start."""
    quarter = max(available // 4, 1)
    return min(4 * GiB, 1 << (quarter.bit_length() - 1))


@dataclass
class EngineConfig:
    dtype: str = "fp32"
    quantization: str = "auto"  # see load_model: GGUF weights stay packed by default
    dense_min_tokens: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # see attention.resolve_kv_cache_dtype
    kv_cache_memory: int | None = None  # bytes for the KV pool; default: see _default_kv_budget
    num_kv_blocks: int | None = None  # exact pool size (overrides kv_cache_memory; tests use it)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    models_dir: str | None = None
    max_queue_len: int | None = None  # waiting requests beyond this are refused (QueueFullError)
    compile: bool = False  # compile the decode step in the background (see ModelRunner)
    defer_compile: bool = False  # ... from `runner.start_compile()` on, which the caller calls when ready


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


@dataclass
class _Sequence:
    """Engine-side state of one child sequence: its request plus output processing."""

    req: Request
    parent: _Parent
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    generator: torch.Generator | None
    max_tokens: int
    stop_ids: frozenset[int]  # token ids that end it: its stop_token_ids, plus EOS unless ignore_eos
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    new_tokens: list[int] = field(default_factory=list)


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class LLMEngine:
    def __init__(self, model: str | Path | LoadedModel | None = None, config: EngineConfig | None = None,
                 progress: bool = False, **overrides) -> None:
        from tokenmill.catalog import resolve_model

        self.config = config or EngineConfig()
        for key, value in overrides.items():
            if not hasattr(self.config, key):
                raise TypeError(f"unknown engine option {key!r}")
            setattr(self.config, key, value)
        cfg = self.config
        if isinstance(model, LoadedModel):
            self.loaded = model
        else:
            self.loaded = load_model(resolve_model(model, models_dir=cfg.models_dir, progress=progress),
                                     dtype=cfg.dtype, progress=progress, quantization=cfg.quantization,
                                     dense_min_tokens=cfg.dense_min_tokens)
        if self.loaded.tokenizer is None:
            raise InvalidRequestError(f"{self.loaded.path}: the model has no tokenizer")
        self.tokenizer = self.loaded.tokenizer
        mc = self.loaded.config
        num_blocks = cfg.num_kv_blocks or self._blocks_for_budget()
        self.runner = ModelRunner(self.loaded, num_blocks=num_blocks, block_size=cfg.block_size, compile=cfg.compile,
                                  defer_compile=cfg.defer_compile, kv_cache_dtype=cfg.kv_cache_dtype)
        limit = min(mc.max_position_embeddings, num_blocks * cfg.block_size)
        self.max_model_len = min(cfg.max_model_len or limit, limit)
        self.kv = KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.policy), self.kv)
        self.sampler = Sampler()
        self._parents: dict[str, _Parent] = {}
        self._sequences: dict[str, _Sequence] = {}
        self._aborted: list[_Parent] = []
        self._ids = itertools.count()
        self.stats = EngineStats(num_total_blocks=num_blocks)
        self._kv_warming = self._kv_warm_units()

    def _blocks_for_budget(self) -> int:
        mc, cfg = self.loaded.config, self.config
        budget = cfg.kv_cache_memory or _default_kv_budget(psutil.virtual_memory().available)
        dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, self.loaded.dtype, self.loaded.model.device.type)
        per_block = KVCache.bytes_per_block(mc.num_layers, cfg.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        if budget < per_block:
            raise InvalidRequestError(f"KV cache memory {budget} bytes holds no block of {per_block} bytes")
        return budget // per_block

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        extra_key: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises InvalidRequestError for anything unservable."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        vocab = self.loaded.config.vocab_size
        params.validate(vocab_size=vocab)
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            if any(not 0 <= t < vocab for t in token_ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidRequestError(f"the prompt has {len(token_ids)} tokens; this model's context is "
                                      f"{self.max_model_len} tokens, leaving no room to generate", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequestError(f"max_tokens={max_tokens} plus the prompt's {len(token_ids)} tokens exceeds "
                                      f"the context of {self.max_model_len} tokens", param="max_tokens")
        limit = self.config.max_queue_len
        if limit is not None and len(self.scheduler.waiting) + params.n > limit:
            raise QueueFullError(f"the server is at capacity ({len(self.scheduler.waiting)} requests waiting); "
                                 "retry shortly")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        parent = _Parent(request_id, text, token_ids)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(token_ids)
        for index in range(params.n):
            child_params = params
            if params.seed is not None and params.n > 1:  # distinct but reproducible children
                seed = (params.seed + index + MAX_SEED + 1) % (2 * (MAX_SEED + 1)) - MAX_SEED - 1
                child_params = replace(params, seed=seed)
            req = Request(
                request_id=f"{request_id}#{index}" if params.n > 1 else request_id,
                prompt_token_ids=list(token_ids),
                sampling_params=child_params,
                arrival_time=arrival,
                priority=priority,
                extra_key=extra_key,
                block_size=self.config.block_size,
            )
            seq = _Sequence(
                req=req, parent=parent, index=index, params=child_params,
                detok=IncrementalDetokenizer(self.tokenizer, token_ids, child_params.skip_special_tokens),
                generator=request_generator(child_params),
                max_tokens=max_tokens,
                stop_ids=frozenset(child_params.stop_token_ids)
                | (frozenset() if child_params.ignore_eos else self.tokenizer.stop_token_ids),
                logprobs=[] if child_params.logprobs is not None else None,
            )
            parent.children.append(seq)
        for seq in parent.children:  # only once every child was built: a request is added whole or not at all
            self._sequences[seq.req.request_id] = seq
            self.scheduler.add_request(seq.req)
        self._parents[request_id] = parent
        self.stats.prompt_tokens += len(token_ids)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool. Unknown ids are ignored."""
        parent = self._parents.get(request_id)
        if parent is None:
            return
        for seq in parent.children:
            if seq.finish_reason is None:
                self._finish(seq, "abort", RequestStatus.FINISHED_ABORTED)
        self._aborted.append(parent)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def warm_kv_cache(self) -> bool:
        """Fault in a little more of the KV pool (`KV_WARM_BYTES` of one layer's keys or values);
        False while `KV_WARM_AHEAD` past the blocks used so far is warm.

        The pool is allocated unwritten (zeroing gigabytes would delay the start by seconds), so the
        step that first writes a block paid for its memory: on the 2-core AMX VM ~1.4 s a GiB, 7% of
        SmolLM2's decode steps at 32 sequences while the pool was new, the other core waiting. A
        server calls this while it has nothing to run. Only blocks that no request holds and the
        prefix cache does not keep are written (zeros: their contents are never read unwritten).
        """
        return next(self._kv_warming, False)

    def _kv_warm_units(self) -> Iterator[bool]:
        cache, pool = self.runner.cache, self.kv.block_pool
        if cache.k[0].device.type != "cpu":  # device memory is resident once allocated
            return
        blocks, tensors = pool.blocks, cache.k + cache.v
        span = max(1, KV_WARM_BYTES // tensors[0][:cache.block_size].nbytes)
        ahead = KV_WARM_AHEAD // (len(tensors) * tensors[0][:cache.block_size].nbytes)
        for first in range(0, len(blocks), span):
            while first >= pool.used_end + ahead:
                yield False
            for tensor in tensors:
                # found again for each tensor: steps may have taken or cached blocks in between
                for unheld, ids in itertools.groupby(range(first, min(len(blocks), first + span)),
                                                     key=lambda i: blocks[i].ref_cnt == 0 and blocks[i].block_hash is None):
                    if unheld:
                        run = list(ids)
                        cache.zero_blocks(tensor, run[0], run[-1] + 1)
                yield True

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        touched: dict[str, _Parent] = {p.request_id: p for p in self._aborted}
        self._aborted.clear()
        sched = self.scheduler.schedule()
        if sched.requests:
            try:
                self._run(sched, touched)
            except Exception as exc:  # noqa: BLE001 - fail this batch's requests, keep the engine serving
                log.exception("step failed; failing the %d requests of its batch", len(sched.requests))
                for req in sched.requests:
                    seq = self._sequences.get(req.request_id)
                    if seq is not None and seq.finish_reason is None:
                        self._fail(seq, f"internal error while running the model: {exc!r}", uncache=True)
                        touched[seq.parent.request_id] = seq.parent
        outputs = [self._output(p) for p in touched.values()]
        for p in touched.values():
            if p.finished:
                self._parents.pop(p.request_id, None)
                for seq in p.children:
                    self._sequences.pop(seq.req.request_id, None)
        self._update_stats()
        return outputs

    def _run(self, sched, touched: dict[str, _Parent]) -> None:
        token_ids, context_lens, tables, sample_rows, prompt_lp_rows = [], [], [], [], []
        offset = 0
        for req, n in zip(sched.requests, sched.num_new_tokens):
            start = req.num_computed_tokens
            token_ids.append(req.all_token_ids[start:start + n])
            context_lens.append(start + n)
            tables.append(self.kv.get_block_ids(req.request_id))
            seq = self._sequences[req.request_id]
            if start + n == req.num_tokens:
                sample_rows.append((offset + n - 1, seq))
            if seq.parent.prompt_logprobs is not None and seq.index == 0 and start < req.num_prompt_tokens:
                prompt_lp_rows.append((offset, start, n, seq))
            offset += n
        seqs = [s for _, s in sample_rows]
        sampling = self._sampling_batch(seqs) if seqs else None
        # When every sequence samples from its last token (decode steps) the runner returns those
        # logits itself, which lets it use its compiled decode graph; otherwise hidden states.
        last_logits = not prompt_lp_rows and len(sample_rows) == len(sched.requests)
        out = self.runner.forward(token_ids, context_lens, tables, hidden_only=not last_logits,
                                  argmax_only=sampling is not None and sampling.argmax_only)
        self.stats.tokens_computed += offset
        for req, n in zip(sched.requests, sched.num_new_tokens):
            req.num_computed_tokens += n
        for row, start, n, seq in prompt_lp_rows:
            self._prompt_logprobs(out[row:row + n], start, seq)
            touched[seq.parent.request_id] = seq.parent
        if sampling is not None:
            logits = out if last_logits else self.runner.model.compute_logits(out[[r for r, _ in sample_rows]])
            self._sample(logits, seqs, sampling, touched)

    def _sampling_batch(self, seqs: list[_Sequence]) -> SamplingBatch:
        return SamplingBatch.build(
            [s.params for s in seqs], [s.req.prompt_token_ids for s in seqs], [s.req.output_token_ids for s in seqs],
            [s.generator for s in seqs], self.loaded.config.vocab_size, [s.stop_ids for s in seqs],
        )

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence], batch: SamplingBatch,
                touched: dict[str, _Parent]) -> None:
        out = self.sampler(logits, batch)
        if not bool(out.usable.all()):  # one request's numerical failure must not reach the others
            for seq, ok in zip(seqs, out.usable.tolist()):
                if not ok:
                    self._fail(seq, "the model produced non-finite logits for this request")
                    touched[seq.parent.request_id] = seq.parent
        sampled = out.token_ids.tolist()
        lp = out.logprobs.tolist() if out.logprobs is not None else None
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        for i, (seq, token) in enumerate(zip(seqs, sampled)):
            if seq.finish_reason is not None:
                continue
            touched[seq.parent.request_id] = seq.parent
            try:
                seq.req.append_output_token(token)
                seq.new_tokens.append(token)
                self.stats.generation_tokens += 1
                if seq.logprobs is not None:
                    self._record_logprobs(seq, token, logits[i], lp[i], top_ids[i], top_lps[i])
                self._process_token(seq, token)
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer failure: this request only
                log.exception("request %s failed", seq.req.request_id)
                self._fail(seq, f"failed to process token {token}: {exc!r}")

    def _record_logprobs(self, seq: _Sequence, token: int, logits: torch.Tensor, logprob: float,
                         top_ids: list[int], top_lps: list[float]) -> None:
        k = seq.params.logprobs
        entry = {tid: Logprob(lp, rank + 1, self.tokenizer.decode([tid]))
                 for rank, (tid, lp) in enumerate(zip(top_ids[:k], top_lps[:k]))}
        if token not in entry:
            rank = int((logits.log_softmax(-1) > logprob).sum()) + 1
            entry = {token: Logprob(logprob, rank, self.tokenizer.decode([token]))} | entry
        seq.logprobs.append(entry)
        seq.cumulative_logprob += logprob

    def _process_token(self, seq: _Sequence, token: int) -> None:
        """Detokenize one new token and decide whether the sequence is done."""
        params, req = seq.params, seq.req
        if token in seq.stop_ids and req.num_output_tokens >= params.min_tokens:
            reason = token if token in params.stop_token_ids else None
            seq.text += seq.detok.flush()
            self._finish(seq, "stop", RequestStatus.FINISHED_STOPPED, reason)
            return
        before = len(seq.text)
        seq.text += seq.detok.push(token)
        if params.stop and req.num_output_tokens >= params.min_tokens:
            longest = max(len(s) for s in params.stop)
            start = max(0, before - longest + 1)
            found = [(i, s) for s in params.stop if (i := seq.text.find(s, start)) >= 0]
            if found:
                at, stop = min(found)
                seq.text = seq.text[:at + len(stop) if params.include_stop_str_in_output else at]
                self._finish(seq, "stop", RequestStatus.FINISHED_STOPPED, stop)
                return
        if req.num_output_tokens >= seq.max_tokens or req.num_tokens >= self.max_model_len:
            seq.text += seq.detok.flush()
            self._finish(seq, "length", RequestStatus.FINISHED_LENGTH)

    def _fail(self, seq: _Sequence, message: str, uncache: bool = False) -> None:
        seq.parent.error = message
        self._finish(seq, "error", RequestStatus.FINISHED_ERROR, uncache=uncache)

    def _finish(self, seq: _Sequence, reason: str, status: RequestStatus, stop_reason: str | int | None = None,
                uncache: bool = False) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.scheduler.finish(seq.req, status, uncache=uncache)

    def _prompt_logprobs(self, hidden: torch.Tensor, start: int, seq: _Sequence) -> None:
        """Logprob of each prompt token given the tokens before it (the first has none)."""
        prompt = seq.req.prompt_token_ids
        end = min(start + hidden.shape[0], len(prompt))
        positions = range(start, end - 1 if end == len(prompt) else end)  # predicts token at pos + 1
        if not positions:
            return
        logprobs = self.runner.model.compute_logits(hidden[: len(positions)]).log_softmax(-1)
        k = seq.params.prompt_logprobs
        targets = torch.tensor(prompt[positions.start + 1: positions.stop + 1])
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        for j, pos in enumerate(positions):
            target = prompt[pos + 1]
            entry = {target: Logprob(float(chosen[j]), int(ranks[j]), self.tokenizer.decode([target]))}
            if k:
                for r, (tid, l) in enumerate(zip(top_ids[j].tolist(), top_lp[j].tolist())):
                    entry.setdefault(tid, Logprob(l, r + 1, self.tokenizer.decode([tid])))
            seq.parent.prompt_logprobs[pos + 1] = entry

    # ------------------------------------------------------------------ outputs

    def _output(self, parent: _Parent) -> RequestOutput:
        completions = []
        for seq in parent.children:
            final = seq.finish_reason is not None
            held = 0 if final or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
            visible = max(seq.emitted, len(seq.text) - held)
            delta = seq.text[seq.emitted:visible]
            seq.emitted = visible
            completions.append(CompletionOutput(
                index=seq.index,
                text=seq.text[:visible],
                token_ids=list(seq.req.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=None if seq.logprobs is None else list(seq.logprobs),  # snapshot: the engine appends
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                text_delta=delta,
                token_ids_delta=seq.new_tokens,
            ))
            seq.new_tokens = []
        first = parent.children[0].req
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=parent.finished,
            prompt_logprobs=list(parent.prompt_logprobs) if parent.prompt_logprobs is not None else None,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            error=parent.error,
        )

    def _update_stats(self) -> None:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = self.kv.prefix_cache_queries
        s.prefix_cache_hits = self.kv.prefix_cache_hits
        s.kv_usage = self.kv.usage
        s.num_free_blocks = self.kv.num_free_blocks


