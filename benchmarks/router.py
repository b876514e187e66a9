"""What prefix-aware routing buys data parallelism: prefix-cache hit rate and TTFT of two replicas.

Workload (`tokenmill bench --shared-prefixes`): 8 system prompts of 1,000 tokens (random words),
each request one of them, drawn at random, then a distinct ~32-token user turn; 128 requests, 16
output tokens (ignore_eos, temperature 0), --concurrency at a time. The same workload runs against
`tokenmill serve --data-parallel-size 2`, first with `--router prefix`, then with `--router
round-robin`, one server at a time. Each replica's KV cache is sized to hold about half of the
system prompts (--cache-prefixes): round-robin sends every system prompt to both replicas, which
then evict each other's prefixes, while prefix routing gives each replica its own half.

The goal: with prefix routing, a prefix-cache hit rate at least 1.8x round-robin's and a p50 TTFT
at most 0.6x. The hit rate comes from the servers' /metrics (summed over the replicas).

Output: hit rate and p50 TTFT of each router side by side, with the ratios; router-<model>.json
in the results directory (BENCH_RESULTS, default benchmarks/results/local).

    python benchmarks/router.py
    python benchmarks/router.py --num-prompts 8 --prefix-len 64 --shared-prefixes 2  # a smoke run
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

ROUTERS = ("prefix", "round-robin")
GiB = 1 << 30
BLOCK_SIZE = 16  # tokenmill serve's default


def kv_cache_gib(path: Path, tokens: int) -> float:
    """--kv-cache-memory (GiB) that holds this many tokens of the model (16-bit KV entries)."""
    import torch

    from tokenmill.model.attention import KVCache
    from tokenmill.model.loader import open_model_info

    config, _ = open_model_info(path)
    per_block = KVCache.bytes_per_block(
        config.num_layers, BLOCK_SIZE, config.num_kv_heads, config.head_dim, torch.float16
    )
    return (tokens // BLOCK_SIZE + 1) * per_block / GiB


def main(argv: list[str] | None = None) -> int:
    from tokenmill.catalog import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalog alias or GGUF path")
    common.add_dtype_arg(p)
    p.add_argument("--shared-prefixes", type=int, default=8, help="distinct system prompts")
    p.add_argument("--prefix-len", type=int, default=1000, help="tokens of each system prompt")
    p.add_argument("--question-len", type=int, default=32, help="tokens of each user turn")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--cache-prefixes",
        type=float,
        default=None,
        help="system prompts one replica's KV cache holds, besides the user turns of the "
        "requests in flight (default: half of --shared-prefixes)",
    )
    p.add_argument("--port", type=int, default=8768)
    p.add_argument("--tokenmill-args", default="", help="extra `tokenmill serve` flags")
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument("--out", default=None, help="JSON path (default: RESULTS/router-<model>.json)")
    args = p.parse_args(argv)

    from tokenmill.bench.serving import BenchConfig, format_comparison, run_benchmark

    path = common.resolve_model(args.model)
    slug = common.model_slug(args.model)
    out = Path(args.out) if args.out else common.RESULTS / f"router-{slug}.json"
    # Prefix routing gives each replica half the system prompts, which then all stay cached;
    # round-robin gives each all of them, to be evicted in turn. The requests in flight share
    # their system prompt's cached blocks, so only their own turns take room besides.
    cache_prefixes = args.cache_prefixes or args.shared_prefixes / 2
    turn = args.question_len + args.output_len + 2 * BLOCK_SIZE
    kv_tokens = int(cache_prefixes * args.prefix_len) + args.concurrency * turn
    kv_gib = kv_cache_gib(path, kv_tokens)
    data: dict[str, object] = {
        "benchmark": "router",
        "model": args.model,
        "model_path": str(path),
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"kv_gib": kv_gib},
        "command": shlex.join(
            ["python", "benchmarks/router.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": common.machine_info(),
        "routers": {},
    }
    results = {}
    for router in ROUTERS:  # one server at a time
        flags = ["--data-parallel-size", "2", "--router", router, "--dtype", args.dtype]
        flags += ["--kv-cache-memory", f"{kv_gib:.6f}", *shlex.split(args.tokenmill_args)]
        cmd = common.tokenmill_serve_cmd(path, args.port, *flags)
        with common.Server(
            f"tokenmill ({router} router)",
            cmd,
            args.port,
            out.parent / "logs" / slug / f"router-{router}.log",
            startup_timeout=args.startup_timeout,
        ) as server:
            config = BenchConfig(
                base_url=server.url,
                num_prompts=args.num_prompts,
                input_len=args.question_len,
                output_len=args.output_len,
                prefix_len=args.prefix_len,
                shared_prefixes=args.shared_prefixes,
                ignore_eos=True,
                max_concurrency=args.concurrency,
                seed=0,
                label=f"{router} router",
            )
            result = asyncio.run(run_benchmark(config))
            m = result.metrics()
            data["routers"][router] = {"command": shlex.join(cmd), **m}
            results[router] = result
            log(
                f"{router}: p50 TTFT {m['median_ttft_ms']:.1f} ms, {m['failed']} failed, "
                f"prefix hit rate {fmt(m.get('prefix_cache_hit_rate'))}%"
            )

    prefix, rr = data["routers"]["prefix"], data["routers"]["round-robin"]
    data["hit_rate_ratio"] = ratio(
        prefix.get("prefix_cache_hit_rate"), rr.get("prefix_cache_hit_rate")
    )
    data["median_ttft_ratio"] = ratio(prefix["median_ttft_ms"], rr["median_ttft_ms"])
    print(
        f"\nRouter benchmark: {path.name}, 2 replicas, {args.shared_prefixes} system prompts of "
        f"{args.prefix_len} tokens + ~{args.question_len}-token user turns, {args.num_prompts} "
        f"requests at concurrency {args.concurrency}, {args.output_len} output tokens, "
        f"{kv_gib * 1024:.1f} MiB of KV cache per replica",
        flush=True,
    )
    print("(ratios: prefix / round-robin)")
    print(format_comparison({"round-robin": results["round-robin"], "prefix": results["prefix"]}))
    rows = [
        [
            "prefix hit rate %",
            fmt(prefix.get("prefix_cache_hit_rate")),
            fmt(rr.get("prefix_cache_hit_rate")),
            fmt_ratio(data["hit_rate_ratio"]),
            ">= 1.8x",
        ],
        [
            "p50 TTFT ms",
            fmt(prefix["median_ttft_ms"]),
            fmt(rr["median_ttft_ms"]),
            fmt_ratio(data["median_ttft_ratio"]),
            "<= 0.6x",
        ],
    ]
    print("\n=== summary (ratio: prefix / round-robin) ===")
    print(
        common.table(["figure", "prefix", "round-robin", "prefix/round-robin", "goal"], rows),
        flush=True,
    )
    common.write_json(out, data)
    return 0


if __name__ == "__main__":
    sys.exit(common.main_guard(main))
