"""`tokenmill bench`: serving benchmark of any OpenAI-compatible server, like `vllm bench serve`."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys

from tokenmill.bench.serving import (
    ENDPOINTS,
    STRUCTURED_MODES,
    BenchConfig,
    format_comparison,
    format_report,
    format_summary,
    run_benchmark,
    run_structured,
    write_plot,
)


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="benchmark an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)",
        description="Stream --num-prompts requests of random prompts to an OpenAI-compatible "
        "server and report throughput and TTFT/TPOT/ITL/E2E latency percentiles, with vLLM's "
        "metric definitions. "
        "Prompts are random words, sized with the server's /tokenize when it has one "
        "(else about one token per word), or random token ids with --token-ids. Where the "
        "server's /metrics counts speculative decoding (tokenmill's or vLLM's counters), the "
        "report adds the run's drafts, acceptance rate and acceptance length.",
    )
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server URL (default: %(default)s)"
    )
    p.add_argument(
        "--endpoint",
        default=ENDPOINTS[0],
        choices=ENDPOINTS,
        help="API route (default: %(default)s)",
    )
    p.add_argument(
        "--model", default=None, help="model id to request (default: the first of GET /v1/models)"
    )
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    p.add_argument(
        "--num-prompts", type=int, default=100, help="requests to send (default: %(default)s)"
    )
    p.add_argument(
        "--input-len",
        type=int,
        default=100,
        help="prompt tokens per request (default: %(default)s)",
    )
    p.add_argument(
        "--output-len", type=int, default=128, help="max_tokens per request (default: %(default)s)"
    )
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        metavar="R",
        help="draw lengths uniformly from [len*(1-R), len*(1+R)] (default: 0, fixed lengths)",
    )
    p.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens of a random prefix shared by all prompts, for prefix caching (default: 0)",
    )
    p.add_argument(
        "--shared-prefixes",
        type=int,
        default=1,
        metavar="K",
        help="K distinct random prefixes of --prefix-len tokens (say, system prompts), each "
        "prompt starting with one drawn at random; the report gives the server's prefix-cache "
        "hit rate over the run (default: 1)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrival rate in req/s (default: inf, all requests at once)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="cap on requests in flight (default: none)",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos so every request runs to --output-len",
    )
    p.add_argument(
        "--token-ids",
        action="store_true",
        help="send prompts as token-id lists, exact in length (completions endpoint only)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of prompts, lengths and arrivals (default: 0)"
    )
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed requests sent first (default: %(default)s)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds before a request is counted as failed (default: %(default)s)",
    )
    p.add_argument(
        "--label", default=None, help="name of this run in the report (default: the model id)"
    )
    p.add_argument(
        "--structured-output",
        default=None,
        choices=STRUCTURED_MODES,
        help="run the workload twice, free text first, and report their ratios: json / "
        "json-unique give the second run's requests JSON schemas (response_format), one of 8 "
        "distinct ones in turn / a never-seen one each; compile-interference keeps it free "
        "while --new-schemas requests with never-seen schemas arrive a quarter into it",
    )
    p.add_argument(
        "--structured-output-ratio",
        type=float,
        default=1.0,
        metavar="R",
        help="share of the constrained run's requests given a schema (default: %(default)s)",
    )
    p.add_argument(
        "--new-schemas",
        type=int,
        default=8,
        help="requests with never-seen schemas for compile-interference (default: %(default)s)",
    )
    p.add_argument(
        "--result-json",
        default=None,
        metavar="PATH",
        help="write metrics and per-request data here",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="write a PNG of latencies and throughput here",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        random_range_ratio=args.random_range_ratio,
        prefix_len=args.prefix_len,
        shared_prefixes=args.shared_prefixes,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        token_ids=args.token_ids,
        seed=args.seed,
        warmup=args.warmup,
        timeout=args.timeout,
        label=args.label,
        structured_output_ratio=args.structured_output_ratio,
    )

    def show(done: int, total: int) -> None:
        print(
            f"\r{done}/{total} requests",
            end="\n" if done == total else "",
            file=sys.stderr,
            flush=True,
        )

    progress = show if sys.stderr.isatty() else None
    if args.structured_output:
        return _run_structured(args, config, progress)
    result = asyncio.run(run_benchmark(config, progress=progress))
    print(format_report(result))
    if args.result_json:
        result.write_json(args.result_json)
    if args.plot:
        write_plot({result.label: result}, args.plot)
    return 0 if result.metrics()["completed"] else 1


def _run_structured(args: argparse.Namespace, config: BenchConfig, progress) -> int:
    """--structured-output: both runs' reports, their metrics side by side, then the summary."""
    mode = args.structured_output
    runs, summary = asyncio.run(run_structured(config, mode, args.new_schemas, progress))
    for result in runs.values():
        print(format_report(result))
    print(format_comparison(runs))
    title = "Compile interference" if mode == "compile-interference" else "Structured outputs"
    print(format_summary(title, summary))
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            runs_json = {label: result.to_dict() for label, result in runs.items()}
            json.dump({"runs": runs_json, "summary": summary}, f, indent=2)
    if args.plot:
        write_plot(runs, args.plot)
    return 0 if all(r.metrics()["completed"] for r in runs.values()) else 1
