"""`tokenmill perplexity`: llama-perplexity-compatible perplexity of a model on a text file."""

from __future__ import annotations

import argparse
import sys
import time

from tokenmill.bench.perplexity import perplexity
from tokenmill.cli.common import (
    add_kv_cache_dtype_arg,
    add_model_args,
    load_from_args,
    read_text_arg,
)


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="measure perplexity on a text file (like llama-perplexity)",
        description="Perplexity over non-overlapping chunks of --ctx tokens, scoring the second "
        "half of each chunk, as llama.cpp's llama-perplexity does.",
    )
    add_model_args(p)
    p.add_argument("--file", "-f", required=True, help="text file to score")
    p.add_argument(
        "--ctx", "-c", type=int, default=512, help="chunk length in tokens (default: 512)"
    )
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks")
    p.add_argument(
        "--decode",
        action="store_true",
        help="score each token from a one-token decode step, the kernels generation runs, instead "
        "of from one pass over the chunk",
    )
    add_kv_cache_dtype_arg(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    text = read_text_arg(None, args.file)
    loaded = load_from_args(args)
    ids = loaded.tokenizer.encode(text, parse_special=False)
    start = time.perf_counter()
    print(f"{len(ids)} tokens, {len(ids) // args.ctx} chunks of {args.ctx}", file=sys.stderr)

    def show(i: int, running: float) -> None:
        print(f"[{i + 1}]{running:.4f},", end="", flush=True)

    result = perplexity(
        loaded,
        ids,
        ctx=args.ctx,
        max_chunks=args.chunks,
        on_chunk=show,
        decode=args.decode,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    elapsed = time.perf_counter() - start
    print(
        f"\nFinal estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f}  "
        f"({result.num_scored} tokens scored in {elapsed:.1f} s)"
    )
    return 0
