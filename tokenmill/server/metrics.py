"""Prometheus metrics: latency histograms observed per request, engine state read at scrape time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.llm_engine import EngineStats
from tokenmill.server.model_registry import ModelEntry, ModelRegistry

# Latency histogram bounds in seconds (TTFT, inter-token, end to end): fine below 100 ms, where
# inter-token latencies fall, coarse up to the longest requests.
_LATENCY_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)


class _EngineCollector:
    """Reads the engines' counters when Prometheus scrapes: the step loop never waits on metrics.
    Each engine family has one sample per loaded model, labelled `model`; with data-parallel
    replicas, one per replica of each, labelled `replica` too."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        engines = [(e.name, e.engine) for e in self.models.entries.values() if e.engine]
        per_replica = {name: engine.replica_stats() for name, engine in engines}
        labels = ["model", "replica"] if any(per_replica.values()) else ["model"]
        samples: list[tuple[list[str], EngineStats]] = []
        for name, engine in engines:
            if len(labels) == 1:
                samples.append(([name], engine.stats()))
            else:
                replicas = per_replica[name] or [engine.stats()]
                samples += [([name, str(i)], s) for i, s in enumerate(replicas)]
        for kind, metric, doc, attr in _ENGINE_METRICS:
            family = kind(metric, doc, labels=labels)
            for values, s in samples:
                family.add_metric(values, getattr(s, attr))
            yield family
        served = GaugeMetricFamily(
            "tokenmill:tenant_served_tokens",
            "Fair scheduling: the virtual token counter of each tenant with requests in the "
            "engine (prompt tokens, plus output tokens weighted 2).",
            labels=[*labels, "tenant"],
        )
        for values, s in samples:
            for tenant, value in s.tenant_served_tokens.items():
                served.add_metric([*values, tenant], value)
        yield served


class _ModelCollector:
    """The registry's models: which are loaded or loading, their memory, loads and unloads."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        entries = list(self.models.entries.values())
        for kind, metric, doc, value in _MODEL_METRICS:
            family = kind(metric, doc, labels=["model"])
            for entry in entries:
                family.add_metric([entry.name], value(entry))
            yield family
        if self.models.memory_budget is not None:
            yield GaugeMetricFamily(
                "tokenmill:memory_budget_bytes",
                "The memory the loaded models may take together (--memory-budget).",
                value=self.models.memory_budget,
            )


# (family, name, help, value of a model) of each model metric
_MODEL_METRICS: list[tuple[type, str, str, Callable[[ModelEntry], float]]] = [
    (
        GaugeMetricFamily,
        "tokenmill:model_loaded",
        "1 while the model is loaded, else 0.",
        lambda e: float(e.status == "loaded"),
    ),
    (
        GaugeMetricFamily,
        "tokenmill:model_loading",
        "1 while the model is loading, else 0.",
        lambda e: float(e.status == "loading"),
    ),
    (
        GaugeMetricFamily,
        "tokenmill:model_memory_bytes",
        "Memory charged to the budget for the model while it is loaded (the larger of its "
        "estimate and its load's measured growth), else 0.",
        lambda e: float(e.memory if e.status == "loaded" else 0),
    ),
    (
        CounterMetricFamily,
        "tokenmill:model_loads",
        "Times the model was loaded.",
        lambda e: e.loads,
    ),
    (
        CounterMetricFamily,
        "tokenmill:model_unloads",
        "Times the model was unloaded (keep_alive passed, or room was made for another).",
        lambda e: e.unloads,
    ),
    (
        CounterMetricFamily,
        "tokenmill:model_load_seconds",
        "Time spent loading the model.",
        lambda e: e.load_seconds,
    ),
]


# (family, name, help, EngineStats field) of each engine metric
_ENGINE_METRICS: list[tuple[type, str, str, str]] = [
    (
        GaugeMetricFamily,
        "tokenmill:num_requests_running",
        "Requests in the running batch.",
        "num_running",
    ),
    (
        GaugeMetricFamily,
        "tokenmill:num_requests_waiting",
        "Requests waiting to be scheduled.",
        "num_waiting",
    ),
    (
        GaugeMetricFamily,
        "tokenmill:kv_cache_usage_perc",
        "Fraction of KV cache blocks in use (0-1).",
        "kv_usage",
    ),
    (
        GaugeMetricFamily,
        "tokenmill:kv_cache_free_blocks",
        "KV cache blocks free.",
        "num_free_blocks",
    ),
    (
        GaugeMetricFamily,
        "tokenmill:kv_cache_total_blocks",
        "KV cache blocks in the pool.",
        "num_total_blocks",
    ),
    (
        CounterMetricFamily,
        "tokenmill:num_preemptions",
        "Requests preempted (recomputed later).",
        "num_preemptions",
    ),
    (
        CounterMetricFamily,
        "tokenmill:prompt_tokens",
        "Prompt tokens of accepted requests.",
        "prompt_tokens",
    ),
    (CounterMetricFamily, "tokenmill:generation_tokens", "Tokens generated.", "generation_tokens"),
    (
        CounterMetricFamily,
        "tokenmill:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
    ),
    (
        CounterMetricFamily,
        "tokenmill:prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hits",
    ),
    (
        CounterMetricFamily,
        "tokenmill:structured_output_requests",
        "Requests whose output a schema or grammar constrains.",
        "structured_requests",
    ),
    (
        CounterMetricFamily,
        "tokenmill:grammar_compiles",
        "Distinct schemas and grammars compiled (the rest came from the cache).",
        "grammar_compiles",
    ),
    (
        CounterMetricFamily,
        "tokenmill:grammar_compile_seconds",
        "Time spent compiling schemas and grammars, off the engine's thread.",
        "grammar_compile_seconds",
    ),
    (
        CounterMetricFamily,
        "tokenmill:spec_decode_num_drafts",
        "Speculative decoding: sequence steps that verified drafts.",
        "spec_num_drafts",
    ),
    (
        CounterMetricFamily,
        "tokenmill:spec_decode_num_draft_tokens",
        "Speculative decoding: tokens drafted and verified.",
        "spec_num_draft_tokens",
    ),
    (
        CounterMetricFamily,
        "tokenmill:spec_decode_num_accepted_tokens",
        "Speculative decoding: drafted tokens accepted (acceptance rate: accepted / draft tokens; "
        "mean acceptance length: 1 + accepted / drafts).",
        "spec_num_accepted_tokens",
    ),
]


class ServerMetrics:
    """The server's Prometheus registry: request latencies (the endpoint's, over all models and
    replicas), and each loaded model's engine state and the registry's models, read at each
    scrape."""

    def __init__(self, models: ModelRegistry) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(models))
        self.registry.register(_ModelCollector(models))
        self.ttft = Histogram(
            "tokenmill:time_to_first_token_seconds",
            "Time to first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "tokenmill:inter_token_latency_seconds",
            "Time between output tokens.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "tokenmill:e2e_request_latency_seconds",
            "Request latency from arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "tokenmill:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Turns one request's stream of outputs into TTFT, inter-token and end-to-end observations."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first_token_at: float | None = None  # time.perf_counter() of the first token

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self.first_token_at is None:
            self.metrics.ttft.observe(now - self.start)
            self.first_token_at = now
        else:
            per_token = (now - self.last) / count
            for _ in range(count):
                self.metrics.itl.observe(per_token)
        self.last = now

    def finish(self, reasons: list[str | None]) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        for reason in reasons:
            self.metrics.finished.labels(finished_reason=reason or "unknown").inc()
