"""The compute dtype: by name, or "auto" (bf16 only where the CPU multiplies it natively)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from tokenmill.model import loader
from tokenmill.model.loader import dtype_name, parse_dtype


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(),
    reason="reads the x86 CPU flags from /proc/cpuinfo",
)
def test_auto_is_bf16_only_on_cpus_with_native_bf16() -> None:
    """AVX512-BF16 or AMX: plain AVX-512 (an Ice Lake Xeon) has oneDNN emulate bf16, ~4x slower than
    fp32."""
    flags = set(
        next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        ).split()
    )
    native_bf16 = {"avx512bw", "avx512vl", "avx512dq"} <= flags and bool(
        {"avx512_bf16", "amx_bf16"} & flags
    )
    assert parse_dtype("auto") == (torch.bfloat16 if native_bf16 else torch.float32)


@pytest.mark.parametrize("preferred", [torch.bfloat16, torch.float32])
def test_auto_resolves_to_the_preferred_dtype(
    monkeypatch: pytest.MonkeyPatch, preferred: torch.dtype
) -> None:
    monkeypatch.setattr(loader, "preferred_dtype", lambda: preferred)
    assert parse_dtype("auto") == preferred
    assert dtype_name("auto") == {torch.bfloat16: "bf16", torch.float32: "fp32"}[preferred]


def test_names_and_errors() -> None:
    assert parse_dtype("bf16") == parse_dtype("bfloat16") == torch.bfloat16
    assert dtype_name(torch.float16) == dtype_name("fp16") == "fp16"
    with pytest.raises(ValueError, match="choose from auto, fp32, bf16, fp16"):
        parse_dtype("int3")
