"""Serving speed of `tokenmill serve` next to `llama-server` on the same GGUF file and workload.

The servers run one at a time, never both at once. For each: start it, time the start to the
first 200 on /health, then run tokenmill's serving client (`tokenmill.bench.serving`, the one
behind `tokenmill bench`) at each concurrency: streaming /v1/completions requests with ~100-token
random-word prompts, 128 output tokens, ignore_eos, temperature 0, all sent at once and capped
at the concurrency; max(--prompts-per-concurrency * C, --min-prompts) prompts per level, one
untimed warm-up request before each. The server's resident memory (process tree) is sampled
every 0.2 s; the peak over its whole life is reported. The server is always killed afterwards
(also on Ctrl-C and SIGTERM).

Output: per-concurrency comparison tables, a summary table (output tok/s, p50 TTFT, p50 TPOT,
ratios tokenmill / llama.cpp), serving-<model>.json and .png in the results directory
(BENCH_RESULTS, default benchmarks/results/local), the servers' logs in its logs/.

    python benchmarks/serving.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import MiB, fmt, fmt_ratio, log, ratio  # noqa: E402

NAMES = {"tokenmill": "tokenmill", "llama.cpp": "llama.cpp"}


def tokenmill_server(path: Path, args: argparse.Namespace) -> tuple[list[str], dict]:
    cmd = common.tokenmill_serve_cmd(
        path, args.tokenmill_port, "--dtype", args.dtype, *shlex.split(args.tokenmill_args)
    )
    return cmd, common.thread_env(args.threads)


def llama_server(path: Path, args: argparse.Namespace) -> tuple[list[str], dict]:
    binary = common.ensure_llama(["llama-server"], build=not args.no_build)["llama-server"]
    if binary is None:
        raise RuntimeError(common.missing_llama_hint(["llama-server"]))
    cmd = common.llama_server_cmd(
        binary,
        path,
        args.llama_port,
        args.threads,
        *("-c", str(args.ctx), "-np", str(args.parallel), "-cb"),
        *shlex.split(args.llama_args),
    )
    return cmd, common.thread_env(args.threads)


def num_prompts(c: int, args: argparse.Namespace) -> int:
    return args.num_prompts or max(args.prompts_per_concurrency * c, args.min_prompts)


def bench_server(
    engine: str, path: Path, args: argparse.Namespace, log_dir: Path
) -> tuple[dict, dict]:
    """Start one server, run every concurrency against it, stop it. (summary, BenchResult per
    level)."""
    from tokenmill.bench.serving import BenchConfig, format_report, run_benchmark

    cmd, env = (tokenmill_server if engine == "tokenmill" else llama_server)(path, args)
    port = args.tokenmill_port if engine == "tokenmill" else args.llama_port
    summary: dict[str, object] = {
        "command": f"OMP_NUM_THREADS={args.threads} " * (engine == "tokenmill") + shlex.join(cmd),
        "runs": {},
    }
    results = {}
    with common.Server(
        engine, cmd, port, log_dir / f"{engine}.log", env=env, startup_timeout=args.startup_timeout
    ) as server:
        summary["startup_s"] = server.startup_s
        summary["compiled_after_s"] = server.ready_s
        summary["rss_idle_mib"] = server.sampler.last / MiB
        for c in args.concurrency:
            config = BenchConfig(
                base_url=server.url,
                endpoint="/v1/completions",
                num_prompts=num_prompts(c, args),
                input_len=args.input_len,
                output_len=args.output_len,
                ignore_eos=True,
                max_concurrency=c,
                seed=args.seed,
                label=f"{engine} c={c}",
                model=None,
                timeout=args.request_timeout,
            )
            log(f"{engine}: concurrency {c}, {config.num_prompts} prompts")
            result = asyncio.run(run_benchmark(config))
            if args.verbose:
                print(format_report(result), flush=True)
            m = result.metrics()
            summary["runs"][str(c)] = {
                "num_prompts": config.num_prompts,
                "peak_rss_mib_so_far": server.peak_rss_mib,
                "prompt_mode": result.prompt_mode,
                **m,
            }
            results[c] = result
            log(
                f"{engine}: c={c}: {m['output_throughput']:.1f} output tok/s, "
                f"p50 TTFT {m['median_ttft_ms']:.0f} ms, "
                f"p50 TPOT {m['median_tpot_ms']:.1f} ms, {m['failed']} failed"
            )
        summary["peak_rss_mib"] = server.peak_rss_mib
    return summary, results


SUMMARY_METRICS = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "p50 TTFT ms"),
    ("median_tpot_ms", "p50 TPOT ms"),
)


def summary_table(data: dict, concurrency: list[int]) -> str:
    engines = data["engines"]
    tm, lc = engines.get("tokenmill"), engines.get("llama.cpp")
    rows = []
    for c in concurrency:
        for key, caption in SUMMARY_METRICS:
            a = tm["runs"][str(c)][key] if tm else None
            b = lc["runs"][str(c)][key] if lc else None
            rows.append([f"c={c} {caption}", fmt(a), fmt(b), fmt_ratio(ratio(a, b))])
    for key, caption, digits in (
        ("startup_s", "startup to /health 200 (s)", 2),
        ("peak_rss_mib", "peak RSS MiB", 0),
    ):
        a, b = (tm or {}).get(key), (lc or {}).get(key)
        rows.append([caption, fmt(a, digits), fmt(b, digits), fmt_ratio(ratio(a, b))])
    return common.table(["figure", "tokenmill", "llama.cpp", "tokenmill/llama.cpp"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_pair_args(p)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument(
        "--prompts-per-concurrency", type=int, default=3, help="prompts per level: this times C ..."
    )
    p.add_argument("--min-prompts", type=int, default=8, help="... but at least this many")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="fixed number of prompts per level (overrides)",
    )
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default="tokenmill,llama.cpp")
    p.add_argument("--tokenmill-port", type=int, default=8765)
    p.add_argument("--llama-port", type=int, default=8766)
    p.add_argument(
        "--tokenmill-args",
        default="",
        help="extra `tokenmill serve` flags, e.g. '--max-num-seqs 32'",
    )
    p.add_argument("--ctx", type=int, default=32768, help="llama-server -c")
    p.add_argument("--parallel", type=int, default=32, help="llama-server -np (slots)")
    p.add_argument("--llama-args", default="", help="extra llama-server flags")
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument("--request-timeout", type=float, default=1800)
    p.add_argument("--no-build", action="store_true", help="do not build a missing llama-server")
    p.add_argument("--verbose", action="store_true", help="also print the full report of every run")
    p.add_argument("--out", default=None, help="JSON path (default: RESULTS/serving-<model>.json)")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(NAMES)
    if unknown:
        p.error(f"unknown engines {', '.join(sorted(unknown))}")

    from tokenmill.bench.serving import format_comparison, write_plot

    path = common.resolve_model(args.model)
    slug = common.model_slug(args.model)
    out = Path(args.out) if args.out else common.RESULTS / f"serving-{slug}.json"
    data = common.run_record("serving", "serving.py", args, path, argv) | {
        "workload": {
            "endpoint": "/v1/completions",
            "input_len": args.input_len,
            "output_len": args.output_len,
            "ignore_eos": True,
            "temperature": 0,
            "warmup": 1,
            "num_prompts": {str(c): num_prompts(c, args) for c in args.concurrency},
        },
        "engines": {},
    }
    results: dict[str, dict] = {}
    for engine in engines:  # strictly one server at a time
        data["engines"][engine], results[engine] = bench_server(
            engine, path, args, out.parent / "logs" / slug
        )

    print(
        f"\nServing benchmark: {path.name}, {args.threads} threads, "
        f"prompts ~{args.input_len} tokens, "
        f"{args.output_len} output tokens",
        flush=True,
    )
    # llama.cpp first, so format_comparison's ratios read tokenmill / llama.cpp like the summary's
    order = sorted(engines, key=lambda e: e != "llama.cpp")
    for c in args.concurrency:
        print(
            f"\n=== concurrency {c} ({num_prompts(c, args)} prompts; "
            "ratios: tokenmill / llama.cpp) ==="
        )
        print(format_comparison({e: results[e][c] for e in order}))
    print("\n=== summary (ratios: tokenmill / llama.cpp) ===")
    print(summary_table(data, args.concurrency), flush=True)

    common.write_json(out, data)
    png = out.with_suffix(".png")
    write_plot({f"{e} c={c}": results[e][c] for c in args.concurrency for e in engines}, str(png))
    log(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(common.main_guard(main))
