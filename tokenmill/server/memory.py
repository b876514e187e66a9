"""The process's memory as the model registry sees it: resident size, handing freed memory back
to the system, and the memory sizes users write (`--memory-budget 8GiB`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re

import psutil

_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)")


def resident_bytes() -> int:
    """This process's resident set size (VmRSS), in bytes."""
    return psutil.Process().memory_info().rss


def available_bytes() -> int:
    """Memory the system can give without swapping (psutil's `available`), in bytes."""
    return psutil.virtual_memory().available


def release_freed_memory() -> None:
    """Collect garbage (an engine's objects hold cycles), then ask glibc's allocator to return
    the free parts of its heaps to the system: without `malloc_trim`, memory freed by a model
    that unloads stays in the process's resident set, reused only by later allocations."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name)
    if hasattr(libc, "malloc_trim"):  # glibc only; other allocators return memory themselves
        libc.malloc_trim(0)


def parse_memory_size(text: str, total: int | None = None) -> int:
    """Bytes of a size such as "8GiB", "512MiB", "2GB" or "1073741824", or of a fraction of the
    system's memory such as "0.5" (`total` bytes; default: the system's physical memory). Raises
    ValueError saying what is accepted."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in ("", *_UNITS):
        raise ValueError(
            f"'{text}' is not a memory size: give bytes with a unit (8GiB, 512MiB, 2GB) or a "
            "fraction of the system's memory (0.5)"
        )
    number, unit = float(match.group(1)), match.group(2)
    if not unit and number <= 1:
        if number <= 0:
            raise ValueError(f"'{text}': a fraction of the system's memory must be above 0")
        return int(number * (total or psutil.virtual_memory().total))
    return int(number * _UNITS[unit or "b"])


def format_bytes(size: int) -> str:
    """A size for messages: "1.5 GiB", "300.0 MiB"."""
    if size >= 1 << 30:
        return f"{size / (1 << 30):.1f} GiB"
    return f"{size / (1 << 20):.1f} MiB"
