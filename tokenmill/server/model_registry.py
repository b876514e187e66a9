"""Several models in one server: which are loaded, loading on demand, and unloading when idle.

Each model keeps its own engine (its own KV pool and prefix cache); the registry maps a request's
`model` to it. A request holds its model for its whole life (`ServedModel`, released once the
response has been sent), so a model never unloads under a running request. When the last request
of a model ends, its keep_alive starts (Ollama's meaning: seconds, or forever); once it passes, the
model unloads: its engine stops, every reference to it goes, and the freed memory is handed back
to the system (`release_freed_memory`).

A model that is not loaded is loaded by the first request that names it (with an `ModelFinder`,
`serve --load-on-demand`); requests that come meanwhile wait for the same load, for at most
`load_timeout` seconds (then 503, and the load goes on). Loads run one at a time, on a worker
thread, so the models already loaded go on serving. Before a load, room is made within
`max_loaded` models and `memory_budget` bytes by unloading idle models that have a finite
keep_alive, least recently used first; a model that can never fit (beside the models kept
forever) is refused with a message that says so, and so is one the system has no free memory for.
A model's memory is its source's estimate (weights plus KV pool), or the growth of the process's
resident memory that its load measured, whichever is larger.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.data_parallel import DataParallelEngine
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.server.errors import APIError
from tokenmill.server.memory import (
    available_bytes,
    format_bytes,
    release_freed_memory,
    resident_bytes,
)

log = logging.getLogger("tokenmill.server")

Engine = AsyncLLMEngine | DataParallelEngine
FOREVER = math.inf  # a keep_alive that never expires
ON_DEMAND_KEEP_ALIVE = 300.0  # seconds, of models loaded on demand: Ollama's default
# A Go duration, as Ollama's keep_alive takes it: "5m", "1h30m", "90s", "-1m"
_DURATION = re.compile(r"(-?)((?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+)")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
LEASES = "model_leases"  # the request scope's state key of its `ServedModel`s


def parse_keep_alive(value: str | float) -> float:
    """Seconds a model stays loaded after its last request, from Ollama's keep_alive: a number of
    seconds or a duration ("5m", "1h30m"); negative: forever (`FOREVER`); 0: unload at once."""
    if isinstance(value, str):
        text = value.strip()
        match = _DURATION.fullmatch(text)
        if match is not None:
            seconds = sum(
                float(n) * _SECONDS[unit] for n, unit in _DURATION_PART.findall(match.group(2))
            )
            value = -seconds if match.group(1) else seconds
        else:
            try:
                value = float(text)
            except ValueError:
                raise InvalidRequestError(
                    f"keep_alive '{value}' is not a duration: give seconds (300), a duration "
                    "('5m', '1h30m'), 0 to unload after the request or -1 to keep the model "
                    "loaded",
                    param="keep_alive",
                ) from None
    if math.isnan(value):
        raise InvalidRequestError("keep_alive must be a number of seconds", param="keep_alive")
    return FOREVER if value < 0 else float(value)


@dataclass(frozen=True)
class ModelSource:
    """A model the server can load: its name, what loading it costs, how to build its engine."""

    name: str
    path: Path | None  # its file or folder; None: a catalog model that a load pulls first
    memory: int  # estimated bytes once loaded: its weights and its KV pool
    build: Callable[[], Engine]  # a running engine; blocks for the load (run on a worker thread)
    keep_alive: float = FOREVER  # seconds it stays loaded after its last request, by default
    # never unloads, whatever a request's keep_alive: an engine handed over running, which
    # `build` cannot make again once shut down
    pinned: bool = False


class ModelFinder(Protocol):
    """The models a server loads on demand, beyond the ones it was started with."""

    def find(self, name: str) -> ModelSource | None:
        """The model a request names, or None if there is none by that name."""
        ...

    def names(self) -> list[str]:
        """Every name `find` knows, for /v1/models."""
        ...


class ModelUnavailableError(TokenmillError):
    """A model named at the start does not fit in the budget or the system's free memory."""


