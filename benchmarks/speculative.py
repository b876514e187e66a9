"""Speculative decoding, side by side: `tokenmill serve` without speculation, with prompt lookup
(n-gram) and with a draft model, next to `llama-server` without and with `--model-draft`, on the
same GGUF files and threads.

Two workloads of chat requests, sent one at a time (concurrency 1), greedy, streamed:
- code editing: the prompt holds a Python module to rewrite with a small change, so the answer
  copies most of the prompt (what prompt lookup is for);
- chat: short questions with free answers.
A tokenmill configuration also runs the code-editing workload at concurrency 32, to show what
speculation costs a full batch (it stands down there).

Every server runs for the whole benchmark (idle ones use no CPU) and the configurations take turns
request by request (32 at once: workload by workload), in an order that rotates each turn, so a
drift of the machine's speed (which moves single runs minutes apart by up to 15%) falls on all of
them alike. Output tok/s is a configuration's completion tokens over its requests' wall time; each
server's first request is an untimed warm-up.

    python benchmarks/speculative.py  # Qwen2.5-Coder-1.5B target, 0.5B draft
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import fmt, fmt_ratio, log, ratio  # noqa: E402

MODULE = """import json
from pathlib import Path


def load_users(path):
    data = json.loads(Path(path).read_text())
    users = []
    for item in data["users"]:
        name = item["name"].strip()
        email = item["email"].strip().lower()
        age = int(item.get("age", 0))
        users.append({"name": name, "email": email, "age": age})
    return users


def adults(users):
    return [user for user in users if user["age"] >= 18]


def by_domain(users):
    domains = {}
    for user in users:
        domain = user["email"].split("@")[1]
        domains.setdefault(domain, []).append(user["name"])
    return domains


def report(path):
    users = load_users(path)
    grown = adults(users)
    print(f"{len(users)} users, {len(grown)} adults")
    for domain, names in sorted(by_domain(grown).items()):
        print(f"{domain}: {', '.join(sorted(names))}")
