"""The mixture-of-experts feed-forward's time per step against the number of experts and top-k.

One MoE block (model/moe.py) with random int4-packed experts (as a Q4 GGUF loads) runs steps of
1 token (a decode), 16 and 128 tokens (prompt chunks). Each step's pairs are grouped by expert and
each picked expert runs once over its rows, so the time should follow tokens x top_k (and the
number of distinct experts picked, each a kernel call) and not the number of experts: with 1 token
and top-2, 8 and 128 experts should cost the same. The table prints the median time per step in
milliseconds and, beside it, the experts that ran.

    python benchmarks/moe.py
    python benchmarks/moe.py --threads 1  # on a machine shared with other jobs
    python benchmarks/moe.py --hidden 2048 --width 1024 --experts 8,64 --top-k 2,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tokenmill.model import kernels
from tokenmill.model.config import ModelConfig, MoESettings
from tokenmill.model.moe import MoE
from tokenmill.model.quant_linear import QuantLinear, quantize_int4
from tokenmill.model.transformer import MLP


def packed(rows: int, cols: int) -> QuantLinear:
    weight = torch.randn(rows, cols) * cols**-0.5
    return QuantLinear(rows, cols, torch.float32, int4=quantize_int4(weight))


def moe_block(hidden: int, width: int, experts: int, top_k: int) -> MoE:
    settings = MoESettings(num_experts=experts, top_k=top_k, intermediate_size=width)
    cfg = ModelConfig(
        architecture="bench",
        vocab_size=1,
        hidden_size=hidden,
        intermediate_size=width,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=hidden,
        moe=settings,
    )
    with torch.device("meta"):
        block = MoE(cfg, lambda w: MLP(cfg, w))
    block.router = torch.nn.Linear(hidden, experts, bias=False)
    for expert in block.experts:
        expert.gate_up_proj = packed(2 * width, hidden)
        expert.down_proj = packed(hidden, width)
    return block.eval()


def time_step(block: MoE, tokens: int, reps: int) -> tuple[float, int]:
    """Median seconds per step over reps (fresh random tokens each), and the experts run in the
    last step."""
    times, used = [], 0
    with torch.inference_mode():
        for rep in range(reps + 1):
            x = torch.randn(tokens, block.router.in_features)
            start = time.perf_counter()
            block(x)
            if rep:  # the first step warms up
                times.append(time.perf_counter() - start)
            _, picked = block.router(x).topk(block.settings.top_k, dim=-1)
            used = len(picked.unique())
    return statistics.median(times), used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=256, help="each expert's intermediate size")
    parser.add_argument("--experts", default="8,32,128")
    parser.add_argument("--top-k", default="1,2,8")
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    kernels.load()
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(
        f"MoE block: hidden {args.hidden}, expert width {args.width}, int4 experts, fp32, "
        f"{args.threads} threads, load average {os.getloadavg()[0]:.1f}"
    )
    header = "| experts | top-k | " + " | ".join(f"{t} tok: ms (experts run)" for t in token_counts)
    print(header + " |")
    print("|" + " ---: |" * (2 + len(token_counts)))
    for experts in (int(e) for e in args.experts.split(",")):
        for top_k in (int(k) for k in args.top_k.split(",")):
            if top_k > experts:
                continue
            block = moe_block(args.hidden, args.width, experts, top_k)
            cells = []
            for tokens in token_counts:
                seconds, used = time_step(block, tokens, args.reps)
                cells.append(f"{seconds * 1e3:.2f} ({used})")
            print(f"| {experts} | {top_k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