@dataclass(eq=False)
class ModelEntry:
    """One model the registry knows, loaded or not (read it; the registry writes it)."""

    source: ModelSource
    memory: int  # bytes charged to the budget while it is loaded
    keep_alive: float  # of its latest request (else its source's)
    engine: Engine | None = None
    loading: asyncio.Task | None = None
    users: int = 0  # requests that hold it
    acquired: int = 0  # requests that ever held it: an expiry checks none came since
    last_used: float = 0.0  # time.monotonic() of its latest release
    expires_at: float | None = None  # time.time() at which it unloads, while idle
    loads: int = 0
    unloads: int = 0
    load_seconds: float = 0.0  # total time its loads took

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def status(self) -> Literal["loaded", "loading", "available"]:
        if self.engine is not None:
            return "loaded"
        return "loading" if self.loading is not None else "available"


class ServedModel:
    """A request's hold on a loaded model: the model does not unload while any is held."""

    def __init__(self, registry: ModelRegistry, entry: ModelEntry, engine: Engine) -> None:
        self.registry = registry
        self.entry = entry
        self.name = entry.name
        self.engine = engine
        self.released = False

    def release(self) -> None:
        """Let the model go (idempotent); its keep_alive starts when no request holds it."""
        if not self.released:
            self.released = True
            self.registry._release(self.entry)

    def check_generates(self) -> None:
        """Refuse a generation request when the model is an encoder (embeddings only)."""
        if self.engine.embeddings_only:
            raise APIError(
                400,
                f"this model serves embeddings only: `{self.name}` is an encoder; use "
                "/v1/embeddings, or name a generative model for completions",
                code="embeddings_only",
            )