"""
EDITS = [
    "Rename the function `load_users` to `read_users` everywhere.",
    "Rename the variable `users` to `people` everywhere.",
    "Add type hints to every function.",
    "Change the adult age from 18 to 21.",
    "Rename `by_domain` to `group_by_domain` everywhere.",
    "Make `report` return the printed lines as a list instead of printing them.",
    'Use `item["age"]` instead of `item.get("age", 0)`.',
    "Add a docstring to every function.",
    "Rename the variable `grown` to `adult_users`.",
]
QUESTIONS = [
    "Explain what a hash map is and when to use one.",
    "What is the difference between a process and a thread?",
    "Give three tips for writing readable Python code.",
    "How does binary search work?",
    "What is a race condition? Give an example.",
    "Explain recursion to a beginner.",
    "What are the pros and cons of using an ORM?",
    "What does a garbage collector do?",
    "How do HTTP cookies work?",
]


def workload(name: str) -> list[list[dict]]:
    if name == "code-editing":
        return [
            [
                {
                    "role": "user",
                    "content": f"{edit} Output the whole module, only code.\n\n```python\n"
                    f"{MODULE}```",
                }
            ]
            for edit in EDITS
        ]
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


async def run_requests(url: str, conversations: list[list[dict]], max_tokens: int) -> dict:
    """The conversations sent all at once; completion tokens and wall seconds."""
    import httpx
    import openai

    # a connection per request: llama-server closes idle kept-alive connections, and a request
    # sent on one as it closes fails
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=1800)
    api = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800, http_client=http
    )

    async def one(messages: list[dict]) -> int:
        stream = await api.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(m) for m in conversations))
    seconds = time.perf_counter() - start
    await api.close()
    return {"tokens": sum(tokens), "seconds": seconds}


def take_turns(urls: dict[str, str], turns: list[list[list[dict]]], max_tokens: int) -> dict:
    """Each turn's conversations (sent at once) on every server, the servers' order rotating
    from turn to turn; per server the totals and its output tok/s."""
    totals = {name: {"requests": 0, "tokens": 0, "seconds": 0.0} for name in urls}
    names = list(urls)
    for i, turn in enumerate(turns):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            run = asyncio.run(run_requests(urls[name], turn, max_tokens))
            totals[name]["requests"] += len(turn)
            totals[name]["tokens"] += run["tokens"]
            totals[name]["seconds"] += run["seconds"]
    for total in totals.values():
        total["tok_s"] = total["tokens"] / total["seconds"]
    return totals


def servers(args: argparse.Namespace) -> dict[str, tuple[list[str], dict, int]]:
    target, draft = common.resolve_model(args.model), common.resolve_model(args.draft)
    env = common.thread_env(args.threads)

    def tokenmill(port: int, *flags: str) -> tuple[list[str], dict, int]:
        cmd = common.tokenmill_serve_cmd(target, port, "--served-model-name", "default", *flags)
        return cmd, env, port

    ngram = {"method": "ngram", "num_speculative_tokens": args.ngram_tokens}
    drafted = {"model": str(draft), "num_speculative_tokens": args.draft_tokens}
    port = args.port
    configs = {
        "tokenmill": tokenmill(port),
        "tokenmill ngram": tokenmill(port + 1, "--speculative-config", json.dumps(ngram)),
        "tokenmill draft": tokenmill(port + 2, "--speculative-config", json.dumps(drafted)),
    }
    binary = common.ensure_llama(["llama-server"], build=not args.no_build)["llama-server"]
    if binary is not None:

        def llama(port: int, *flags: str) -> tuple[list[str], dict, int]:
            cmd = common.llama_server_cmd(
                binary, target, port, args.threads, "-c", "8192", "-np", "1", "--alias", "default"
            )
            return cmd + list(flags), env, port

        configs["llama.cpp"] = llama(port + 3)
        configs["llama.cpp draft"] = llama(port + 4, "--model-draft", str(draft))
    return {name: configs[name] for name in args.engines.split(",") if name in configs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--ngram-tokens",
        type=int,
        default=7,
        help="K of prompt lookup (7: a decode and its drafts fit one compiled step's 8 rows)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=6,
        help="K of the draft model, at most (it stops drafting after an unsure draft)",
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--engines",
        default="tokenmill,tokenmill ngram,tokenmill draft,llama.cpp,llama.cpp draft",
    )
    p.add_argument(
        "--batch-check",
        default="tokenmill,tokenmill ngram",
        help="configurations also run at concurrency 32",
    )
    p.add_argument(
        "--workloads",
        default="code-editing,chat",
        help="workloads run at concurrency 1 (comma-separated; empty: none)",
    )
    p.add_argument("--turns", type=int, default=2, help="times each workload's requests are sent")
    p.add_argument("--port", type=int, default=8775, help="the first of five ports")
    p.add_argument("--no-build", action="store_true")
    args = p.parse_args(argv)
    results_dir = Path(common.RESULTS)
    configs = servers(args)
    out = {name: {"command": shlex.join(cmd)} for name, (cmd, _, _) in configs.items()}
    with contextlib.ExitStack() as stack:
        urls = {}
        for name, (cmd, env, port) in configs.items():
            log_path = results_dir / "logs" / f"spec-{name.replace(' ', '-')}.log"
            server = common.Server(name, cmd, port, log_path, env=env, startup_timeout=1800)
            urls[name] = stack.enter_context(server).url
        for load in filter(None, args.workloads.split(",")):
            warm_up, *timed = workload(load)
            take_turns(urls, [[warm_up]], args.max_tokens)
            runs = take_turns(urls, [[c] for c in timed] * args.turns, args.max_tokens)
            for name, run in runs.items():
                out[name][load] = run
                log(f"{name} {load}: {run['tok_s']:.1f} tok/s")
        batched = {name: urls[name] for name in args.batch_check.split(",") if name in urls}
        if batched:
            _, *timed = workload("code-editing")
            full = [timed * (32 // len(timed)) + timed[: 32 % len(timed)]]
            take_turns(batched, full[:1], 16)  # warm-up
            runs = take_turns(batched, full * args.turns, 128)
            for name, run in runs.items():
                out[name]["code-editing c=32"] = run
                log(f"{name} code-editing c=32: {run['tok_s']:.1f} tok/s")
    loads = ["code-editing", "chat", "code-editing c=32"]
    print(
        common.table(
            [
                "configuration",
                *(f"{load} tok/s" for load in loads),
                "vs tokenmill",
                "vs llama.cpp draft",
            ],
            [
                [
                    name,
                    *(fmt(runs.get(load, {}).get("tok_s")) for load in loads),
                    " / ".join(
                        fmt_ratio(
                            ratio(
                                runs.get(load, {}).get("tok_s"),
                                out.get("tokenmill", {}).get(load, {}).get("tok_s"),
                            )
                        )
                        for load in loads
                    ),
                    " / ".join(
                        fmt_ratio(
                            ratio(
                                runs.get(load, {}).get("tok_s"),
                                out.get("llama.cpp draft", {}).get(load, {}).get("tok_s"),
                            )
                        )
                        for load in loads[:2]
                    ),
                ]
                for name, runs in out.items()
            ],
        )
    )
    common.write_json(
        results_dir / "speculative.json", {"machine": common.machine_info(), "results": out}
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.main_guard(main))
