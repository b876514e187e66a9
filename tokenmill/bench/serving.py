"""Serving benchmark for any OpenAI-compatible server (tokenmill, vLLM, llama-server, ...).

Metrics follow vLLM's `benchmark_serving.py` so numbers are comparable across engines:
TTFT is the time to the first streamed chunk that carries text, ITL the gaps between such
chunks, E2E the time to `data: [DONE]`, and TPOT = (E2E - TTFT) / (output tokens - 1) per
request with more than one output token. Output tokens come from the usage chunk the
server sends for `stream_options.include_usage` (else one per text chunk); input tokens
from the same chunk (else the planned prompt length).

Prompts need no local tokenizer. By default they are random common English words, which
are about one token each in BPE and SentencePiece vocabularies; when the server has a
`/tokenize` endpoint (vLLM or llama-server shape) the tokens-per-word ratio is measured on
it first, so prompts land close to the requested length on any tokenizer. With
`token_ids=True` prompts are lists of token ids (completions endpoint only), exact in
length: the ids come from the server's tokenization of the same words, or, without
`/tokenize`, from [1000, 10000), which holds only ordinary tokens in common vocabularies.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import string
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.errors import InvalidRequestError, TokenmillError

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
PERCENTILES = (("Mean", "mean"), ("Median", "median"), ("P90", "p90"), ("P99", "p99"))
LATENCIES = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
FALLBACK_TOKEN_IDS = range(1000, 10000)
# JSON schema workloads: "json" takes JSON_SCHEMAS distinct schemas in turn (the server's grammar
# cache serves the repeats), "json-unique" gives every request a schema never seen before
STRUCTURED_OUTPUTS = ("json", "json-unique")
JSON_SCHEMAS = 8
# `run_structured`'s comparisons: one of those against free text, or free text with and without
# requests bringing new schemas mid-run
STRUCTURED_MODES = (*STRUCTURED_OUTPUTS, "compile-interference")
# fewest output tokens one record of `json_schema`'s list takes: the list is made long enough
# that writing it outlasts the requested output length
RECORD_TOKENS = 10
# max_tokens of the requests that bring new schemas mid-run: past the first masks, but too few
# to weigh on the batch
NEW_SCHEMA_TOKENS = 16
# Counters read from /metrics around a run, by their names after the server's prefix (tokenmill's
# or vLLM's names): speculative decoding's, and the prefix cache's (prompt tokens looked up and
# found), summed over their labels (a data-parallel server's replicas)
SPEC_DECODE_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PREFIX_CACHE_COUNTERS = ("queries", "hits")
COUNTER_GROUPS = {"spec_decode": SPEC_DECODE_COUNTERS, "prefix_cache": PREFIX_CACHE_COUNTERS}
METRIC_PREFIXES = ("tokenmill:", "vllm:")
CALIBRATION_WORDS = 1000
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be has "
    "or had first one their its new after who they have her she two been other when there all "
    "during into school time may years more most only over city some world would where later up "
    "such used many can state about national out known university united then made high between "
    "life year before under part three well like so what because group people since while water "
    "house music game name right back work place long small great old light day night home line "
    "power road book war team film side land body family sea river south north west east end man "
    "woman king word number"
).split()


@dataclass
class BenchConfig:
    """One benchmark run: where to send requests, what to send and how fast."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None  # None: $OPENAI_API_KEY
    num_prompts: int = 100
    input_len: int = 100  # prompt tokens after the shared prefix
    output_len: int = 128
    random_range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int = 0  # tokens of a random prefix shared by the prompts
    shared_prefixes: int = 1  # distinct prefixes of prefix_len tokens; each prompt takes one
    request_rate: float = math.inf  # Poisson arrivals in req/s; inf sends everything at once
    max_concurrency: int | None = None
    ignore_eos: bool = False
    token_ids: bool = False
    seed: int = 0
    warmup: int = 1  # untimed requests first, so one-off start-up costs stay out of the numbers
    timeout: float = 600.0  # seconds before a request is abandoned and counted as failed
    label: str | None = None  # name in reports; None: the model id
    structured_output: str | None = None  # one of STRUCTURED_OUTPUTS; None: free text
    structured_output_ratio: float = 1.0  # share of the requests given a schema, as in vLLM
    new_schemas: int = 0  # requests with never-seen schemas, sent together mid-run
    new_schemas_at: float = 0.0  # ... this many seconds after the first request

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise InvalidRequestError(
                f"endpoint must be one of {', '.join(ENDPOINTS)}, not {self.endpoint!r}"
            )
        if min(self.num_prompts, self.input_len, self.output_len) < 1:
            raise InvalidRequestError("num_prompts, input_len and output_len must be at least 1")
        if not 0 <= self.random_range_ratio < 1:
            raise InvalidRequestError("random_range_ratio must be in [0, 1)")
        if self.prefix_len < 0 or self.warmup < 0:
            raise InvalidRequestError("prefix_len and warmup must not be negative")
        if self.shared_prefixes < 1:
            raise InvalidRequestError("shared_prefixes must be at least 1")
        if not self.request_rate > 0:
            raise InvalidRequestError("request_rate must be positive (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequestError("max_concurrency must be at least 1")
        if not self.timeout > 0:
            raise InvalidRequestError("timeout must be positive")
        if self.token_ids and self.endpoint != "/v1/completions":
            raise InvalidRequestError("token-id prompts need the /v1/completions endpoint")
        if self.structured_output not in (None, *STRUCTURED_OUTPUTS):
            raise InvalidRequestError(
                f"structured_output must be one of {', '.join(STRUCTURED_OUTPUTS)}, "
                f"not {self.structured_output!r}"
            )
        if not 0 <= self.structured_output_ratio <= 1:
            raise InvalidRequestError("structured_output_ratio must be in [0, 1]")
        if self.new_schemas < 0 or self.new_schemas_at < 0:
            raise InvalidRequestError("new_schemas and new_schemas_at must not be negative")


@dataclass
class RequestResult:
    """What one request measured; times in seconds."""

    # prompt tokens: the server's usage count when it sends one, else the planned length
    input_len: int
    start: float = 0.0  # when it was sent, after the start of the benchmark
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (
            (self.e2e - self.ttft) / (self.output_len - 1)
            if self.success and self.output_len > 1
            else None
        )


@dataclass
class BenchResult:
    config: BenchConfig
    model: str
    label: str
    prompt_mode: str  # how prompts were built, for the report
    duration: float  # from the first request sent to the last one finished
    requests: list[RequestResult]
    new_schema_requests: list[RequestResult] = field(default_factory=list)  # apart from the rest
    # the server's speculative-decoding counters over the run (SPEC_DECODE_COUNTERS), where its
    # /metrics has them
    spec_decode: dict[str, float] | None = None
    # the server's prefix-cache counters over the run (PREFIX_CACHE_COUNTERS), where it has them
    prefix_cache: dict[str, float] | None = None

    def metrics(self) -> dict[str, float]:
        """Summary under vLLM's result-JSON names; latencies in milliseconds."""
        ok = [r for r in self.requests if r.success]
        total_in = sum(r.input_len for r in ok)
        total_out = sum(r.output_len for r in ok)
        d = self.duration
        metrics: dict[str, float] = {
            "completed": len(ok),
            "failed": len(self.requests) - len(ok),
            "duration": d,
            "total_input_tokens": total_in,
            "total_output_tokens": total_out,
            "request_throughput": len(ok) / d,
            "output_throughput": total_out / d,
            "total_token_throughput": (total_in + total_out) / d,
        }
        samples = {
            "ttft": [r.ttft for r in ok],
            "tpot": [r.tpot for r in ok if r.tpot is not None],
            "itl": [gap for r in ok for gap in r.itl],
            "e2el": [r.e2e for r in ok],
        }
        for name, values in samples.items():
            # 0 when there is nothing to measure, as in vLLM
            ms = np.asarray(values or [0.0]) * 1000
            metrics |= {
                f"mean_{name}_ms": float(ms.mean()),
                f"std_{name}_ms": float(ms.std()),
                f"median_{name}_ms": float(np.median(ms)),
                f"p90_{name}_ms": float(np.percentile(ms, 90)),
                f"p99_{name}_ms": float(np.percentile(ms, 99)),
            }
        if self.spec_decode and self.spec_decode["num_drafts"]:
            spec = self.spec_decode
            drafted = spec["num_draft_tokens"]
            metrics |= {
                "spec_decode_num_drafts": int(spec["num_drafts"]),
                "spec_decode_num_draft_tokens": int(drafted),
                "spec_decode_num_accepted_tokens": int(spec["num_accepted_tokens"]),
                # vLLM's definitions: accepted / drafted, and tokens per verified draft
                "spec_decode_acceptance_rate": spec["num_accepted_tokens"] / drafted * 100,
                "spec_decode_acceptance_length": 1
                + spec["num_accepted_tokens"] / spec["num_drafts"],
            }
        if self.prefix_cache and self.prefix_cache["queries"]:
            cache = self.prefix_cache
            metrics |= {
                "prefix_cache_queries": int(cache["queries"]),
                "prefix_cache_hits": int(cache["hits"]),
                "prefix_cache_hit_rate": cache["hits"] / cache["queries"] * 100,
            }
        return metrics

    def settings(self) -> dict[str, object]:
        """The run's settings, JSON-safe and without the API key."""
        s = asdict(self.config)
        del s["api_key"]
        s |= {"model": self.model, "label": self.label, "prompt_mode": self.prompt_mode}
        if math.isinf(self.config.request_rate):
            s["request_rate"] = "inf"
        return s

    def to_dict(self) -> dict[str, object]:
        """Settings, metrics and per-request arrays (seconds), laid out like vLLM's result JSON."""
        rs = self.requests
        return {
            "settings": self.settings(),
            **self.metrics(),
            "input_lens": [r.input_len for r in rs],
            "output_lens": [r.output_len for r in rs],
            "starts": [r.start for r in rs],
            "ttfts": [r.ttft for r in rs],
            "itls": [r.itl for r in rs],
            "e2els": [r.e2e for r in rs],
            "errors": [r.error for r in rs],
            "new_schema_ttfts": [r.ttft for r in self.new_schema_requests],
            "new_schema_errors": [r.error for r in self.new_schema_requests],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)


@dataclass
class _Workload:
    prompts: list[str | list[int]]
    input_lens: list[int]  # planned prompt tokens, prefix included
    output_lens: list[int]
    warmup_prompt: str | list[int]  # shares nothing with the prompts, so it warms no prefix cache
    description: str
    schemas: list[dict[str, Any] | None]  # each prompt's JSON schema, None for free text
    warmup_schema: dict[str, Any] | None


def json_schema(rng: random.Random, output_len: int) -> dict[str, Any]:
    """A bounded JSON schema whose property names `rng` draws: a title, a level, a date and a list
    of records (a string, an integer, a flag) long enough that writing it outlasts `output_len`
    tokens, so that constrained requests generate as many tokens as free ones."""

    def name() -> str:
        return "".join(rng.choices(string.ascii_lowercase, k=rng.randint(4, 9)))

    def record(fields: list[dict[str, Any]]) -> dict[str, Any]:
        properties = {name(): f for f in fields}
        return {
            "type": "object",
            "properties": properties,
            "required": list(properties),
            "additionalProperties": False,
        }

    row = record(
        [
            {"type": "string", "maxLength": 24},
            {"type": "integer", "minimum": 0, "maximum": 9999},
            {"type": "boolean"},
        ]
    )
    items = -(-output_len // RECORD_TOKENS)
    return record(
        [
            {"type": "string", "maxLength": 40},
            {"enum": rng.sample(WORDS, 3)},
            {"type": "string", "format": "date"},
            {"type": "array", "items": row, "minItems": items, "maxItems": 2 * items},
        ]
    )


async def run_benchmark(
    config: BenchConfig, progress: Callable[[int, int], None] | None = None
) -> BenchResult:
    """Send `config.num_prompts` streaming requests and measure them; `progress(done, total)` after
    each.

    Failed requests are recorded, not raised; TokenmillError only when no model id can be found
    or a warm-up request fails, since then every measurement would be meaningless.
    """
    base = config.base_url.rstrip("/")
    key = config.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # No connection cap: a pooled request waiting for a free connection would count that wait as
    # TTFT. aiohttp parses HTTP in C: on a small machine the client shares the cores with the server
    # it measures, and a pure-Python parser (httpx's) takes CPU from the server on every streamed
    # chunk.
    # A connection per request (force_close): reusing a kept-alive one that the server is closing
    # at that moment fails the request (llama-server closes idle ones), and connecting over loopback
    # costs well under a millisecond of the request's TTFT.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=config.timeout)
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector
    ) as client:
        model = config.model or await _first_model(client, base)
        work = await _workload(config, client, base, model)
        url = base + config.endpoint

        def payload(
            prompt: str | list[int], max_tokens: int, schema: dict[str, Any] | None
        ) -> dict[str, object]:
            body: dict[str, object] = {
                "model": model,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if config.endpoint == "/v1/chat/completions":
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            if config.ignore_eos:
                body["ignore_eos"] = True
            if schema is not None:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": "bench", "schema": schema},
                }
            return body

        async def send(
            prompt: str | list[int],
            input_len: int,
            output_len: int,
            t0: float,
            schema: dict[str, Any] | None = None,
        ) -> RequestResult:
            start = time.perf_counter()
            body = payload(prompt, output_len, schema)
            try:
                return await asyncio.wait_for(
                    _stream(client, url, body, input_len, start, t0), config.timeout
                )
            except asyncio.TimeoutError:
                return RequestResult(
                    input_len, start=start - t0, error=f"timed out after {config.timeout:g} s"
                )

        for _ in range(config.warmup):
            warm = await send(
                work.warmup_prompt,
                config.input_len,
                config.output_len,
                time.perf_counter(),
                work.warmup_schema,
            )
            if not warm.success:
                raise TokenmillError(f"warm-up request to {url} failed: {warm.error}")

        sem = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        done = 0

        async def one(i: int, t0: float) -> RequestResult:
            nonlocal done
            request = (
                work.prompts[i],
                work.input_lens[i],
                work.output_lens[i],
                t0,
                work.schemas[i],
            )
            if sem is None:
                result = await send(*request)
            else:
                async with sem:
                    result = await send(*request)
            done += 1
            if progress:
                progress(done, config.num_prompts)
            return result

        async def new_schemas(t0: float) -> list[RequestResult]:
            await asyncio.sleep(max(0.0, t0 + config.new_schemas_at - time.perf_counter()))
            fresh = random.Random()  # seeded by the OS: schemas no run has sent before
            return await asyncio.gather(
                *(
                    send(
                        work.warmup_prompt,
                        config.input_len,
                        NEW_SCHEMA_TOKENS,
                        t0,
                        json_schema(fresh, config.output_len),
                    )
                    for _ in range(config.new_schemas)
                )
            )

        counters_before = await _server_counters(client, base)
        arrivals = random.Random(config.seed)
        t0 = time.perf_counter()
        side = asyncio.create_task(new_schemas(t0)) if config.new_schemas else None
        arrival = 0.0
        tasks = []
        for i in range(config.num_prompts):
            if i and not math.isinf(config.request_rate):
                # Absolute arrival times, so sleep overshoot does not add up and lower the rate.
                arrival += arrivals.expovariate(config.request_rate)
                await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i, t0)))
        requests = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        new_schema_requests = await side if side else []
        counters_after = await _server_counters(client, base)
    moved = {
        group: {k: counters_after[group][k] - counters_before[group][k] for k in names}
        for group, names in COUNTER_GROUPS.items()
        if group in counters_before and group in counters_after
    }
    return BenchResult(
        config,
        model,
        config.label or model,
        work.description,
        duration,
        list(requests),
        list(new_schema_requests),
        moved.get("spec_decode"),
        moved.get("prefix_cache"),
    )


