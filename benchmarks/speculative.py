"""Speculative decoding, side by side: `tokenmill serve` without speculation, with prompt lookup
(n-gram) and with a draft model, next to `llama-server` without and with `--model-draft`, on the
same GGUF files and threads, one server at a time.

Two workloads of chat requests, sent one at a time (concurrency 1), greedy, streamed:
- code editing: the prompt holds a Python module to rewrite with a small change, so the answer
  copies most of the prompt (what prompt lookup is for);
- chat: short questions with free answers.
A tokenmill configuration also runs the code-editing workload at concurrency 32, to show what
speculation costs a full batch (it stands down there). Output tok/s is completion tokens over the
wall time of the workload; the first request of each workload is an untimed warm-up.

    python benchmarks/speculative.py  # Qwen2.5-Coder-1.5B target, 0.5B draft
"""

from __future__ import annotations

import argparse
import asyncio
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


async def run_workload(
    url: str, conversations: list[list[dict]], concurrency: int, max_tokens: int
) -> dict:
    import httpx
    import openai

    # a connection per request: llama-server closes idle kept-alive connections, and a request
    # sent on one as it closes fails
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=1800)
    client = openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800, http_client=http
    )

    async def one(messages: list[dict]) -> int:
        stream = await client.chat.completions.create(
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

    await one(conversations[0])  # warm-up
    todo = conversations[1:] * max(1, concurrency // max(len(conversations) - 1, 1))
    gate = asyncio.Semaphore(concurrency)

    async def gated(messages: list[dict]) -> int:
        async with gate:
            return await one(messages)

    start = time.perf_counter()
    tokens = await asyncio.gather(*(gated(m) for m in todo))
    seconds = time.perf_counter() - start
    await client.close()
    return {
        "requests": len(todo),
        "tokens": sum(tokens),
        "seconds": seconds,
        "tok_s": sum(tokens) / seconds,
    }


def servers(args: argparse.Namespace) -> dict[str, tuple[list[str], dict, int]]:
    target, draft = common.resolve_model(args.model), common.resolve_model(args.draft)
    tokenmill = common.tokenmill_serve_cmd(
        target, args.tokenmill_port, "--served-model-name", "default"
    )
    env = common.thread_env(args.threads)
    ngram = {"method": "ngram", "num_speculative_tokens": args.ngram_tokens}
    drafted = {"model": str(draft), "num_speculative_tokens": args.draft_tokens}
    configs = {
        "tokenmill": (tokenmill, env, args.tokenmill_port),
        "tokenmill ngram": (
            tokenmill + ["--speculative-config", json.dumps(ngram)],
            env,
            args.tokenmill_port,
        ),
        "tokenmill draft": (
            tokenmill + ["--speculative-config", json.dumps(drafted)],
            env,
            args.tokenmill_port,
        ),
    }
    binary = common.ensure_llama(["llama-server"], build=not args.no_build)["llama-server"]
    if binary is not None:
        llama = common.llama_server_cmd(
            binary,
            target,
            args.llama_port,
            args.threads,
            "-c",
            "8192",
            "-np",
            "1",
            "--alias",
            "default",
        )
        configs["llama.cpp"] = (llama, env, args.llama_port)
        configs["llama.cpp draft"] = (llama + ["--model-draft", str(draft)], env, args.llama_port)
    return {name: configs[name] for name in args.engines.split(",") if name in configs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ngram-tokens", type=int, default=8, help="K of prompt lookup")
    p.add_argument("--draft-tokens", type=int, default=3, help="K of the draft model")
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
    p.add_argument("--tokenmill-port", type=int, default=8775)
    p.add_argument("--llama-port", type=int, default=8776)
    p.add_argument("--no-build", action="store_true")
    args = p.parse_args(argv)
    results_dir = Path(common.RESULTS)
    out: dict[str, dict] = {}
    for name, (cmd, env, port) in servers(args).items():
        with common.Server(
            name,
            cmd,
            port,
            results_dir / "logs" / f"spec-{name.replace(' ', '-')}.log",
            env=env,
            startup_timeout=1800,
        ) as server:
            runs = {}
            for load in filter(None, args.workloads.split(",")):
                runs[load] = asyncio.run(
                    run_workload(server.url, workload(load), 1, args.max_tokens)
                )
                log(f"{name} {load}: {runs[load]['tok_s']:.1f} tok/s")
            if name in args.batch_check.split(","):
                runs["code-editing c=32"] = asyncio.run(
                    run_workload(server.url, workload("code-editing"), 32, 128)
                )
                log(f"{name} code-editing c=32: {runs['code-editing c=32']['tok_s']:.1f} tok/s")
            out[name] = {"command": shlex.join(cmd), **runs}
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
