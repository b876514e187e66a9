"""Fair scheduling, side by side: tenant A keeps many long requests in flight while tenant B sends
one short request a second; B's time to first token under `--scheduling-policy fair` (alone, and
with `--max-running-per-tenant`) and `fcfs`, against B's on an idle server, with A's output
tokens per second beside it. Tenants are told apart by API key (`--api-keys-file`).

    python benchmarks/fairness.py  # SmolLM2, A: 64 streams of 256 tokens, B: 20 requests

Goal (issue 40): B's p50 TTFT under fair <= 1.5x its TTFT on the idle server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import fmt, fmt_ratio, log, ratio  # noqa: E402

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
B_PROMPT = "In one sentence, what is a hash map?"


async def _ttft(client, key: str, prompt: str, max_tokens: int) -> float:
    """Seconds from sending a streamed chat request to its first content."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }
    start = time.perf_counter()
    first = None
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter() - start
    return first if first is not None else float("nan")


async def _flood(client, stop: asyncio.Event, streams: int, max_tokens: int) -> int:
    """Tenant A: `streams` long requests in flight until stop; returns those completed."""
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        while not stop.is_set():
            prompt = f"Write a long story about a lighthouse keeper, part {i}."
            await _ttft(client, "key-a", prompt, max_tokens)
            done += 1

    tasks = [asyncio.create_task(one(i)) for i in range(streams)]
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return done


async def _measure(url: str, args: argparse.Namespace, loaded: bool) -> tuple[list[float], float]:
    """B's TTFTs, one request a second, with A's flood running or not, and A's output tokens per
    second meanwhile (its completed requests')."""
    import httpx

    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await _ttft(client, "key-b", B_PROMPT, args.b_tokens)  # warm-up
        stop = asyncio.Event()
        flood = asyncio.create_task(_flood(client, stop, args.streams, args.a_tokens))
        if loaded:
            await asyncio.sleep(args.ramp)  # A's streams all running
        else:
            stop.set()
        start, times = time.perf_counter(), []
        for _ in range(args.b_requests):
            started = time.perf_counter()
            times.append(await _ttft(client, "key-b", B_PROMPT, args.b_tokens))
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))
        stop.set()
        seconds = time.perf_counter() - start
        completed = await flood
    return times, completed * args.a_tokens / seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--streams", type=int, default=64, help="tenant A's requests in flight")
    p.add_argument("--a-tokens", type=int, default=256, help="tokens of each of A's requests")
    p.add_argument("--b-requests", type=int, default=20, help="tenant B's requests, one a second")
    p.add_argument("--b-tokens", type=int, default=16)
    p.add_argument("--ramp", type=float, default=5.0, help="seconds for A's streams to start")
    p.add_argument(
        "--tenant-limit", type=int, default=8, help="fair: --max-running-per-tenant of a run"
    )
    p.add_argument("--port", type=int, default=8777)
    args = p.parse_args(argv)
    model = common.resolve_model(args.model)
    results_dir = Path(common.RESULTS)
    rows, summary = [], {"machine": common.machine_info()}
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.json"
        keys.write_text(json.dumps(KEYS))
        idle = None
        runs = [
            ("fair", []),
            (
                f"fair, {args.tenant_limit} per tenant",
                ["--max-running-per-tenant", str(args.tenant_limit)],
            ),
            ("fcfs", []),
        ]
        for name, extra in runs:
            policy = name.split(",")[0]
            cmd = common.tokenmill_serve_cmd(
                model,
                args.port,
                "--served-model-name",
                "default",
                "--scheduling-policy",
                policy,
                "--api-keys-file",
                str(keys),
                *extra,
            )
            log_path = results_dir / f"fairness-{policy}-{len(extra)}.log"
            env = common.thread_env(args.threads)
            with common.Server(f"tokenmill {name}", cmd, args.port, log_path, env=env) as server:
                if idle is None:
                    idle = statistics.median(asyncio.run(_measure(server.url, args, False))[0])
                    log(f"B alone: p50 TTFT {idle * 1000:.1f} ms")
                times, a_tok_s = asyncio.run(_measure(server.url, args, True))
            p50 = statistics.median(times)
            log(f"{name}: B's p50 TTFT {p50 * 1000:.1f} ms under A's {args.streams} streams")
            rows.append(
                [name, fmt(idle * 1000), fmt(p50 * 1000), fmt_ratio(ratio(p50, idle)), fmt(a_tok_s)]
            )
            summary[name] = {
                "idle_ttft_s": idle,
                "p50_ttft_s": p50,
                "ttfts_s": times,
                "a_tok_s": a_tok_s,
            }
    headers = ["policy", "B idle p50 ms", "B loaded p50 ms", "loaded / idle", "A out tok/s"]
    print(common.table(headers, rows))
    common.write_json(results_dir / "fairness.json", summary)
    return 0


if __name__ == "__main__":
    sys.exit(common.main_guard(main))