async def run_structured(
    config: BenchConfig,
    mode: str,
    new_schemas: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, BenchResult], dict[str, float]]:
    """Two runs of `config`'s workload, free text first, by label, and their summary. For "json"
    and "json-unique" the second run gives its requests JSON schemas (`structured_comparison`);
    for "compile-interference" it stays free while `new_schemas` requests with never-seen schemas
    arrive a quarter into it, by the first run's duration (`compile_interference`). The second
    run draws its prompts with seed + 1, so that none shares a cached prefix with the first's."""
    if mode not in STRUCTURED_MODES:
        raise InvalidRequestError(
            f"mode must be one of {', '.join(STRUCTURED_MODES)}, not {mode!r}"
        )
    free = replace(config, structured_output=None, new_schemas=0, label="free")
    first = await run_benchmark(free, progress)
    if mode == "compile-interference":
        with_new = replace(
            free,
            seed=config.seed + 1,
            new_schemas=new_schemas,
            new_schemas_at=first.duration / 4,
            label="free + new schemas",
        )
        second = await run_benchmark(with_new, progress)
        return {first.label: first, second.label: second}, compile_interference(first, second)
    constrained = replace(free, seed=config.seed + 1, structured_output=mode, label=mode)
    second = await run_benchmark(constrained, progress)
    return {first.label: first, second.label: second}, structured_comparison(first, second)


