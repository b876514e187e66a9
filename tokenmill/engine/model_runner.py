"""Runs the model over one step's batch: index tensors, forward pass, logits of the tokens asked for.

Decode steps (one new token per sequence) can run a `torch.compile`d graph of the whole model:
eager PyTorch spends more time dispatching a small model's ~600 ops per step than computing them,
while the compiled graph fuses the norms, rotary, attention and activations into a few C++ kernels
and calls the quantized matmuls directly. Compilation takes minutes the first time (seconds once
inductor's on-disk cache has the graphs), so it runs on a background thread while eager steps
serve; the compiled graph takes over when it is ready.
"""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch.fx.experimental import _config as shape_config

from tokenmill.model import kernels
from tokenmill.model.attention import AttentionBatch, KVCache
from tokenmill.model.loader import LoadedModel

log = logging.getLogger("tokenmill.engine")
# Inductor accumulates float sums longer than 4096 in chunks, and guards a graph traced with a
# shorter context on staying at or below it; longer contexts would need graphs of their own.
COMPILED_CONTEXT_MAX = 4096

class ModelRunner:
    """Owns the model and its paged KV cache; block allocation is the caller's business."""

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16, compile: bool = False) -> None:
        self.max_threads = torch.get_num_threads()  # as configured on the thread that builds the runner
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.cache = KVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=loaded.dtype)
        self._compiled_decode = None  # set once every decode graph is compiled
        self.compile_error: BaseException | None = None
        self.compile_seconds: float | None = None
        self._compile_thread: threading.Thread | None = None
        self.uncompiled_decode_steps = 0  # decode steps no compiled graph fitted (run eagerly)
        self._kernel_build = kernels.build_in_background() if self.cache.k[0].device.type == "cpu" else None
        if compile:
            self._compile_thread = threading.Thread(target=self._compile_decode, name="tokenmill-compile", daemon=True)
            self._compile_thread.start()

    @property
    def decode_mode(self) -> str:
        """'compiled', 'compiling' (eager until ready) or 'eager'."""
        if self._compiled_decode is not None:
            return "compiled"
        alive = self._compile_thread is not None and self._compile_thread.is_alive()
        return "compiling" if alive else "eager"

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compilation ends (True if the compiled graph is in use)."""
        if self._compile_thread is not None:
            self._compile_thread.join(timeout)
        return self._compiled_decode is not None

    @torch.inference_mode()
    def forward(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        all_logits: bool = False,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        """Feed sequence i its new tokens token_ids[i], ending at context length context_lens[i].

        Returns float32 logits of each sequence's last new token (num_seqs, vocab), or of every new
        token (total_tokens, vocab) when all_logits is set; with hidden_only, the final hidden
        states instead of logits (for callers that need logits of only some tokens).
        """
        query_lens = [len(t) for t in token_ids]
        batch = AttentionBatch.build(query_lens, context_lens, block_tables, self.block_size, self.cache.pad_slot)
        flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
        self._set_threads(self.max_threads)  # this thread's OpenMP setting; compiled kernels were built for it
        if self._compiled_decode is not None and not hidden_only and self._is_decode(query_lens, context_lens):
            logits = self._run_compiled(flat, batch)
            if logits is not None:
                return logits
        hidden = self.model(flat, self.cache, batch)
        if hidden_only:
            return hidden
        if not all_logits:
            last = torch.tensor(query_lens).cumsum(0) - 1
            hidden = hidden[last]
        return self.model.compute_logits(hidden)

    def _run_compiled(self, flat: torch.Tensor, batch: AttentionBatch) -> torch.Tensor | None:
        """The compiled step's logits, or None for a batch no warm-up graph covers.

        Compiling a new graph here would stall every request for minutes, so such a step runs
        eagerly instead (the warm-up leaves batch size and context length dynamic: this should
        not happen, and is logged once if it does).
        """
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                return self._compiled_decode(flat, batch)[0]
        except RuntimeError as exc:
            if "fail_on_recompile" not in str(exc):
                raise
            self.uncompiled_decode_steps += 1
            if self.uncompiled_decode_steps == 1:
                log.warning("a decode batch of %d runs eagerly: no compiled graph fits it (%s)",
                            batch.num_seqs, str(exc).splitlines()[-1].strip())
            return None

    @staticmethod
    def _is_decode(query_lens: list[int], context_lens: list[int]) -> bool:
        # A 1-token context would hit shapes the graphs were not compiled for (size-1 dims are
        # specialized); such a step is a first token, which the eager path serves. Contexts past
        # COMPILED_CONTEXT_MAX run eagerly too: the graphs' softmax sums are specialized to it.
        return max(query_lens) == 1 and 1 < min(context_lens) and max(context_lens) <= COMPILED_CONTEXT_MAX

    @staticmethod
    def _set_threads(threads: int) -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def _decode_logits(self, flat: torch.Tensor, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits, and the final hidden states as a second output: an output is stored once, where
        inductor would otherwise recompute the last norms inside the output head's fused reduction
        for every one of its rows (Gemma 3's batch-1 step: 36 ms against 17 ms)."""
        hidden = self.model(flat, self.cache, batch)
        return self.model.compute_logits(hidden), hidden

    def _compile_decode(self) -> None:
        """Compile the decode graphs: one for batch 1 (size-1 dims are specialized) and one for
        every larger batch (see `QuantLinear._kernel`)."""
        start = time.perf_counter()
        if self._kernel_build is not None:
            self._kernel_build.join()  # graphs traced before the kernels load would not use them
        self._set_threads(self.max_threads)  # inductor builds its kernels for the current thread count
        try:
            # The KV pool never changes size: as symbols, its tensors' lengths (one per layer and K/V)
            # were graph arguments boxed into tensors on every call, each with guards of its own.
            for tensor in self.cache.k + self.cache.v:
                torch._dynamo.mark_static(tensor, 0)
            compiled = torch.compile(self._decode_logits, dynamic=True, options={"cpp_wrapper": True})
            # no "duck sizing": a warm-up batch size equal to some other size (say, the KV heads)
            # would otherwise be assumed equal to it, and the first real batch would recompile.
            # Specialized floats: the layers' constants (norm eps, softmax scale) would otherwise
            # be graph inputs, boxed into tensors on every call (~1.5 ms of a 12 ms step).
            with torch.inference_mode(), shape_config.patch(use_duck_shape=False), \
                    torch._dynamo.config.patch(specialize_float=True):
                for batch_size in (1, 2):
                    compiled(*self._warmup_inputs(batch_size))
        except Exception as exc:  # noqa: BLE001 - eager steps keep serving; say why once
            self.compile_error = exc
            log.warning("compiling the decode step failed; decoding stays eager: %r", exc)
            return
        finally:
            self.cache.zero_pad_slot()  # the warm-up wrote its K/V there
        self.compile_seconds = time.perf_counter() - start
        log.info("compiled decode step ready after %.1f s", self.compile_seconds)
        self._compiled_decode = compiled

    def _warmup_inputs(self, batch_size: int) -> tuple[torch.Tensor, AttentionBatch]:
        """A decode batch whose K/V writes land in the pad slot (zeroed again afterwards), so the
        warm-up touches no block the engine may be using meanwhile."""
        pad = self.cache.pad_slot
        context = batch_size + 2  # 1 would be specialized
        batch = AttentionBatch.build([1] * batch_size, [context] * batch_size, [[0]] * batch_size, self.block_size,
                                     pad)
        batch.slot_mapping.fill_(pad)
        batch.context_slots.fill_(pad)
        return torch.zeros(batch_size, dtype=torch.int64), batch


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)
