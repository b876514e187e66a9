"""Where `tokenmill serve`'s models come from: the engine each model gets (with the command line's
engine options), what it is estimated to cost, and, with --load-on-demand, the catalog aliases and
cached models a request may name (`CachedModels`); never an arbitrary path a request names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.catalog import list_models, resolve_model
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.data_parallel import DataParallelEngine
from tokenmill.engine.embedding import EmbeddingEngine
from tokenmill.engine.kv_memory import default_kv_budget
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import TokenmillError
from tokenmill.model.encoder import is_encoder_dir
from tokenmill.server.memory import available_bytes
from tokenmill.server.model_registry import Engine, ModelSource


@dataclass
class EngineBuilder:
    """Builds a model's engine as the command line says: one `LLMEngine` in this process, an
    encoder's `EmbeddingEngine`, or data-parallel replicas on Ray."""

    options: dict[str, Any]  # LLMEngine options (kv_cache_memory: None for the default budget)
    data_parallel: dict[str, Any] = field(default_factory=dict)  # DataParallelEngine's, if any
    progress: bool = False

    @property
    def replicas(self) -> int:
        return self.data_parallel.get("num_replicas", 1)

    def source(
        self,
        name: str,
        path: Path | None,
        size: int,
        keep_alive: float,
        pull: Callable[[], Path] | None = None,
    ) -> ModelSource:
        """The model `name` (at `path`, `size` bytes; None: not pulled yet, `pull` fetches it).

        Its memory is estimated as its weights' size on disk plus the KV pool its engine gets:
        --kv-cache-memory, else the default budget of the memory free now, which the engine is
        then given, so that the estimate is the pool's real size; times the data-parallel
        replicas (each its own process)."""
        encoder = path is not None and is_encoder_dir(path)
        kv = (
            0
            if encoder
            else self.options["kv_cache_memory"] or default_kv_budget(available_bytes())
        )
        options = {**self.options, "kv_cache_memory": kv or None}

        def build() -> Engine:
            if path is not None:
                return self._build(path, options)
            assert pull is not None, "a model that is not pulled yet needs its pull"
            return self._build(pull(), options)

        return ModelSource(name, path, (size + kv) * self.replicas, build, keep_alive)

    def _build(self, path: Path, options: dict[str, Any]) -> Engine:
        if is_encoder_dir(path):  # an encoder (BERT, sentence-transformers): embeddings only
            if self.replicas != 1:
                raise TokenmillError(
                    f"{path.name} is an encoder (embeddings only): --data-parallel-size serves "
                    "generative models"
                )
            return AsyncLLMEngine(lambda: EmbeddingEngine(path))
        if self.replicas != 1:
            return DataParallelEngine(path, engine_options=options, **self.data_parallel)
        # loaded on the thread that runs it: see AsyncLLMEngine
        return AsyncLLMEngine(lambda: LLMEngine(path, progress=self.progress, **options))


@dataclass
class CachedModels:
    """The models `serve --load-on-demand` loads when a request names them: every catalog alias
    (pulled first if it is not cached) and every model in the cache (`tokenmill list`)."""

    builder: EngineBuilder
    keep_alive: float  # of the models it loads
    models_dir: str | None = None

    def names(self) -> list[str]:
        return [row.name for row in list_models(self.models_dir)]

    def find(self, name: str) -> ModelSource | None:
        for row in list_models(self.models_dir):
            if row.name == name:

                def pull(name: str = name) -> Path:
                    return resolve_model(name, models_dir=self.models_dir, progress=False)

                path = row.path if row.cached else None
                return self.builder.source(name, path, row.size or 0, self.keep_alive, pull)
        return None
