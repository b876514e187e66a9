"""Offline (no server) speed of tokenmill next to llama.cpp on the same GGUF file, llama-bench
style.

Figures, each the mean over --reps timed repetitions after an untimed warm-up:
  pp512      prompt processing, tokens/s: one 512-token forward pass of one sequence
  tg128      batch-1 decode, tokens/s: 128 steps of one token each after a 16-token prompt,
             including the greedy pick (the engine's `greedy_ids`) that feeds the next step;
             eager, as a first `LLM()` run decodes
  tg128, compiled graphs   the same through the compiled decode graphs, as `LLM()` decodes once
             an earlier run cached them (built first where none did; --no-compiled-tg: skipped)
  decode@B   batched decode, tokens/s = B * 64 / time: B sequences, each with a 128-token prompt
             (prefilled untimed), decode one token per step for 64 steps (greedy pick per sequence)
  peak RSS   the process's peak resident memory (ru_maxrss) after pp/tg and after batched decode

llama.cpp: `llama-bench -p 512 -n 128` (pp512, tg128; random tokens, warm-up run included) and
`llama-batched-bench -npp 128 -ntg 64 -npl 8,32,64` (S_TG t/s, the decode rate of the batch),
each as a separate process whose own peak RSS is read from /proc (VmHWM). Runs are sequential,
never concurrent; pp and tg take turns: each repetition times tokenmill's once, then runs
`llama-bench -r 1` once, so a drift of the machine's speed over the run reaches both engines.
Results: a side-by-side table on stdout, offline-<model>.json in the results directory
(BENCH_RESULTS, default benchmarks/results/local).

    python benchmarks/offline.py --model smollm2-135m-instruct --reps 3
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import MiB, fmt, fmt_ratio, log, ratio  # noqa: E402

if TYPE_CHECKING:
    from tokenmill.engine.model_runner import ModelRunner

PROMPT_FOR_TG = 16  # tokens before the tg run, as a short chat turn would have


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarize(rates: list[float]) -> dict[str, object]:
    return {
        "avg_ts": statistics.fmean(rates),
        "stddev_ts": statistics.stdev(rates) if len(rates) > 1 else 0.0,
        "samples_ts": rates,
    }


# ---------------------------------------------------------------- tokenmill


class TokenmillRuns:
    """tokenmill's `ModelRunner` in this process: `pp_tg_rep` times one repetition of pp and of
    tg (warming each up untimed the first time), `batched` the batched decode figures."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        import psutil
        import torch

        from tokenmill.engine.model_runner import ModelRunner, blocks_needed
        from tokenmill.model.loader import load_model

        torch.set_num_threads(args.threads)
        self.args = args
        t0 = time.perf_counter()
        loaded = load_model(
            path,
            dtype=args.dtype,
            progress=False,
            quantization=args.quantization,
            dense_min_tokens=args.dense_min_tokens,
            batch_invariant=args.batch_invariant,
        )
        load_s = time.perf_counter() - t0
        rss_loaded = psutil.Process().memory_info().rss / MiB
        log(f"tokenmill: loaded {path.name} in {load_s:.2f} s (RSS {rss_loaded:.0f} MiB)")

        self.block_size = bs = 16
        self.per_seq = blocks_needed(args.batch_prompt + args.batch_steps + 4, bs)
        tg_blocks = blocks_needed(PROMPT_FOR_TG + args.tg + 8, bs)
        self.tg_table = [list(range(tg_blocks))]  # the tg sequence's blocks, in either runner
        num_blocks = max(
            blocks_needed(args.pp, bs),
            tg_blocks,
            max(args.batches, default=0) * self.per_seq,
        )
        # torch.empty: pages commit as used
        self.runner = ModelRunner(
            loaded, num_blocks=num_blocks, block_size=bs, compile=args.compile
        )
        t0 = time.perf_counter()
        compiled = self.runner.wait_compiled()
        if args.compile:
            log(
                f"tokenmill: decode graphs compiled={compiled} in {time.perf_counter() - t0:.1f} s"
                + (f" ({self.runner.compile_error!r})" if self.runner.compile_error else "")
            )
        vocab = loaded.config.vocab_size
        self.gen = torch.Generator().manual_seed(0)
        # ordinary tokens, away from the special ones at the start
        self.id_range = (min(1000, vocab // 10), vocab)
        self.out: dict[str, object] = {
            "load_s": load_s,
            "rss_after_load_mib": rss_loaded,
            "decode_mode": self.runner.decode_mode,
            "compile_s": self.runner.compile_seconds,
        }
        self.rates: dict[str, list[float]] = {}
        self.pp_ids: list[int] | None = None
        # per runner: the first decode token after the tg prompt
        self.tg_first: dict[int, int] = {}
        # tg again through the compiled decode graphs, as `LLM()` runs once an earlier run cached
        # them (built now, or loaded from that cache), unless every figure is compiled already
        self.compiled_runner = None
        if args.compiled_tg and args.tg and not args.compile:
            t0 = time.perf_counter()
            runner = ModelRunner(
                loaded,
                num_blocks=tg_blocks,
                block_size=bs,
                compile=True,
            )
            compiled = runner.wait_compiled()
            if runner.compile_error is not None:
                why = f" ({runner.compile_error!r})"
            elif not compiled:  # `ModelRunner._graphs_lose`
                why = " (an earlier run's trials kept the eager steps: LLM() skips the graphs too)"
            else:
                why = ""
            log(
                f"tokenmill: decode graphs for the compiled tg, compiled={compiled} in "
                f"{time.perf_counter() - t0:.1f} s{why}"
            )
            self.compiled_runner = runner if compiled else None
            self.out["compiled_tg_graphs_s"] = runner.compile_seconds

    def random_ids(self, n: int) -> list[int]:
        import torch

        return torch.randint(*self.id_range, (n,), generator=self.gen).tolist()

    def pp_tg_rep(self) -> None:
        """One timed repetition of pp and of tg, each warmed up (untimed) on its first call."""
        from tokenmill.engine.model_runner import blocks_needed
        from tokenmill.sample.sampler import greedy_ids

        args, runner, bs = self.args, self.runner, self.block_size
        # pp: one sequence, args.pp tokens from an empty context (its blocks are simply overwritten)
        if args.pp:
            table = [list(range(blocks_needed(args.pp, bs)))]
            if self.pp_ids is None:
                self.pp_ids = self.random_ids(args.pp)
                runner.last_token_logits([self.pp_ids], [args.pp], table, prompt_tokens=[args.pp])
            t = time.perf_counter()
            logits = runner.last_token_logits(
                [self.pp_ids], [args.pp], table, prompt_tokens=[args.pp]
            )
            int(greedy_ids(logits[:1]))
            self.rates.setdefault(f"pp{args.pp}", []).append(args.pp / (time.perf_counter() - t))
        if args.tg:
            self.tg_rep(runner, f"tg{args.tg}")
            if self.compiled_runner is not None:
                self.tg_rep(self.compiled_runner, f"tg{args.tg}_compiled")
        for name, rates in self.rates.items():
            log(f"tokenmill: {name} {rates[-1]:.1f} tok/s (rep {len(rates)})")

    def tg_rep(self, runner: ModelRunner, name: str) -> None:
        """One timed tg repetition on runner: one sequence decoding greedily, each rep from the
        same position (the prompt's KV stays valid); warmed up untimed on its first call."""
        from tokenmill.sample.sampler import greedy_ids

        tg, table = self.args.tg, self.tg_table

        def decode(first: int, steps: int) -> None:
            token = first
            for i in range(steps):
                logits = runner.last_token_logits([[token]], [PROMPT_FOR_TG + i + 1], table)
                token = int(greedy_ids(logits[:1]))

        first = self.tg_first.get(id(runner))
        if first is None:
            prompt = self.random_ids(PROMPT_FOR_TG)
            logits = runner.last_token_logits(
                [prompt], [PROMPT_FOR_TG], table, prompt_tokens=[PROMPT_FOR_TG]
            )
            first = self.tg_first[id(runner)] = int(greedy_ids(logits[:1]))
            decode(first, 8)  # warm-up
        t = time.perf_counter()
        decode(first, tg)
        self.rates.setdefault(name, []).append(tg / (time.perf_counter() - t))

    def batched(self) -> dict[str, object]:
        """The pp/tg figures so far, then the batched decode ones; the result."""
        from tokenmill.sample.sampler import greedy_ids

        args, runner, per_seq = self.args, self.runner, self.per_seq
        for name, rates in self.rates.items():
            self.out[name] = summarize(rates)
        self.out["peak_rss_pp_tg_mib"] = peak_rss_mib()
        # batched decode: B sequences with disjoint blocks, one token each per step
        for b in args.batches:
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(b)]
            prompts = [self.random_ids(args.batch_prompt) for _ in range(b)]
            # prefill a few sequences at a time, as a scheduler would
            chunk = max(1, 2048 // args.batch_prompt)
            firsts: list[int] = []
            for i in range(0, b, chunk):
                counts = [args.batch_prompt] * len(prompts[i : i + chunk])
                logits = runner.last_token_logits(
                    prompts[i : i + chunk], counts, tables[i : i + chunk], prompt_tokens=counts
                )
                firsts += greedy_ids(logits).tolist()

            def decode_batch(
                steps: int,
                firsts: list[int] = firsts,
                b: int = b,
                tables: list[list[int]] = tables,
            ) -> None:
                tokens = firsts
                for s in range(steps):
                    logits = runner.last_token_logits(
                        [[t] for t in tokens], [args.batch_prompt + s + 1] * b, tables
                    )
                    tokens = greedy_ids(logits).tolist()

            decode_batch(4)  # warm-up
            rates = []
            for _ in range(args.reps):
                t = time.perf_counter()
                decode_batch(args.batch_steps)
                rates.append(b * args.batch_steps / (time.perf_counter() - t))
            self.out[f"decode_b{b}"] = summarize(rates)
            log(f"tokenmill: decode@{b} {self.out[f'decode_b{b}']['avg_ts']:.1f} tok/s")
        self.out["peak_rss_mib"] = peak_rss_mib()
        return self.out


# ---------------------------------------------------------------- llama.cpp


class LlamaRuns:
    """llama.cpp's tools as separate processes: `pp_tg_rep` runs `llama-bench` for one timed
    repetition (after its own warm-up run), `batched` runs `llama-batched-bench`."""

    def __init__(self, path: Path, args: argparse.Namespace) -> None:
        self.path, self.args = path, args
        self.tools = common.ensure_llama(
            ["llama-bench", "llama-batched-bench"], build=not args.no_build
        )
        self.out: dict[str, object] = {"commands": {}, "notes": []}
        self.rates: dict[str, list[float]] = {}
        self.pp_tg_rss = 0.0
        self.pp_tg_wall = 0.0
        if self.tools["llama-bench"] is None:
            self.out["notes"].append(
                "no pp/tg figures for llama.cpp: " + common.missing_llama_hint(["llama-bench"])
            )

    def command(self, tool: str, *options: str) -> list[str]:
        """tool's command line on this model and thread count, then options."""
        return [str(self.tools[tool]), "-m", str(self.path), "-t", str(self.args.threads), *options]

    def pp_tg_rep(self) -> None:
        args = self.args
        if self.tools["llama-bench"] is None or not (args.pp or args.tg):
            return
        cmd = self.command(
            "llama-bench",
            "-p",
            str(args.pp),
            "-n",
            str(args.tg),
            "-r",
            "1",
            "-o",
            "json",
        )
        self.out["commands"]["llama-bench"] = shlex.join(cmd) + f"  # {args.reps} times"
        log(f"llama.cpp: {shlex.join(cmd)}")
        rc, stdout, stderr, wall, rss = common.run_measured(cmd, timeout=args.timeout)
        if rc:
            raise RuntimeError(f"llama-bench failed ({rc}):\n{stderr[-3000:]}")
        tests = json.loads(stdout)
        for t in tests:
            name = f"pp{t['n_prompt']}" if t["n_gen"] == 0 else f"tg{t['n_gen']}"
            self.rates.setdefault(name, []).append(t["avg_ts"])
            log(f"llama.cpp: {name} {t['avg_ts']:.1f} tok/s (rep {len(self.rates[name])})")
        first = tests[0] if tests else {}
        self.out["build"] = {
            k: first.get(k)
            for k in (
                "build_commit",
                "build_number",
                "cpu_info",
                "model_type",
                "model_size",
                "n_threads",
                "flash_attn",
                "type_k",
                "n_batch",
            )
        }
        self.pp_tg_rss = max(self.pp_tg_rss, rss)
        self.pp_tg_wall += wall

    def batched(self) -> dict[str, object]:
        """The pp/tg figures so far, then the batched decode ones; the result."""
        args, out = self.args, self.out
        for name, rates in self.rates.items():
            out[name] = summarize(rates)
        if self.rates:
            out["peak_rss_pp_tg_mib"] = self.pp_tg_rss
            out["wall_s_llama_bench"] = self.pp_tg_wall
        if not args.batches:
            return out
        if self.tools["llama-batched-bench"] is None:
            build_dir = common.LLAMA_PREFIX / "build"
            how = (
                f"build it: cmake --build {build_dir} --target llama-batched-bench"
                if (build_dir / "CMakeCache.txt").is_file()
                else common.missing_llama_hint(["llama-batched-bench"])
            )
            out["notes"].append(f"no batched decode figures for llama.cpp: {how}")
            return out
        ctx = max(args.batches) * (args.batch_prompt + args.batch_steps)
        cmd = self.command(
            "llama-batched-bench",
            "-tb",
            str(args.threads),
            "-c",
            str(ctx),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            str(args.batch_prompt),
            "-ntg",
            str(args.batch_steps),
            "-npl",
            ",".join(map(str, args.batches)),
            "--output-format",
            "jsonl",
        )
        out["commands"]["llama-batched-bench"] = shlex.join(cmd)
        rates: dict[int, list[float]] = {b: [] for b in args.batches}
        peak = 0.0
        for rep in range(args.reps):  # it has no repetition option: run it --reps times
            log(f"llama.cpp ({rep + 1}/{args.reps}): {shlex.join(cmd)}")
            rc, stdout, stderr, wall, rss = common.run_measured(cmd, timeout=args.timeout)
            if rc:
                raise RuntimeError(f"llama-batched-bench failed ({rc}):\n{stderr[-3000:]}")
            peak = max(peak, rss)
            for line in (stdout + "\n" + stderr).splitlines():
                line = line.strip()
                if line.startswith("{") and '"speed_tg"' in line:
                    row = json.loads(line)
                    rates.setdefault(row["pl"], []).append(row["speed_tg"])
        for b in args.batches:
            if rates.get(b):
                out[f"decode_b{b}"] = summarize(rates[b])
                log(f"llama.cpp: decode@{b} {out[f'decode_b{b}']['avg_ts']:.1f} tok/s")
            else:
                out["notes"].append(f"llama-batched-bench reported nothing for B={b}")
        out["peak_rss_mib"] = peak
        return out


# ---------------------------------------------------------------- report


def figures(args: argparse.Namespace) -> list[tuple[str, str, str, str]]:
    """(key, caption, unit, llama.cpp's key) of the headline figures, in table order."""
    rows = []
    if args.pp:
        rows.append((f"pp{args.pp}", f"pp{args.pp} (prompt, batch 1)", "tok/s", f"pp{args.pp}"))
    if args.tg:
        tg = f"tg{args.tg}"
        rows.append((tg, f"{tg} (decode, batch 1)", "tok/s", tg))
        if args.compiled_tg and not args.compile:
            rows.append((f"{tg}_compiled", f"{tg}, compiled graphs", "tok/s", tg))
    rows += [(f"decode_b{b}", f"decode @ batch {b}", "tok/s", f"decode_b{b}") for b in args.batches]
    rows += [
        ("peak_rss_pp_tg_mib", "peak RSS, pp/tg", "MiB", "peak_rss_pp_tg_mib"),
        ("peak_rss_mib", "peak RSS, all", "MiB", "peak_rss_mib"),
    ]
    return rows


def value(result: dict | None, key: str) -> float | None:
    if not result or key not in result:
        return None
    v = result[key]
    return v["avg_ts"] if isinstance(v, dict) else v


def format_table(data: dict, args: argparse.Namespace) -> str:
    tm, lc = data["results"].get("tokenmill"), data["results"].get("llama.cpp")
    rows = []
    for key, caption, unit, peer_key in figures(args):
        a, b = value(tm, key), value(lc, peer_key)
        sd = ""
        if tm and isinstance(tm.get(key), dict) and tm[key]["stddev_ts"]:
            sd = f" ±{tm[key]['stddev_ts']:.1f}"
        rows.append([f"{caption} [{unit}]", fmt(a) + sd, fmt(b), fmt_ratio(ratio(a, b))])
    return common.table(["figure", "tokenmill", "llama.cpp", "tokenmill/llama.cpp"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="catalog alias or GGUF path")
    common.add_dtype_arg(p)
    p.add_argument(
        "--quantization", default="auto", choices=["auto", "gguf", "none", "int8", "int4"]
    )
    p.add_argument(
        "--dense-min-tokens",
        type=int,
        default=None,
        help="keep dense copies of quantized layers for batches of at least this many tokens",
    )
    p.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tokenmill's default; --no-batch-invariant lets the batch size pick the kernels",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--compile", action="store_true", help="compile tokenmill's decode step (see ModelRunner)"
    )
    p.add_argument(
        "--compiled-tg",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time tg through the compiled decode graphs, as LLM() runs once they are cached "
        "(builds them first where no earlier run cached them: minutes)",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--pp", type=int, default=512, help="prompt length of the pp test (0: skip)")
    p.add_argument("--tg", type=int, default=128, help="decode steps of the tg test (0: skip)")
    p.add_argument(
        "--batches", default="8,32,64", help="batch sizes of the batched decode test ('' : skip)"
    )
    p.add_argument(
        "--batch-prompt",
        type=int,
        default=128,
        help="prompt tokens per sequence before batched decode",
    )
    p.add_argument("--batch-steps", type=int, default=64, help="decode steps of the batched test")
    p.add_argument("--engines", default="tokenmill,llama.cpp")
    p.add_argument("--no-build", action="store_true", help="do not build missing llama.cpp tools")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per llama.cpp run")
    p.add_argument("--out", default=None, help="JSON path (default: RESULTS/offline-<model>.json)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]

    path = common.resolve_model(args.model)
    data = common.run_record("offline", "offline.py", args, path, argv) | {"results": {}}
    results: dict[str, dict] = data["results"]  # type: ignore[assignment]
    runs: dict[str, TokenmillRuns | LlamaRuns] = {}
    if "tokenmill" in engines:
        runs["tokenmill"] = TokenmillRuns(path, args)
    if "llama.cpp" in engines:
        runs["llama.cpp"] = LlamaRuns(path, args)
    # pp and tg: the engines take turns, one repetition each, so that the machine's drifts (a
    # shared VM's memory speed moves over minutes) reach both engines' figures alike
    for _ in range(args.reps):
        for engine in runs.values():
            engine.pp_tg_rep()
    for name, engine in runs.items():
        results[name] = engine.batched()
    data["ratios"] = {
        key: ratio(value(results.get("tokenmill"), key), value(results.get("llama.cpp"), peer_key))
        for key, _, _, peer_key in figures(args)
    }

    print(
        f"\nOffline benchmark: {path.name}, {args.threads} threads, tokenmill {args.dtype} "
        f"quantization={args.quantization} dense_min_tokens={args.dense_min_tokens} "
        f"batch_invariant={args.batch_invariant} "
        f"decode={results.get('tokenmill', {}).get('decode_mode')}, {args.reps} reps"
    )
    print(format_table(data, args), flush=True)
    for note in results.get("llama.cpp", {}).get("notes", []):
        print(f"note: {note}")
    out = (
        Path(args.out)
        if args.out
        else common.RESULTS / f"offline-{common.model_slug(args.model)}.json"
    )
    common.write_json(out, data)
    return 0


if __name__ == "__main__":
    sys.exit(common.main_guard(main))
