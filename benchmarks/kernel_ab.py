"""The GEMVs of gemv.cpp at a git revision against the working tree's, in one process.

On a shared VM a kernel's speed moves by 10-30% from one process to the next (other tenants, the
clock, steal time), more than most changes to it are worth, so timing two builds in turn decides
nothing. This compiles both versions of gemv.cpp (with their simd.h and ops.h) into one extension,
each in a namespace of its own, and times them in alternating rounds on the same tensors: each
round gives a ratio new / base, and the table prints their median beside the best times. Random
weights of the catalog models' shapes go to the row GEMVs (`int4_rows_linear`, with and without
5-bit planes, `int6_rows_linear`) and the int8 one (`int8_linear`); the tile kernels of CPUs with
AVX-512 VNNI are not covered. The build takes a minute or two.

    python benchmarks/kernel_ab.py --base HEAD
    python benchmarks/kernel_ab.py --base HEAD~3 --threads 2 --rows 1,32
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import cpp_extension

from tokenmill.model import kernels

KERNELS = Path(kernels.__file__).parent
# the headers first: gemv.cpp includes them
SOURCES = [*(header.name for header in kernels.HEADERS), "gemv.cpp"]
# per op: (rows N, columns K) of layers of Gemma 3 270M, SmolLM2-135M and Qwen2.5-Coder-1.5B
SHAPES = {
    "int4": [(2048, 640), (640, 2048), (1536, 576), (8960, 1536)],
    "int5": [(2048, 640)],
    "int6": [(640, 2048), (1536, 8960)],
    "int8": [(8192, 640)],
}
CALLS = {  # the op's call in C++, on the arguments the Python side passes
    "int4": "tokenmill::int4_rows_linear(x, w[0], w[1], w[2], std::nullopt, std::nullopt, 1 << 30)",
    "int5": "tokenmill::int4_rows_linear(x, w[0], w[1], w[2], w[3], std::nullopt, 1 << 30)",
    "int6": "tokenmill::int6_rows_linear(x, w[0], w[1], w[2], w[3], std::nullopt, 1 << 30)",
    "int8": "tokenmill::int8_linear(x, w[0], w[1], std::nullopt, 1 << 30, 1 << 30)",
}


def version_text(read: Callable[[str], str], namespace: str) -> tuple[set[str], str]:
    """One version's sources as (their system includes, the rest wrapped in `namespace`)."""
    includes, body = set(), []
    for name in SOURCES:
        for line in read(name).splitlines():
            if line.startswith("#include <"):
                includes.add(line)
            elif not line.startswith(('#include "', "#pragma once")):
                body.append(line)
    return includes, f"namespace {namespace} {{\n" + "\n".join(body) + "\n}\n"


def extension_source(base: str) -> str:
    root = repo_root()

    def at_base(name: str) -> str:
        path = (KERNELS / name).relative_to(root)
        return subprocess.run(
            ["git", "show", f"{base}:{path}"], check=True, capture_output=True, text=True, cwd=root
        ).stdout

    base_includes, base_body = version_text(at_base, "base")
    new_includes, new_body = version_text(lambda name: (KERNELS / name).read_text(), "changed")
    timing = "\n".join(
        f"""std::vector<double> {kind}(at::Tensor x, std::vector<at::Tensor> w, int64_t reps,
    int64_t rounds) {{
  return alternate([&] {{ base::{CALLS[kind]}; }}, [&] {{ changed::{CALLS[kind]}; }}, reps, rounds);
}}"""
        for kind in CALLS
    )
    return (
        "\n".join(sorted(base_includes | new_includes | {"#include <chrono>"}))
        + f"""
{base_body}
{new_body}
// per round: the base's seconds per call, then the changed version's; odd rounds run the changed
// version first, so that neither gains from going second (caches, the clock)
template <typename Call>
double seconds_per_call(const Call& call, int64_t reps) {{
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i) call();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / reps;
}}
template <typename Base, typename Changed>
std::vector<double> alternate(Base base_call, Changed changed_call, int64_t reps, int64_t rounds) {{
  std::vector<double> seconds;
  for (int64_t r = 0; r < rounds; ++r) {{
    double base, changed;
    if (r % 2 == 0) {{
      base = seconds_per_call(base_call, reps);
      changed = seconds_per_call(changed_call, reps);
    }} else {{
      changed = seconds_per_call(changed_call, reps);
      base = seconds_per_call(base_call, reps);
    }}
    seconds.push_back(base);
    seconds.push_back(changed);
  }}
  return seconds;
}}
{timing}
"""
    )


def repo_root() -> Path:
    out = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip())


def weights(kind: str, n: int, k: int) -> list[torch.Tensor]:
    """Random weights in the op's layout (its speed does not depend on their values)."""
    groups = k // 32
    if kind == "int8":
        return [torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 1e-3]
    nibbles = torch.randint(0, 256, (n, groups * 16), dtype=torch.uint8)
    units = torch.rand(n) * 1e-3 + 1e-4
    if kind == "int6":
        highs = torch.randint(0, 256, (n, groups * 8), dtype=torch.uint8)
        return [nibbles, highs, torch.randint(-100, 100, (n, groups * 2), dtype=torch.int16), units]
    steps = torch.randint(1, 200, (n, groups), dtype=torch.int16)
    lows = (torch.randn(n, groups) * 0.01).half().view(torch.int16)
    steps_lows = torch.stack([steps, lows], -1).reshape(n, 2 * groups).contiguous()
    fifth = (
        [torch.randint(0, 256, (n, (groups + 3) // 4 * 16), dtype=torch.uint8)]
        if kind == "int5"
        else []
    )
    return [nibbles, steps_lows, units, *fifth]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base", default="HEAD", help="the git revision to compare against (default HEAD)"
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument(
        "--rows", default="1,8,32,512", help="activation rows per call, comma-separated"
    )
    parser.add_argument(
        "--rounds", type=int, default=16, help="alternating rounds per case (default 16)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as build:
        module = cpp_extension.load_inline(
            "kernel_ab",
            cpp_sources=[extension_source(args.base)],
            functions=list(CALLS),
            extra_cflags=[*kernels.CFLAGS, "-std=c++20"],
            extra_ldflags=["-fopenmp"],
            build_directory=build,
        )
    print(f"{'op':5} {'N x K':>12} {'rows':>5} {'base ms':>9} {'new ms':>9} {'new/base':>9}")
    for kind, shapes in SHAPES.items():
        for n, k in shapes:
            w = weights(kind, n, k)
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k)
                reps = max(2, int(2e8 / (rows * n * k)))  # ~0.2 G products a round
                seconds = getattr(module, kind)(x, w, reps, args.rounds)
                base, new = seconds[0::2], seconds[1::2]
                ratio = statistics.median(b / a for a, b in zip(base, new))
                times = f"{min(base) * 1e3:9.3f} {min(new) * 1e3:9.3f}"
                print(f"{kind:5} {f'{n} x {k}':>12} {rows:>5} {times} {ratio:9.3f}", flush=True)


if __name__ == "__main__":
    main()
