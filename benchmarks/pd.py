"""Prefill/decode disaggregation beside one engine: TTFT and TPOT of `tokenmill serve
--data-parallel-size 2 --pd-disaggregation` (replica 0 prefills, replica 1 decodes, the KV blocks
going through Ray's object store) and of a single `tokenmill serve`, one server at a time.

Workload (`tokenmill bench`): --num-prompts requests of --input-len random tokens, --output-len
tokens out (ignore_eos), --concurrency at a time. Prints the two runs side by side (ratios:
disaggregated / single) and writes pd-<model>.json to the results directory.

    python benchmarks/pd.py
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import fmt, fmt_ratio, ratio  # noqa: E402

SETUPS = {
    "single engine": [],
    "P/D disaggregated": ["--data-parallel-size", "2", "--pd-disaggregation"],
}


def main(argv: list[str] | None = None) -> int:
    from tokenmill.catalog import DEFAULT_MODEL

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="catalog alias or GGUF path")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--port", type=int, default=8769)
    args = p.parse_args(argv)

    from tokenmill.bench.serving import BenchConfig, format_comparison, run_benchmark

    path = common.resolve_model(args.model)
    slug = common.model_slug(args.model)
    out = common.RESULTS / f"pd-{slug}.json"
    data: dict[str, object] = {
        "benchmark": "pd",
        "model": args.model,
        "settings": vars(args),
        "command": shlex.join(["python", "benchmarks/pd.py", *(argv or sys.argv[1:])]),
        "machine": common.machine_info(),
        "setups": {},
    }
    results = {}
    for name, flags in SETUPS.items():
        cmd = common.tokenmill_serve_cmd(path, args.port, *flags)
        log_path = out.parent / "logs" / slug / f"pd-{'-'.join(name.split()).lower()}.log"
        with common.Server(name, cmd, args.port, log_path) as server:
            config = BenchConfig(
                base_url=server.url,
                num_prompts=args.num_prompts,
                input_len=args.input_len,
                output_len=args.output_len,
                ignore_eos=True,
                max_concurrency=args.concurrency,
                seed=0,
                label=name,
            )
            results[name] = asyncio.run(run_benchmark(config))
            data["setups"][name] = {"command": shlex.join(cmd), **results[name].metrics()}
    single, pd = data["setups"]["single engine"], data["setups"]["P/D disaggregated"]
    print(format_comparison(results))
    rows = [
        [figure, fmt(pd[key]), fmt(single[key]), fmt_ratio(ratio(pd[key], single[key]))]
        for figure, key in (
            ("p50 TTFT ms", "median_ttft_ms"),
            ("p50 TPOT ms", "median_tpot_ms"),
            ("output tok/s", "output_throughput"),
        )
    ]
    print("\n=== summary (ratio: disaggregated / single) ===")
    print(common.table(["figure", "P/D", "single", "P/D / single"], rows), flush=True)
    common.write_json(out, data)
    return 0


if __name__ == "__main__":
    sys.exit(common.main_guard(main))