async def _server_counters(client: aiohttp.ClientSession, base: str) -> dict[str, dict[str, float]]:
    """The server's counters of each group in COUNTER_GROUPS, from its Prometheus /metrics, by
    group; a group is missing where the server has no /metrics or not all of its counters (a
    server without speculation, llama-server)."""
    try:
        async with client.get(f"{base}/metrics") as resp:
            if resp.status != 200:
                return {}
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}
    found: dict[str, dict[str, float]] = {group: {} for group in COUNTER_GROUPS}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for prefix in METRIC_PREFIXES:
                    if not sample.name.startswith(prefix):
                        continue
                    name = sample.name.removeprefix(prefix).removesuffix("_total")
                    for group, names in COUNTER_GROUPS.items():
                        key = name.removeprefix(group + "_")
                        if name.startswith(group + "_") and key in names:
                            found[group][key] = found[group].get(key, 0.0) + sample.value
    except ValueError:  # not Prometheus text
        return {}
    return {
        group: counters
        for group, counters in found.items()
        if len(counters) == len(COUNTER_GROUPS[group])
    }


async def _first_model(client: aiohttp.ClientSession, base: str) -> str:
    try:
        async with client.get(f"{base}/v1/models") as resp:
            resp.raise_for_status()
            return (await resp.json(content_type=None))["data"][0]["id"]
    except (
        aiohttp.ClientError,
        asyncio.TimeoutError,
        ValueError,
        KeyError,
        IndexError,
        TypeError,
    ) as exc:
        raise TokenmillError(
            f"cannot read the model id from {base}/v1/models ({exc}); pass --model"
        ) from exc


