"""What automatic prefix caching buys `tokenmill serve`: TTFT with a long shared prompt prefix.

Workload: a 1,000-token shared prefix (random words: the shape of a long system prompt) followed
by a distinct ~24-token tail per request (the "question"), 64 requests, 16 output tokens
(ignore_eos, temperature 0), sent --concurrency at a time (default 1: each request finds the
previous ones' prefix blocks cached; with many in flight at once the first batch all miss).
The same workload runs twice against `tokenmill serve`, once with the prefix cache (the default)
and once with --no-prefix-caching, one server at a time. The prefix-cache hit counters come
from the server's /metrics.

Output: mean/p50 TTFT of each and the ratio; prefix-cache-<model>.json in the results directory
(BENCH_RESULTS, default benchmarks/results/local).

    python benchmarks/prefix_cache.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import fmt, fmt_ratio, log, ratio  # noqa: E402

MODES = (("prefix cache", []), ("no prefix cache", ["--no-prefix-caching"]))


def scrape_prefix_counters(url: str) -> dict[str, float]:
    """tokenmill:prefix_cache_{queries,hits} from /metrics (tokens)."""
    import httpx

    counters: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return counters
    for line in text.splitlines():
        for name in ("prefix_cache_queries", "prefix_cache_hits"):
            if line.startswith(f"tokenmill:{name}") and not line.startswith("#"):
                counters[name] = float(line.split()[-1])
    return counters


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalog alias or GGUF path")
    common.add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the server")
    p.add_argument("--prefix-len", type=int, default=1000, help="shared prefix tokens")
    p.add_argument("--question-len", type=int, default=24, help="distinct tokens after the prefix")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    p.add_argument("--port", type=int, default=8767)
    p.add_argument("--tokenmill-args", default="", help="extra `tokenmill serve` flags")
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument(
        "--out", default=None, help="JSON path (default: RESULTS/prefix-cache-<model>.json)"
    )
    args = p.parse_args(argv)

    from tokenmill.bench.serving import BenchConfig, format_comparison, run_benchmark

    path = common.resolve_model(args.model)
    slug = common.model_slug(args.model)
    out = Path(args.out) if args.out else common.RESULTS / f"prefix-cache-{slug}.json"
    data = common.run_record("prefix_cache", "prefix_cache.py", args, path, argv) | {"modes": {}}
    results = {}
    for mode, flags in MODES:  # one server at a time
        cmd = common.tokenmill_serve_cmd(
            path, args.port, "--dtype", args.dtype, *flags, *shlex.split(args.tokenmill_args)
        )
        with common.Server(
            f"tokenmill ({mode})",
            cmd,
            args.port,
            out.parent / "logs" / slug / f"prefix-{mode.replace(' ', '-')}.log",
            env=common.thread_env(args.threads),
            startup_timeout=args.startup_timeout,
        ) as server:
            config = BenchConfig(
                base_url=server.url,
                endpoint=args.endpoint,
                num_prompts=args.num_prompts,
                input_len=args.question_len,
                output_len=args.output_len,
                prefix_len=args.prefix_len,
                ignore_eos=True,
                max_concurrency=args.concurrency,
                seed=0,
                label=mode,
            )
            before = scrape_prefix_counters(server.url)
            result = asyncio.run(run_benchmark(config))
            after = scrape_prefix_counters(server.url)
            m = result.metrics()
            counters = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            data["modes"][mode] = {
                "command": f"OMP_NUM_THREADS={args.threads} {shlex.join(cmd)}",
                "startup_s": server.startup_s,
                "peak_rss_mib": server.peak_rss_mib,
                "prefix_counters": counters,
                **m,
            }
            results[mode] = result
            hit = ratio(counters.get("prefix_cache_hits"), counters.get("prefix_cache_queries"))
            log(
                f"{mode}: mean TTFT {m['mean_ttft_ms']:.1f} ms, p50 {m['median_ttft_ms']:.1f} ms, "
                f"{m['failed']} failed, prefix hit rate {fmt(None if hit is None else 100 * hit)}%"
            )

    cached, uncached = data["modes"]["prefix cache"], data["modes"]["no prefix cache"]
    data["ttft_speedup_mean"] = ratio(uncached["mean_ttft_ms"], cached["mean_ttft_ms"])
    data["ttft_speedup_median"] = ratio(uncached["median_ttft_ms"], cached["median_ttft_ms"])

    print(
        f"\nPrefix cache benchmark: {path.name}, {args.prefix_len}-token shared prefix + "
        f"~{args.question_len}-token question, {args.num_prompts} requests "
        f"at concurrency {args.concurrency}, "
        f"{args.output_len} output tokens",
        flush=True,
    )
    print("(ratios: prefix cache / no prefix cache)")
    print(
        format_comparison(
            {"no prefix cache": results["no prefix cache"], "prefix cache": results["prefix cache"]}
        )
    )
    rows = []
    for key, caption in (
        ("mean_ttft_ms", "mean TTFT ms"),
        ("median_ttft_ms", "p50 TTFT ms"),
        ("p90_ttft_ms", "p90 TTFT ms"),
        ("output_throughput", "output tok/s"),
    ):
        a, b = cached[key], uncached[key]
        rows.append([caption, fmt(a), fmt(b), fmt_ratio(ratio(b, a))])
    hits = [
        ratio(
            m["prefix_counters"].get("prefix_cache_hits"),
            m["prefix_counters"].get("prefix_cache_queries"),
        )
        for m in (cached, uncached)
    ]
    rows.append(["prefix hit rate %", *(fmt(None if h is None else 100 * h) for h in hits), ""])
    print("\n=== summary (ratio: no cache / cache) ===")
    print(
        common.table(["figure", "prefix cache", "no prefix cache", "no cache/cache"], rows),
        flush=True,
    )
    common.write_json(out, data)
    return 0


if __name__ == "__main__":
    sys.exit(common.main_guard(main))
