"""A first start of `tokenmill serve` on a machine with empty caches, next to llama-server's start.

On the first start tokenmill builds its C++ kernels for the CPU while it serves on PyTorch's, then
reloads the model onto them, and builds its decode graphs in the background after that; both are
cached (~/.cache/tokenmill, inductor's cache) for later starts.
This script starts `tokenmill serve MODEL` with those caches in new, empty directories
(`XDG_CACHE_HOME` and `TORCHINDUCTOR_CACHE_DIR`; the model file itself is passed by path), sends a
16-token completion as soon as `/health` answers, then one after another until `/health` says the
decode graphs serve ("the fast path"), and a few more after that. It then starts the server again
on the now-filled caches (a later start), and last starts llama-server on the same file and sends
it the same request. The servers run one at a time. Graphs still building at --timeout end the
first start with what it saw so far, and no later start follows.

With --load-streams N, N answers are in flight at once from the first answer on instead, until
the graphs serve and --after-s seconds more: what a busy server's throughput pays for the build.
`--tokenmill-args=--no-compile` gives the same load without any build to set beside it.

Reported, in seconds from the server's start: the first `/health` 200, the first answer, when the
kernels' library appeared in the cache and when the graphs served; the answers' latencies (and,
under load, output tokens a second) while the graphs built and after. Output: a table and
first-start-<model>.json in the results directory (BENCH_RESULTS, default
benchmarks/results/local).

    python benchmarks/first_start.py --model smollm2-135m-instruct
    python benchmarks/first_start.py --model smollm2-135m-instruct --load-streams 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import fmt, log  # noqa: E402

PROMPT = "The capital of France is"
ANSWERS_AFTER_FAST_PATH = 5  # answers timed once the graphs serve, to set beside those before
HEALTH_POLL_S = 0.2  # how often /health is asked while a server starts or its graphs build


def client(connections: int = 1) -> httpx.Client:
    """One client for a run's requests: kept-alive connections, so that the client's own work
    takes little of the cores the server is timed on."""
    return httpx.Client(limits=httpx.Limits(max_connections=connections + 1))


def complete(http: httpx.Client, url: str, max_tokens: int, timeout: float) -> float:
    """Send one greedy completion; return its latency in seconds."""
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    response = http.post(url + "/v1/completions", json=body, timeout=timeout)
    response.raise_for_status()
    return time.perf_counter() - start


def health(http: httpx.Client, url: str) -> dict | None:
    """/health's JSON body, or None while the server does not answer 200."""
    try:
        response = http.get(url + "/health", timeout=2.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return response.json()
    except ValueError:
        return {}


def kernels_built(cache: Path) -> bool:
    return any((cache / "tokenmill" / "kernels").glob("*/tokenmill_kernels.so"))


def latencies(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"count": 0, "p50_s": None, "p90_s": None, "max_s": None}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "p50_s": statistics.median(ordered),
        "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "max_s": ordered[-1],
    }


def building(
    http: httpx.Client, url: str, timeout: float, since: Callable[[], float]
) -> dict[str, object]:
    """/health's body once it no longer says the graphs are building (or at `timeout`); a
    /health that does not answer in time under the load is asked again, not taken for done."""
    state = health(http, url)
    while (state is None or state.get("decode") == "compiling") and since() < timeout:
        time.sleep(HEALTH_POLL_S)
        state = health(http, url)
    return state or {}