async def _server_tokenize(
    client: aiohttp.ClientSession, base: str, model: str, text: str
) -> list[int] | None:
    """Token ids of `text` (without BOS) from the server's /tokenize, or None when it has none."""
    # vLLM and tokenmill take {"model", "prompt"}; llama-server takes {"content"}.
    for body in ({"model": model, "prompt": text, "add_special_tokens": False}, {"content": text}):
        try:
            async with client.post(f"{base}/tokenize", json=body) as resp:
                tokens = (
                    (await resp.json(content_type=None)).get("tokens")
                    if resp.status == 200
                    else None
                )
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            continue
        if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
            return tokens
    return None


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


async def _workload(
    config: BenchConfig, client: aiohttp.ClientSession, base: str, model: str
) -> _Workload:
    rng = random.Random(config.seed)
    sample = [rng.choice(WORDS) for _ in range(CALIBRATION_WORDS)]
    ids = await _server_tokenize(client, base, model, " ".join(sample))
    if config.token_ids:
        pool: list[str] | list[int] = sorted(set(ids)) if ids else list(FALLBACK_TOKEN_IDS)
        per_piece = 1.0
        source = (
            "from the server's /tokenize"
            if ids
            else f"in [{FALLBACK_TOKEN_IDS.start}, {FALLBACK_TOKEN_IDS.stop})"
        )
        description = f"random token ids {source}"
    else:
        pool = list(WORDS)
        per_piece = len(ids) / len(sample) if ids else 1.0
        how = "measured with the server's /tokenize" if ids else "assumed, no /tokenize"
        description = f"random words, {per_piece:.2f} tokens/word ({how})"

    def pieces(n_tokens: int) -> list:
        return [rng.choice(pool) for _ in range(max(1, round(n_tokens / per_piece)))]

    def as_prompt(parts: list) -> str | list[int]:
        return parts if config.token_ids else " ".join(parts)

    input_lens = _lengths(rng, config.input_len, config.random_range_ratio, config.num_prompts)
    output_lens = _lengths(rng, config.output_len, config.random_range_ratio, config.num_prompts)
    if config.prefix_len and config.shared_prefixes > 1:
        prefixes = [pieces(config.prefix_len) for _ in range(config.shared_prefixes)]
        prompts = [as_prompt(rng.choice(prefixes) + pieces(n)) for n in input_lens]
        description += f", one of {config.shared_prefixes} shared prefixes each"
    else:
        prefix = pieces(config.prefix_len) if config.prefix_len else []
        prompts = [as_prompt(prefix + pieces(n)) for n in input_lens]
    warmup_prompt = as_prompt(pieces(config.input_len))
    schemas: list[dict[str, Any] | None] = [None] * config.num_prompts
    warmup_schema = None
    if config.structured_output:
        unique = random.Random()  # seeded by the OS: schemas no run has sent before

        def schema(n: int) -> dict[str, Any]:
            if config.structured_output == "json-unique":
                return json_schema(unique, config.output_len)
            return json_schema(
                random.Random(f"{config.seed}-{n % JSON_SCHEMAS}"), config.output_len
            )

        picked = rng.sample(
            range(config.num_prompts), int(config.num_prompts * config.structured_output_ratio)
        )
        for n, i in enumerate(sorted(picked)):
            schemas[i] = schema(n)
        warmup_schema = schema(0)
        description += f", {len(picked)} with a JSON schema ({config.structured_output})"
    return _Workload(
        prompts=prompts,
        input_lens=[config.prefix_len + n for n in input_lens],
        output_lens=output_lens,
        warmup_prompt=warmup_prompt,
        description=description,
        schemas=schemas,
        warmup_schema=warmup_schema,
    )


