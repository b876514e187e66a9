"""Build a suite's summary.md from the JSON results of the suite's scripts.

Reads RESULTS/{offline,serving,prefix-cache,first-start}-*.json and writes RESULTS/summary.md
beside them: the headline tables (tokenmill / llama.cpp), the machine and the exact commands. The
JSON and logs stay uncommitted; the summary (and the serving PNGs) are what a suite keeps in git.

    python benchmarks/summarize.py [--results DIR]   (default: BENCH_RESULTS or results/local)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, fmt, fmt_ratio, ratio  # noqa: E402
from first_start import HEADERS as FIRST_START_HEADERS  # noqa: E402
from first_start import row as first_start_row  # noqa: E402

HOME = str(Path.home())


def load(results: Path, prefix: str) -> list[dict]:
    out = []
    for path in sorted(results.glob(f"{prefix}-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
    return out


def md_table(headers: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def short(cmd: str) -> str:
    """A command as recorded, with the home directory as ~ and the tokenmill console script by
    name."""
    return re.sub(r"\S*/bin/tokenmill ", "tokenmill ", cmd).replace(HOME, "~")


def avg(result: dict | None, key: str) -> float | None:
    v = (result or {}).get(key)
    return v.get("avg_ts") if isinstance(v, dict) else v


def offline_section(runs: list[dict]) -> tuple[str, list[str]]:
    rows, cmds = [], []
    for d in runs:
        s, res = d["settings"], d["results"]
        tm, lc = res.get("tokenmill"), res.get("llama.cpp")
        keys = []  # (caption, tokenmill's key, llama.cpp's key, digits)
        if s.get("pp"):
            keys.append((f"pp{s['pp']} tok/s", f"pp{s['pp']}", f"pp{s['pp']}", 1))
        if s.get("tg"):
            tg = f"tg{s['tg']}"
            keys.append((f"{tg} tok/s", tg, tg, 1))
            if f"{tg}_compiled" in (tm or {}):  # against llama.cpp's one tg figure
                keys.append((f"{tg} tok/s, compiled graphs", f"{tg}_compiled", tg, 1))
        keys += [
            (f"decode @ batch {b} tok/s", f"decode_b{b}", f"decode_b{b}", 1)
            for b in s.get("batches", [])
        ]
        keys += [
            ("peak RSS pp/tg MiB", "peak_rss_pp_tg_mib", "peak_rss_pp_tg_mib", 0),
            ("peak RSS all MiB", "peak_rss_mib", "peak_rss_mib", 0),
        ]
        for caption, key, peer_key, digits in keys:
            a, b = avg(tm, key), avg(lc, peer_key)
            rows.append(
                [d["model_file"], caption, fmt(a, digits), fmt(b, digits), fmt_ratio(ratio(a, b))]
            )
        cmds.append(d["command"])
        cmds += [short(c) for c in (lc or {}).get("commands", {}).values()]
        for note in (lc or {}).get("notes", []):
            cmds.append(f"# note: {short(note)}")
    text = md_table(
        ["model", "figure", "tokenmill", "llama.cpp", "tokenmill / llama.cpp"], rows, "llrrr"
    )
    if runs:
        s = runs[0]["settings"]
        text = (
            f"tokenmill: dtype {s['dtype']}, quantization {s['quantization']}, dense_min_tokens "
            f"{s['dense_min_tokens']}, {s['threads']} threads, {s['reps']} reps. "
            "Higher tok/s is better; "
            "lower RSS is better.\n\n" + text
        )
    return text, cmds


def serving_section(runs: list[dict]) -> tuple[str, list[str]]:
    rows, extra, cmds = [], [], []
    for d in runs:
        tm, lc = d["engines"].get("tokenmill"), d["engines"].get("llama.cpp")
        concurrency = list((tm or lc or {}).get("runs", {}))
        for c in concurrency:
            row = [d["model_file"], c, str((tm or lc)["runs"][c]["num_prompts"])]
            for key, digits in (
                ("output_throughput", 1),
                ("median_ttft_ms", 0),
                ("median_tpot_ms", 1),
            ):
                a = tm["runs"][c][key] if tm else None
                b = lc["runs"][c][key] if lc else None
                row += [fmt(a, digits), fmt(b, digits), fmt_ratio(ratio(a, b))]
            failed = sum(int(e["runs"][c]["failed"]) for e in (tm, lc) if e)
            row.append(str(failed))
            rows.append(row)
        for key, caption, digits in (
            ("startup_s", "startup to first /health 200 (s)", 2),
            ("peak_rss_mib", "server peak RSS (MiB)", 0),
        ):
            a, b = (tm or {}).get(key), (lc or {}).get(key)
            extra.append(
                [d["model_file"], caption, fmt(a, digits), fmt(b, digits), fmt_ratio(ratio(a, b))]
            )
        cmds.append(d["command"])
        cmds += [short(e["command"]) for e in (tm, lc) if e]
    headers = [
        "model",
        "C",
        "prompts",
        "out tok/s TM",
        "out tok/s llama",
        "ratio",
        "p50 TTFT ms TM",
        "p50 TTFT ms llama",
        "ratio",
        "p50 TPOT ms TM",
        "p50 TPOT ms llama",
        "ratio",
        "failed",
    ]
    text = md_table(headers, rows, "lrr" + "r" * 10)
    if runs:
        w = runs[0]["workload"]
        text = (
            f"Workload: {w['endpoint']}, ~{w['input_len']}-token random-word prompts, "
            f"{w['output_len']} output tokens, ignore_eos, temperature 0, C requests in flight. "
            "TM = tokenmill, llama = llama-server; "
            "ratio = tokenmill / llama.cpp (higher is better for tok/s, lower for TTFT/TPOT).\n\n"
            + text
            + "\n\n"
            + md_table(
                ["model", "figure", "tokenmill", "llama.cpp", "tokenmill / llama.cpp"],
                extra,
                "llrrr",
            )
        )
    return text, cmds


def prefix_section(runs: list[dict]) -> tuple[str, list[str]]:
    rows, cmds = [], []
    for d in runs:
        c, u = d["modes"]["prefix cache"], d["modes"]["no prefix cache"]
        pc = c.get("prefix_counters", {})
        hit = ratio(pc.get("prefix_cache_hits"), pc.get("prefix_cache_queries"))
        rows.append(
            [
                d["model_file"],
                fmt(c["mean_ttft_ms"]),
                fmt(u["mean_ttft_ms"]),
                fmt_ratio(ratio(u["mean_ttft_ms"], c["mean_ttft_ms"])),
                fmt(c["median_ttft_ms"]),
                fmt(u["median_ttft_ms"]),
                "-" if hit is None else fmt(100 * hit),
            ]
        )
        cmds.append(d["command"])
        cmds += [short(m["command"]) for m in (c, u)]
    text = md_table(
        [
            "model",
            "mean TTFT ms, cache",
            "mean TTFT ms, no cache",
            "speedup",
            "p50 TTFT ms, cache",
            "p50 TTFT ms, no cache",
            "prefix hit rate %",
        ],
        rows,
    )
    if runs:
        s = runs[0]["settings"]
        text = (
            f"{s['prefix_len']}-token shared prefix + ~{s['question_len']}-token distinct "
            f"question, {s['num_prompts']} requests at concurrency {s['concurrency']}, "
            f"{s['output_len']} output tokens; "
            "`tokenmill serve` with and without `--no-prefix-caching`.\n\n" + text
        )
    return text, cmds


def first_start_section(runs: list[dict]) -> tuple[str, list[str]]:
    rows, cmds = [], []
    for d in runs:
        for name, result in d["engines"].items():
            rows.append([d["model_file"], *first_start_row(name, result)])
        cmds.append(d["command"])
        cmds += list(dict.fromkeys(short(e["command"]) for e in d["engines"].values()))
    text = md_table(["model", *FIRST_START_HEADERS], rows, "ll" + "r" * 9)
    if runs:
        settings = runs[0]["settings"]
        streams = settings.get("load_streams")
        after = " or ".join(sorted({f"{d['settings'].get('after_s', 0):g}" for d in runs}))
        tokens = settings["max_tokens"]
        sent = (
            f"Greedy answers of {max(1, tokens // 2)}-{tokens * 3 // 2} tokens, {streams} at a "
            "time, from the first answer until the decode graphs serve (the fast path) and "
            f"{after} s after"
            if streams
            else f"{tokens}-token greedy answers, one at a time, from the first /health 200 until "
            "the decode graphs serve (the fast path) and a few after"
        )
        text = (
            "Seconds from the server's start. tokenmill's first start has empty caches (kernels, "
            "decode graphs; the model file is given by path), its later start the caches the "
            f"first one filled. {sent}; their latencies in seconds, their output tokens a "
            "second.\n\n" + text
        )
    return text, cmds


def machine_section(all_runs: list[dict]) -> str:
    if not all_runs:
        return ""
    m = all_runs[0]["machine"]
    dates = sorted(d["machine"]["date"] for d in all_runs)
    loads = [d["machine"].get("load_avg_1m_at_start") for d in all_runs]
    llama = (
        next(
            (
                d["results"]["llama.cpp"].get("build")
                for d in all_runs
                if d.get("benchmark") == "offline" and "llama.cpp" in d.get("results", {})
            ),
            None,
        )
        or {}
    )
    isa = f", ISA: {' '.join(m['isa'])}" if m.get("isa") else ""
    lines = [
        f"- CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs{isa})",
        f"- tokenmill git {m['tokenmill_git']}, torch {m['torch']}, Python {m['python']}",
        (
            f"- llama.cpp build {llama['build_commit']} (as llama-bench reports it)"
            if llama.get("build_commit")
            else "- llama.cpp: no llama-bench run"
        ),
        f"- runs from {dates[0]} to {dates[-1]}; "
        "1-minute load average at the start of each script: "
        + ", ".join("-" if x is None else f"{x:.2f}" for x in loads),
    ]
    return "\n".join(lines)


def build(results: Path) -> str:
    offline, serving, prefix, first_start = (
        load(results, "offline"),
        load(results, "serving"),
        load(results, "prefix-cache"),
        load(results, "first-start"),
    )
    all_runs = offline + serving + prefix + first_start
    threads = {d["settings"].get("threads") for d in all_runs} - {None}
    threads_text = " / ".join(str(t) for t in sorted(threads)) or "the same"
    parts = [
        "# Benchmark summary: tokenmill vs llama.cpp",
        "",
        "Generated by `benchmarks/summarize.py` from the suite's JSON results "
        "(`benchmarks/run_all.sh` runs everything; see `benchmarks/README.md`). "
        "Same GGUF file "
        f"and {threads_text} threads for both engines; one engine at a time.",
        "",
        machine_section(all_runs),
    ]
    suite = os.environ.get("BENCH_SUITE_COMMAND")  # set by run_all.sh
    commands: list[str] = [suite] if suite else []
    for title, runs, section in (
        ("Offline (llama-bench style)", offline, offline_section),
        ("Serving (OpenAI-compatible server, streaming)", serving, serving_section),
        ("Prefix caching (tokenmill only)", prefix, prefix_section),
        ("First start (empty caches) and later start", first_start, first_start_section),
    ):
        parts += ["", f"## {title}", ""]
        if runs:
            text, cmds = section(runs)
            parts.append(text)
            commands += cmds
        else:
            parts.append("_no results_")
    parts += ["", "## Exact commands", "", "```sh", *commands, "```", ""]
    return "\n".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--results",
        default=str(RESULTS),
        help="directory of the suite's JSON results "
        "(default: $BENCH_RESULTS, else benchmarks/results/local)",
    )
    args = p.parse_args()
    results = Path(args.results)
    if not any(results.glob("*.json")):
        p.error(f"no JSON results in {results}: run the suite there first (benchmarks/run_all.sh)")
    out = results / "summary.md"
    out.write_text(build(results))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