def under_load(
    http: httpx.Client, url: str, args: argparse.Namespace, since: Callable[[], float]
) -> dict[str, object]:
    """--load-streams answers in flight at once from the first answer on, until the decode graphs
    serve (tokenmill; at once for a server without them) and --after-s seconds more: the output
    tokens a second and the answers' latencies while the graphs built and after. Each answer asks
    for a length drawn from 1/2 to 3/2 of --max-tokens, so that the streams do not finish in waves
    that a window of time would count whole or not at all."""
    stop = threading.Event()
    finished: list[tuple[float, float, int]] = []  # (when, latency, tokens) of each answer
    failed: list[str] = []

    def stream(seed: int) -> None:
        lengths = random.Random(seed)
        while not stop.is_set():
            tokens = lengths.randint(max(1, args.max_tokens // 2), args.max_tokens * 3 // 2)
            try:
                latency = complete(http, url, tokens, args.timeout)
            except httpx.HTTPError as exc:  # counted and reported: the rates would be too low
                failed.append(repr(exc))
                time.sleep(HEALTH_POLL_S)
                continue
            finished.append((since(), latency, tokens))

    start = since()
    threads = [
        threading.Thread(target=stream, args=(seed,), daemon=True)
        for seed in range(args.load_streams)
    ]
    for thread in threads:
        thread.start()
    state = building(http, url, args.timeout, since)
    built = state.get("decode") != "compiling"
    fast = since()  # when the graphs began to serve, or the timeout
    if built:
        time.sleep(args.after_s)
    else:
        log(f"graphs still building after {args.timeout:g} s: the figures so far")
    end = since()
    stop.set()
    for thread in threads:
        thread.join(args.timeout)

    def rate(t0: float, t1: float) -> float | None:
        tokens = sum(n for when, _, n in finished if t0 <= when < t1)
        return tokens / (t1 - t0) if t1 - t0 >= 1 else None

    result: dict[str, object] = {
        "decode": state.get("decode"),
        "load_streams": args.load_streams,
        "tok_s_while_building": rate(start, fast),
        "tok_s_after": rate(fast, end),
        "answers_while_building": latencies([lat for when, lat, _ in finished if when < fast]),
        "answers_after": latencies([lat for when, lat, _ in finished if fast <= when < end]),
        "failed": len(failed),
    }
    if failed:
        log(f"{len(failed)} answers failed under load, the first: {failed[0]}")
    if "decode" in state and built:
        result["fast_path_s"] = fast
    return result


def start_and_probe(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    port: int,
    log_path: Path,
    args: argparse.Namespace,
    cache: Path | None = None,
) -> dict[str, object]:
    """Start a server, wait for /health, time the first answer, then (tokenmill) keep answering
    until the decode graphs serve. cache: tokenmill's XDG cache, watched for the kernels."""
    if common.port_in_use(port):
        raise RuntimeError(f"port {port} is already in use; pick another")
    url = f"http://127.0.0.1:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"command": shlex.join(cmd)}
    with open(log_path, "w") as out, client(args.load_streams) as http:
        log(f"starting {name}: {shlex.join(cmd)}")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            kernels_s = None
            probed = threading.Event()

            def since() -> float:
                return time.perf_counter() - start

            def watch_kernels() -> None:  # the kernels build while the server answers
                nonlocal kernels_s
                while not probed.wait(HEALTH_POLL_S):
                    if kernels_built(cache):
                        kernels_s = since()
                        return

            watcher = threading.Thread(target=watch_kernels, daemon=True)
            if cache is not None:
                watcher.start()
            while (state := health(http, url)) is None:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {proc.returncode} before it was healthy; see "
                        f"{log_path}:\n{common.tail(log_path)}"
                    )
                if since() > args.timeout:
                    raise RuntimeError(f"{name} not healthy after {args.timeout:g} s")
                time.sleep(HEALTH_POLL_S)
            result["health_s"] = since()
            complete(http, url, args.max_tokens, args.timeout)
            result["first_answer_s"] = since()
            log(
                f"{name}: /health after {result['health_s']:.1f} s, first answer after "
                f"{result['first_answer_s']:.1f} s"
            )
            if args.load_streams:
                result.update(under_load(http, url, args, since))
            else:
                before: list[float] = []
                while (state or {}).get("decode") == "compiling" and since() < args.timeout:
                    before.append(complete(http, url, args.max_tokens, args.timeout))
                    state = health(http, url) or state  # unanswered: ask after the next answer
                result["decode"] = (state or {}).get("decode")
                if "decode" in (state or {}):  # tokenmill: its answers while the graphs built
                    result["answers_while_building"] = latencies(before)
                    if result["decode"] == "compiling":
                        log(f"{name}: graphs still building after {args.timeout:g} s")
                    else:  # its fast path's start, and answers on it
                        result["fast_path_s"] = result["first_answer_s"] if not before else since()
                        after = [
                            complete(http, url, args.max_tokens, args.timeout)
                            for _ in range(ANSWERS_AFTER_FAST_PATH)
                        ]
                        result["answers_after"] = latencies(after)
            probed.set()
            if cache is not None:
                watcher.join()
            result["kernels_s"] = kernels_s
        finally:
            probed.set()
            common.kill_tree(proc)
    return result


HEADERS = [
    "server",
    "/health",
    "first answer",
    "kernels built",
    "fast path",
    "answers meanwhile",
    "p50 meanwhile",
    "p50 after",
    "tok/s meanwhile",
    "tok/s after",
]


def row(name: str, result: dict) -> list[str]:
    """One line of the table for a start's result (summarize.py's too)."""
    during = result.get("answers_while_building") or {}
    after = result.get("answers_after") or {}
    return [
        name,
        fmt(result.get("health_s")),
        fmt(result.get("first_answer_s")),
        fmt(result.get("kernels_s")),
        fmt(result.get("fast_path_s")),
        str(during.get("count", "-")),
        fmt(during.get("p50_s"), 2),
        fmt(after.get("p50_s"), 2),
        fmt(result.get("tok_s_while_building")),
        fmt(result.get("tok_s_after")),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_server_pair_args(p)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per timed answer")
    p.add_argument("--engines", default="tokenmill,llama.cpp")
    p.add_argument("--tokenmill-port", type=int, default=8767)
    p.add_argument("--llama-port", type=int, default=8768)
    p.add_argument("--tokenmill-args", default="", help="extra `tokenmill serve` flags")
    p.add_argument(
        "--load-streams",
        type=int,
        default=0,
        help="answers in flight at once from the first answer on, to time the graphs' build "
        "under load (default: 0, one answer after another)",
    )
    p.add_argument(
        "--after-s",
        type=float,
        default=60,
        help="with --load-streams: seconds of load after the fast path begins",
    )
    p.add_argument("--timeout", type=float, default=1200, help="seconds a start may take in all")
    p.add_argument("--no-build", action="store_true", help="do not build a missing llama-server")
    p.add_argument(
        "--out", default=None, help="JSON path (default: RESULTS/first-start-<model>.json)"
    )
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - {"tokenmill", "llama.cpp"}
    if unknown:
        p.error(f"unknown engines {', '.join(sorted(unknown))}")

    path = common.resolve_model(args.model)
    slug = common.model_slug(args.model)
    out = Path(args.out) if args.out else common.RESULTS / f"first-start-{slug}.json"
    logs = out.parent / "logs" / slug
    data = common.run_record("first-start", "first_start.py", args, path, argv) | {"engines": {}}
    rows = []
    if "tokenmill" in engines:
        cmd = common.tokenmill_serve_cmd(
            path, args.tokenmill_port, "--dtype", args.dtype, *shlex.split(args.tokenmill_args)
        )
        with tempfile.TemporaryDirectory(prefix="tokenmill-first-start-") as empty:
            cache = Path(empty) / "cache"
            env = common.thread_env(args.threads)
            env.update(
                XDG_CACHE_HOME=str(cache), TORCHINDUCTOR_CACHE_DIR=str(Path(empty) / "inductor")
            )
            flags = f" {args.tokenmill_args}" if args.tokenmill_args else ""
            for start, log_name in (("first start", "first-start"), ("later start", "later-start")):
                result = start_and_probe(
                    f"tokenmill{flags} ({start})",
                    cmd,
                    env,
                    args.tokenmill_port,
                    logs / f"tokenmill-{log_name}.log",
                    args,
                    cache if start == "first start" else None,
                )
                data["engines"][f"tokenmill{flags}, {start}"] = result
                rows.append(row(f"tokenmill{flags}, {start}", result))
                if result.get("decode") == "compiling":
                    log("no later start: the first start cached no graphs for it to load")
                    break
    if "llama.cpp" in engines:
        binary = common.ensure_llama(["llama-server"], build=not args.no_build)["llama-server"]
        if binary is None:
            raise RuntimeError(common.missing_llama_hint(["llama-server"]))
        # as many slots as answers in flight, 1,024 tokens of context each (serving.py: 32 x 1,024)
        slots = max(1, args.load_streams)
        cmd = common.llama_server_cmd(
            binary, path, args.llama_port, args.threads, "-np", str(slots), "-c", str(1024 * slots)
        )
        result = start_and_probe(
            "llama-server",
            cmd,
            common.thread_env(args.threads),
            args.llama_port,
            logs / "llama-server-start.log",
            args,
        )
        data["engines"]["llama-server"] = result
        rows.append(row("llama-server", result))

    print(
        f"\nFirst start: {path.name}, {args.threads} threads, {args.max_tokens}-token answers "
        "(seconds from the server's start)\n"
    )
    print(common.table(HEADERS, rows), flush=True)
    common.write_json(out, data)
    return 0


if __name__ == "__main__":
    sys.exit(common.main_guard(main))