@dataclass
class ModelRegistry:
    """name -> model (loaded or not): see the module's docstring."""

    finder: ModelFinder | None = None  # None: only the models added at the start
    max_loaded: int | None = None  # most models loaded at once
    memory_budget: int | None = None  # bytes the loaded models' memory may add up to
    load_timeout: float = 300.0  # seconds a request waits for its model to load
    entries: dict[str, ModelEntry] = field(default_factory=dict)
    default_model: str | None = None  # of requests that name none: the first one started with
    # one load or unload at a time
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    # set when a request releases a model: room may have come free
    _room: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    # expiries under way (referenced until they end)
    _tasks: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)
    _listening: bool = field(default=False, init=False, repr=False)

    # ------------------------------------------------------------------ at the start

    def add(self, source: ModelSource, engine: Engine | None = None) -> None:
        """Know `source` (and serve `engine`, already running, for it)."""
        entry = ModelEntry(source, source.memory, source.keep_alive, engine)
        if engine is not None:
            entry.loads = 1
            self.default_model = self.default_model or source.name
        self.entries[source.name] = entry

    def load_now(self, source: ModelSource) -> None:
        """Load `source` before the server starts; raises ModelUnavailableError if it does not
        fit beside the models loaded so far."""
        entry = ModelEntry(source, source.memory, source.keep_alive)
        try:
            victims, fits = self._plan_room(entry)
            if victims or not fits:
                raise APIError(400, self._no_room_message(entry))
            self._check_free_memory(entry)
        except APIError as exc:
            raise ModelUnavailableError(exc.message) from None
        self.entries[source.name] = entry
        self.default_model = self.default_model or source.name
        self._build(entry)

    def start_compile(self) -> None:
        """The server listens (on its event loop): compile the loaded models' decode graphs, and
        each later one's as it loads (see `AsyncLLMEngine.start_compile`); the keep_alive of
        those that have one starts now."""
        self._listening = True
        for entry in self.entries.values():
            if entry.engine is not None:
                entry.engine.start_compile()
                self._start_keep_alive(entry)

    def shutdown(self) -> None:
        for entry in self.entries.values():
            if entry.engine is not None:
                entry.engine.shutdown()

    # ------------------------------------------------------------------ requests

    def entry(self, name: str | None) -> ModelEntry:
        """The model a request names (None: the default), loaded or not; 404 if there is none."""
        if name is None:
            name = self.default_model
            if name is None:
                raise APIError(400, "name a model: this server has no default", param="model")
        for key in (name, name.removesuffix(":latest")):
            if key in self.entries:
                return self.entries[key]
        source = self.finder.find(name.removesuffix(":latest")) if self.finder else None
        if source is None:
            served = ", ".join(f"`{n}`" for n in self.entries) or "none loaded"
            how = "" if self.finder else " (serve --load-on-demand loads cached models too)"
            raise APIError(
                404,
                f"The model `{name}` does not exist: not found among this server's models "
                f"({served}{how})",
                param="model",
                code="model_not_found",
            )
        self.add(source)
        return self.entries[source.name]

    async def acquire(self, name: str | None, keep_alive: float | None = None) -> ServedModel:
        """Hold the model a request names, loading it first if it is not loaded. keep_alive:
        seconds it stays loaded after this request (None: its default)."""
        entry = self.entry(name)
        entry.users += 1  # held from here on: neither an expiry nor a load unloads it
        entry.acquired += 1
        entry.expires_at = None
        try:
            while entry.engine is None:
                await self._wait_loaded(entry)
        except BaseException:
            self._release(entry)
            raise
        if keep_alive is not None and not entry.source.pinned:
            entry.keep_alive = keep_alive
        else:
            entry.keep_alive = entry.source.keep_alive
        return ServedModel(self, entry, entry.engine)

    async def unload(self, name: str) -> None:
        """Unload a model now if no request holds it (Ollama's keep_alive 0 with no prompt)."""
        entry = self.entry(name)
        async with self._lock:
            if entry.engine is not None and entry.users == 0 and not entry.source.pinned:
                await self._unload_locked(entry)

    def _release(self, entry: ModelEntry) -> None:
        entry.users -= 1
        entry.last_used = time.monotonic()
        self._room.set()
        self._start_keep_alive(entry)

    def _start_keep_alive(self, entry: ModelEntry) -> None:
        """Unload the model once its keep_alive passes, if it is idle and loaded."""
        if entry.users or entry.engine is None or entry.keep_alive == FOREVER:
            return
        entry.expires_at = time.time() + entry.keep_alive
        acquired = entry.acquired
        loop = asyncio.get_running_loop()
        loop.call_later(entry.keep_alive, lambda: self._spawn(self._expire(entry, acquired)))

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire(self, entry: ModelEntry, acquired: int) -> None:
        """Unload an idle model whose keep_alive passed, unless a request came since."""
        async with self._lock:
            if entry.acquired == acquired and entry.users == 0 and entry.engine is not None:
                await self._unload_locked(entry)

    # ------------------------------------------------------------------ loading

    async def _wait_loaded(self, entry: ModelEntry) -> None:
        """Wait for the model's load (starting it if none runs), at most `load_timeout`."""
        if entry.loading is None:
            entry.loading = asyncio.ensure_future(self._load(entry))
            entry.loading.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            await asyncio.wait_for(asyncio.shield(entry.loading), self.load_timeout)
        except asyncio.TimeoutError:
            raise APIError(
                503,
                f"the model `{entry.name}` is still loading after {self.load_timeout:g} s; "
                "retry shortly",
                type_="service_unavailable",
                code="model_loading",
                headers={"Retry-After": "5"},
            ) from None

    async def _load(self, entry: ModelEntry) -> None:
        try:
            async with self._lock:
                await self._make_room(entry)
                self._check_free_memory(entry)
                await asyncio.to_thread(self._build, entry)
                if self._listening and entry.engine is not None:
                    entry.engine.start_compile()
        except APIError:
            raise
        except Exception as exc:
            log.exception("loading %s failed", entry.name)
            raise APIError(
                500, f"loading the model `{entry.name}` failed: {exc}", type_="server_error"
            ) from exc
        finally:
            entry.loading = None

    def _build(self, entry: ModelEntry) -> None:
        """Load the model (blocking), and charge it what its load measured if that is more than
        the estimate."""
        started, before = time.perf_counter(), resident_bytes()
        engine = entry.source.build()
        entry.memory = max(entry.source.memory, resident_bytes() - before)
        entry.load_seconds += time.perf_counter() - started
        entry.loads += 1
        entry.engine = engine
        log.info(
            "loaded %s (%s) in %.1f s",
            entry.name,
            format_bytes(entry.memory),
            time.perf_counter() - started,
        )

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload idle models until `entry` fits; wait (bounded) for requests holding models to
        end when only that would make room. Raises when it cannot fit."""
        deadline = time.monotonic() + self.load_timeout
        while True:
            self._room.clear()
            # planned again after each unload: a request may have taken a planned victim since
            victims, fits = self._plan_room(entry)
            if victims:
                await self._unload_locked(victims[0])
                continue
            if fits:
                return
            left = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._room.wait(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise APIError(
                    503,
                    self._no_room_message(entry) + "; the models that hold it are serving "
                    "requests: retry shortly",
                    type_="service_unavailable",
                    code="model_memory_busy",
                    headers={"Retry-After": "5"},
                ) from None

    def _plan_room(self, entry: ModelEntry) -> tuple[list[ModelEntry], bool]:
        """The idle models to unload for `entry` (least recently used first) and whether it then
        fits; raises APIError(400) if it cannot fit beside the models kept forever."""
        loaded = [e for e in self.entries.values() if e.engine is not None and e is not entry]
        kept = [e for e in loaded if e.keep_alive == FOREVER]
        budget, most = self.memory_budget, self.max_loaded
        never = (budget is not None and entry.memory + sum(e.memory for e in kept) > budget) or (
            most is not None and len(kept) >= most
        )
        if never:
            raise APIError(400, self._no_room_message(entry), code="model_too_large")
        count, used = len(loaded), sum(e.memory for e in loaded)

        def fits() -> bool:
            room_for_count = most is None or count < most
            return room_for_count and (budget is None or used + entry.memory <= budget)

        victims = []
        idle = sorted((e for e in loaded if e.users == 0 and e not in kept), key=_last_used)
        for victim in idle:
            if fits():
                break
            victims.append(victim)
            count, used = count - 1, used - victim.memory
        return victims, fits()

    def _no_room_message(self, entry: ModelEntry) -> str:
        loaded = [e for e in self.entries.values() if e.engine is not None and e is not entry]
        held = ", ".join(
            f"`{e.name}` {format_bytes(e.memory)}"
            + (" (kept loaded)" if e.keep_alive == FOREVER else "")
            for e in loaded
        )
        limits = []
        if self.memory_budget is not None:
            limits.append(f"the memory budget is {format_bytes(self.memory_budget)}")
        if self.max_loaded is not None:
            limits.append(f"at most {self.max_loaded} models load at once")
        return (
            f"the model `{entry.name}` does not fit: it needs about {format_bytes(entry.memory)} "
            f"(weights and KV cache) and {' and '.join(limits) or 'there is no room'} "
            f"(--memory-budget, --max-loaded-models); loaded: {held or 'none'}. Raise the limits, "
            "give models a shorter keep_alive, lower --kv-cache-memory, or use a smaller model"
        )

    def _check_free_memory(self, entry: ModelEntry) -> None:
        """Refuse a load that the system has no free memory for, rather than risk an
        out-of-memory kill."""
        free = available_bytes()
        if entry.memory > free:
            raise APIError(
                503,
                f"the model `{entry.name}` needs about {format_bytes(entry.memory)} but the system "
                f"has {format_bytes(free)} free: unload a model, lower --kv-cache-memory or use a "
                "smaller model",
                type_="service_unavailable",
                code="model_memory_unavailable",
            )

    async def _unload_locked(self, entry: ModelEntry) -> None:
        """Stop the model's engine and hand its memory back; the caller holds the lock."""
        engine, entry.engine = entry.engine, None
        entry.expires_at = None
        if engine is None:
            return
        await asyncio.to_thread(engine.shutdown)
        del engine  # the last reference: the model's tensors are freed here
        await asyncio.to_thread(release_freed_memory)
        entry.unloads += 1
        log.info("unloaded %s", entry.name)


def _last_used(entry: ModelEntry) -> float:
    return entry.last_used


class ReleaseModels:
    """A plain ASGI middleware that releases the models a request held (`ServedModel`s in its
    scope's state) once its response has been sent, streamed or not, or the client has left."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            for served in scope.get("state", {}).pop(LEASES, []):
                served.release()