def _text(event: dict, chat: bool) -> str:
    """The generated text a stream event carries ('' for role-only, finish and usage chunks)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or ""


async def _stream(
    client: aiohttp.ClientSession, url: str, body: dict, input_len: int, start: float, t0: float
) -> RequestResult:
    out = RequestResult(input_len, start=start - t0)
    chat = "messages" in body
    last = start
    chunks = 0
    try:
        async with client.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace").strip()
                out.error = f"HTTP {resp.status}: {text[:300]}"
                return out
            async for raw in resp.content:  # line by line
                line = raw.decode(errors="replace")
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments and event names
                data = line[5:].strip()
                if data == "[DONE]":
                    out.e2e = time.perf_counter() - start
                    break
                event = json.loads(data)
                if event.get("error"):
                    out.error = f"stream error: {json.dumps(event['error'])[:300]}"
                    return out
                if _text(event, chat):
                    now = time.perf_counter()
                    if chunks == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                usage = event.get("usage")
                if usage:
                    out.output_len = usage.get("completion_tokens") or 0
                    out.input_len = usage.get("prompt_tokens") or input_len
            else:
                out.error = "the stream ended without data: [DONE]"
                return out
    except Exception as exc:  # any transport or protocol failure counts against this request only
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    if chunks == 0:
        out.error = "no text was streamed"  # nothing to time a first token by
        return out
    out.output_len = out.output_len or chunks
    out.success = True
    return out


def _rows(spec_decode: bool = False, prefix_cache: bool = False) -> list[tuple[str, str | None]]:
    """(caption, metrics key) in report order; a None key marks a section heading. spec_decode,
    prefix_cache: with the speculative-decoding and prefix-cache sections."""
    rows: list[tuple[str, str | None]] = [
        ("Successful requests", "completed"),
        ("Failed requests", "failed"),
        ("Benchmark duration (s)", "duration"),
        ("Total input tokens", "total_input_tokens"),
        ("Total generated tokens", "total_output_tokens"),
        ("Request throughput (req/s)", "request_throughput"),
        ("Output token throughput (tok/s)", "output_throughput"),
        ("Total token throughput (tok/s)", "total_token_throughput"),
    ]
    for name, short, title in LATENCIES:
        rows.append((title, None))
        rows += [(f"{cap} {short} (ms)", f"{stat}_{name}_ms") for cap, stat in PERCENTILES]
    if spec_decode:
        rows += [
            ("Speculative Decoding", None),
            ("Acceptance rate (%)", "spec_decode_acceptance_rate"),
            ("Acceptance length", "spec_decode_acceptance_length"),
            ("Drafts", "spec_decode_num_drafts"),
            ("Draft tokens", "spec_decode_num_draft_tokens"),
            ("Accepted tokens", "spec_decode_num_accepted_tokens"),
        ]
    if prefix_cache:
        rows += [
            ("Prefix Cache", None),
            ("Hit rate (%)", "prefix_cache_hit_rate"),
            ("Prompt tokens looked up", "prefix_cache_queries"),
            ("Prompt tokens found", "prefix_cache_hits"),
        ]
    return rows


def _value(v: float) -> str:
    return str(v) if isinstance(v, int) else f"{v:.2f}"


def format_report(result: BenchResult) -> str:
    """A vLLM-style report: the settings, then throughput and latency percentiles."""
    c = result.config
    rate = "inf" if math.isinf(c.request_rate) else f"{c.request_rate:g}"
    spread = f" (random range ratio {c.random_range_ratio:g})" if c.random_range_ratio else ""
    settings = [
        ("Label", result.label),
        ("Model", result.model),
        ("URL", c.base_url.rstrip("/") + c.endpoint),
        ("Prompts", result.prompt_mode),
        ("Input / output tokens", f"{c.input_len} / {c.output_len}{spread}"),
        ("Shared prefix tokens", c.prefix_len),
        ("Shared prefixes", c.shared_prefixes),
        ("Request rate (req/s)", rate),
        ("Max concurrency", c.max_concurrency or "unlimited"),
        ("Ignore EOS", c.ignore_eos),
    ]
    lines = [" Serving Benchmark Result ".center(50, "=")]
    lines += [f"{k + ':':<40} {v}" for k, v in settings]
    lines.append("-" * 50)
    metrics = result.metrics()
    for caption, key in _rows("spec_decode_num_drafts" in metrics, "prefix_cache_hits" in metrics):
        lines.append(
            f"{caption:-^50}" if key is None else f"{caption + ':':<40} {_value(metrics[key])}"
        )
    lines.append("=" * 50)
    errors = [r.error for r in result.requests if not r.success]
    if errors:
        lines.append(f"First error ({len(errors)} failed): {errors[0][:300]}")
    return "\n".join(lines)


def format_comparison(results: dict[str, BenchResult]) -> str:
    """The metrics of several runs side by side, each after the first with its ratio to the
    first."""
    names = list(results)
    metrics = [results[n].metrics() for n in names]
    width = max(22, *(len(n) + 2 for n in names))
    lines = [f"{'Metric':<40}" + "".join(f"{n:>{width}}" for n in names)]
    for caption, key in _rows(prefix_cache=all("prefix_cache_hits" in m for m in metrics)):
        if key is None:
            lines.append(f" {caption} ".center(40 + width * len(names), "-"))
            continue
        base = metrics[0][key]
        cells = [_value(base)]
        for m in metrics[1:]:
            ratio = f"{m[key] / base:.2f}x" if base else "-"
            cells.append(f"{_value(m[key])} ({ratio})")
        lines.append(f"{caption:<40}" + "".join(f"{cell:>{width}}" for cell in cells))
    return "\n".join(lines)


def _ratio(value: float, base: float) -> float:
    return value / base if base else 0.0


def structured_comparison(free: BenchResult, constrained: BenchResult) -> dict[str, float]:
    """Constrained decoding against free: output throughput and median TPOT of each, and their
    ratios."""
    f, c = free.metrics(), constrained.metrics()
    return {
        "free_output_throughput": f["output_throughput"],
        "constrained_output_throughput": c["output_throughput"],
        "output_throughput_ratio": _ratio(c["output_throughput"], f["output_throughput"]),
        "free_median_tpot_ms": f["median_tpot_ms"],
        "constrained_median_tpot_ms": c["median_tpot_ms"],
        "median_tpot_ratio": _ratio(c["median_tpot_ms"], f["median_tpot_ms"]),
    }


def _max_itl_ms(result: BenchResult) -> float:
    return 1000 * max((gap for r in result.requests if r.success for gap in r.itl), default=0.0)


def compile_interference(without: BenchResult, with_new: BenchResult) -> dict[str, float]:
    """The streams' inter-token latency without and with requests bringing new schemas mid-run
    (`BenchConfig.new_schemas`), their ratios, and how those requests fared (their TTFT includes
    compiling their schema)."""
    a, b = without.metrics(), with_new.metrics()
    new = [r for r in with_new.new_schema_requests if r.success]
    ttfts = [1000 * r.ttft for r in new] or [0.0]
    return {
        "p99_itl_ms_without": a["p99_itl_ms"],
        "p99_itl_ms_with": b["p99_itl_ms"],
        "p99_itl_ratio": _ratio(b["p99_itl_ms"], a["p99_itl_ms"]),
        "max_itl_ms_without": _max_itl_ms(without),
        "max_itl_ms_with": _max_itl_ms(with_new),
        "new_schema_completed": len(new),
        "new_schema_failed": len(with_new.new_schema_requests) - len(new),
        "new_schema_median_ttft_ms": float(np.median(ttfts)),
    }


SUMMARY_CAPTIONS = {
    "free_output_throughput": "Free output throughput (tok/s)",
    "constrained_output_throughput": "Constrained output throughput (tok/s)",
    "output_throughput_ratio": "Constrained / free output throughput",
    "free_median_tpot_ms": "Free median TPOT (ms)",
    "constrained_median_tpot_ms": "Constrained median TPOT (ms)",
    "median_tpot_ratio": "Constrained / free median TPOT",
    "p99_itl_ms_without": "P99 ITL without new schemas (ms)",
    "p99_itl_ms_with": "P99 ITL with new schemas (ms)",
    "p99_itl_ratio": "P99 ITL with / without",
    "max_itl_ms_without": "Max ITL without new schemas (ms)",
    "max_itl_ms_with": "Max ITL with new schemas (ms)",
    "new_schema_completed": "New-schema requests completed",
    "new_schema_failed": "New-schema requests failed",
    "new_schema_median_ttft_ms": "New-schema requests' median TTFT (ms)",
}


def format_summary(title: str, summary: dict[str, float]) -> str:
    """A summary (`structured_comparison`, `compile_interference`) as report lines; ratios as
    multiples."""
    lines = [f" {title} ".center(50, "=")]
    for key, value in summary.items():
        shown = f"{value:.2f}x" if key.endswith("_ratio") else _value(value)
        lines.append(f"{SUMMARY_CAPTIONS[key] + ':':<40} {shown}")
    lines.append("=" * 50)
    return "\n".join(lines)


def write_plot(results: dict[str, BenchResult], path: str) -> None:
    """A PNG with one latency panel per metric (mean/p50/p90/p99) and two throughput panels, bars
    per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    metrics = [results[n].metrics() for n in names]
    panels = [
        (f"{short} (ms)", [(cap, f"{stat}_{name}_ms") for cap, stat in PERCENTILES])
        for name, short, _ in LATENCIES
    ]
    panels += [
        (
            "Token throughput (tok/s)",
            [("output", "output_throughput"), ("total", "total_token_throughput")],
        ),
        ("Request throughput (req/s)", [("requests", "request_throughput")]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    width = 0.8 / len(names)
    for ax, (title, bars) in zip(axes.flat, panels):
        x = np.arange(len(bars))
        for j, (name, m) in enumerate(zip(names, metrics)):
            heights = [m[key] for _, key in bars]
            drawn = ax.bar(x + (j - (len(names) - 1) / 2) * width, heights, width, label=name)
            ax.bar_label(drawn, fmt="%.1f", fontsize=7)
        ax.set_xticks(x, [cap for cap, _ in bars])
        ax.set_title(title)
        ax.margins(y=0.12)  # room for the value labels
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="upper right")
    fig.suptitle("Serving benchmark: " + " vs ".join(names))
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
