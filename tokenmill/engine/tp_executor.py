"""Tensor parallelism over processes (`--tensor-parallel-size N`): the engine's own process is
rank 0, the driver, and ranks 1..N-1 are worker processes, started with torch.multiprocessing's
spawn (`--distributed-executor-backend mp`) or as Ray actors (`ray`: on this machine, or on the
nodes of the Ray cluster the process is connected to), joined by one torch.distributed process
group (gloo on CPU, NCCL for CUDA models).

The scheduler and the KV block manager run once, in the driver. Each step the driver broadcasts
the step's inputs (token ids, context lengths, block tables, prompt token counts: what
`ModelRunner` builds the flat batch and the `AttentionBatch` from) before its own forward pass;
every rank then runs the same forward over its shard of the weights (see model/sharding.py), the
ranks gathering each other's shares of the attention, the MLP and their outputs, and rank 0 alone
computes logits. Each rank's KV cache holds only its KV heads and is addressed by the driver's
block tables. Steps run eagerly: the compiled decode graphs stay off.

A `None` broadcast ends the workers' loops; workers are daemon processes, so they also end when
the driver's interpreter exits, and a worker whose driver died fails its next collective and
exits.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import socket
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenmill.errors import InvalidRequestError, TokenmillError

log = logging.getLogger("tokenmill.engine")

EXECUTOR_BACKENDS = ("mp", "ray")
# the collectives' timeout: a worker waits for the next step as long as the engine stays idle
GROUP_TIMEOUT = datetime.timedelta(days=365)
# seconds a worker gets to leave on its own at shutdown before it is terminated
JOIN_TIMEOUT_S = 10.0

# one step's inputs: token ids of each sequence, context lengths, block tables, prompt token counts
StepInputs = tuple[list[list[int]], list[int], list[list[int]], list[int] | None]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to load its shard and build its runner."""

    path: str
    load_options: dict[str, Any]  # load_model's keyword arguments, but the shard
    block_size: int
    kv_cache_dtype: str
    threads: int
    init_method: str


def check_backend(backend: str) -> None:
    if backend not in EXECUTOR_BACKENDS:
        raise InvalidRequestError(
            f"distributed executor backend {backend!r} is not supported: tensor parallelism "
            "runs its workers as local processes (--distributed-executor-backend mp, the "
            "default) or as Ray actors (ray)"
        )


