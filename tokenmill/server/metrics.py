"""Prometheus metrics: latency histograms observed per request, engine state read at scrape time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tokenmill.engine.llm_engine import EngineStats

# Latency histogram bounds in seconds (TTFT, inter-token, end to end): fine below 100 ms, where
# inter-token latencies fall, coarse up to the longest requests.
_LATENCY_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)


class _EngineCollector:
    """Reads the engine's counters when Prometheus scrapes: the step loop never waits on metrics.
    With data-parallel replicas, each engine family has one sample per replica, labelled
    `replica`."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        replica_stats: Callable[[], list[EngineStats]] | None = None,
    ) -> None:
        self.stats = stats
        self.replica_stats = replica_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        per_replica = self.replica_stats() if self.replica_stats is not None else []
        labels = ["replica"] if per_replica else []
        samples = [([str(i)], s) for i, s in enumerate(per_replica)] or [([], self.stats())]
        for kind, name, doc, attr in _ENGINE_METRICS:
            family = kind(name, doc, labels=labels)
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
    """The server's Prometheus registry: request latencies (the endpoint's, over all replicas),
    and the engine's state (from stats(), or per replica from replica_stats() where it returns
    any, read at each scrape)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        replica_stats: Callable[[], list[EngineStats]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, replica_stats))
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