def threads_per_rank(size: int) -> int:
    """OpenMP threads of each rank, so that the ranks share the cores the process was given."""
    return max(1, torch.get_num_threads() // size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class TPExecutor:
    """The driver's side: starts the workers, sends them each step, stops them."""

    def __init__(
        self,
        size: int,
        path: str,
        load_options: dict[str, Any],
        block_size: int,
        kv_cache_dtype: str,
        backend: str = "mp",
    ) -> None:
        """Start the N-1 workers (backend: `EXECUTOR_BACKENDS`), which load their shards
        meanwhile; `connect` waits for them. Sets this process's threads to its share of the
        cores (restored by `shutdown`)."""
        if dist.is_initialized():
            raise TokenmillError(
                "a torch.distributed process group already exists in this process: shut down the "
                "other tensor-parallel engine first (one per process)"
            )
        self.size = size
        self._threads_before = torch.get_num_threads()
        threads = threads_per_rank(size)
        self.spec = WorkerSpec(
            path=path,
            load_options=load_options,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            threads=threads,
            init_method=f"tcp://{_driver_address(backend)}:{_free_port()}",
        )
        torch.set_num_threads(threads)
        self.workers = (
            RayWorkers(size, self.spec) if backend == "ray" else ProcessWorkers(size, self.spec)
        )
        self._finalizer = weakref.finalize(self, self.workers.stop, False)
        self.connected = False

    @property
    def pids(self) -> list[int]:
        return self.workers.pids

    def connect(self, num_blocks: int, device: torch.device) -> None:
        """Wait for every worker to load its shard, join the process group as rank 0 and send
        the KV pool's size. Raises (workers stopped) if a worker failed."""
        try:
            self.workers.wait_loaded()
        except TokenmillError:
            self.shutdown(graceful=False)
            raise
        dist.init_process_group(
            _backend(device),
            init_method=self.spec.init_method,
            rank=0,
            world_size=self.size,
            timeout=GROUP_TIMEOUT,
        )
        self.connected = True
        dist.broadcast_object_list([num_blocks], src=0)

    def send_step(
        self,
        token_ids: list[list[int]],
        context_lens: list[int],
        block_tables: list[list[int]],
        prompt_tokens: list[int] | None,
    ) -> None:
        """Broadcast a step's inputs; the caller runs its own forward pass next."""
        dist.broadcast_object_list([(token_ids, context_lens, block_tables, prompt_tokens)], src=0)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers and leave the process group. graceful: tell them to leave (the
        process group must be in step); else terminate them."""
        if self.connected:
            if graceful:
                try:
                    dist.broadcast_object_list([None], src=0)
                except RuntimeError as exc:  # a worker already gone
                    log.warning("could not tell the tensor-parallel workers to stop: %s", exc)
            self.workers.stop(graceful)
            dist.destroy_process_group()
            self.connected = False
        self.workers.stop(False)
        self._finalizer.detach()
        torch.set_num_threads(self._threads_before)


def _driver_address(backend: str) -> str:
    """Where the workers reach the driver: this machine, or its address in the Ray cluster."""
    if backend != "ray":
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


class ProcessWorkers:
    """Ranks 1..N-1 as local processes (torch.multiprocessing's spawn)."""

    def __init__(self, size: int, spec: WorkerSpec) -> None:
        ctx = mp.get_context("spawn")
        self._ready: Any = ctx.Queue()
        self.processes = [
            ctx.Process(
                target=_worker,
                args=(rank, size, spec, self._ready),
                name=f"tokenmill-tp{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.processes:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard; raises if one failed."""
        waiting = set(range(1, len(self.processes) + 1))
        while waiting:
            try:
                rank, error = self._ready.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self.processes if not p.is_alive()]
                if dead:
                    raise TokenmillError(
                        f"tensor-parallel worker {dead[0].name} exited with code "
                        f"{dead[0].exitcode} while loading its shard; see its output above"
                    ) from None
                continue
            if error is not None:
                raise TokenmillError(f"tensor-parallel worker {rank} failed: {error}")
            waiting.discard(rank)

    def stop(self, graceful: bool) -> None:
        """Wait for the workers to leave (graceful: they were told to), then terminate any
        left."""
        for p in self.processes:
            if graceful:
                p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join()


class RayWorkers:
    """Ranks 1..N-1 as Ray actors, each of `spec.threads` CPUs, placed by Ray on the cluster this
    process is connected to (a local Ray instance is started if it is connected to none). The
    model's path must exist on every node."""

    def __init__(self, size: int, spec: WorkerSpec) -> None:
        from tokenmill.engine.data_parallel import import_ray

        ray = self._ray = import_ray("--distributed-executor-backend ray")
        if not ray.is_initialized():
            ray.init(include_dashboard=False, logging_level=logging.WARNING)
        actor = ray.remote(num_cpus=spec.threads)(RayWorker)
        self.actors = [actor.remote() for _ in range(1, size)]
        self._loads = [a.load.remote(rank, size, spec) for rank, a in enumerate(self.actors, 1)]
        self._serving: list[Any] = []

    @property
    def pids(self) -> list[int]:
        return self._ray.get([a.pid.remote() for a in self.actors])

    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard, then start their step loops (which
        join the process group); raises if one failed."""
        for rank, error in enumerate(self._ray.get(self._loads), 1):
            if error is not None:
                raise TokenmillError(f"tensor-parallel worker {rank} failed: {error}")
        self._serving = [a.serve.remote() for a in self.actors]

    def stop(self, graceful: bool) -> None:
        if graceful and self._serving:
            self._ray.wait(self._serving, num_returns=len(self._serving), timeout=JOIN_TIMEOUT_S)
        for a in self.actors:
            self._ray.kill(a)
        self.actors, self._serving = [], []


class RayWorker:
    """A tensor-parallel worker as a Ray actor: `load`, then `serve` (`_worker`'s two halves)."""

    def load(self, rank: int, size: int, spec: WorkerSpec) -> str | None:
        """Load this rank's shard; the error, if it failed."""
        self.rank, self.size, self.spec = rank, size, spec
        try:
            self.loaded = _load_shard(rank, size, spec)
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
            return f"{type(exc).__name__}: {exc}"
        return None

    def serve(self) -> None:
        _serve(self.rank, self.size, self.spec, self.loaded)

    def pid(self) -> int:
        return os.getpid()


def _worker(rank: int, size: int, spec: WorkerSpec, ready: Any) -> None:
    """A worker process's life: load its shard, report, then serve until the driver says stop."""
    try:
        loaded = _load_shard(rank, size, spec)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which raises it
        ready.put((rank, f"{type(exc).__name__}: {exc}"))
        return
    ready.put((rank, None))
    _serve(rank, size, spec, loaded)


def _load_shard(rank: int, size: int, spec: WorkerSpec) -> Any:
    from tokenmill.model.loader import load_model
    from tokenmill.model.sharding import Shard

    torch.set_num_threads(spec.threads)
    return load_model(spec.path, progress=False, shard=Shard(rank, size), **spec.load_options)


def _serve(rank: int, size: int, spec: WorkerSpec, loaded: Any) -> None:
    """Join the group, then run every step the driver sends until it sends None."""
    from tokenmill.engine.model_runner import ModelRunner

    dist.init_process_group(
        _backend(loaded.model.device),
        init_method=spec.init_method,
        rank=rank,
        world_size=size,
        timeout=GROUP_TIMEOUT,
    )
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    runner = ModelRunner(
        loaded, num_blocks=box[0], block_size=spec.block_size, kv_cache_dtype=spec.kv_cache_dtype
    )
    while True:
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as exc:  # the driver's end of the group closed: it is gone
            log.warning("tensor-parallel worker %d: the driver is gone, exiting (%s)", rank, exc)
            return
        if box[0] is None:
            break
        runner.hidden_states(*box[0])
    dist.destroy_process_group()
